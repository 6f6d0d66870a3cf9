"""Optimizer state in files, stepped one parameter group at a time (NVMe optimizer offload).

::

    opt = torch.optim.AdamW(model.parameters(), foreach=True)     # after fully_shard
    files = offload_state_to_files(opt, model, "/nvme/run1")      # vescale_zero.optim
    ...  opt.step(), opt.zero_grad(), opt.state_dict(), vz.checkpoint.save(...) as before

[Note: stepping group by group] ``opt.step()`` runs the optimizer's own step once per
``fully_shard`` group (``groups_of(model)``, in module order; parameters of no group last),
each time with every ``param_group["params"]`` cut to that group's parameters::

    for each group g:   read g's file -> the staging buffer   (state tensors are views of it)
                        optimizer.step() on g's parameters only
                        state -> the buffer (a no-op for in-place optimizers) -> g's file
                        drop g's state

The staging buffer is one host tensor sized to the largest group's state (and, for state on
an accelerator, one device buffer per device), reused by every group and step, so the host
holds one group's state at a time; between steps no state tensor exists. With
``buffer_count=2`` two buffers alternate and one I/O thread reads the next group's file while
this group steps (its writes go through the same thread, in order). The first step finds no
files: the optimizer creates the state (lazily, as always), which is then written out.
Element-wise optimizers (Adam, AdamW, 8-bit AdamW) step each group exactly as they would in
one call, so the weights equal an in-memory run's bit for bit. An optimizer whose step mixes
parameters of different groups (a global statistic computed inside ``step``) does not, and
step hooks run once per group.

[Note: state outside the step] ``opt.state`` becomes a mapping backed by the files: reading
a parameter's entry outside a step (``state_dict()``, ``vz.checkpoint.save``, ``items()``)
reads that parameter's state into fresh tensors -- a snapshot, which is not written back when
changed. To change state, assign it: ``opt.state[p] = {...}`` (what ``vz.checkpoint.load``
does) is written to the group's file once every parameter of the group has been assigned,
and at the latest before the next step; ``opt.load_state_dict`` replaces all of it at once.
A parameter without state reads as ``{}`` (not kept).
"""

from __future__ import annotations

import copy
import types
import weakref
from collections import defaultdict
from collections.abc import MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..fully_shard import groups_of
from .state_file_io import StateFileDir, StateFileError
from .state_layout import Layout, Stage, build_layout, local_of, rebuild, signature_of

__all__ = ["StateFiles", "FileBackedState", "StateFileError", "offload_state_to_files"]

_INSTALLED = "_vescale_state_files"


class FileBackedState(MutableMapping):
    """``optimizer.state`` while its state is in files ([Note: state outside the step])."""

    def __init__(self, owner: "StateFiles") -> None:
        self._owner = owner
        self._resident: Dict[torch.Tensor, dict] = {}  # the group being stepped
        self._active: Optional[set] = None  # ids of its parameters, during its step
        self._pending: Dict[torch.Tensor, Optional[dict]] = {}  # assigned outside a step; None: deleted

    def __getitem__(self, param: torch.Tensor) -> dict:
        if param in self._resident:
            return self._resident[param]
        if self._active is not None and id(param) in self._active:
            return self._resident.setdefault(param, {})  # lazy state creation, as in a defaultdict
        if param in self._pending:
            return self._pending[param] or {}
        return self._owner._read_param(param) or {}

    def __setitem__(self, param: torch.Tensor, value: dict) -> None:
        if self._active is not None and id(param) in self._active:
            self._resident[param] = value
        else:
            self._pending[param] = value
            self._owner._flush_if_complete(param)

    def __delitem__(self, param: torch.Tensor) -> None:
        if param not in self:
            raise KeyError(param)
        if param in self._resident:
            del self._resident[param]
        else:
            self._pending[param] = None
            self._owner._flush_if_complete(param)

    def __contains__(self, param: object) -> bool:
        if param in self._resident:
            return True
        if param in self._pending:
            return self._pending[param] is not None
        return self._owner._stored(param)

    def __iter__(self) -> Iterator[torch.Tensor]:
        seen = set()
        for p in [*self._resident, *self._owner._stored_params(), *self._pending]:
            if id(p) not in seen and p in self:
                seen.add(id(p))
                yield p

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"FileBackedState({len(self)} parameters' state in {self._owner.files.directory!r})"


