"""Test-only: make a collective on the wrong device fail on a CPU machine.

On a GPU job a tensor created without a device lands on the CPU, and an NCCL process
group refuses it. Gloo serves the CPU, so on our machines the same bug passes unseen.
Inside :func:`strict_collectives`, the roles are played by other devices::

                                 GPU job (NCCL)          here (gloo, inside the guard)
    the model's device           cuda:<local>            cpu
    a tensor made with no device cpu                     meta
    a collective on it           refused by NCCL         refused by the guard, naming it

Every tensor handed to a ``torch.distributed`` tensor collective (also those that object
collectives make inside) must be on ``device``; anything else raises ``WrongDevice`` (after
joining the collective with stand-in tensors, so that the other ranks do not hang).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Iterator, List

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["strict_collectives", "WrongDevice", "GUARDED"]

GUARDED = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
           "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single", "all_to_all", "reduce", "gather",
           "scatter")  # those the installed torch has


CPU = torch.device("cpu")


class WrongDevice(RuntimeError):
    """A collective got a tensor on a device its group does not serve."""


def _tensors(value) -> List[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _stand_in(value, device: torch.device):
    """``value`` with every tensor off ``device`` replaced by zeros on ``device``."""
    if torch.is_tensor(value):
        return value if value.device == device else torch.zeros(value.shape, dtype=value.dtype, device=device)
    if isinstance(value, (list, tuple)) and any(torch.is_tensor(v) for v in value):
        return type(value)(_stand_in(v, device) for v in value)
    return value


def _guarded(name: str, fn, device: torch.device, calls: List[str], inside: List[bool]):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if inside[0]:  # torch re-enters through its torch-function dispatch (the meta mode)
            return fn(*args, **kwargs)
        inside[0] = True
        try:
            return _check(*args, **kwargs)
        finally:
            inside[0] = False

    def _check(*args, **kwargs):
        calls.append(name)
        wrong = [t.device for t in _tensors(list(args) + list(kwargs.values())) if t.device != device]
        if not wrong:
            return fn(*args, **kwargs)
        # The other ranks may be in this collective already: join it with stand-ins (so
        # every rank stays in step and the test fails instead of hanging), then refuse.
        fn(*[_stand_in(a, device) for a in args], **{k: _stand_in(v, device) for k, v in kwargs.items()})
        raise WrongDevice(f"dist.{name} got a tensor on {wrong[0]}, and the group's tensors live on {device} "
                          "(a tensor created without a device?)")

    return call


@contextmanager
def strict_collectives(device: torch.device = CPU) -> Iterator[List[str]]:
    """For the duration: tensors created without a device land on ``meta``, and every
    tensor collective checks that its tensors are on ``device``. Yields the names of the
    collectives called (so a test can tell that the guard saw them)."""
    calls: List[str] = []
    inside = [False]
    saved = {(mod, name): getattr(mod, name) for mod in (dist, c10d) for name in GUARDED if hasattr(mod, name)}
    try:
        for (mod, name), fn in saved.items():
            setattr(mod, name, _guarded(name, fn, device, calls, inside))
        with torch.device("meta"):
            yield calls
    finally:
        for (mod, name), fn in saved.items():
            setattr(mod, name, fn)
