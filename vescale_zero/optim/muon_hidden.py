"""Muon's step hidden in backward (``Muon(..., hide_in_backward=True)``).

[Note: the Muon step hidden in backward]
A ``fully_shard`` group's sharded gradients are final for this backward once its reduce-scatter
is finished (grad_reduce [Note: what runs after the reduce-scatter]), while backward still runs
the earlier layers. Then, for that group's Muon matrices::

    the group's reduce-scatter finished (its post-finish hook, on the thread running backward)
      momentum and direction of each piece   element-wise, into new tensors: the state and the
                                             gradients are not written
      -> a job for the worker thread (on an accelerator, its own stream, after an event)
    worker: the pieces to their roots, Newton-Schulz, the pieces back  (muon [Note: Muon's roots])
    step(): wait for every job, check that each is this step's (below), apply, commit momentum

The worker's moves run on a process group of their own, made with the optimizer: a group's
reduce-scatter finishes when it has arrived, which differs between ranks, so a move issued from
there would interleave differently with the gathers and reduce-scatters of backward on each rank;
on its own group only the jobs' moves are issued, in the one order groups finish in (the
reduce-scatter order, scheduler [Note: one order of reduce-scatters]), on every rank alike.

A job is this step's only if nothing changed since: each matrix's ``.grad`` is the same tensor at
the same version (an in-place change bumps it), its momentum buffer too, and ``momentum``,
``nesterov``, ``ns_steps`` are as they were. Otherwise ``step()`` computes that matrix as the
plain step does, so the result is always the plain step's, bit for bit:

* gradient clipping scales the gradients in place: the jobs are stale, and ``step()`` computes
  every matrix again (exposed, not wrong). ``vz.clip_grad_norm_`` leaves the gradients untouched
  when it does not clip (a coefficient of 1), so the hidden work stands on those steps;
* a non-finite step (``vz.skip_nonfinite_steps``) sets every ``.grad`` to ``None``: Muon skips
  the matrices (muon [Note: a matrix without a gradient]) and the jobs are dropped, the momentum
  not touched (it is committed only by ``step()``);
* gradient accumulation across synced backwards: each reduce-scatter restarts the group's job
  (the last one stands; the others are waited for and dropped);
* a backward without ``step()`` (an evaluation backward, a skipped step): its jobs are dropped by
  the next ``step()``, whose own jobs replace them.

Whether a matrix is taken from its job is agreed on by every rank (the all-reduce of
muon [Note: a matrix without a gradient] carries the flags too), so the moves of the matrices
computed again match. Learning rate and weight decay are read by ``step()``, as always.
Offloaded groups are refused (their gradients reach the host after the hook).
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..primitives.comm_device import current_device
from ..primitives.ragged_tensor import local_piece
from ..runtime.job_timeout import job_timeout
from ..runtime.param_group import slot_of
from .muon import MuonLayout, orthogonalise

__all__ = ["HiddenStep"]


class _Job:
    """One group's matrices, started when its reduce-scatter finished."""

    def __init__(self, layout: MuonLayout, ks: List[int], group: Optional[dist.ProcessGroup],
                 device: torch.device, stream: Optional[torch.Stream]) -> None:
        self.layout, self.ks, self.group, self.device, self.stream = layout, ks, group, device, stream
        self.snapshots: Dict[int, tuple] = {}
        self.momenta: Dict[int, torch.Tensor] = {}
        self.directions: Dict[int, torch.Tensor] = {}
        self.ns_steps: Dict[int, int] = {}
        self.updates: Dict[int, torch.Tensor] = {}
        self.started: Optional[torch.Event] = None
        self.finished: Optional[torch.Event] = None
        self.error: Optional[BaseException] = None
        self.done = threading.Event()

    def run(self) -> None:
        """On the worker: the moves and Newton-Schulz; never raises (``error`` holds it)."""
        try:
            with current_device(self.device), (self.stream if self.stream is not None else contextlib.nullcontext()):
                if self.started is not None:
                    self.stream.wait_event(self.started)
                self.updates = orthogonalise(self.layout, self.ks, self.directions, self.ns_steps, self.group,
                                             self.device)
                self.directions = {}
                if self.stream is not None:
                    self.finished = torch.Event(device=self.device)
                    self.finished.record(self.stream)
        except BaseException as e:  # noqa: BLE001 - step() raises it on the main thread
            self.error = e
        finally:
            self.done.set()


def _work(jobs: "queue.SimpleQueue[Optional[_Job]]") -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        job.run()


def _snapshot(state: dict, p: torch.Tensor, group: dict) -> tuple:
    """What a job's result depends on, as of now ([Note: the Muon step hidden in backward])."""
    buf = state.get("momentum_buffer")
    own = None if buf is None else (local_piece(buf).data_ptr(), local_piece(buf)._version)
    grad = local_piece(p.grad)
    return (weakref.ref(p.grad), grad.data_ptr(), grad._version, own,
            (group["momentum"], group["nesterov"], group["ns_steps"]))


def _same(old: tuple, new: tuple) -> bool:
    return old[0]() is not None and old[1:] == new[1:]


