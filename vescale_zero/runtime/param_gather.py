"""How a group's sharded master parameters become its full compute parameters.

Every all-gather of a group runs through one :class:`ParamGather`: something made from the
master shard before the collective, one collective (or two), something done after it::

    strategy        before (this rank)                   collective              after
    DirectGather    --   (master.local *is* the input)   all-gather              --
    CastGather      master.local -> param_dtype, into    in-place all-gather     --
                    this rank's slot of compute.full     (offloaded: issued
                    (offloaded: a host->device copy)     from the copy stream)
    FP8TileGather   master.local -> float8 tile bands    1 in-place all-gather   dequantize / copy
                    + scales, other tensors cast to      of bytes                into compute.full,
                    param_dtype, into this rank's slot                            free the byte buffer
                    of one byte buffer made for it

[Note: every gather re-reads the master]
The gather input is made from the master shard on every all-gather, never cached. An
optimizer may write the master without bumping its version counter (``fused=True`` AdamW,
DeepSpeed's FusedAdam and CPU Adam, apex), and a checkpoint load or a ``.data`` write
bypasses it too, so no cache key can be trusted; a stale cast trains silently wrong. The
cost is one element-wise pass over the shard (``S`` elements) beside a collective of ``m*S``;
PyTorch FSDP2 pays the same.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..primitives.collectives import CommStats, all_gather
from ..primitives.dbuffer import DBuffer
from .fp8_gather import FP8GatherLayout
from .offload import HostCopies
from .post_forward import PostForwardShard

__all__ = ["ParamGather", "DirectGather", "CastGather", "FP8TileGather", "make_param_gather"]


class ParamGather:
    """One group's all-gather of its parameters into ``compute.full`` (see module docstring).

    ``start`` issues the collective(s) (``async_op``: return at once), ``finish`` waits and
    completes ``compute.full``, ``release`` frees it.
    """

    def __init__(self, master: DBuffer, compute: DBuffer, process_group: dist.ProcessGroup, stats: CommStats) -> None:
        self.master, self.compute = master, compute
        self.process_group, self.stats = process_group, stats
        self.comm: Optional[Callable] = None  # FSDP2's custom AllGather (set_custom_all_gather) runs the collective
        self._works: List = []

    def start(self, async_op: bool) -> None:
        raise NotImplementedError

    def start_post_forward(self, shard: "PostForwardShard", async_op: bool) -> None:
        """Gather from the post-forward shard over its group, into ``compute.full``
        (post_forward [Note: the post-forward shard])."""
        work = shard.gather(self.compute, self.stats, async_op, self.comm)
        if work is not None:
            self._works.append(work)

    def finish(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []

    def release(self) -> None:
        self.finish()
        self.compute.free()

    def _gather(self, source: Optional[torch.Tensor], async_op: bool) -> None:
        work = self.compute.all_gather(self.process_group, source=source, stats=self.stats, async_op=async_op,
                                       comm=self.comm)
        if work is not None:
            self._works.append(work)


class DirectGather(ParamGather):
    """Compute dtype = master dtype: the master shard is the gather input (zero copies)."""

    def start(self, async_op: bool) -> None:
        self._gather(None, async_op)


class CastGather(ParamGather):
    """Mixed precision, or a master shard in host memory: copy (cast) the master shard into
    this rank's slot of the full buffer and gather in place
    (see [Note: every gather re-reads the master]). Offloaded, the copy and the collective run
    from the copy stream (offload [Note: host copies and their streams]): always asynchronous,
    :meth:`finish` waits."""

    def __init__(self, master: DBuffer, compute: DBuffer, process_group: dist.ProcessGroup, stats: CommStats,
                 host_copies: Optional[HostCopies] = None) -> None:
        super().__init__(master, compute, process_group, stats)
        self.host_copies = host_copies

    def start(self, async_op: bool) -> None:
        slot = self.compute.own_slot()
        if self.host_copies is None:
            with torch.no_grad():
                slot.copy_(self.master.local)
            self._gather(slot, async_op)
            return
        with torch.no_grad():
            stream = self.host_copies.to_device(slot, self.master.local)
        if stream is None:
            self._gather(slot, async_op)
        else:
            with stream:
                self._gather(slot, True)


class FP8TileGather(ParamGather):
    """Gather the FP8-chosen tensors as float8 (e4m3) tile bands with one fp32 scale per tile,
    and the others in ``param_dtype``, in ONE all-gather of bytes; see :mod:`vescale_zero.runtime.fp8_gather`
    ([Note: one collective per group]). The gathered byte buffer exists only from ``start`` to
    ``finish``."""

    def __init__(self, master: DBuffer, compute: DBuffer, process_group: dist.ProcessGroup, stats: CommStats,
                 layout: FP8GatherLayout) -> None:
        super().__init__(master, compute, process_group, stats)
        self.layout = layout
        self._bytes: Optional[torch.Tensor] = None

    def start(self, async_op: bool) -> None:
        plan, rank, device = self.master.plan, self.master.rank, self.compute.device
        size = self.layout.slot_bytes
        self._bytes = torch.zeros(plan.world_size * size, dtype=torch.uint8, device=device)
        own = self._bytes.narrow(0, rank * size, size)
        local = self.master.local
        if local.device != device:  # an offloaded master: packed on the device, after a copy on this stream
            local = local.to(device, non_blocking=True)
        with torch.no_grad():
            self.layout.pack_local(rank, local, own)
        work = all_gather(self._bytes, own, self.process_group, self.stats, async_op, self.comm)
        if work is not None:
            self._works.append(work)
        self.compute.allocate()

    def finish(self) -> None:
        super().finish()
        if self._bytes is not None:
            with torch.no_grad():  # through the wire: see DBuffer [Note: version counter]
                self.layout.unpack_full(self._bytes, self.compute._wire)
            self._bytes = None


def make_param_gather(master: DBuffer, compute: DBuffer, process_group: dist.ProcessGroup, stats: CommStats,
                      shapes, fp8_tile: Optional[int], fp8: Optional[Sequence[bool]] = None,
                      host_copies: Optional[HostCopies] = None) -> ParamGather:
    """The strategy for a group: FP8 tiles if ``fp8_tile`` and some tensor is chosen for FP8
    (``fp8[i]``; default: every tensor of 2+ dimensions, [Note: which tensors are FP8]), else a
    cast (a copy) if the compute dtype differs from the master's or the master is offloaded
    (``host_copies``), else the direct gather."""
    if fp8_tile:
        chosen = [len(s) >= 2 for s in shapes] if fp8 is None else list(fp8)
        if any(chosen):
            layout = FP8GatherLayout(master.plan, shapes, fp8_tile, chosen, compute.dtype)
            return FP8TileGather(master, compute, process_group, stats, layout)
    if compute.dtype != master.dtype or host_copies is not None:
        return CastGather(master, compute, process_group, stats, host_copies)
    return DirectGather(master, compute, process_group, stats)
