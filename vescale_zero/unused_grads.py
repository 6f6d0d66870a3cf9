"""Parameters without a gradient: which ones got none on *any* rank, and what their ``.grad`` becomes.

::

    micro-batch backwards (no sync)       synced backward                 end of backward
    GradUsage.note_unsynced(arrived)  ->  GradUsage.note_synced(...)  ->  usage_anywhere(groups)
      used |= arrived                       snapshot (used, had .grad)      one all-reduce (MAX) of
                                            used = {}                       flags per process group
                                                                          drop_unused(usage)
                                                                            .grad = None where no
                                                                            rank used a parameter

[Note: unused everywhere]
A parameter without a gradient on *every* rank (over all micro-batches since the last
synced backward) gets ``.grad = None`` on its sharded parameter, as with DDP and FSDP2, so
optimizers skip it (no weight decay, no moment decay); ``unused_grads = "zero"`` keeps a zero
gradient instead, as ZeRO-3 and Megatron's DDP do (the DeepSpeed and Megatron adapters set
it). Which parameters got gradients anywhere is one small all-reduce of flags per process
group at the end of a synced backward, read on the host only by a rank on which some
parameter got none ([Note: usage flags without a host read]).

[Note: usage flags without a host read]
Reading every rank's flags back with ``.tolist()`` on every synced backward would make the
host wait for the whole backward and every reduce-scatter: a stall per step on a GPU, where
the host must run ahead of the device. What we do instead:
  * a parameter used on this rank is used anywhere, so a rank that saw a gradient for every
    parameter knows the answer (drop nothing) without the others' flags. It still takes
    part in the all-reduce (every rank must issue the same collectives, and it cannot know
    whether another rank needs the result), but never reads it: the collective stays queued
    on the device like the reduce-scatters, and the host goes on;
  * the flags are made on the device (ones, zeros filled in), not copied from a Python
    list: a host-to-device copy from pageable memory also waits for the device's queue;
  * a rank on which some parameter got no gradient (an MoE expert without tokens) must
    know whether another rank used it before anything reads ``.grad`` (an optimizer
    decides on the host whether to skip a parameter), so it reads its groups' reduced flags
    back, all process groups' at once: one host read per synced backward, only there.
    DDP with ``find_unused_parameters=True`` reads its used-map back the same way.
Deferring ``.grad = None`` past the end of backward (to the optimizer step, or to a read of
``.grad``) was rejected: the first thing to look at ``.grad`` after backward is the host
(the user's code, clipping, the optimizer's skip), so the read would only move, and a
``.grad`` that changes from a tensor to None between two reads would surprise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .param_group import ParamGroup

__all__ = ["UNUSED_GRAD_POLICIES", "GradUsage", "usage_anywhere", "drop_unused"]

UNUSED_GRAD_POLICIES = ("none", "zero")


class GradUsage:
    """Which of one group's parameters got a gradient on this rank since the last synced
    backward ([Note: unused everywhere]), by index in the group."""

    def __init__(self) -> None:
        self.policy = "none"
        self._used: Set[int] = set()
        # (indices that require grad, used here, had a sharded .grad before) of the synced
        # backward, until unused_anywhere
        self._synced: Optional[Tuple[List[int], Set[int], Set[int]]] = None

    def note_unsynced(self, arrived: Set[int]) -> None:
        """A backward without gradient sync: its gradients count for the next synced one."""
        self._used |= arrived

    def note_synced(self, indices: Sequence[int], arrived: Set[int], had_grad: Set[int]) -> None:
        """A synced backward reduces the parameters ``indices``: what was used since the last
        one, and which already held a sharded ``.grad`` (those keep it: the sum of earlier
        steps')."""
        used = self._used | arrived
        self._used = set()
        if self.policy == "none":
            self._synced = (list(indices), used, had_grad)

    def local_flags(self) -> Optional[List[int]]:
        """1/0 per reduced parameter: got a gradient on this rank; ``None`` unless a synced
        backward reduced under policy ``"none"``."""
        if self._synced is None:
            return None
        indices, used, _ = self._synced
        return [1 if i in used else 0 for i in indices]

    def unused_anywhere(self, used_anywhere: Optional[Sequence[int]]) -> List[int]:
        """The indices whose ``.grad`` becomes None: no rank used them (``used_anywhere``, flags
        in :meth:`local_flags` order; ``None``: every one was used here) and they held no
        gradient before. Ends the synced backward's record."""
        indices, _, had_grad = self._synced
        self._synced = None
        if used_anywhere is None:
            return []
        return [i for i, flag in zip(indices, used_anywhere) if not flag and i not in had_grad]


def usage_anywhere(groups: Sequence["ParamGroup"]) -> List[Tuple["ParamGroup", Optional[torch.Tensor]]]:
    """One all-reduce (MAX) of the usage flags of every group on a process group, in the order
    of ``groups`` (the same on every rank); ``[(group, flags)]``, ``flags`` the group's part of
    the reduced flags where this rank must read them, else None
    ([Note: usage flags without a host read])."""
    buckets: Dict[tuple, List[Tuple["ParamGroup", List[int]]]] = {}
    for group in groups:
        flags = group.usage.local_flags()
        if flags is not None:
            buckets.setdefault((id(group.process_group), id(group.replicate_group)), []).append((group, flags))
    out: List[Tuple["ParamGroup", Optional[torch.Tensor]]] = []
    for entries in buckets.values():
        first = entries[0][0]
        local = [f for _, flags in entries for f in flags]
        flat = _flags_on_device(local, first.device)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=first.process_group)
        if first.replicate_group is not None:  # HSDP: used on any replica is used
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=first.replicate_group)
        for (group, flags), part in zip(entries, flat.split([len(f) for _, f in entries])):
            out.append((group, part if not all(flags) else None))
    return out


def drop_unused(usage: List[Tuple["ParamGroup", Optional[torch.Tensor]]]) -> None:
    """After every group finished its gradient sync: ``.grad = None`` where no rank used a
    parameter; one host read of the flags that this rank must know, none if it used every
    parameter ([Note: usage flags without a host read])."""
    needed = [flags for _, flags in usage if flags is not None]
    values = torch.cat(needed).tolist() if needed else []
    at = 0
    for group, flags in usage:
        part = None  # used here, so used anywhere: nothing to drop
        if flags is not None:
            part = values[at:at + flags.numel()]
            at += flags.numel()
        for i in group.usage.unused_anywhere(part):
            group.params[i].sharded.grad = None


def _flags_on_device(flags: List[int], device: torch.device) -> torch.Tensor:
    """``flags`` (0/1) as an int32 tensor on ``device`` without a host-to-device copy (a copy
    from pageable memory waits for the device's queue): ones, then the zeros filled in, one
    fill per run of zeros (only parameters without a gradient here make one)."""
    out = torch.ones(len(flags), dtype=torch.int32, device=device)
    start = None
    for i, f in enumerate(flags + [1]):
        if not f and start is None:
            start = i
        elif f and start is not None:
            out[start:i].zero_()
            start = None
    return out
