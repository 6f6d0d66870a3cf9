"""DBuffer: one role's flat buffer of a planned FSDP group (parameters, gradients, ...).

::

    plan: world size 3, shard size S, tensors A B C packed by the planner

    full   [ A        |A  B     | B  pad C ]     m*S elements; storage exists only while
            rank 0      rank 1    rank 2       gathered (allocated / freed, then reused)
                           |
    local (rank 1)     [A  B     ]             S elements, persistent

    full_view(B)  -> B's whole tensor, a view into ``full``   (no copy-out after all-gather)
    local_view(B) -> rank 1's piece of B, a view into ``local`` (no copy-in before it)

All-gather is one collective from ``local`` into ``full`` -- or, when the gather input is
made fresh each time (a cast, a quantization), in place from this rank's own slot of
``full`` (:meth:`DBuffer.own_slot`), so no separate input buffer lives between gathers.
Reduce-scatter is one collective from ``full`` into ``local``. Element-wise group
operations (zero, scale, cast) act once on a whole buffer.

[Note: storage of the full buffer]
``full`` keeps its shape for life; only its storage is resized to zero bytes when the
group reshards and back to ``m*S`` elements before the next gather. Every view handed
out (the unsharded parameters, the tensors autograd saved for backward) shares that
storage, so it stays valid across cycles without being re-created, and the allocator
sees one block of one size per group and role, freed and reused in a fixed order.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from .collectives import CommStats, all_gather, reduce_scatter
from .planner import ShardPlan

__all__ = ["DBuffer"]


def _gaps(plan: ShardPlan) -> List[tuple]:
    """``(start, length)`` of every stretch of ``[0, m*S)`` that holds no tensor."""
    spans = sorted((off, off + spec.numel) for off, spec in zip(plan.offsets, plan.specs) if spec.numel)
    gaps, cursor = [], 0
    for start, end in spans:
        if start > cursor:
            gaps.append((cursor, start - cursor))
        cursor = max(cursor, end)
    if plan.global_size > cursor:
        gaps.append((cursor, plan.global_size - cursor))
    return gaps


class DBuffer:
    """Flat buffer for one role of one group on one rank (see module docstring).

    Args:
        plan: the group's layout.
        rank: this rank's index in the group.
        dtype, device: of both the local shard and the full buffer.
        shapes: the shape of each planned tensor, for its view into ``full``
            (default: flat).
        local: an existing tensor of ``shard_size`` elements to use as the local shard
            (two roles of the same dtype can share one), or ``None`` to allocate one.
        with_local: ``False`` for a role that never needs a persistent shard.
        with_full: ``False`` for a role that never gathers (master params, sharded grads).
    """

    def __init__(
        self,
        plan: ShardPlan,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        shapes: Optional[Sequence[Sequence[int]]] = None,
        local: Optional[torch.Tensor] = None,
        with_local: bool = True,
        with_full: bool = True,
    ) -> None:
        self.plan, self.rank, self.dtype, self.device = plan, rank, dtype, torch.device(device)
        if local is not None:
            if local.numel() != plan.shard_size or local.dtype != dtype or local.device != self.device:
                raise ValueError(
                    f"DBuffer local shard must have {plan.shard_size} elements of {dtype} on "
                    f"{self.device}, got {local.numel()} of {local.dtype} on {local.device}"
                )
            self.local: Optional[torch.Tensor] = local
        else:
            self.local = torch.zeros(plan.shard_size, dtype=dtype, device=device) if with_local else None
        self.full = torch.empty(plan.global_size if with_full else 0, dtype=dtype, device=device)
        self._nbytes = self.full.untyped_storage().nbytes()
        # Views are bounds-checked when made, so make them all while the storage exists.
        shapes = shapes or [(s.numel,) for s in plan.specs]
        self._full_views: List[torch.Tensor] = [
            self.full.narrow(0, off, spec.numel).view(tuple(shape))
            for off, spec, shape in zip(plan.offsets, plan.specs, shapes)
        ] if with_full else []
        self._gap_views: List[torch.Tensor] = [  # the padding between and after the tensors
            self.full.narrow(0, start, length) for start, length in _gaps(plan)
        ] if with_full else []
        # [Note: version counter] Autograd saved views of ``full`` in forward, and the
        # backward re-gather refills that storage by design. Collectives write through
        # ``_wire``: the same storage, its own version counter, so the saved views never
        # look modified (an async gloo/NCCL write bumps it from another thread).
        self._wire = self.full.new_empty(0).set_(self.full.untyped_storage(), 0, self.full.shape)
        self.free()
        self._local_slices = plan.local_slices(rank)

    # ---- storage of the full buffer -------------------------------------------------
    @property
    def is_allocated(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def allocate(self, zero: bool = False) -> torch.Tensor:
        """Give ``full`` its storage back (no-op if it has it); optionally zero it."""
        if not self.is_allocated:
            self.full.untyped_storage().resize_(self._nbytes)
            if zero:
                self.full.zero_()
        elif zero:
            self.full.zero_()
        return self.full

    def zero_padding(self) -> None:
        """Zero the padding of ``full`` (what lies between and after the tensors), one op."""
        if self._gap_views:
            torch._foreach_zero_(self._gap_views)

    def free(self) -> None:
        """Release ``full``'s storage; its views stay valid for the next ``allocate``."""
        self.full.untyped_storage().resize_(0)

    # ---- views ----------------------------------------------------------------------
    def own_slot(self) -> torch.Tensor:
        """This rank's ``[rank*S, (rank+1)*S)`` of ``full`` (allocated here), written through
        the wire (see [Note: version counter]): the input of an in-place all-gather."""
        self.allocate()
        size = self.plan.shard_size
        return self._wire.narrow(0, self.rank * size, size)

    def full_view(self, index: int) -> torch.Tensor:
        """Tensor ``index`` inside the full buffer, in its shape (the same view for life)."""
        return self._full_views[index]

    def local_view(self, index: int) -> torch.Tensor:
        """This rank's flat piece of tensor ``index`` inside the local shard (may be empty)."""
        if self.local is None:
            raise RuntimeError("this DBuffer has no local shard")
        start, end, shard_off = self._local_slices[index]
        return self.local.narrow(0, shard_off, end - start)

    def local_range(self, index: int) -> tuple:
        """``(start, end)`` of tensor ``index``'s flat elements this rank owns."""
        start, end, _ = self._local_slices[index]
        return start, end

    def copy_local_from_full(self, index: int, full: torch.Tensor) -> None:
        """Fill this rank's piece of tensor ``index`` from the whole tensor ``full`` (any
        shape with the tensor's number of elements; any device or dtype), as group creation,
        full-state-dict loads and materialisation do."""
        start, end = self.local_range(index)
        self.local_view(index).copy_(full.detach().reshape(-1)[start:end])

    # ---- collectives ----------------------------------------------------------------
    def all_gather(
        self,
        group: Optional[dist.ProcessGroup],
        *,
        source: Optional[torch.Tensor] = None,
        stats: Optional[CommStats] = None,
        async_op: bool = False,
        comm: Optional[Callable] = None,
    ):
        """One all-gather of ``source`` (default: ``local``; may be :meth:`own_slot`) into
        ``full`` (allocated here); ``comm``: a custom all-gather runs it."""
        self.allocate()
        shard = self.local if source is None else source
        return all_gather(self._wire, shard, group, stats, async_op, comm)

    def reduce_scatter(
        self,
        group: Optional[dist.ProcessGroup],
        *,
        into: Optional[torch.Tensor] = None,
        op: dist.ReduceOp = dist.ReduceOp.AVG,
        stats: Optional[CommStats] = None,
        async_op: bool = False,
        comm: Optional[Callable] = None,
    ):
        """One reduce-scatter of ``full`` into ``into`` (default: ``local``); ``comm``: a custom
        reduce-scatter runs it."""
        if not self.is_allocated:
            raise RuntimeError("reduce_scatter on a DBuffer whose full buffer is freed")
        out = self.local if into is None else into
        return reduce_scatter(out, self._wire, group, op, stats, async_op, comm)
