"""The two collectives of a DBuffer, with byte accounting.

Both are single calls over whole flat buffers; nothing is packed or unpacked around
them. ``all_gather_single`` / ``reduce_scatter_single`` are torch's names for
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (same kernels, no deprecation
warning on torch >= 2.13).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["CommStats", "all_gather", "reduce_scatter"]

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommStats:
    """Bytes a rank moved through collectives: the size of each collective's full buffer."""

    all_gather_bytes: int = 0
    reduce_scatter_bytes: int = 0
    all_gathers: int = 0
    reduce_scatters: int = 0

    def reset(self) -> None:
        self.all_gather_bytes = self.reduce_scatter_bytes = self.all_gathers = self.reduce_scatters = 0


def all_gather(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    stats: Optional[CommStats] = None,
    async_op: bool = False,
):
    """``output[k*S:(k+1)*S] = shard`` of rank k, for every k; one collective."""
    if stats is not None:
        stats.all_gather_bytes += output.numel() * output.element_size()
        stats.all_gathers += 1
    return _all_gather_single(output, shard, group=group, async_op=async_op)


def reduce_scatter(
    shard: torch.Tensor,
    full: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    op: dist.ReduceOp = dist.ReduceOp.AVG,
    stats: Optional[CommStats] = None,
    async_op: bool = False,
):
    """``shard = op over ranks of full[k*S:(k+1)*S]`` on rank k; one collective."""
    if stats is not None:
        stats.reduce_scatter_bytes += full.numel() * full.element_size()
        stats.reduce_scatters += 1
    return _reduce_scatter_single(shard, full, op=op, group=group, async_op=async_op)
