"""Exact live tensor bytes of one process, with an optional hard budget (benchmarks and tests).

``LiveBytes`` is a ``TorchDispatchMode`` that knows every tensor storage alive in the process:
on entry it registers the storages of every tensor Python can reach (``gc``), then every
storage a tensor op allocates while it is active, and it follows ``UntypedStorage.resize_``
(FSDP2 and vescale-zero free and re-allocate their full buffers that way). ``live`` is the
sum of their current sizes, ``peak`` its maximum, and ``peak_storages`` the storages (with
their sizes) alive at that peak, to be split by role afterwards (:meth:`LiveBytes.split`).

``LiveBytes(budget=n)`` raises :class:`OverBudget` from the op (or ``resize_``) that takes the
live bytes past ``n``: a per-rank memory cap for a test, exact and the same on every device
(a CPU process's RSS is not: the allocator keeps freed pages).

Blind spots: storages that C++ code allocates without a tensor op (a backend's internal
buffers) and tensors no Python object reaches at entry are not counted.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from typing import Callable, Dict, Iterable, Optional

import torch
from torch.distributed.tensor import DTensor

from vescale_zero.torch_compat import TorchDispatchMode, tree_flatten

__all__ = ["LiveBytes", "OverBudget"]


class OverBudget(RuntimeError):
    """The live tensor bytes went past a :class:`LiveBytes` budget."""


def _storage(t: torch.Tensor) -> Optional[torch.UntypedStorage]:
    if t.device.type == "meta" or isinstance(t, DTensor):  # a DTensor's bytes are its local tensor's
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
        return None


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as m: step()`` then ``m.peak``, ``m.live``, ``m.split(roles)``."""

    def __init__(self, budget: Optional[int] = None) -> None:
        super().__init__()
        self.budget = budget
        self.live = self.peak = 0
        self.peak_storages: Dict[int, int] = {}  # key -> bytes, at the peak
        self._size: Dict[int, int] = {}  # key -> current bytes of every live storage
        self._key: Dict[int, int] = {}  # id(storage object) -> key
        self._refs: Dict[int, weakref.ref] = {}
        self._next = 0
        self._orig_resize: Optional[Callable] = None

    # ---- bookkeeping ----------------------------------------------------------------
    def key_of(self, storage: torch.UntypedStorage) -> Optional[int]:
        """The key of a live tracked storage, ``None`` if it is not tracked."""
        key = self._key.get(id(storage))
        return key if key is not None and self._refs[key]() is storage else None

    def _add(self, storage: torch.UntypedStorage) -> None:
        if self.key_of(storage) is not None:
            return
        key, sid = self._next, id(storage)
        self._next += 1

        def freed(_ref, key=key, sid=sid):
            self._set(key, 0)
            self._size.pop(key, None)
            self._refs.pop(key, None)
            if self._key.get(sid) == key:
                del self._key[sid]

        self._key[sid], self._refs[key], self._size[key] = key, weakref.ref(storage, freed), 0
        self._set(key, storage.nbytes())

    def _set(self, key: int, nbytes: int) -> None:
        old = self._size.get(key)
        if old is None:
            return
        self._size[key] = nbytes
        self.live += nbytes - old
        if self.live > self.peak:
            self.peak = self.live
            self.peak_storages = {k: n for k, n in self._size.items() if n}
            if self.budget is not None and self.live > self.budget:
                raise OverBudget(f"{self.live} live tensor bytes > budget {self.budget} B")

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count these tensors' storages too (from now on, until freed)."""
        for t in tensors:
            st = _storage(t)
            if st is not None:
                self._add(st)

    # ---- the mode ---------------------------------------------------------------------
    def __enter__(self) -> "LiveBytes":
        gc.collect()
        with warnings.catch_warnings():  # touching every object wakes deprecation warnings
            warnings.simplefilter("ignore")
            self.track([o for o in gc.get_objects() if isinstance(o, torch.Tensor)])
        self.peak, self.peak_storages = self.live, {k: n for k, n in self._size.items() if n}
        self._orig_resize = orig = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st: torch.UntypedStorage, size: int):
            out = orig(st, size)
            key = tracker.key_of(st)
            if key is None:
                tracker._add(st)
            else:
                tracker._set(key, st.nbytes())
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize
        super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back here
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = _storage(t)
                if st is not None:
                    key = self.key_of(st)
                    if key is None:
                        self._add(st)
                    elif self._size[key] != st.nbytes():  # an in-place op grew it
                        self._set(key, st.nbytes())
        return out

    # ---- reading --------------------------------------------------------------------
    def keys_of(self, tensors: Iterable[torch.Tensor]) -> set:
        """Keys of the tracked storages behind ``tensors`` (untracked ones are skipped)."""
        keys = set()
        for t in tensors:
            st = _storage(t) if isinstance(t, torch.Tensor) else None
            key = self.key_of(st) if st is not None else None
            if key is not None:
                keys.add(key)
        return keys

    def split(self, roles: Dict[int, str], other: str = "other") -> Dict[str, int]:
        """Bytes alive at the peak by role: ``roles`` maps a storage key to its role (first
        match wins where the caller built it so); storages with no role count as ``other``."""
        out: Dict[str, int] = {}
        for key, n in self.peak_storages.items():
            role = roles.get(key, other)
            out[role] = out.get(role, 0) + n
        return out
