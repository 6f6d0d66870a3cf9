"""CPU offload: a group's persistent shards in host memory, its collectives on the device.

``fully_shard(module, offload_policy=CPUOffloadPolicy(pin_memory=True))`` (torch's own policy
class, as FSDP2 takes it) moves every *persistent* per-rank buffer of a group to the host; what
exists only while a group is gathered or reducing stays on the compute device::

    host (pinned)                                 device (the module's)
    -------------                                 ---------------------
    master.local   sharded params, fp32  --H2D--> own slot of compute.full --all-gather--> compute.full
    grads.sharded  sharded .grad         <--D2H-- reduce-scatter output <--reduce-scatter-- grads.full
    optimizer state (made by the optimizer
    from the parameters it holds: on the host)

Each move is one copy of one contiguous range per group (a rank's shard), whatever the number
of tensors in it: the planner keeps every tensor's piece inside that range. The optimizer
steps on the host (torch's AdamW, DeepSpeed's CPU Adam, ``vescale_zero.optim``), on the
parameters it was given, as with FSDP2.

[Note: host copies and their streams]
On an accelerator the host-to-device copy of a gather runs on a copy stream of its own that
first waits for the compute stream (the slot it writes was allocated there), and the group's
all-gather is issued from that stream, so the collective waits for the copy and the compute
stream waits for neither: a prefetched group's copy overlaps the current group's compute. The
device-to-host copy of a reduced gradient is issued on the compute stream after the
collective's wait, ``non_blocking`` into pinned memory. Neither copy makes the host wait; the
host waits (an event per copy, :meth:`HostCopies.settle`) only before it touches what a copy
may still be reading or writing: before any optimizer step (a global step pre-hook: the step
writes the master a gather may still be reading and reads gradients still arriving) and at the
end of each backward (the caller may read ``.grad``). On a CPU device, host = device: the same
buffers and copies, with nothing asynchronous to wait for.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Dict, List, Optional

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["HostOffload", "resolve_offload_policy", "HostCopies", "settle_all_host_copies"]

_HOST = torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class HostOffload:
    """Where a group's persistent shards live when offloaded: host memory, pinned or not."""

    pin_memory: bool = True
    device: torch.device = _HOST

    def pins(self, compute_device: torch.device) -> bool:
        """Whether host buffers are pinned: when asked and there is an accelerator to pin for
        (a CPU-only process has none: pinning is then skipped, not refused)."""
        return self.pin_memory and torch.device(compute_device).type not in ("cpu", "meta") \
            and torch.accelerator.is_available()

    def empty(self, numel: int, dtype: torch.dtype, compute_device: torch.device) -> torch.Tensor:
        """A host buffer of ``numel`` elements (pinned: :meth:`pins`)."""
        return torch.empty(numel, dtype=dtype, device=self.device, pin_memory=self.pins(compute_device))


def resolve_offload_policy(policy: Optional[OffloadPolicy]) -> Optional[HostOffload]:
    """``None`` / ``OffloadPolicy()`` (FSDP2's "no offload"): ``None``; ``CPUOffloadPolicy``:
    its :class:`HostOffload`; anything else is refused naming what is accepted."""
    if policy is None:
        return None
    if isinstance(policy, CPUOffloadPolicy):
        return HostOffload(pin_memory=bool(policy.pin_memory))
    if type(policy) is OffloadPolicy:
        return None
    raise TypeError(
        f"fully_shard(offload_policy=...) takes torch.distributed.fsdp.CPUOffloadPolicy(pin_memory=...) or "
        f"OffloadPolicy() (no offload), got {policy!r}")


_LIVE: "weakref.WeakSet[HostCopies]" = weakref.WeakSet()
_HOOK = None
_COPY_STREAMS: Dict[torch.device, torch.Stream] = {}  # one per device, shared by its groups


def _copy_stream(device: torch.device) -> torch.Stream:
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.Stream(device=device)
    return _COPY_STREAMS[device]


def settle_all_host_copies(*_args, **_kwargs) -> None:
    """Wait for every host copy still in flight, in every offloaded group of the process
    ([Note: host copies and their streams]); registered as a global optimizer step pre-hook."""
    for copies in list(_LIVE):
        copies.settle()


def _register_step_hook() -> None:
    global _HOOK
    if _HOOK is None:
        _HOOK = register_optimizer_step_pre_hook(settle_all_host_copies)


class HostCopies:
    """The host <-> device copies of one offloaded group ([Note: host copies and their streams]).

    Args:
        offload: where the host side lives.
        device: the compute device (the collectives' and the full buffers').
    """

    def __init__(self, offload: HostOffload, device: torch.device) -> None:
        device = torch.device(device)
        self.asynchronous = device.type not in ("cpu", "meta")
        if self.asynchronous and device.index is None:  # "cuda" -> "cuda:<current>": one copy stream per device
            device = torch.device(device.type, torch.accelerator.current_device_index())
        self.offload, self.device = offload, device
        self._events: List[torch.Event] = []
        _LIVE.add(self)
        _register_step_hook()

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> Optional[torch.Stream]:
        """Copy (and cast) host ``src`` into device ``dst``. Returns the stream the copy runs on
        (issue the collective reading ``dst`` from it), ``None`` when synchronous."""
        if not self.asynchronous:
            dst.copy_(src)
            return None
        stream = _copy_stream(self.device)
        stream.wait_stream(torch.accelerator.current_stream(self.device))
        with stream:
            if src.dtype != dst.dtype:  # cast on the device: a host-side cast would make an unpinned temporary
                src = src.to(self.device, non_blocking=True)
            dst.copy_(src, non_blocking=True)
            self._note(stream.record_event())
        return stream

    def _note(self, event: torch.Event) -> None:
        """Keep ``event`` for :meth:`settle`, dropping those already complete (a loop of forwards
        without an optimizer step, generation, never settles)."""
        self._events = [e for e in self._events if not e.query()]
        self._events.append(event)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, *, wait: bool = False) -> None:
        """Copy (and cast) device ``src`` into host ``dst`` on the compute stream; ``wait``: the
        caller reads ``dst`` next, so return only when it is complete."""
        if not self.asynchronous:
            dst.copy_(src)
            return
        dst.copy_(src, non_blocking=True)
        event = torch.accelerator.current_stream(self.device).record_event()
        if wait:
            event.synchronize()
        else:
            self._note(event)

    def settle(self) -> None:
        """Return when every copy issued so far is complete (the host may then read the
        gradients and write the master)."""
        events, self._events = self._events, []
        for event in events:
            event.synchronize()