def _after_reduce(hidden_ref: "weakref.ref[HiddenStep]", group_ref: "weakref.ref") -> None:
    """A group's post-finish hook (held weakly: param_group [Note: hooks hold their group weakly])."""
    hidden, group = hidden_ref(), group_ref()
    if hidden is not None and group is not None:
        hidden.start(group)


class HiddenStep:
    """The jobs of one :class:`~vescale_zero.optim.Muon` ([Note: the Muon step hidden in backward])."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = weakref.ref(optimizer)
        muon = optimizer._muon_params()
        params = [p for p, _ in muon]
        groups: Dict[int, object] = {}
        for p in params:
            slot = slot_of(p)
            if slot is None:
                continue  # a parameter outside fully_shard: stepped by step()
            if slot[0].offload is not None:
                raise ValueError("Muon(hide_in_backward=True): the model's groups are offloaded (offload_policy), "
                                 "so their gradients reach the host after the reduce-scatter; drop one of the two")
            groups.setdefault(id(slot[0]), slot[0])
        layout = optimizer._plan(params) if params else None
        self.device = optimizer._device()
        self.comm_group: Optional[dist.ProcessGroup] = None
        if layout is not None and layout.world > 1:
            ranks = dist.get_process_group_ranks(layout.group) if layout.group is not None else \
                list(range(dist.get_world_size()))
            self.comm_group = dist.new_group(ranks, timeout=job_timeout(), use_local_synchronization=True)
        accelerator = torch.accelerator.current_accelerator()
        on_accelerator = accelerator is not None and self.device.type == accelerator.type
        self.stream = torch.Stream(device=self.device) if on_accelerator else None
        self._jobs: Dict[int, _Job] = {}  # id(group) -> its latest job
        self._queued: List[_Job] = []  # every job not yet waited for, in order
        self._members: Dict[Tuple[Tuple[int, ...], int], List[int]] = {}
        self._queue: "queue.SimpleQueue[Optional[_Job]]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        for group in groups.values():
            hook = functools.partial(_after_reduce, weakref.ref(self), weakref.ref(group))
            group.grads.post_finish_hooks.append(hook)
        weakref.finalize(self, self._queue.put, None)  # the worker ends with the optimizer

    def close(self) -> None:
        """Stop the worker (after the jobs queued; they are dropped). Optional: it also stops when
        the optimizer is collected."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    # ---- in backward ---------------------------------------------------------------------
    def start(self, group) -> None:
        """``group``'s gradients are reduced: start its matrices' job."""
        optimizer = self._optimizer()
        if optimizer is None:
            return
        muon = optimizer._muon_params()
        layout = optimizer._layout
        key = tuple(id(p) for p, _ in muon)
        if layout is None or layout.key != key:
            return  # the parameters changed since the layout: step() plans again (a collective, maybe)
        ks = self._members.get((key, id(group)))
        if ks is None:
            ks = self._members[(key, id(group))] = [
                k for k, (p, _) in enumerate(muon) if (slot_of(p) or (None,))[0] is group]
        if not ks or any(muon[k][0].grad is None for k in ks):
            self._jobs.pop(id(group), None)
            return
        job = _Job(layout, ks, self.comm_group, self.device, self.stream)
        with torch.no_grad():
            for k in ks:
                p, settings = muon[k]
                state = optimizer.state[p]
                job.snapshots[k] = _snapshot(state, p, settings)
                job.directions[k], job.momenta[k] = optimizer._direction(p, settings, commit=False)
                job.ns_steps[k] = settings["ns_steps"]
        if self.stream is not None:
            job.started = torch.Event(device=self.device)
            job.started.record()
            for direction in job.directions.values():  # made on this stream, used and freed on the worker's
                direction.record_stream(self.stream)
        self._jobs[id(group)] = job
        self._queued.append(job)
        if self._thread is None:
            self._thread = threading.Thread(target=_work, args=(self._queue,), name="vescale-muon", daemon=True)
            self._thread.start()
        self._queue.put(job)

    # ---- in step() ---------------------------------------------------------------------
    def collect(self, layout: MuonLayout, muon: Sequence[Tuple[torch.Tensor, dict]]) -> Dict[int, tuple]:
        """Wait for every job; ``{matrix: (its momentum after this step, its update)}`` for the
        matrices whose job is this step's ([Note: the Muon step hidden in backward])."""
        queued, jobs = self._queued, list(self._jobs.values())
        self._queued, self._jobs = [], {}
        for job in queued:
            job.done.wait()
        for job in queued:
            if job.error is not None:
                raise RuntimeError(f"Muon(hide_in_backward=True): a step started in backward failed: {job.error}") \
                    from job.error
        optimizer = self._optimizer()
        out: Dict[int, tuple] = {}
        current = torch.accelerator.current_stream(self.device) if self.stream is not None else None
        for job in jobs:
            if job.layout.key != layout.key:
                continue
            if job.finished is not None:
                current.wait_event(job.finished)
            for k in job.ks:
                p, settings = muon[k]
                if p.grad is None or not _same(job.snapshots[k], _snapshot(optimizer.state[p], p, settings)):
                    continue
                update = job.updates[k]
                if current is not None:  # made on the worker's stream, used on this one
                    update.record_stream(current)
                    job.momenta[k].record_stream(current)
                out[k] = (job.momenta[k], update)
        return out
