"""The gradient side of one group: full gradients -> one reduce-scatter -> sharded gradients.

::

    buffer         dtype          lives                                  is
    full           param_dtype    pre-backward .. reduce-scatter issued  the unsharded params' .grad
                                  (kept while accumulating without sync) (see the Note below)
    reduce         reduce_dtype   issue .. finish, only when              one cast of ``full``
                                  reduce_dtype != param_dtype
    sharded.local  master dtype   always                                 the sharded params' .grad

``issue`` casts and scales once per group and starts the reduce-scatter (asynchronous);
``finish`` waits, frees the full buffers and leaves the result in ``sharded.local``, added to
what is there when gradients accumulate across synced backwards.

[Note: HSDP] With a replicate group (``fully_shard`` on a 2-D ``("replicate", "shard")``
mesh) the reduce-scatter runs inside the shard group and ``finish`` then all-reduces the
reduced *shard* across the replicas (bytes across replicas = shard size), before it is
cast or accumulated: the mean of a mean of equal-sized groups is the mean over the whole
data-parallel world, as DDP over it gives. A divide factor divides once: SUM in both.
Without gradient sync nothing is reduced, so the replicas are skipped too.

[Note: the first gradient is copied in]
Autograd hands a parameter its first gradient as a tensor of its own (``.grad`` is None:
AccumulateGrad keeps the incoming tensor). :meth:`GradReducer.take` copies it into the
parameter's view of ``full`` and the view becomes ``.grad``, so every later gradient of the
window (another micro-batch without sync, a recompute's nested backward) is added in place.
One read and one write per element, as a reduce-scatter copy-in costs, instead of zeroing
the buffer and adding into it. ``full`` is therefore not zeroed when it gets its storage:
only its padding is, and, before the reduce-scatter, the views of tensors that got no
gradient in the window.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .collectives import CommStats, all_reduce
from .dbuffer import DBuffer
from .planner import ShardPlan

__all__ = ["GradReducer"]


class GradReducer:
    """Buffers and the reduce-scatter of one group's gradients (see module docstring).

    Args:
        plan, rank, process_group: the group's layout and ranks (the shard group).
        replicate_group: HSDP's group of this rank's replicas, or ``None`` (see [Note: HSDP]).
        stats: where the reduce-scatter's bytes are counted.
        grad_dtype: of the full gradients (the compute dtype).
        reduce_dtype: of the collective.
        shard_dtype: of the sharded gradients (the master parameters' dtype).
        device, shapes: of the buffers and each tensor's full view.
    """

    def __init__(self, plan: ShardPlan, rank: int, process_group: dist.ProcessGroup, stats: CommStats, *,
                 grad_dtype: torch.dtype, reduce_dtype: torch.dtype, shard_dtype: torch.dtype,
                 device: torch.device, shapes: Sequence[Sequence[int]],
                 replicate_group: Optional[dist.ProcessGroup] = None) -> None:
        def new(dtype: torch.dtype, **kw) -> DBuffer:
            return DBuffer(plan, rank, dtype, device, shapes=shapes, **kw)

        self.plan, self.rank, self.process_group, self.stats = plan, rank, process_group, stats
        self.replicate_group = replicate_group
        self.reduce_dtype, self.shard_dtype = reduce_dtype, shard_dtype
        self.full = new(grad_dtype, with_local=False)
        self.reduce = None if reduce_dtype == grad_dtype else new(reduce_dtype, with_local=False)
        self.sharded = new(shard_dtype, with_full=False)
        self.requires_grad_sync = True
        self.divide_factor: Optional[float] = None  # None: AVG over the group
        self._pending: Optional[Tuple] = None
        self._written: set = set()  # tensors of ``full`` holding a gradient of this window

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def prepare(self) -> None:
        """Give the full gradients their storage for a new window (its padding zeroed, see
        [Note: the first gradient is copied in]); kept as it is while a window accumulates."""
        if not self.full.is_allocated:
            self.full.allocate()
            self.full.zero_padding()
            self._written = set()

    def take(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        """Put ``grad`` of tensor ``index`` into its view of ``full``: a copy for the window's
        first gradient, an add after it. Returns the view (the parameter's ``.grad`` now)."""
        self.prepare()
        view = self.full.full_view(index)
        if grad.data_ptr() != view.data_ptr():
            with torch.no_grad():
                (view.add_ if index in self._written else view.copy_)(grad)
        self._written.add(index)
        return view

    def _zero_unwritten(self) -> None:
        views = [self.full.full_view(i) for i in range(len(self.plan.specs)) if i not in self._written]
        if views:
            torch._foreach_zero_(views)

    def issue(self, accumulate: bool) -> None:
        """Start the reduce-scatter of ``full`` (asynchronous). ``accumulate``: add the result
        to the sharded gradients already there instead of replacing them."""
        self.prepare()  # every rank joins the collective, with zeros if it has no gradient
        self._zero_unwritten()
        source = self.full
        if self.reduce is not None:
            with torch.no_grad():
                self.reduce.allocate().copy_(self.full.full)  # one cast per group
            self.full.free()
            source = self.reduce
        op = dist.ReduceOp.AVG
        if self.divide_factor is not None:
            # [Note: divide factor] SUM of gradients pre-divided by the factor: the mean
            # over a larger population than this group (Megatron's expert parameters are
            # reduced over the expert-data-parallel group but averaged over data-parallel),
            # or a plain sum (factor 1) when the loss is normalised afterwards.
            # Multiplies by the reciprocal, as Megatron's DDP does, so the two round alike.
            if self.divide_factor != 1:
                with torch.no_grad():
                    source.full.mul_(1.0 / self.divide_factor)
            op = dist.ReduceOp.SUM
        direct = not accumulate and self.reduce_dtype == self.shard_dtype
        out = self.sharded.local if direct else torch.empty(
            self.plan.shard_size, dtype=self.reduce_dtype, device=self.sharded.device)
        work = source.reduce_scatter(self.process_group, into=out, op=op, stats=self.stats, async_op=True)
        self._pending = (work, source, out, accumulate, op == dist.ReduceOp.AVG)

    def finish(self, params: Sequence[Tuple[int, nn.Parameter]]) -> None:
        """Wait for the reduce-scatter; give each ``(index, sharded param)`` its ``.grad``."""
        if self._pending is None:
            return
        work, source, out, accumulate, average = self._pending
        self._pending = None
        work.wait()
        source.free()
        if self.replicate_group is not None:  # [Note: HSDP]
            with torch.no_grad():
                all_reduce(out, self.replicate_group, average, self.stats)
        local = self.sharded.local
        with torch.no_grad():
            if out is not local:
                if accumulate:
                    for i, sp in params:
                        if sp.grad is None:
                            self.sharded.local_view(i).zero_()
                    self._accumulate(out, params)
                else:
                    local.copy_(out)  # one cast per group
            for i, sp in params:
                if sp.grad is None:
                    sp.grad = self.sharded.local_view(i)

    def _accumulate(self, reduced: torch.Tensor, params: Sequence[Tuple[int, nn.Parameter]]) -> None:
        ours = all(sp.grad is None or sp.grad.data_ptr() == self.sharded.local_view(i).data_ptr() for i, sp in params)
        if ours:
            self.sharded.local.add_(reduced)  # one add per group
            return
        slices = self.plan.local_slices(self.rank)
        for i, sp in params:  # a user replaced some .grad: add piece by piece
            start, end, off = slices[i]
            target = sp.grad if sp.grad is not None else self.sharded.local_view(i)
            target.add_(reduced.narrow(0, off, end - start))

    def zero(self) -> None:
        """Drop every gradient: the full buffers (accumulated without sync) and the shards."""
        if self._pending is not None:
            work = self._pending[0]
            work.wait()
            self._pending = None
        self.full.free()
        if self.reduce is not None:
            self.reduce.free()
        self.sharded.local.zero_()

