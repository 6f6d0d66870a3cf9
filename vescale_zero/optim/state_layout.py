"""How one parameter group's optimizer state is laid out in its file and staging buffer.

[Note: state layout] A group's payload is its state tensors' bytes, one region per device
(so each region moves to or from its device in one copy), every tensor at a multiple of
64 bytes (a view of any dtype is then aligned). A DTensor's local tensor is stored, and its
spec kept in memory to rebuild it; non-tensor values (a Python ``step``) stay in memory.
The layout is rebuilt when the state's keys, dtypes, shapes or devices change (the first
step, a parameter that gets its first gradient); otherwise a step writes in place.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor

__all__ = ["Slot", "Layout", "Stage", "build_layout", "signature_of", "rebuild", "local_of"]

_ALIGN = 64  # every state tensor starts on this many bytes of the buffer (any dtype's view is aligned)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class Slot:
    """Where one state tensor lives in a group's payload, and how to rebuild it."""

    device: torch.device
    dtype: torch.dtype
    shape: Tuple[int, ...]  # of the local tensor
    cls: Optional[type]  # the DTensor class for a DTensor (its local tensor is stored), else None
    spec: Any  # the DTensor's spec
    offset: int
    nbytes: int


@dataclass
class Layout:
    """One group's state on disk: per parameter, its keys in order, each a slot or a value."""

    params: List[torch.Tensor]
    entries: List[List[Tuple[Any, Optional[Slot]]]]  # (key, slot); None: a non-tensor value in ``values``
    values: Dict[Tuple[int, Any], Any]
    nbytes: int
    regions: Dict[torch.device, Tuple[int, int]]  # device -> its [start, end) of the payload
    signature: tuple
    digest: int
    index: Dict[int, int] = field(default_factory=dict)  # id(param) -> position in params


def local_of(value: torch.Tensor) -> torch.Tensor:
    return value._local_tensor if isinstance(value, DTensor) else value


def describe(value: Any) -> tuple:
    if not torch.is_tensor(value):
        return ("value",)
    local = local_of(value)
    spec = value._spec if isinstance(value, DTensor) else None
    return (local.device, local.dtype, tuple(local.shape), type(value) if spec is not None else None, spec)


def signature_of(params: List[torch.Tensor], states: Dict[torch.Tensor, dict]) -> tuple:
    return tuple((id(p), tuple((k, describe(v)) for k, v in states[p].items())) for p in params)


def build_layout(params: List[torch.Tensor], states: Dict[torch.Tensor, dict], signature: tuple) -> Layout:
    tensors = [(i, k, v) for i, p in enumerate(params) for k, v in states[p].items() if torch.is_tensor(v)]
    devices: List[torch.device] = []
    for _, _, v in tensors:
        if local_of(v).device not in devices:
            devices.append(local_of(v).device)
    slots: Dict[Tuple[int, Any], Slot] = {}
    regions: Dict[torch.device, Tuple[int, int]] = {}
    offset = 0
    for device in devices:  # one contiguous region per device: one copy to / from its buffer
        start = offset
        for i, k, v in tensors:
            local = local_of(v)
            if local.device == device:
                nbytes = local.numel() * local.element_size()
                spec = v._spec if isinstance(v, DTensor) else None
                slots[(i, k)] = Slot(device, local.dtype, tuple(local.shape), type(v) if spec is not None else None,
                                      spec, offset, nbytes)
                offset += _aligned(nbytes)
        regions[device] = (start, offset)
    entries = [[(k, slots.get((i, k))) for k in states[p]] for i, p in enumerate(params)]
    described = repr([[(repr(k), None if s is None else (str(s.device), str(s.dtype), s.shape, s.offset))
                       for k, s in e] for e in entries])
    layout = Layout(list(params), entries, {}, offset, regions, signature, zlib.crc32(described.encode()))
    layout.index = {id(p): i for i, p in enumerate(params)}
    return layout


def rebuild(slot: Slot, local: torch.Tensor) -> torch.Tensor:
    return local if slot.cls is None else slot.cls(local, slot.spec, requires_grad=False)


class Stage:
    """One staging buffer: a host tensor, and one tensor per accelerator device holding state."""

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self.host: Optional[torch.Tensor] = None
        self.on_device: Dict[torch.device, torch.Tensor] = {}

    def ensure(self, layout: Layout) -> None:
        """Big enough for ``layout`` (a new tensor if not: an older one may still be written out)."""
        if self.host is None or self.host.numel() < layout.nbytes:
            self.host = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        for device, (start, end) in layout.regions.items():
            buf = self.on_device.get(device)
            if device.type != "cpu" and (buf is None or buf.numel() < end - start):
                self.on_device[device] = torch.empty(end - start, dtype=torch.uint8, device=device)

    def view(self, slot: Slot, layout: Layout) -> torch.Tensor:
        if slot.device.type == "cpu":
            raw = self.host[slot.offset : slot.offset + slot.nbytes]
        else:
            start = layout.regions[slot.device][0]
            raw = self.on_device[slot.device][slot.offset - start : slot.offset - start + slot.nbytes]
        return raw.view(slot.dtype).view(slot.shape)

    def to_devices(self, layout: Layout) -> None:
        for device, (start, end) in layout.regions.items():
            if device.type != "cpu":
                self.on_device[device][: end - start].copy_(self.host[start:end])

    def from_devices(self, layout: Layout) -> None:
        for device, (start, end) in layout.regions.items():
            if device.type != "cpu":
                self.host[start:end].copy_(self.on_device[device][: end - start])

    def holds(self, t: torch.Tensor) -> bool:
        ptr = local_of(t).untyped_storage().data_ptr()
        return any(b is not None and b.untyped_storage().data_ptr() == ptr
                   for b in [self.host, *self.on_device.values()])

    def nbytes(self) -> int:
        return sum(b.numel() for b in [self.host, *self.on_device.values()] if b is not None)
