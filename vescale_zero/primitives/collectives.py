"""The two collectives of a DBuffer, with byte accounting.

Both are single calls over whole flat buffers; nothing is packed or unpacked around
them. ``all_gather_single`` / ``reduce_scatter_single`` are torch's names for
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (same kernels, no deprecation
warning on torch >= 2.13).

[Note: gloo reduce-scatter]
gloo has no reduce-scatter of its own: torch runs an all-reduce of a clone of the whole
buffer and keeps one chunk, moving twice the bytes a reduce-scatter needs. On gloo we
reduce-scatter as one ``all_to_all_single`` (rank k receives every rank's chunk k, the
bytes of a ring reduce-scatter) into a receive buffer the size of the full buffer (the
size of gloo's clone), then sum the chunks in rank order into the shard when the work is
waited on (dividing by the group size for AVG). Measured on 2 CPU ranks, 6 MiB: 4.8 ms
against 8.0 ms (4 ranks: 9.8 against 18.1). NCCL and other backends keep their own.
:func:`set_reduce_scatter_impl` (or ``VESCALE_ZERO_REDUCE_SCATTER``) picks another, e.g. to
compare with peers on torch's own reduce-scatter.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..torch_compat import all_gather_single as _all_gather_single
from ..torch_compat import reduce_scatter_single as _reduce_scatter_single

__all__ = ["CommStats", "all_gather", "reduce_scatter", "all_reduce", "AllToAllReduceScatter", "CompletedWork",
           "set_reduce_scatter_impl", "get_reduce_scatter_impl", "REDUCE_SCATTER_IMPLS"]

REDUCE_SCATTER_IMPLS = ("auto", "native", "all_to_all")
"""``auto``: ``all_to_all`` on gloo for SUM/AVG, the backend's own otherwise; ``native``: always
torch's ``reduce_scatter_tensor``; ``all_to_all``: always ours (SUM/AVG only)."""


def _checked_impl(impl: str, source: str) -> str:
    if impl not in REDUCE_SCATTER_IMPLS:
        raise ValueError(f"{source}: unknown reduce-scatter implementation {impl!r}; use one of {REDUCE_SCATTER_IMPLS}")
    return impl


_impl = _checked_impl(os.environ.get("VESCALE_ZERO_REDUCE_SCATTER", "auto"), "VESCALE_ZERO_REDUCE_SCATTER")


def set_reduce_scatter_impl(impl: str = "auto") -> str:
    """Pick the reduce-scatter implementation for this process (every rank must pick the same,
    before its first reduce-scatter); returns the previous one. See [Note: gloo reduce-scatter]."""
    global _impl
    previous, _impl = _impl, _checked_impl(impl, "set_reduce_scatter_impl")
    return previous


def get_reduce_scatter_impl() -> str:
    return _impl



@dataclass
class CommStats:
    """Bytes a rank moved through collectives: the size of each collective's full buffer."""

    all_gather_bytes: int = 0
    reduce_scatter_bytes: int = 0
    all_gathers: int = 0
    reduce_scatters: int = 0
    all_reduce_bytes: int = 0  # HSDP: the reduced shard, across replicas
    all_reduces: int = 0

    def reset(self) -> None:
        self.all_gather_bytes = self.reduce_scatter_bytes = self.all_gathers = self.reduce_scatters = 0
        self.all_reduce_bytes = self.all_reduces = 0


class CompletedWork:
    """The work of a collective that had finished when it returned (a custom one that ran
    synchronously): ``wait()`` and ``is_completed()`` answer at once."""

    def wait(self, timeout: Optional[object] = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def all_gather(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    stats: Optional[CommStats] = None,
    async_op: bool = False,
    comm: Optional[Callable] = None,
):
    """``output[k*S:(k+1)*S] = shard`` of rank k, for every k; one collective (``comm``: FSDP2's
    custom ``AllGather``, called with these buffers, runs it)."""
    if stats is not None:
        stats.all_gather_bytes += output.numel() * output.element_size()
        stats.all_gathers += 1
    if comm is not None:
        return comm(output_tensor=output, input_tensor=shard, group=group, async_op=async_op)
    return _all_gather_single(output, shard, group=group, async_op=async_op)


class AllToAllReduceScatter:
    """The work of a reduce-scatter run as ``all_to_all_single`` + a local sum (see
    [Note: gloo reduce-scatter]); ``wait()`` finishes it, as a ``Work``'s would."""

    def __init__(self, work: Optional[dist.Work], received: torch.Tensor, shard: torch.Tensor, world: int,
                 average: bool) -> None:
        self._work, self._received, self._shard = work, received, shard
        self._world, self._average = world, average

    def wait(self, timeout: Optional[object] = None) -> bool:
        if self._received is None:
            return True
        if self._work is not None:
            self._work.wait()
        torch.sum(self._received.view(self._world, -1), dim=0, out=self._shard)
        if self._average:
            self._shard.div_(self._world)
        self._received = self._work = None
        return True

    def is_completed(self) -> bool:
        """Whether :meth:`wait` returns without waiting on the network (the exchange is over;
        only the local sum may be left)."""
        return self._received is None or self._work is None or self._work.is_completed()


def _native_reduce_scatter(group: Optional[dist.ProcessGroup], op: dist.ReduceOp) -> bool:
    summing = op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
    if _impl == "all_to_all":
        if not summing:
            raise ValueError(f"the all_to_all reduce-scatter sums or averages only, not {op}; "
                             "set_reduce_scatter_impl('auto') for this op")
        return False
    return _impl == "native" or dist.get_backend(group) != "gloo" or not summing


def reduce_scatter(
    shard: torch.Tensor,
    full: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    op: dist.ReduceOp = dist.ReduceOp.AVG,
    stats: Optional[CommStats] = None,
    async_op: bool = False,
    comm: Optional[Callable] = None,
):
    """``shard = op over ranks of full[k*S:(k+1)*S]`` on rank k; one collective (``comm``: FSDP2's
    custom ``ReduceScatter``, called with these buffers, runs it; asynchronous, a work is returned
    even if it ran synchronously)."""
    if stats is not None:
        stats.reduce_scatter_bytes += full.numel() * full.element_size()
        stats.reduce_scatters += 1
    if comm is not None:
        work = comm(output_tensor=shard, input_tensor=full, group=group, op=op, async_op=async_op)
        return (work or CompletedWork()) if async_op else None
    if _native_reduce_scatter(group, op):
        return _reduce_scatter_single(shard, full, op=op, group=group, async_op=async_op)
    world = dist.get_world_size(group)
    received = torch.empty_like(full)
    work = dist.all_to_all_single(received, full, group=group, async_op=async_op)
    handle = AllToAllReduceScatter(work, received, shard, world, average=op == dist.ReduceOp.AVG)
    if not async_op:
        handle.wait()
        return None
    return handle


def all_reduce(
    tensor: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    average: bool,
    stats: Optional[CommStats] = None,
) -> None:
    """``tensor = sum (or mean) over ranks of tensor``, in place; one collective. The mean is
    a SUM then one division (gloo has no AVG)."""
    if stats is not None:
        stats.all_reduce_bytes += tensor.numel() * tensor.element_size()
        stats.all_reduces += 1
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    if average:
        tensor.div_(dist.get_world_size(group))
