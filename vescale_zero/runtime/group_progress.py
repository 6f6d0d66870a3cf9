"""Where one FSDP group stands in forwards and backwards: the bookkeeping ``ParamGroup`` keeps
besides its buffers.

::

    forward  k   (root forward id)      ForwardRecord: ran in k? with grad? its uses in k:
        |                                 one InputGradTrigger per call with grad (its input
        v                                 node fires when that call's backward is over), and
                                          the calls under no_grad
    backward of k (and of other          BackwardProgress: started, gradients arrived (per
    forwards whose graphs it reaches)     graph task), the uses still to end, ready, issued;
                                          Part: takes part in it or not

The rules these records serve are in ``vescale_zero.runtime.param_group``
([Note: when a group's gradients are complete]) and ``vescale_zero.runtime.scheduler``
([Note: one order of reduce-scatters]).
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field
from typing import Callable, Collection, Dict, List, Optional, Set, Tuple, Union

from ..torch_compat import engine_will_execute
from .eager_hooks import outside_compile

__all__ = ["GroupState", "Part", "BackwardProgress", "InputGradTrigger", "ForwardRecord", "Forwards", "UsesIn"]

FORWARDS_KEPT = 1024
"""Forwards a group remembers while their backward has not run (pipeline micro-batches in
flight); older ones were never differentiated (evaluation forwards with grad enabled)."""

Forwards = Union[None, int, Collection[Optional[int]]]
"""The root forwards a backward differentiates: one id, several, or ``None`` (not known)."""


def _as_set(forwards: Forwards) -> Set[int]:
    if forwards is None:
        return set()
    if isinstance(forwards, int):
        return {forwards}
    return {f for f in forwards if f is not None}


class GroupState(enum.Enum):
    SHARDED = "sharded"
    SHARDED_POST_FORWARD = "sharded post forward"  # post_forward [Note: the post-forward shard]
    UNSHARDING = "unsharding"  # all-gather issued, not yet waited on
    UNSHARDED = "unsharded"


class Part(enum.Enum):
    """What a group does in a backward (scheduler [Note: one order of reduce-scatters])."""

    TAKES_PART = "takes part"  # ran forward with grad in a forward being differentiated, or seen in backward
    MAY_TAKE_PART = "may take part"  # ran those forwards only under no_grad: a reentrant checkpoint may recompute it
    NONE = "none"  # did not run in them


class InputGradTrigger:
    """One use of a module: a call whose end in backward the identity node on its inputs
    announces (``fire``, when the gradients of the call's inputs are computed). ``node``: a weak
    reference to that node, set when it is made; ``None`` for a *blind* call, whose inputs carry
    no gradient (nothing can tell when its backward is over)."""

    __slots__ = ("on_done", "node", "__weakref__")

    def __init__(self, on_done: Callable[["InputGradTrigger"], None]) -> None:
        self.on_done = on_done
        self.node: Optional[weakref.ref] = None

    @property
    def blind(self) -> bool:
        return self.node is None

    def in_graph(self) -> bool:
        """Whether the backward running on this thread will run this call's input node (its graph is
        alive and reached from what is differentiated)."""
        node = self.node() if self.node is not None else None
        return node is not None and engine_will_execute(node)

    @outside_compile
    def fire(self) -> None:
        self.on_done(self)


@dataclass(frozen=True)
class UsesIn:
    """A group's uses in the forwards one backward differentiates ([Note: counting uses])."""

    signalled: Tuple[InputGradTrigger, ...] = ()  # calls whose input node will fire in this backward
    blind: int = 0  # calls with grad whose end nothing signals
    without_grad: int = 0  # calls under no_grad (a reentrant checkpoint recomputes them in backward)


@dataclass
class _CallsIn:
    """A group's calls in one root forward."""

    with_grad: List[InputGradTrigger] = field(default_factory=list)
    without_grad: int = 0


