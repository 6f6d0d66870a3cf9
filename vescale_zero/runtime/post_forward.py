"""The post-forward shard: ``reshard_after_forward=<int>`` (FSDP2's meaning), DeepSpeed's ZeRO++ hpZ.

[Note: the post-forward shard]
With ``reshard_after_forward=n`` (``1 < n < m`` for a shard group of ``m`` ranks, ``n`` dividing
``m``) a group does not free its full parameters after forward: each rank keeps ``1/n`` of the
gathered buffer, and backward gathers it back over a *post-forward group* of ``n`` ranks (a node,
say), never across it. The post-forward groups are FSDP2's: the shard group's ranks in blocks of
``n`` consecutive ones (shard ranks ``0..n-1``, ``n..2n-1``, ...).

What each rank keeps is derived from the group's plan, not planned again. The plan packs the
group into ``m * S`` elements with every rank boundary ``k * S`` on a block boundary of the
tensor it falls in; the post-forward plan over ``n`` ranks has shard size ``S' = (m / n) * S``,
and its boundaries ``j * S'`` are boundaries of the plan, so each post-forward rank owns a
contiguous range of whole blocks, as RaggedShard requires. The gathered buffer keeps one layout:
a backward all-gather over the ``n`` ranks (rank ``j`` of the post-forward group gives
``[j * S', (j + 1) * S')``) fills the same ``compute.full`` forward's all-gather filled, so the
unsharded parameters and the views autograd saved stay valid and no byte is copied around the
collective. Planning the ``n``-rank group afresh could pad less, but its layout would differ
from the gathered buffer's: every backward would copy between the two.

The kept range is a copy of the forward's gathered values (the compute dtype; an FP8 gather's
dequantized values), taken when forward reshards the group and freed once backward has
gathered from it (as FSDP2 frees its post-forward data). So backward computes with exactly the
weights forward used. A reshard anywhere else (the next root forward, a state dict, a reshard
between two uses in backward, the end of backward) drops it: the next gather re-reads the master
([Note: every gather re-reads the master]) over the whole shard group.

A post-forward group is made once per set of ranks (every ``fully_shard`` call with the same
shard group and ``n`` shares it) with the shard group's timeout
([Note: the job's timeout]).
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from ..primitives.collectives import CommStats
from ..primitives.dbuffer import DBuffer
from ..primitives.planner import ShardPlan
from .job_timeout import carry_job_timeout, group_timeout

__all__ = ["PostForwardShard", "post_forward_group"]

_GROUPS: "weakref.WeakKeyDictionary[dist.ProcessGroup, Dict[int, dist.ProcessGroup]]" = weakref.WeakKeyDictionary()


def post_forward_group(shard_group: dist.ProcessGroup, size: int) -> dist.ProcessGroup:
    """This rank's post-forward group of ``size`` ranks inside ``shard_group``
    ([Note: the post-forward shard]); made on first use, by the ranks of each block alone."""
    made = _GROUPS.setdefault(shard_group, {})
    if size not in made:
        ranks = dist.get_process_group_ranks(shard_group)
        block = dist.get_rank(shard_group) // size
        members = ranks[block * size:(block + 1) * size]
        group = dist.new_group(members, timeout=group_timeout(shard_group), use_local_synchronization=True)
        carry_job_timeout(group)
        made[size] = group
    return made[size]


class PostForwardShard:
    """One group's post-forward shard on this rank ([Note: the post-forward shard]): the range
    ``[j * S', (j + 1) * S')`` of its gathered buffer, ``j`` this rank's place in ``group``."""

    def __init__(self, plan: ShardPlan, group: dist.ProcessGroup, dtype: torch.dtype, device: torch.device) -> None:
        size = dist.get_world_size(group)
        if plan.world_size % size:
            raise ValueError(f"a post-forward group of {size} ranks must divide the shard group's {plan.world_size}")
        self.group, self.size = group, size
        self.length = plan.shard_size * (plan.world_size // size)  # S'
        self.start = dist.get_rank(group) * self.length
        self._piece = torch.empty(self.length, dtype=dtype, device=device)
        self._nbytes = self._piece.untyped_storage().nbytes()
        self.drop()

    @property
    def held(self) -> bool:
        return self._piece.untyped_storage().nbytes() > 0

    def keep(self, gathered: DBuffer) -> None:
        """Copy this rank's range of the gathered buffer (forward is over)."""
        self._piece.untyped_storage().resize_(self._nbytes)
        with torch.no_grad():
            self._piece.copy_(gathered.full.detach().narrow(0, self.start, self.length))

    def gather(self, gathered: DBuffer, stats: CommStats, async_op: bool, comm: Optional[Callable] = None):
        """All-gather the kept ranges over the post-forward group into ``gathered``'s full buffer."""
        return gathered.all_gather(self.group, source=self._piece, stats=stats, async_op=async_op, comm=comm)

    def drop(self) -> None:
        self._piece.untyped_storage().resize_(0)
