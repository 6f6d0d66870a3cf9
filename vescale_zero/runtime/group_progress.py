"""Where one FSDP group stands in forwards and backwards: the bookkeeping ``ParamGroup`` keeps
besides its buffers.

::

    forward  k   (root forward id)      ForwardRecord: ran in k? with grad? how many calls?
        |                                 one InputGradTrigger per forward (fires when the
        v                                 gradients of every call's inputs are computed)
    backward of k                       BackwardProgress: started, gradients arrived, ready,
                                          reduce-scatter issued; Part: takes part in it or not

The rules these records serve are in ``vescale_zero.runtime.param_group``
([Note: when a group's gradients are complete]) and ``vescale_zero.runtime.scheduler``
([Note: one order of reduce-scatters]).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Set

from .eager_hooks import outside_compile

__all__ = ["GroupState", "Part", "BackwardProgress", "InputGradTrigger", "ForwardRecord"]

FORWARDS_KEPT = 1024
"""Forwards a group remembers while their backward has not run (pipeline micro-batches in
flight); older ones were never differentiated (evaluation forwards with grad enabled)."""


class GroupState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDING = "unsharding"  # all-gather issued, not yet waited on
    UNSHARDED = "unsharded"


class Part(enum.Enum):
    """What a group does in a backward (scheduler [Note: one order of reduce-scatters])."""

    TAKES_PART = "takes part"  # ran forward with grad in the forward being differentiated, or seen in backward
    MAY_TAKE_PART = "may take part"  # ran that forward only under no_grad: a reentrant checkpoint may recompute it
    NONE = "none"  # did not run in that forward


@dataclass
class BackwardProgress:
    """Where one group stands in the current backward; a new one when the backward ends."""

    in_backward: bool = False  # pre-backward, a recompute, a gradient or an input trigger was seen in it
    started: bool = False  # pre-backward ran: full params installed, gradient views attached
    arrived: Set[int] = field(default_factory=set)  # indices whose gradient was accumulated
    ready: bool = False  # its gradients are complete ([Note: when a group's gradients are complete])
    issued: bool = False  # its reduce-scatter is issued (or skipped: no gradient sync)


class InputGradTrigger:
    """Counts the calls of a module (in one forward, or among one backward's recomputes)
    whose input gradients are still to come; when all have come, ``on_done`` runs (the group
    is ready). A call whose inputs need no gradient can never tell when its backward is over:
    it makes the trigger ``blind`` (the group then waits for its gradients or the end of
    backward)."""

    def __init__(self, on_done: Callable[[], None]) -> None:
        self.on_done, self.armed, self.fired, self.blind = on_done, 0, 0, False

    @outside_compile
    def fire(self) -> None:
        self.fired += 1
        if self.fired == self.armed and not self.blind:
            self.on_done()


class ForwardRecord:
    """The root forwards a group ran in (with grad or not), its calls in the latest one, and
    the input triggers of its forwards and of the current backward's recomputes."""

    def __init__(self) -> None:
        self._calls: tuple = (None, 0)  # (forward id, module calls in that forward)
        self._ran: Dict[int, bool] = {}  # forward id -> ran with grad enabled in it (else only without)
        # (forward id, its InputGradTrigger), held for the whole forward: a call whose inputs need
        # no gradient makes it blind, and no autograd node holds a blind trigger (a new one for the
        # next call of that forward would forget it: a group of several modules, a tied embedding)
        self._forward_trigger: Optional[tuple] = None
        self._recompute_trigger: Optional[InputGradTrigger] = None

    def note(self, grad_enabled: bool, forward_id: int, has_grads: bool) -> None:
        """The module runs forward (not a recompute) in root forward ``forward_id``."""
        fid, calls = self._calls
        self._calls = (forward_id, calls + 1 if fid == forward_id else 1)
        if not has_grads:
            return
        self._ran[forward_id] = self._ran.get(forward_id, False) or grad_enabled
        if len(self._ran) > FORWARDS_KEPT:  # forwards never differentiated (evaluation)
            del self._ran[min(self._ran)]

    def part_in(self, forward_id: Optional[int], seen_in_backward: bool) -> Part:
        """What the group does in the backward of root forward ``forward_id``."""
        if seen_in_backward or self._ran.get(forward_id):
            return Part.TAKES_PART
        return Part.MAY_TAKE_PART if forward_id in self._ran else Part.NONE

    def input_trigger(self, forward_id: Optional[int],
                      make: Callable[[], InputGradTrigger]) -> Optional[InputGradTrigger]:
        """The trigger to arm for one more call whose input gradients will come: per forward
        (``forward_id``), or, for a recompute inside backward (``None``), per backward --
        only when the module ran once in its forward, so one recompute is all of it."""
        if forward_id is None:
            if self._calls[1] != 1:
                return None
            if self._recompute_trigger is None:
                self._recompute_trigger = make()
            trigger = self._recompute_trigger
        else:
            fid, trigger = self._forward_trigger or (None, None)
            if fid != forward_id or trigger is None:
                trigger = make()
                self._forward_trigger = (forward_id, trigger)
        trigger.armed += 1
        return trigger

    def end_backward(self, forward_id: Optional[int]) -> None:
        """The backward of ``forward_id`` is over: forwards up to it are done with; later ones
        (pipeline schedules run the next micro-batches' forwards first) keep their records."""
        self._recompute_trigger = None
        if forward_id is not None:
            for fid in [f for f in self._ran if f <= forward_id]:
                del self._ran[fid]