@dataclass
class BackwardProgress:
    """Where one group stands in the current backward; a new one when the backward ends."""

    in_backward: bool = False  # pre-backward, a recompute, a gradient or an input trigger was seen in it
    started: bool = False  # pre-backward ran: full params installed, gradient views attached
    arrived: Set[int] = field(default_factory=set)  # indices whose gradient was accumulated
    ready: bool = False  # its gradients are complete ([Note: when a group's gradients are complete])
    issued: bool = False  # its reduce-scatter is issued (or skipped: no gradient sync)
    # the uses still to end: param_group [Note: counting uses]
    planned: bool = False  # its uses in this backward were counted
    planned_forwards: Set[int] = field(default_factory=set)  # the root forwards whose uses were counted
    known_uses: bool = False  # some use was counted (or recomputed); else: [Note: counting uses], last case
    graph_task: int = -1  # the autograd graph task of the backward itself (not a recompute's nested one)
    due: Set[int] = field(default_factory=set)  # ids of the triggers whose input node is still to fire
    blind: int = 0  # blind uses in ``graph_task``: over when every gradient arrived there
    recomputes_due: int = 0  # calls under no_grad not recomputed yet
    blind_recomputes: int = 0  # recomputed blind uses: over when every gradient arrived in a nested task
    arrived_in: Dict[int, Set[int]] = field(default_factory=dict)  # graph task -> indices accumulated in it
    begun: int = 0  # pre-backward hooks of its calls that ran
    ended: int = 0  # input nodes of its calls that fired


class ForwardRecord:
    """The root forwards a group ran in (with grad or not) and its uses in each."""

    def __init__(self) -> None:
        self._ran: Dict[int, bool] = {}  # forward id -> ran with grad enabled in it (else only without)
        self._calls: Dict[int, _CallsIn] = {}  # forward id -> its calls there (groups with gradients only)

    def note(self, grad_enabled: bool, forward_id: int, has_grads: bool, differentiable: bool = True) -> None:
        """The module runs forward (not a recompute) in root forward ``forward_id``;
        ``differentiable``: that root forward runs with grad enabled (a call under ``no_grad``
        in one that does not -- evaluation, generation -- is never differentiated: not recorded)."""
        if not has_grads or not (grad_enabled or differentiable):
            return
        self._ran[forward_id] = self._ran.get(forward_id, False) or grad_enabled
        calls = self._calls.setdefault(forward_id, _CallsIn())
        if not grad_enabled:
            calls.without_grad += 1
        for record in (self._ran, self._calls):
            if len(record) > FORWARDS_KEPT:  # forwards never differentiated (evaluation)
                del record[min(record)]

    def add_use(self, forward_id: int, trigger: InputGradTrigger) -> None:
        """A call with grad in root forward ``forward_id`` (after :meth:`note`)."""
        self._calls.setdefault(forward_id, _CallsIn()).with_grad.append(trigger)

    def recorded(self) -> Set[int]:
        """The root forwards it remembers."""
        return set(self._ran) | set(self._calls)

    def signalling(self) -> Set[int]:
        """The root forwards in which some call of it has an input node (alive or not)."""
        return {fid for fid, calls in self._calls.items() if any(not t.blind for t in calls.with_grad)}

    def part_in(self, forwards: Forwards, seen_in_backward: bool) -> Part:
        """What the group does in the backward of root forwards ``forwards``."""
        fids = _as_set(forwards)
        if seen_in_backward or any(self._ran.get(f) for f in fids):
            return Part.TAKES_PART
        return Part.MAY_TAKE_PART if any(f in self._ran for f in fids) else Part.NONE

    def forwards_in_graph(self) -> Set[int]:
        """The forwards some call of which the running backward reaches (inside that backward)."""
        return {fid for fid, calls in self._calls.items() if any(t.in_graph() for t in calls.with_grad)}

    def uses_in(self, forwards: Collection[int]) -> UsesIn:
        """The uses in ``forwards`` of the backward running on this thread ([Note: counting uses])."""
        signalled, blind, without_grad = [], 0, 0
        for fid in sorted(forwards):
            calls = self._calls.get(fid)
            if calls is None:
                continue
            without_grad += calls.without_grad
            for trigger in calls.with_grad:
                if trigger.in_graph():
                    signalled.append(trigger)
                else:
                    blind += 1  # blind, or its inputs do not reach its outputs
        return UsesIn(tuple(signalled), blind, without_grad)

    def end_backward(self, forward_id: Optional[int]) -> None:
        """The backward of forwards up to ``forward_id`` is over: forwards up to it are done with;
        later ones (pipeline schedules run the next micro-batches' forwards first) keep their records."""
        if forward_id is not None:
            for record in (self._ran, self._calls):
                for fid in [f for f in record if f <= forward_id]:
                    del record[fid]
