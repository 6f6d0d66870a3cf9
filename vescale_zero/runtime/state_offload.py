"""Move tensors' bytes off the device and back, in place: the storages stay, the views stay.

[Note: offloading states in place]
RL loops free the accelerator while something else uses it -- an inference engine generating the
next rollouts -- and take the training state back afterwards (DeepSpeed's
``engine.offload_states()`` / ``reload_states()``). A ragged model's state is a handful of flat
buffers per group (master shard, gradient shard, the optimizer's state), and everything the
modules, the optimizer and the hooks hold is a *view* of one of them. So the bytes move, not the
tensors: each storage is copied into a host buffer (pinned when asked and an accelerator exists)
and resized to zero bytes; reloading resizes it back on its device and copies the bytes in.
Every tensor object -- the sharded parameters, their ``.grad``, the optimizer's state, the
buffers' views -- stays the same object over the same storage, so nothing that holds one needs
to know, and training afterwards reads exactly the bytes it left (a data pointer may change: the
views follow their storage). Between the two, the offloaded tensors have no bytes: nothing may
read them (the DeepSpeed engine refuses a forward).

With ``non_blocking`` the copies are issued without waiting; offloading still waits once, after
the last copy, before it frees the device bytes the copies read.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch
from torch.distributed.tensor import DTensor

__all__ = ["StateOffloader"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns the bytes: a DTensor's (our sharded parameters') local tensor."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole of ``storage`` as a flat uint8 tensor (a view: writes land in the storage)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class StateOffloader:
    """Tensors' storages moved to host buffers and back (see [Note: offloading states in place]).

    Args:
        host: where the bytes go (``"cpu"``).
    """

    def __init__(self, host: str = "cpu") -> None:
        self.host = torch.device(host)
        self._held: Dict[str, List[Tuple[torch.UntypedStorage, torch.Tensor]]] = {}

    @property
    def offloaded(self) -> List[str]:
        """The names of the state kinds offloaded now."""
        return [name for name, held in self._held.items() if held]

    def offload(self, name: str, tensors: Iterable[torch.Tensor], pin_memory: bool = True,
                non_blocking: bool = False) -> int:
        """Move the bytes of every storage behind ``tensors`` (each once; empty ones and those of
        kinds already offloaded skipped) to host buffers, under ``name``; the bytes moved."""
        if self._held.get(name):
            return 0
        seen = {id(s) for held in self._held.values() for s, _ in held}
        storages: Dict[Tuple[torch.device, int], torch.UntypedStorage] = {}
        for t in tensors:
            if t is None:
                continue
            storage = _local(t).untyped_storage()
            if storage.nbytes() and id(storage) not in seen:
                storages.setdefault((storage.device, storage.data_ptr()), storage)
        pin = pin_memory and torch.accelerator.is_available()
        held = []
        for storage in storages.values():
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, device=self.host, pin_memory=pin)
            host.copy_(_bytes_of(storage), non_blocking=non_blocking)
            held.append((storage, host))
        if non_blocking and held and torch.accelerator.is_available():
            torch.accelerator.synchronize()  # the copies read what resize_ frees
        for storage, _ in held:
            storage.resize_(0)
        self._held[name] = held
        return sum(host.numel() for _, host in held)

    def reload(self, non_blocking: bool = False) -> int:
        """Give every offloaded storage its bytes back, on its device; the bytes moved."""
        moved = 0
        for name in list(self._held):
            for storage, host in self._held.pop(name):
                storage.resize_(host.numel())
                _bytes_of(storage).copy_(host, non_blocking=non_blocking)
                moved += host.numel()
        if non_blocking and moved and torch.accelerator.is_available():
            torch.accelerator.synchronize()  # the host buffers are dropped here
        return moved
