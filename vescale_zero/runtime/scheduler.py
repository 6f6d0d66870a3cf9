"""The one reduce-scatter order: every group of a root reports its gradients to one scheduler, which
issues their reduce-scatters in the same order on every rank.

A gradient's way from its hook to the collective, every call downward or through the group's
:class:`~vescale_zero.runtime.param_group.GroupScheduler` (the interface a group is given when its
root registers it, :meth:`ReduceScatterScheduler.register`)::

    autograd: a parameter's gradient is accumulated, or a call's input gradients are computed
      -> param_group._grad_accumulated / _use_ended    (the post-accumulate-grad hook; the input node)
      -> ParamGroup._on_grad_accumulated               (which gradients arrived, in which graph task)
           -> scheduler.gradient_arrived(group)        (finish what has arrived: reap)
         ParamGroup._on_use_ended                      (a use is over: param_group [Note: counting uses])
      -> ParamGroup._become_ready                      (param_group [Note: when a group's gradients are complete])
           -> scheduler.group_ready(group)
      -> ReduceScatterScheduler._issue_ready           (the order below)
      -> ParamGroup.issue_reduce_scatter               (gradients copied in)
      -> GradReducer.issue                             (the reduce-scatter: grad_reduce)

The module hooks (:mod:`vescale_zero.runtime.hooks`) tell the scheduler where an iteration
stands: a root forward's start and end and each group's first call in it (the order is the
first forward's), a backward's start and each forward it reaches (which forwards it
differentiates), and its end.

[Note: one order of reduce-scatters]
Collectives pair up across ranks by the order they are issued in, so every rank must issue
the same reduce-scatters in the same order, whatever gradients it got. Groups issue in one
fixed order: the reverse of the first forward's order (backward's natural order), then the
groups that were not in it. A group issues once it is ready and every earlier group that
takes part in this backward has issued. Taking part is judged against the forwards being
differentiated (param_group [Note: counting uses] finds them; pipeline schedules run the next
micro-batches' forwards before this backward): a group that ran in them with grad enabled, or
was seen in this backward, takes part; one that ran in them only under ``no_grad`` may still
take part (a reentrant checkpoint recomputes it), so it holds later groups until it does or
the backward ends; one that did not run in them takes no part. At the end every participating
group is ready, so the rest issue, in order; a group that only ran under ``no_grad`` and was
never recomputed issues nothing. Readiness may differ between ranks (an MoE expert without
tokens on one rank), the sequence of collectives cannot.
"""

from __future__ import annotations

from typing import FrozenSet, List, Optional, Tuple

import torch

from ..torch_compat import autograd_graph_task_id
from .group_progress import Part
from .param_group import ParamGroup
from .unused_grads import drop_unused, usage_anywhere

__all__ = ["ReduceScatterScheduler"]

Usage = List[Tuple[ParamGroup, Optional[torch.Tensor]]]
"""What :func:`~vescale_zero.runtime.unused_grads.usage_anywhere` returns, for ``drop_unused``."""


