"""Test-only: how many bytes a call keeps alive *at once* beyond what it returns.

On CPU-only machines the "device" and the "cpu" of ``cpu_offload`` are one device, so a
device-memory peak cannot tell a gather buffer from the CPU copy it fills. This tracker
tells them apart by fate instead of by device: it records every storage that tensor ops
allocate while it is active, when each is freed, and which are still alive at the end
(the result). The *transient peak* is the most bytes alive at once among storages freed
before the end -- the gather buffers and scratch of a streamed gather -- whatever device
they live on::

    time ->     gather g0   copy out   gather g1   copy out     end
    g0 buffer   [=========================]                      freed: transient
    g1 buffer                          [==================]      freed: transient
    copies                  [=====================================]  kept: the result
    transient peak = max bytes of [==] bars alive together (one group, when streamed)
"""

from __future__ import annotations

import weakref
from typing import Dict, List, Tuple

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["TransientBytes"]


class TransientBytes(TorchDispatchMode):
    """``with TransientBytes() as t: f()`` then ``t.peak()``: the transient peak, in bytes."""

    def __init__(self) -> None:
        super().__init__()
        self._events: List[Tuple[str, int, int]] = []  # ("alloc" | "free", storage key, bytes)
        self._refs: Dict[int, weakref.ref] = {}
        self._next = 0

    def _track(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta":
            return  # no memory behind it (a model planned on meta before its shards exist)
        storage = tensor.untyped_storage()
        if any(ref() is storage for ref in self._refs.values()):
            return  # a view (or an in-place result) of storage already tracked
        key, size = self._next, storage.nbytes()
        self._next += 1
        self._events.append(("alloc", key, size))

        def freed(_ref, key=key, size=size):
            self._events.append(("free", key, size))
            self._refs.pop(key, None)

        self._refs[key] = weakref.ref(storage, freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {_plain(t).untyped_storage().data_ptr() for t in tree_flatten((args, kwargs or {}))[0]
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            t = _plain(t)
            if t.untyped_storage().nbytes() and t.untyped_storage().data_ptr() not in inputs:
                self._track(t)
        return out

    def peak(self) -> int:
        """Most bytes alive at once among the tracked storages freed before now."""
        alive_at_end = set(self._refs)
        live = best = 0
        for kind, key, size in self._events:
            if key in alive_at_end:
                continue
            live += size if kind == "alloc" else -size
            best = max(best, live)
        return best

    def kept(self) -> int:
        """Bytes of the tracked storages still alive (what the call returned)."""
        return sum(ref().nbytes() for ref in self._refs.values() if ref() is not None)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding the storage: a DTensor's (our sharded parameters') local tensor."""
    return t._local_tensor if isinstance(t, DTensor) else t
