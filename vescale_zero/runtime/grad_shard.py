"""GradShard: the flat buffer of one group's sharded gradients, alive only while held.

::

    plan: world size 3, shard size S; rank 1 owns pieces of A and B

    shard (rank 1)   [A  B     ]   S elements, the master dtype
                      |  |
    A_sharded.grad ---+  +--- B_sharded.grad     views (narrow) into the shard

[Note: gradient shards live with their .grad]
The reducer holds the shard only *weakly*: the parameters' ``.grad`` views (and whatever else a
caller keeps, e.g. Megatron's ``main_grad``) hold it. It gets storage at a group's first
reduce-scatter of a window (the output lands in it) and is freed when the last view lets go:
``optimizer.zero_grad(set_to_none=True)`` (or ``param.grad = None`` everywhere) frees it, as
PyTorch FSDP2 frees its gradients; ``set_to_none=False`` zeroes the views and so keeps it, and
the next synced backward adds into it. Forward and the start of backward then run without
gradient shards, which is where a step's memory peaks.

[Note: a kept gradient stays the caller's]
A shard that is alive while no parameter's ``.grad`` views it any more is held by someone
else: a caller that kept ``g = p.grad`` across ``zero_grad(set_to_none=True)`` (PCGrad,
GradNorm, logging). The next reduce must not write into it -- autograd gives such a
parameter a new ``.grad`` and leaves the kept tensor alone -- so the reducer forgets it
(:meth:`GradShard.disown_unless_held_by`) and the next reduce gets a new shard. Views taken
with :meth:`GradShard.persistent_view` (Megatron's ``main_grad``, read after every reduce)
instead keep the shard the group's for its life. Checking costs nothing when nothing held
the shard (it is ``None``) and one data-pointer comparison when a ``.grad`` still views it.
A parameter whose ``.grad`` alone was set to ``None`` while others still view the shard gets
its range zeroed and reused (a view of that range kept elsewhere sees it).
"""

from __future__ import annotations

import weakref
from typing import Iterable, Optional

import torch

from ..primitives.planner import ShardPlan

__all__ = ["GradShard"]


class GradShard:
    """This rank's sharded gradients of one group (see [Note: gradient shards live with their .grad]).

    Args:
        plan, rank: the group's layout and this rank's index in it.
        dtype, device: of the shard (the master parameters').
        pin_memory: allocate it in pinned host memory (an offloaded group on an accelerator:
            vescale_zero.runtime.offload).
    """

    def __init__(self, plan: ShardPlan, rank: int, dtype: torch.dtype, device: torch.device, *,
                 pin_memory: bool = False) -> None:
        self.plan, self.rank, self.dtype, self.device = plan, rank, dtype, torch.device(device)
        self.pin_memory = pin_memory
        self._slices = plan.local_slices(rank)
        self._ref: Optional[weakref.ref] = None
        self._persistent = False  # persistent_view handed out: the shard is the group's for life

    @property
    def live(self) -> Optional[torch.Tensor]:
        """The shard if something still holds it, else ``None`` (never allocates)."""
        return None if self._ref is None else self._ref()

    def allocate(self, zero: bool = False) -> torch.Tensor:
        """The live shard, or a new one (zeroed if ``zero``). The caller holds it: the reducer does not."""
        shard = self.live
        if shard is None:
            shard = torch.empty(self.plan.shard_size, dtype=self.dtype, device=self.device, pin_memory=self.pin_memory)
            if zero:
                shard.zero_()
            self._ref = weakref.ref(shard)
        return shard

    @property
    def local(self) -> torch.Tensor:
        """The shard, given zeroed storage if nothing held it (kept only by whoever keeps it)."""
        return self.allocate(zero=True)

    def disown_unless_held_by(self, grads: Iterable[Optional[torch.Tensor]]) -> None:
        """Forget the live shard unless one of ``grads`` (the parameters' ``.grad``) views it or
        persistent views were handed out: [Note: a kept gradient stays the caller's]."""
        shard = self.live
        if shard is None or self._persistent:
            return
        lo = shard.data_ptr()
        hi = lo + shard.numel() * shard.element_size()
        if not any(g is not None and lo <= g.data_ptr() < hi for g in grads):
            self._ref = None

    def forget(self) -> None:
        """Stop using the live shard (its holders keep it) unless persistent views were handed
        out, in which case it is zeroed: the next reduce starts from zero either way."""
        shard = self.live
        if shard is None:
            return
        if self._persistent:
            shard.zero_()
        else:
            self._ref = None

    def persistent_view(self, index: int) -> torch.Tensor:
        """:meth:`local_view` for a holder that keeps it for the group's life and reads it after
        every reduce (Megatron's ``main_grad``): the shard is then reused, never replaced."""
        self._persistent = True
        return self.local_view(index)

    def view_of(self, shard: torch.Tensor, index: int) -> torch.Tensor:
        """This rank's flat piece of tensor ``index`` inside ``shard`` (may be empty)."""
        start, end, off = self._slices[index]
        return shard.narrow(0, off, end - start)

    def local_view(self, index: int) -> torch.Tensor:
        """:meth:`view_of` the shard (given zeroed storage if it had none); the view holds it."""
        return self.view_of(self.local, index)

    def local_range(self, index: int) -> tuple:
        """``(start, end)`` of tensor ``index``'s flat elements this rank owns."""
        start, end, _ = self._slices[index]
        return start, end