class ReduceScatterScheduler:
    """The reduce-scatters of every group under one root: their order
    ([Note: one order of reduce-scatters]), the ones in flight ([Note: bounded gradient memory]) and the end of a
    backward. Implements :class:`~vescale_zero.runtime.param_group.GroupScheduler`."""

    def __init__(self) -> None:
        self._groups: List[ParamGroup] = []  # registered: the root's groups, in module order
        self._first_forward: List[ParamGroup] = []  # groups by their first call in the first root forward
        self._order_fixed = False  # that forward has ended: _first_forward is the order
        self._order: Optional[List[ParamGroup]] = None  # cached once fixed, until requires_grad changes
        self.differentiated: FrozenSet[int] = frozenset()  # the root forwards the current backward differentiates
        self.backward_of: Optional[int] = None  # the last of them
        self._task = -1  # the current backward's autograd graph task
        self.reducing: List[ParamGroup] = []  # reduce-scatters issued, not yet waited on

    def register(self, group: ParamGroup) -> None:
        """``group`` reports to this scheduler from now on (the root's lazy initialisation)."""
        self._groups.append(group)
        group.report_to(self)

    # ---- where the iteration stands (told by the hooks) ---------------------------------
    def begin_forward(self) -> None:
        """A root forward starts: before the first one has ended, its order starts afresh."""
        if not self._order_fixed:
            self._first_forward = []

    def note_first_call(self, group: ParamGroup) -> None:
        """``group``'s first call in this root forward (not a recompute)."""
        if not self._order_fixed:
            self._first_forward.append(group)

    def end_forward(self) -> None:
        """A root forward ended: the first one's order is the order from now on."""
        self._order_fixed = True

    def invalidate_order(self) -> None:
        """Which groups have gradients changed (param_group [Note: requires_grad after sharding])."""
        self._order = None

    def begin_backward(self, forward_id: Optional[int]) -> None:
        """A backward starts: its first hook, on an output of root forward ``forward_id``, inside
        the backward's graph task. Which forwards it differentiates, and each group's uses in
        them: param_group [Note: counting uses]."""
        forwards = set() if forward_id is None else {forward_id}
        for group in self._groups:
            forwards |= group.forwards.forwards_in_graph()
        self.backward_of = None
        self.differentiated = frozenset()
        self._task = autograd_graph_task_id()
        self._differentiate(forwards)

    def reached(self, forward_id: Optional[int]) -> None:
        """A hook of this backward on an output of a call in root forward ``forward_id``: a
        forward not counted yet joins (param_group [Note: counting uses])."""
        if forward_id is not None and forward_id not in self.differentiated:
            self._differentiate({forward_id})

    def _differentiate(self, forwards) -> None:
        """Count ``forwards`` and the earlier forwards no node can be found for: those whose
        calls are all blind or under no_grad (param_group [Note: counting uses])."""
        forwards = set(self.differentiated) | set(forwards)
        if forwards:
            last = max(forwards)
            recorded, signalling = set(), set()
            for group in self._groups:
                recorded |= group.forwards.recorded()
                signalling |= group.forwards.signalling()
            forwards |= {f for f in recorded - signalling if f <= last}
        self.differentiated = frozenset(forwards)
        self.backward_of = max(forwards) if forwards else None
        for group in self._groups:
            group.plan_backward(self.differentiated, self._task)

    def order(self) -> List[ParamGroup]:
        """The groups with gradients, in [Note: one order of reduce-scatters]."""
        if self._order is not None:
            return self._order
        seen = set(map(id, self._first_forward))
        groups = list(reversed(self._first_forward)) + [g for g in reversed(self._groups) if id(g) not in seen]
        order = [g for g in groups if g.grad_indices]
        if self._order_fixed:
            self._order = order
        return order

    # ---- what groups report (GroupScheduler) --------------------------------------------
    def gradient_arrived(self, group: ParamGroup) -> None:
        """A gradient of ``group`` was accumulated: finish the reduce-scatters that have arrived
        (each gradient's arrival polls): their inputs are freed as soon as they are done with,
        never waited for here."""
        while self.reducing and self.reducing[0].grads.arrived:
            self.reducing.pop(0).finish_grad_sync()

    def group_ready(self, group: ParamGroup) -> None:
        """``group``'s gradients are complete: issue what the order allows now."""
        self._issue_ready()

    # ---- issuing ------------------------------------------------------------------------
    def _issue_ready(self, final: bool = False) -> None:
        """Issue every reduce-scatter that [Note: one order of reduce-scatters] allows now."""
        for group in self.order():
            if group.progress.issued:
                continue
            part = group.part_in(self.differentiated)
            if part is not Part.TAKES_PART:
                if final or part is Part.NONE:
                    continue  # takes no part (and, at the end, never will)
                return  # may still be recomputed: later groups wait for it
            if not group.progress.ready:
                return
            if group.requires_grad_sync:
                self._finish_in_flight(group.max_reduce_scatters_in_flight)
            if group.issue_reduce_scatter():
                self.reducing.append(group)

    def _finish_in_flight(self, limit: int = 1) -> None:
        """[Note: bounded gradient memory] One reduce-scatter in flight: before a group copies
        its gradients into its collective's input, the older reduce-scatter is waited for and
        its input freed (it ran during this group's backward), so backward holds one group's
        gradients and one input buffer at most, as PyTorch FSDP2 does by default; one that
        arrived before is finished at once (:meth:`gradient_arrived`), which FSDP2 does not do.
        A group set to allow ``limit`` in flight (``set_reduce_scatter_max_input_buffers``)
        waits only for the oldest beyond ``limit - 1``."""
        while len(self.reducing) >= limit:
            self.reducing.pop(0).finish_grad_sync()

    def end_backward(self) -> Usage:
        """The end of a backward (the root's final callback): every participating group is
        ready, the rest of the reduce-scatters issued in order, the usage flags reduced
        (unused_grads [Note: unused everywhere]); returns them for ``drop_unused`` once every
        group has finished its gradient sync (the hooks wait for each and reshard it)."""
        for group in self.order():
            if group.part_in(self.differentiated) is Part.TAKES_PART:
                group.force_ready()  # no-op for groups already ready; issues nothing by itself
        self._issue_ready(final=True)
        usage = usage_anywhere(self.order())
        self.reducing.clear()
        self.backward_of, self.differentiated = None, frozenset()
        return usage

    def reduce_accumulated(self) -> None:
        """[Note: reducing after backward] Backwards without gradient sync only accumulate; a
        host that reduces once per step *after* its backwards (Megatron's DDP without
        ``overlap_grad_reduce`` reduces in ``finish_grad_sync``) asks for the reduction here:
        every group with gradients reduce-scatters what was accumulated since the last reduction,
        in [Note: one order of reduce-scatters] (zeros for a group that got none: every rank
        issues the same collectives), one in flight at a time ([Note: bounded gradient memory]),
        then the usage flags (unused_grads [Note: usage flags without a host read]), as at the end
        of a synced backward."""
        for group in self.order():
            self._finish_in_flight()
            if group.issue_accumulated_reduce_scatter():
                self.reducing.append(group)
        usage = usage_anywhere(self.order())
        self._finish_in_flight()
        for group in self.order():
            group.settle_host_copies()
        drop_unused(usage)

    def reset(self) -> None:
        """runtime.hooks [Note: resetting an iteration]: what was issued is dropped (each group
        waits for its own collectives), the backward forgotten, and a first forward that did not
        end starts its order again."""
        self.reducing.clear()
        self.backward_of, self.differentiated = None, frozenset()
        if not self._order_fixed:
            self._first_forward = []
