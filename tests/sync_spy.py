"""Test-only: record the host reads of device values (host syncs) made within a block.

On a GPU the host must run ahead of the device: a Python call that reads a device tensor's
value on the host (``.item()``, ``.tolist()``, ``bool(t)``, ``float(t)``, ``int(t)``,
``.cpu()``) waits for every kernel queued before it. ``record_host_syncs(device)`` wraps
those methods of ``torch.Tensor`` in the calling process and records each call made on a
tensor of ``device`` (the parameters' device: on our CPU machines, the CPU itself stands
for the accelerator), with the innermost caller outside torch, so a failure says who read.

Tensors that live on the host by design even in a GPU run (torch's optimizers keep their
``step`` counters on the CPU unless ``fused`` or ``capturable``) are passed in ``host``
and not recorded: reading them does not wait for the device.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from typing import Iterable, Iterator, List

import torch

__all__ = ["SYNCING_METHODS", "record_host_syncs", "host_step_counters"]

SYNCING_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu")

_TORCH_DIR = os.path.dirname(torch.__file__)


def _caller() -> str:
    """The innermost frame outside torch and this file: who asked for the value."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not frame.filename.startswith(_TORCH_DIR) and frame.filename != __file__:
            return f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"
    return "?"


def host_step_counters(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """A torch optimizer's ``step`` tensors, kept on the host unless it is fused or
    capturable (then they are device tensors, and reading them is a sync)."""
    if optimizer.defaults.get("fused") or optimizer.defaults.get("capturable"):
        return []
    return [s["step"] for s in optimizer.state.values() if torch.is_tensor(s.get("step"))]


@contextlib.contextmanager
def record_host_syncs(device: torch.device, host: Iterable[torch.Tensor] = ()) -> Iterator[List[str]]:
    """Within: every call of :data:`SYNCING_METHODS` on a tensor of ``device`` (other than
    those in ``host``) is appended as ``"method at file:line function"``."""
    device = torch.device(device)
    skip = {id(t) for t in host}
    calls: List[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in SYNCING_METHODS}

    def wrap(name, original):
        def spy(self, *args, **kwargs):
            if self.device == device and id(self) not in skip:
                calls.append(f"{name} at {_caller()}")
            return original(self, *args, **kwargs)

        return spy

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
