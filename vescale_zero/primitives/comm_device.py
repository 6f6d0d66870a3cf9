"""Which device a tensor handed to a collective must live on.

A process group's backend serves some device types only. Our sharded buffers live on the
parameters' device, which the group serves by construction; the small tensors we make
for a collective (a flag, a norm, a count) must be put on such a device *explicitly*:
left to the default device they land on the CPU, which an NCCL group refuses::

    group's backend            small tensor on          result
    gloo                       cpu (default)            fine
    nccl                       cpu (default)            error: no backend for device type cpu
    nccl                       collective_device(...)   cuda:<current>: fine
    cuda:nccl,cpu:gloo         either                   fine

Object collectives (``broadcast_object_list``, ``all_gather_object``) pick their own
device: the *current* accelerator device on NCCL, so every rank must have made its own
device current (``torch.cuda.set_device(local_rank)``) or they all land on device 0.
:func:`current_device` makes the model's device current for the duration of such a call.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["backend_device_types", "collective_device", "current_device"]

_CPU = torch.device("cpu")


def backend_device_types(group: Optional[dist.ProcessGroup] = None) -> Tuple[str, ...]:
    """The device types (``"cpu"``, ``"cuda"``, ...) the backend of ``group`` (default: the
    world) serves; empty if its backend is one torch does not describe."""
    backend = str(dist.get_backend(group))
    if ":" in backend:  # "cuda:nccl,cpu:gloo": one backend per device type
        return tuple(pair.split(":", 1)[0].strip() for pair in backend.split(","))
    return tuple(dist.Backend.backend_capability.get(backend.lower(), ()))


def collective_device(group: Optional[dist.ProcessGroup] = None, prefer: Optional[torch.device] = None) -> torch.device:
    """The device for a small tensor in a collective on ``group`` (default: the world).

    ``prefer`` (the model's or the parameters' device) if the group's backend serves it;
    else the CPU if it does; else the current accelerator device (``cuda:<current>`` on
    NCCL). Raises ``RuntimeError`` naming the backend if none of them is served.
    """
    types = backend_device_types(group)
    if prefer is not None and (not types or torch.device(prefer).type in types):
        return torch.device(prefer)
    if not types or "cpu" in types:
        return _CPU
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None and accelerator.type in types:
        return torch.device(accelerator.type, torch.accelerator.current_device_index())
    raise RuntimeError(
        f"no device for a collective on a process group of backend {dist.get_backend(group)!r}, which serves "
        f"{list(types)}: neither {prefer} nor the CPU nor the current accelerator "
        f"({accelerator}); initialise the process group with a backend for the model's device"
    )


def current_device(device: Optional[torch.device]) -> torch.accelerator.device_index:
    """A context manager making ``device`` the current accelerator device for its duration
    (object collectives on NCCL use the current one); a no-op for a CPU device or ``None``."""
    accelerator = torch.accelerator.current_accelerator()
    index = None
    if device is not None and accelerator is not None and torch.device(device).type == accelerator.type:
        index = torch.device(device).index
    return torch.accelerator.device_index(index)