def _files_step(optimizer: torch.optim.Optimizer, closure: Optional[Callable] = None) -> Any:
    """``optimizer.step`` while installed (a function of the optimizer, so LR schedulers can wrap it)."""
    return getattr(optimizer, _INSTALLED).step(closure)


def _installed_step(optimizer: torch.optim.Optimizer) -> Callable:
    """``optimizer.step`` as installed.

    [Note: LR schedulers] A torch LR scheduler wraps ``optimizer.step`` (checked against torch
    2.13: ``LRScheduler.__init__`` binds ``step.__func__`` to the optimizer and marks the wrapper
    ``_wrapped_by_lr_sched``, warning when a step without the mark runs). A scheduler made later
    wraps this bound method; one made before is inside it (the step that runs per group), so the
    replacement keeps its mark."""
    if not getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        return types.MethodType(_files_step, optimizer)
    owner = weakref.ref(optimizer)

    def step(closure: Optional[Callable] = None) -> Any:
        return _files_step(owner(), closure)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return step


def _files_load_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    getattr(optimizer, _INSTALLED).load_state_dict(state_dict)


class StateFiles:
    """The installed state files of one optimizer (see :func:`offload_state_to_files`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, directory: str, *,
                 buffer_count: int = 1, pin_memory: bool = False) -> None:
        if getattr(optimizer, _INSTALLED, None) is not None:
            raise ValueError("this optimizer's state is already in files (offload_state_to_files was called on it)")
        if buffer_count < 1:
            raise ValueError(f"buffer_count must be >= 1 (1: read, step, write; 2: read the next group's state while "
                             f"stepping this one), got {buffer_count}")
        groups = groups_of(model)
        if not groups:
            raise ValueError("the model has no fully_shard groups: call vz.fully_shard / fully_shard_layers on it "
                             "first, then build the optimizer and put its state in files")
        self._group_of = {id(sp): i for i, g in enumerate(groups) for sp in g.sharded_params}
        self._loose = len(groups)  # the "group" of the optimizer's parameters that are in no fully_shard group
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.files = StateFileDir(directory, rank, world)
        # the files and the directory's lock go with this object (a cycle through the optimizer) unless closed
        self._finalizer = weakref.finalize(self, self.files.close, False)
        self.optimizer = optimizer
        pin = pin_memory and torch.accelerator.is_available()
        self._stages = [Stage(pin) for _ in range(min(buffer_count, 2))]  # more would wait on the same step
        self._io = ThreadPoolExecutor(1, thread_name_prefix="vz-state-io") if buffer_count > 1 else None
        self._writes: List[Future] = []
        self._layouts: Dict[int, Layout] = {}
        self.state = FileBackedState(self)
        self._own_methods = {name: name in optimizer.__dict__ for name in ("step", "load_state_dict")}
        self._inner_step = optimizer.step
        self._inner_load = optimizer.load_state_dict
        existing = optimizer.state
        optimizer.step = _installed_step(optimizer)
        optimizer.load_state_dict = types.MethodType(_files_load_state_dict, optimizer)
        setattr(optimizer, _INSTALLED, self)
        optimizer.state = self.state
        self._replace_all(existing)

    # ---- which parameters step together ---------------------------------------------------
    def _units(self) -> Dict[int, List[torch.Tensor]]:
        """The optimizer's parameters by fully_shard group index, in group order."""
        units: Dict[int, List[torch.Tensor]] = {}
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                units.setdefault(self._group_of.get(id(p), self._loose), []).append(p)
        return dict(sorted(units.items()))

    def _unit_of(self, param: torch.Tensor) -> int:
        return self._group_of.get(id(param), self._loose)

    # ---- the step: [Note: stepping group by group] -------------------------------------------
    def step(self, closure: Optional[Callable] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.flush()
        units = self._units()
        order = list(units)
        saved = [g["params"] for g in self.optimizer.param_groups]
        stages = self._stages
        try:
            reading = self._start_read(order[0], stages[0]) if order else None
            for n, unit in enumerate(order):
                stage = stages[n % len(stages)]
                resident = self._finish_read(unit, stage, reading)
                following = order[n + 1] if n + 1 < len(order) else None
                reading = None
                if following is not None and len(stages) > 1:  # read ahead into the other buffer
                    reading = self._start_read(following, stages[(n + 1) % len(stages)])
                members = {id(p) for p in units[unit]}
                self.state._resident, self.state._active = resident, members
                for g, params in zip(self.optimizer.param_groups, saved):
                    g["params"] = [p for p in params if id(p) in members]
                self._inner_step()
                states = {p: self.state._resident[p] for p in units[unit] if self.state._resident.get(p)}
                self.state._resident, self.state._active = {}, None
                self._commit(unit, units[unit], states, stage)
                if following is not None and len(stages) == 1:  # one buffer: read once this group is out
                    reading = self._start_read(following, stage)
        finally:
            for g, params in zip(self.optimizer.param_groups, saved):
                g["params"] = params
            self.state._resident, self.state._active = {}, None
            self._drain()
        return loss

    def _start_read(self, unit: int, stage: Stage) -> Optional[Future]:
        layout = self._layouts.get(unit)
        if layout is None:
            return None
        stage.ensure(layout)
        host = stage.host[: layout.nbytes]

        def read() -> None:
            self.files.read(unit, host, layout.nbytes, layout.digest)

        if self._io is not None:
            return self._io.submit(read)
        read()
        return None

    def _finish_read(self, unit: int, stage: Stage, reading: Optional[Future]) -> Dict[torch.Tensor, dict]:
        """The group's state dicts, their tensors views of ``stage`` (empty before its first step)."""
        if reading is not None:
            reading.result()
        layout = self._layouts.get(unit)
        if layout is None:
            return {}
        stage.to_devices(layout)
        out = {}
        for i, (param, entries) in enumerate(zip(layout.params, layout.entries)):
            out[param] = {k: (rebuild(s, stage.view(s, layout)) if s is not None else layout.values[(i, k)])
                          for k, s in entries}
        return out

    def _commit(self, unit: int, params: List[torch.Tensor], states: Dict[torch.Tensor, dict], stage: Stage) -> None:
        """Write ``states`` (the group's, every parameter with state) to the group's file via ``stage``."""
        params = [p for p in params if states.get(p)]
        if not params:
            if self._layouts.pop(unit, None) is not None:
                self._drain()
                self.files.remove(unit)
            return
        signature = signature_of(params, states)
        layout = self._layouts.get(unit)
        if layout is None or layout.signature != signature:
            layout = build_layout(params, states, signature)
            if stage.host is not None:  # tensors in the buffer move: free them from it before it is overwritten
                states = {p: {k: (v.clone() if torch.is_tensor(v) and stage.holds(v) else v) for k, v in s.items()}
                          for p, s in states.items()}
            self._drain()  # a write still running may read this stage
            stage.ensure(layout)
        else:
            for p, entries in zip(params, layout.entries):  # a state tensor moved between slots?
                for k, s in entries:
                    v = states[p][k]
                    if s is not None and stage.holds(v) and local_of(v).data_ptr() != stage.view(s, layout).data_ptr():
                        states = {q: {kk: (vv.clone() if torch.is_tensor(vv) and stage.holds(vv) else vv)
                                      for kk, vv in st.items()} for q, st in states.items()}
                        break
        with torch.no_grad():
            for i, (p, entries) in enumerate(zip(params, layout.entries)):
                for k, s in entries:
                    v = states[p][k]
                    if s is None:
                        layout.values[(i, k)] = v
                        continue
                    dst, src = stage.view(s, layout), local_of(v)
                    if dst.data_ptr() != src.data_ptr():  # in-place optimizers updated the buffer itself
                        dst.copy_(src)
        stage.from_devices(layout)
        self._layouts[unit] = layout
        host, nbytes, digest = stage.host, layout.nbytes, layout.digest

        def write() -> None:
            self.files.write(unit, host, nbytes, digest)

        if self._io is not None:
            self._writes.append(self._io.submit(write))
        else:
            write()

    def _drain(self) -> None:
        writes, self._writes = self._writes, []
        for w in writes:
            w.result()

    # ---- state outside the step: [Note: state outside the step] -----------------------------
    def _stored(self, param: object) -> bool:
        layout = self._layouts.get(self._group_of.get(id(param), self._loose))
        return layout is not None and id(param) in layout.index

    def _stored_params(self) -> List[torch.Tensor]:
        return [p for unit in sorted(self._layouts) for p in self._layouts[unit].params]

    def _read_param(self, param: torch.Tensor) -> Optional[dict]:
        """A fresh copy of ``param``'s state from its group's file (None: it has none)."""
        unit = self._unit_of(param)
        layout = self._layouts.get(unit)
        if layout is None or id(param) not in layout.index:
            return None
        self._drain()
        i = layout.index[id(param)]
        out = {}
        for k, s in layout.entries[i]:
            if s is None:
                out[k] = copy.deepcopy(layout.values[(i, k)])
                continue
            raw = torch.empty(s.nbytes, dtype=torch.uint8)
            self.files.read(unit, raw, layout.nbytes, layout.digest, offset=s.offset)
            out[k] = rebuild(s, raw.view(s.dtype).view(s.shape).to(s.device))
        return out

    def _flush_if_complete(self, param: torch.Tensor) -> None:
        if self.state._active is not None:
            return  # during a step the buffers are in use: the next flush writes it
        unit = self._unit_of(param)
        members = self._units().get(unit, [])
        if all(p in self.state._pending for p in members):
            self._flush_unit(unit, members)

    def _flush_unit(self, unit: int, members: List[torch.Tensor]) -> None:
        pending = self.state._pending
        states = {}
        for p in members:
            s = pending[p] if p in pending else self._read_param(p)
            if s:
                states[p] = s
        self._commit(unit, members, states, self._stages[0])
        self._drain()
        for p in members:
            pending.pop(p, None)

    def flush(self) -> None:
        """Write every state assigned outside a step to its group's file (the step does this first)."""
        if not self.state._pending:
            return
        units = self._units()
        touched = {self._unit_of(p) for p in self.state._pending}
        for unit in sorted(touched):
            self._flush_unit(unit, units.get(unit, []))
        self.state._pending.clear()  # state of parameters the optimizer no longer holds

    def _replace_all(self, states: Any) -> None:
        """All of the optimizer's state becomes ``states`` (a mapping param -> dict), written out."""
        for members in self._units().values():
            for p in members:
                self.state._pending[p] = states[p] if p in states and states[p] else None
        self.flush()

    def load_state_dict(self, state_dict: dict) -> None:
        """The optimizer's own ``load_state_dict`` (into memory), then its state into the files."""
        self.optimizer.state = defaultdict(dict)
        try:
            self._inner_load(state_dict)
        finally:
            loaded, self.optimizer.state = self.optimizer.state, self.state
        self._replace_all(loaded)

    # ---- reading the figures, closing ------------------------------------------------------
    def buffer_bytes(self) -> int:
        """Bytes of the staging buffers (host and devices): the state held in memory during a step."""
        return sum(s.nbytes() for s in self._stages)

    def staging_buffers(self) -> List[torch.Tensor]:
        """The staging buffers (host, then device ones) allocated so far."""
        return [b for s in self._stages for b in [s.host, *s.on_device.values()] if b is not None]

    def payload_bytes(self) -> Dict[int, int]:
        """Each group's state bytes on disk (aligned), by fully_shard group index."""
        return {unit: layout.nbytes for unit, layout in self._layouts.items()}

    def close(self) -> None:
        """Bring the state back into the optimizer's memory, restore it, delete the files."""
        self.flush()
        self._drain()
        states = defaultdict(dict, {p: self._read_param(p) for p in self._stored_params()})
        for name, own in self._own_methods.items():
            if own:
                setattr(self.optimizer, name, self._inner_step if name == "step" else self._inner_load)
            else:
                self.optimizer.__dict__.pop(name, None)
        self.optimizer.state = states
        delattr(self.optimizer, _INSTALLED)
        self._layouts.clear()
        self.files.close(remove=True)
        if self._io is not None:
            self._io.shutdown()


def offload_state_to_files(optimizer: torch.optim.Optimizer, model: nn.Module, directory: str, *,
                           buffer_count: int = 1, pin_memory: bool = False) -> StateFiles:
    """Keep ``optimizer``'s state (built over ``model``'s sharded parameters) in files under
    ``directory`` and step it group by group ([Note: stepping group by group]); returns the
    handle (``close()`` brings the state back into memory). ``directory`` must exist and be
    writable, and belong to this optimizer alone (every rank writes its own files in it).
    ``buffer_count=2`` reads the next group's state while this one steps (two buffers);
    ``pin_memory`` pins the host buffer when an accelerator is present."""
    return StateFiles(optimizer, model, directory, buffer_count=buffer_count, pin_memory=pin_memory)
