"""ParamGroup: the parameters that ``fully_shard`` gathers together, and their buffers.

One group owns, per rank::

    role            buffer                      dtype          lives
    sharded params  master.local                param's own    always (the optimizer's tensors; in
                                                               host memory when offloaded: see
                                                               vescale_zero.runtime.offload, as are the
                                                               sharded grads)
    full params     compute.full                param_dtype    while gathered (forward/backward)
    gather input    master.local, or this rank's slot of compute.full (a cast), or of a
                    float8 buffer (FP8 tiles): see vescale_zero.runtime.param_gather
    full grads      the unsharded params' .grad param_dtype    first gradient .. reduce-scatter issued
                    (autograd's own tensors)                   (or the end of a backward without sync)
    reduce input    grads.full                  reduce_dtype   reduce-scatter issued .. finished; also
                                                               the gradients accumulated without sync
                                                               (grad_reduce: see below)
    sharded grads   grads.sharded (GradShard)   param's own    first reduce-scatter .. zero_grad(set_to_none)
                                                               (``param.grad`` views hold it: grad_shard,
                                                               see below)

The gradients accumulated without sync: grad_reduce [Note: accumulating in the reduce dtype]; the
lifetime of the sharded gradients: grad_shard [Note: gradient shards live with their .grad].

Every parameter object the module sees is a view: a sharded parameter into
``master.local``, an unsharded parameter into ``compute.full``, a sharded gradient into the
shard of ``grads.sharded``. The unsharded parameters' gradients are autograd's own tensors
until the reduce-scatter copies them into ``grads.full``
(grad_reduce [Note: gradients are copied in at the reduce-scatter]).

[Note: when a group's gradients are complete]
The reduce-scatter needs every gradient of the group for this backward: every *use* of the
group in it (a call of its module whose backward this backward runs) must be over. The group is
*ready* when every use it counted is over ([Note: counting uses]), and at the end of the
backward (the root's final callback) at the latest. A use that ends through its input
gradients (an autograd node on the inputs, as PyTorch FSDP2's post-backward) ends the module's
backward for that call, so a parameter without a gradient by then has none from it (an MoE
expert that got no token on this rank).

Which parameters got no gradient on any rank, and what their ``.grad`` becomes, is
``vescale_zero.runtime.unused_grads`` ([Note: unused everywhere]); each group keeps its ``usage``.

*When* it becomes ready may differ between ranks (which parameters got gradients differs);
the order in which ready groups issue their reduce-scatters must not: the group reports each
gradient and its readiness to its root's scheduler (:class:`GroupScheduler`, given when the root
registers it), which issues (``vescale_zero.runtime.scheduler``
[Note: one order of reduce-scatters]). A gradient that arrives for a group after its reduce-scatter was issued cannot
be reduced any more: it is an error, never a silent loss.

[Note: counting uses]
A module may be used more than once in one backward: called twice in a forward (a layer reused,
as DeepSpeed's ``SimpleModel`` does), in two root forwards that one backward differentiates
(``(model(a) + model(b)).backward()``), recomputed by activation checkpointing. Autograd
accumulates a parameter's gradient once per graph task, after every use there, but a reentrant
checkpoint differentiates each recomputed piece in a nested graph task of its own. So a group
counts its uses, and knows how each one ends:

  * a call with grad gets an identity node on its inputs (the hooks' input trigger) that fires
    when the call's input gradients are computed: its backward is over. At a backward's first
    hook, inside the backward's own graph task, the root's scheduler asks the autograd engine
    which of these nodes it will run (``torch_compat.engine_will_execute``): the forwards they
    belong to, and the first hook's own, are the forwards this backward differentiates (a later
    hook on an output of another forward adds it). Earlier forwards still recorded that have no
    node at all count too: every call in them blind or under ``no_grad`` (a reentrant-
    checkpointed model under a root fed with data), their root's output hook may run only after
    a later forward's whole backward. A forward with nodes none of which the engine will run is
    not differentiated here (an evaluation forward with grad), nor is a later one (a pipeline
    schedule's next micro-batch); a call under ``no_grad`` in a root forward without grad
    (evaluation, generation) is not recorded at all. Each node the engine will run is a
    *signalled* use;
  * a counted call whose inputs carry no gradient (data, a frozen embedding's output, a
    parameter passed in), or whose node the engine will not run, is a *blind* use: it is over
    when every gradient of the group has been accumulated in the backward's own graph task (a
    call this backward does not differentiate adds no gradient there);
  * a call under ``no_grad`` in those forwards may be recomputed inside backward by a reentrant
    checkpoint: it is due until recomputed, and its recompute is a use of its own (signalled by
    its node in the checkpoint's nested backward, or blind: over when every gradient has arrived
    in a nested graph task). A recompute of a call that ran with grad is no use (non-reentrant
    checkpointing recomputes inside the original call's backward, and autograd does not
    differentiate the recomputed graph). A call under ``no_grad`` that is never recomputed
    holds the group until the end of the backward;
  * a group that counted no use (its forwards' records are gone: a second backward through a
    retained graph) is ready once every gradient has arrived in one graph task.

Between two uses, when every use that began (its pre-backward ran) has ended and none is blind,
the group reshards; the next use's pre-backward gathers it again, as after forward, so two
forwards differentiated together hold no more gathered groups than one. What is counted (the
calls, their nodes, the forwards) is the same on every rank; gradient arrivals, which may differ,
only end blind uses.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..primitives.collectives import CommStats
from ..primitives.dbuffer import DBuffer
from ..primitives.planner import ShardPlan, TensorSpec, plan
from ..primitives.ragged_tensor import local_piece, ragged_spec, shard_mesh
from ..primitives.tensor_parallel import local_tensor
from ..torch_compat import autograd_graph_task_id
from .eager_hooks import outside_compile
from .grad_reduce import GradReducer
from .grad_shard import GradShard
from .group_progress import BackwardProgress, ForwardRecord, Forwards, GroupState, InputGradTrigger, Part
from .offload import HostCopies, HostOffload
from .param_gather import make_param_gather
from .post_forward import PostForwardShard
from .ragged_param import ManagedParam, RaggedParam, ShardedRange
from .unused_grads import GradUsage

__all__ = ["slot_of", "ManagedParam", "ParamGroup", "GroupScheduler", "GroupState", "ShardedRange", "BackwardProgress",
           "ForwardRecord", "InputGradTrigger", "Part"]


class GroupScheduler(Protocol):
    """What a group reports its gradients to: its root's scheduler
    (:class:`vescale_zero.runtime.scheduler.ReduceScatterScheduler`), which decides when the group
    reduce-scatters (it calls :meth:`ParamGroup.issue_reduce_scatter`)."""

    def gradient_arrived(self, group: "ParamGroup") -> None:
        """One of ``group``'s gradients was accumulated (reduce-scatters that arrived can finish)."""

    def group_ready(self, group: "ParamGroup") -> None:
        """``group``'s gradients are complete ([Note: when a group's gradients are complete])."""


_SLOTS: Dict[int, Tuple["weakref.ref", "weakref.ref", int]] = {}  # id(sharded param) -> (param, group, index)


def _register_slot(param: nn.Parameter, group: "ParamGroup", index: int) -> None:
    """Remember which group and index a sharded parameter belongs to (weakly: neither is kept
    alive, and nothing is attached to the parameter that pickling or deepcopy would follow)."""
    _SLOTS[id(param)] = (weakref.ref(param), weakref.ref(group), index)
    weakref.finalize(param, _SLOTS.pop, id(param), None)


def slot_of(param: torch.Tensor) -> Optional[Tuple["ParamGroup", int]]:
    """``(group, index)`` of a sharded parameter of a live ``fully_shard`` group, else ``None``."""
    entry = _SLOTS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    group = entry[1]()
    return None if group is None else (group, entry[2])


def _use_ended(group_ref: "weakref.ref[ParamGroup]", trigger: InputGradTrigger) -> None:
    """A use's input node fired ([Note: hooks hold their group weakly])."""
    group = group_ref()
    if group is not None:
        group._on_use_ended(trigger)


@outside_compile
def _grad_accumulated(group_ref: "weakref.ref[ParamGroup]", index: int, param: torch.Tensor) -> None:
    """The post-accumulate-grad hook of a group's parameter ([Note: hooks hold their group weakly])."""
    group = group_ref()
    if group is not None:
        group._on_grad_accumulated(index, param)


class ParamGroup:
    """Buffers and state of one FSDP group on one rank (see module docstring)."""

    def __init__(
        self,
        managed: Sequence[ManagedParam],
        originals: Sequence[nn.Parameter],
        granularities: Sequence[int],
        process_group: dist.ProcessGroup,
        *,
        param_dtype: Optional[torch.dtype] = None,
        reduce_dtype: Optional[torch.dtype] = None,
        align: int = 1,
        fp8_tile: Optional[int] = None,
        replicate_group: Optional[dist.ProcessGroup] = None,
        fp8: Optional[Sequence[bool]] = None,
        offload: Optional[HostOffload] = None,
        post_forward_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        dtypes = {p.dtype for p in originals}
        devices = {p.device for p in originals}
        if len(dtypes) != 1 or len(devices) != 1:
            names = [f"{m.fqn}: {p.dtype} on {p.device}" for m, p in zip(managed, originals)]
            raise ValueError(
                "all parameters of one fully_shard group must share a dtype and a device "
                f"(they share one flat buffer); got {names}. Cast/move the module first, or "
                "apply fully_shard to sub-modules so each group is uniform."
            )
        self.managed = list(managed)
        self.process_group = process_group  # the shard group: plans, gathers, reduce-scatters
        self.replicate_group = replicate_group  # HSDP: grad_reduce [Note: HSDP]
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.orig_dtype = originals[0].dtype
        self.device = originals[0].device
        self.param_dtype = param_dtype or self.orig_dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        # a tensor-parallel parameter is planned, cut and gathered as its TP-local tensor:
        # tensor_parallel [Note: ragged inside the tensor-parallel piece]
        specs = [TensorSpec(math.prod(m.shape), g, m.fqn) for m, g in zip(managed, granularities)]
        self.plan: ShardPlan = plan(specs, self.world_size, align=align)
        self.stats = CommStats()
        self._fp8_tile = fp8_tile
        # which tensors an FP8 gather moves as FP8: fp8_gather [Note: which tensors are FP8]
        self._fp8 = None if fp8 is None else list(fp8)
        self._expose_full_grad: Optional[Callable[[nn.Parameter, torch.Tensor], None]] = None
        self.offload = offload
        # reshard_after_forward=<int>: post_forward [Note: the post-forward shard]
        self.post_forward_group = post_forward_group
        self._build(self.device, originals)
        with torch.no_grad():
            for i, p in enumerate(originals):
                self.master.copy_local_from_full(i, local_tensor(p))
        # vescale_zero.materialize [Note: deferred initialisation]: built from meta parameters,
        # the shards hold no values until materialize() or load_full_state_dict() fills them.
        self.needs_init = self.device.type == "meta"

        self.state = GroupState.SHARDED
        # the root forward whose pre-hook or prefetch last gathered or used it while gathered;
        # None once resharded: runtime [Note: nothing stays gathered after forward]
        self.gathered_for: Optional[int] = None
        self.progress = BackwardProgress()
        self._scheduler: Optional[GroupScheduler] = None  # its root's, from report_to
        self.forwards = ForwardRecord()  # the forwards it ran in, and their input triggers
        self.usage = GradUsage()  # unused_grads [Note: unused everywhere]
        self.unshard_in_backward = True  # set_unshard_in_backward(False): backward reads no parameter value
        self.max_reduce_scatters_in_flight = 1  # scheduler [Note: bounded gradient memory]
        self.to_sharded_params()

    def _build(self, device: torch.device, templates: Sequence[nn.Parameter],
               unsharded_templates: Optional[Sequence[nn.Parameter]] = None) -> None:
        """Every buffer of the group on ``device`` (the full ones freed) and the parameter
        objects viewing them, carrying the attributes of ``templates`` (the unsharded ones
        of ``unsharded_templates`` if given)."""
        self.device = torch.device(device)  # the compute device: full buffers, collectives
        self.mesh = shard_mesh(self.process_group, self.device)
        shapes = [m.shape for m in self.managed]
        # offload [Note: host copies and their streams]: the persistent shards in host memory
        copies = None if self.offload is None or self.device.type == "meta" else HostCopies(self.offload, self.device)
        self.host_copies: Optional[HostCopies] = copies
        self.host_device = self.device if copies is None else self.offload.device  # where the shards live
        local = None
        if copies is not None:
            local = self.offload.empty(self.plan.shard_size, self.orig_dtype, self.device).zero_()
        self.master = DBuffer(self.plan, self.rank, self.orig_dtype, self.host_device, shapes=shapes, with_full=False,
                              local=local)
        direct = self.param_dtype == self.orig_dtype and not self._fp8_tile and copies is None
        self.compute = DBuffer(self.plan, self.rank, self.param_dtype, self.device, shapes=shapes,
                               local=self.master.local if direct else None, with_local=direct)
        self.gather = make_param_gather(self.master, self.compute, self.process_group, self.stats, shapes,
                                        self._fp8_tile, self._fp8, copies)
        self.post_forward: Optional[PostForwardShard] = None
        if self.post_forward_group is not None and self.device.type != "meta":
            self.post_forward = PostForwardShard(self.plan, self.post_forward_group, self.param_dtype, self.device)
        self.grads = GradReducer(self.plan, self.rank, self.process_group, self.stats, reduce_dtype=self.reduce_dtype,
                                 shard_dtype=self.orig_dtype, device=self.device, shapes=shapes,
                                 replicate_group=self.replicate_group, grad_dtype=self.param_dtype,
                                 host_copies=copies)
        self.params: List[RaggedParam] = []
        for i, (m, p) in enumerate(zip(self.managed, templates)):
            like = unsharded_templates[i] if unsharded_templates is not None else None
            placement, full = self.plan.placement(i), self.compute.full_view(i)
            if m.tp is None:
                spec = ragged_spec(self.mesh, placement, m.shape, self.orig_dtype)
            else:
                spec = ragged_spec(m.tp.mesh, placement, m.tp.shape, self.orig_dtype, m.tp.placements(placement))
                full = m.tp.unsharded(full)
            self.params.append(RaggedParam(m, p, self.master.local_view(i), full, spec, unsharded_like=like))
            _register_slot(self.params[-1].sharded, self, i)
        self._grad_indices = [i for i, m in enumerate(self.managed) if m.requires_grad]
        self._hooked: Set[int] = set()
        for i in self._grad_indices:
            self._hook_grad(i)

    def _hook_grad(self, index: int) -> None:
        """[Note: hooks hold their group weakly] A hook registered on a tensor lives in C++
        where Python's cycle collector cannot see it: a hook holding the group strongly
        (group -> unsharded param -> hook -> group) would keep every group, its buffers and
        its module alive after the model is dropped."""
        if index not in self._hooked:
            self._hooked.add(index)
            self.params[index].unsharded.register_post_accumulate_grad_hook(
                functools.partial(_grad_accumulated, weakref.ref(self), index))

    def report_to(self, scheduler: GroupScheduler) -> None:
        """Report gradients and readiness to ``scheduler`` (its root's, once, at the root's lazy
        initialisation)."""
        if self._scheduler is not None and self._scheduler is not scheduler:
            raise RuntimeError("a fully_shard group belongs to one root: it already reports to another root's "
                               "scheduler (apply fully_shard to a module under one root only)")
        self._scheduler = scheduler

    def follow_requires_grad(self) -> bool:
        """[Note: requires_grad after sharding] ``p.requires_grad_(flag)`` on a sharded parameter
        (staged freezing and unfreezing) takes effect at its group's next forward, as with FSDP2:
        the unsharded parameter follows the flag, so autograd computes (or skips) its gradient
        and the group reduces what it gets. True if a flag changed (the runtime then re-derives
        which groups reduce)."""
        flags = [rp.sharded.requires_grad for rp in self.params]
        if flags == [m.requires_grad for m in self.managed]:
            return False
        for i, (rp, flag) in enumerate(zip(self.params, flags)):
            if rp.managed.requires_grad != flag:
                rp.managed = self.managed[i] = dataclasses.replace(rp.managed, requires_grad=flag)
                rp.unsharded.requires_grad_(flag)
                if flag:
                    self._hook_grad(i)
        self._grad_indices = [i for i, m in enumerate(self.managed) if m.requires_grad]
        return True

    def leave_meta(self, device: torch.device) -> None:
        """Rebuild the group, built on the meta device, on ``device``: only the persistent
        shards get storage (values unset: ``needs_init`` stays true), and new parameter
        objects (meta tensors cannot turn into real ones in place) replace the old in every
        owner."""
        if self.device.type != "meta":
            raise RuntimeError(f"this fully_shard group is already on {self.device}, not on the meta device")
        if torch.device(device).type == "meta":
            raise ValueError("leave_meta needs a real device (e.g. 'cuda' or 'cpu'), got the meta device")
        # The reducer and the gather are rebuilt too: keep what was set on the group before (a
        # gradient divide factor set between fully_shard and materialize must survive).
        grads, gather = self.grads, self.gather
        self._build(device, self.sharded_params, self.unsharded_params)
        self.grads.keep_settings_of(grads)
        self.gather.comm = gather.comm
        self.to_sharded_params()

    # ---- parameter objects and buffers -----------------------------------------------
    @property
    def sharded_params(self) -> List[nn.Parameter]:
        return [p.sharded for p in self.params]

    @property
    def unsharded_params(self) -> List[nn.Parameter]:
        return [p.unsharded for p in self.params]

    @property
    def sharded_grad(self) -> GradShard:
        """The sharded gradients' buffer (``.live``: the shard or ``None``; ``param.grad`` are views)."""
        return self.grads.sharded

    @property
    def grad_indices(self) -> List[int]:
        return list(self._grad_indices)

    @property
    def requires_grad_sync(self) -> bool:
        return self.grads.requires_grad_sync

    @requires_grad_sync.setter
    def requires_grad_sync(self, value: bool) -> None:
        self.grads.requires_grad_sync = value

    @property
    def gradient_divide_factor(self) -> Optional[float]:
        return self.grads.divide_factor

    @gradient_divide_factor.setter
    def gradient_divide_factor(self, value: Optional[float]) -> None:
        self.grads.divide_factor = value

    def to_sharded_params(self) -> None:
        for p in self.params:
            p.to_sharded()

    def to_unsharded_params(self) -> None:
        for p in self.params:
            p.to_unsharded()

    # ---- all-gather / free -----------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """Gather the full parameters into ``compute.full`` (no-op unless sharded): from the
        post-forward shard over its group if forward kept one, else from the shard."""
        if self.state is GroupState.SHARDED_POST_FORWARD:
            self.gather.start_post_forward(self.post_forward, async_op)
        elif self.state is GroupState.SHARDED:
            self.gather.start(async_op)
        else:
            return
        self.state = GroupState.UNSHARDING

    def wait_for_unshard(self) -> None:
        if self.state is GroupState.UNSHARDING:
            self.gather.finish()
            if self.post_forward is not None:
                self.post_forward.drop()  # gathered from: post_forward [Note: the post-forward shard]
            self.state = GroupState.UNSHARDED

    def reshard(self) -> None:
        """Free the full parameters (and a post-forward shard) and hand the modules their
        sharded parameters."""
        self.gather.release()
        if self.post_forward is not None:
            self.post_forward.drop()
        self.to_sharded_params()
        self.state = GroupState.SHARDED
        self.gathered_for = None

    def reshard_after_forward(self) -> None:
        """Forward is over and a backward may follow: keep the post-forward shard if the group
        has one (post_forward [Note: the post-forward shard]), else :meth:`reshard`."""
        if self.post_forward is None or self.state is not GroupState.UNSHARDED:
            self.reshard()
            return
        self.post_forward.keep(self.compute)
        self.gather.release()
        self.to_sharded_params()
        self.state = GroupState.SHARDED_POST_FORWARD  # gathered_for stays: the next root forward drops it

    # ---- forward bookkeeping (group_progress.ForwardRecord) ---------------------------
    def note_forward(self, grad_enabled: bool, forward_id: int, differentiable: bool = True) -> None:
        """The module runs forward (not a recompute inside backward) in root forward
        ``forward_id``, which runs with grad enabled if ``differentiable``."""
        self.forwards.note(grad_enabled, forward_id, bool(self._grad_indices), differentiable)

    def part_in(self, forwards: Forwards) -> Part:
        """What this group does in the backward of root forwards ``forwards`` (ids, one id, or None)."""
        return self.forwards.part_in(forwards, self.progress.in_backward)

    def note_recompute(self, grad_enabled: bool) -> None:
        """The module runs forward inside backward (activation recompute)."""
        if grad_enabled and self._grad_indices:
            self.progress.in_backward = True

    def new_use(self, recompute: bool) -> Optional[InputGradTrigger]:
        """The trigger of a call with grad about to run ([Note: counting uses]); ``None`` for a
        group without gradients, or a recompute that is no use of its own."""
        if not self._grad_indices:
            return None
        if recompute:
            self._ensure_planned()
            if self.progress.recomputes_due <= 0:
                return None
        return InputGradTrigger(functools.partial(_use_ended, weakref.ref(self)))

    def add_use(self, trigger: InputGradTrigger, forward_id: Optional[int]) -> None:
        """``trigger``'s call runs in root forward ``forward_id`` (``None``: a recompute), its
        input node made (or none: blind)."""
        if forward_id is not None:
            self.forwards.add_use(forward_id, trigger)
            return
        progress = self.progress
        progress.recomputes_due -= 1
        progress.known_uses = True
        if trigger.blind:
            progress.blind_recomputes += 1
        else:
            progress.due.add(trigger)

    def plan_backward(self, forwards: Forwards, graph_task: int) -> None:
        """Count this group's uses in root ``forwards`` of the backward that runs in autograd graph
        task ``graph_task`` ([Note: counting uses]); inside it, again as it reaches more forwards."""
        progress = self.progress
        if not progress.planned:
            progress.planned, progress.graph_task = True, graph_task
        if not self._grad_indices or not forwards:
            return
        new = set(forwards) - progress.planned_forwards
        if not new:
            return
        progress.planned_forwards |= new
        uses = self.forwards.uses_in(new)
        progress.due.update(uses.signalled)
        progress.blind += uses.blind
        progress.recomputes_due += uses.without_grad
        progress.known_uses = progress.known_uses or bool(uses.signalled or uses.blind or uses.without_grad)

    def _ensure_planned(self) -> None:
        """Something of this backward reached the group before its root's first hook did: it
        counts no use ([Note: counting uses], last case)."""
        if not self.progress.planned:
            self.plan_backward(None, autograd_graph_task_id())

    # ---- backward --------------------------------------------------------------------
    def set_grads_written_into_full(self, expose: Callable[[nn.Parameter, torch.Tensor], None],
                                    written: Callable[[nn.Parameter], bool]) -> None:
        """Kernels add weight gradients into full-size views during backward
        (grad_reduce [Note: gradients written into full during backward]):
        ``expose(unsharded param, its view of the full gradient buffer)`` now, for every parameter
        with a gradient (the views stay valid while the buffer is freed and allocated again); each
        backward's start zeroes the buffer unless it holds the window's gradients;
        ``written(unsharded param)``: its ``.grad`` is a dummy, the gradient is in the view."""
        self._expose_full_grad = expose
        self.grads.written_into_full = written
        for i in self._grad_indices:
            expose(self.params[i].unsharded, self.grads.full.full_view(i))

    def begin_backward(self) -> bool:
        """Pre-backward: the full parameters are installed (a recompute reads them), unless
        ``unshard_in_backward`` is off. True the first time in this backward."""
        if self.unshard_in_backward or self.state is not GroupState.SHARDED:
            self.unshard()
            self.wait_for_unshard()
            self.to_unsharded_params()
        progress = self.progress
        progress.in_backward = True
        progress.begun += 1
        if progress.started:
            return False
        progress.started = True
        if self._expose_full_grad is not None and self._grad_indices:
            self.grads.open_full()
        return True

    def _on_grad_accumulated(self, index: int, param: torch.Tensor) -> None:
        progress = self.progress
        if progress.issued and self.grads.requires_grad_sync:
            raise RuntimeError(
                f"parameter {self.managed[index].fqn!r} received a gradient after its fully_shard group had "
                "reduce-scattered this backward's gradients, so it cannot be reduced. Its gradient came after "
                "every use of its module in this backward had ended: the parameter is used outside its module's "
                "forward (read by another module, or stored and used later). Apply fully_shard to a module whose "
                "forward contains every use of the parameter (e.g. a common parent), or to the root only."
            )
        # param.grad stays autograd's tensor: grad_reduce [Note: gradients are copied in at the reduce-scatter]
        self._ensure_planned()
        progress.in_backward = True
        progress.arrived.add(index)
        task = autograd_graph_task_id()
        got = progress.arrived_in.setdefault(task, set())
        got.add(index)
        if len(got) == len(self._grad_indices) and task != progress.graph_task:
            progress.blind_recomputes = 0  # every blind recompute's nested backward is over: [Note: counting uses]
        if self._scheduler is not None:
            self._scheduler.gradient_arrived(self)
        self._check_ready()

    def _on_use_ended(self, trigger: InputGradTrigger) -> None:
        """A use's input gradients are computed: its backward is over ([Note: counting uses])."""
        self._ensure_planned()
        progress = self.progress
        progress.in_backward = True
        progress.ended += 1
        progress.due.discard(trigger)
        self._check_ready()
        if not progress.ready and progress.started and progress.begun <= progress.ended \
                and self.state is not GroupState.SHARDED:
            self.reshard()  # between uses: the next one's pre-backward gathers again

    def _check_ready(self) -> None:
        """Ready once every counted use is over ([Note: counting uses])."""
        progress = self.progress
        if progress.ready or progress.due or progress.recomputes_due > 0 or progress.blind_recomputes > 0:
            return
        complete = len(self._grad_indices)
        if progress.blind and len(progress.arrived_in.get(progress.graph_task, ())) < complete:
            return
        if not progress.known_uses and not any(len(got) == complete for got in progress.arrived_in.values()):
            return
        # After a blind use a frozen parameter (no gradient to tell us) may still be read: such
        # groups reshard at the end of backward.
        self._become_ready(done_with_params=(progress.known_uses and not progress.blind)
                           or complete == len(self.managed))

    def force_ready(self) -> None:
        """End of backward: whatever arrived is all there is."""
        self._become_ready(done_with_params=True)

    def _become_ready(self, done_with_params: bool) -> None:
        progress = self.progress
        if progress.ready:
            return
        progress.ready = True
        if done_with_params and progress.started:
            self.reshard()  # backward no longer reads the full parameters
        if self._scheduler is not None:
            self._scheduler.group_ready(self)

    def issue_reduce_scatter(self) -> bool:
        """Copy the gradients in and start the reduce-scatter; False while gradient sync is off
        (the gradients then accumulate, for the next synced backward:
        grad_reduce [Note: accumulating in the reduce dtype])."""
        self.progress.issued = True
        if not self._grad_indices:
            return False
        if not self.grads.requires_grad_sync:
            self.usage.note_unsynced(self.progress.arrived)
            self.grads.accumulate_unsynced([(i, self.params[i].unsharded) for i in self._grad_indices])
            return False
        # grad_shard [Note: a kept gradient stays the caller's]
        self.grads.sharded.disown_unless_held_by(local_piece(self.params[i].sharded.grad)
                                                 for i in self._grad_indices)
        had_grad = {i for i in self._grad_indices if self.params[i].sharded.grad is not None}
        self.usage.note_synced(self._grad_indices, self.progress.arrived, had_grad)
        self.grads.issue(bool(had_grad), [(i, self.params[i].unsharded) for i in self._grad_indices])
        return True

    def issue_accumulated_reduce_scatter(self) -> bool:
        """Outside backward: start the reduce-scatter of what backwards without gradient sync
        accumulated since the last reduction (zeros where nothing did), as the next synced
        backward would have (scheduler [Note: reducing after backward]); False for a group without
        gradients. Gradient sync stays as it was."""
        sync = self.requires_grad_sync
        self.requires_grad_sync = True
        try:
            return self.issue_reduce_scatter()
        finally:
            self.requires_grad_sync = sync
            self.progress = BackwardProgress()

    def finish_grad_sync(self) -> None:
        """Wait for the reduce-scatter and give the sharded parameters their ``.grad``."""
        self.grads.finish([(i, self.params[i].sharded) for i in self._grad_indices])

    def settle_host_copies(self) -> None:
        """An offloaded group: return when its host copies are complete
        (offload [Note: host copies and their streams]); a no-op otherwise."""
        if self.host_copies is not None:
            self.host_copies.settle()

    def end_backward(self, forward_id: Optional[int]) -> None:
        """The backward of root forward ``forward_id`` is over: the next one starts afresh.
        Forwards up to it are done with; later ones (pipeline schedules run the next
        micro-batches' forwards first) keep their records."""
        self.progress = BackwardProgress()
        self.forwards.end_backward(forward_id)

    def reset_iteration(self) -> None:
        """runtime [Note: resetting an iteration]: the collectives in flight waited for, the group
        resharded, what the failed iteration reduced or accumulated dropped."""
        self.gather.finish()
        self.reshard()
        self.grads.discard()
        for p in self.params:
            p.unsharded.grad = None
        self.progress = BackwardProgress()
        self.forwards = ForwardRecord()

    def zero_grad(self) -> None:
        """Drop every gradient of the group: locally accumulated full gradients (from
        backwards without gradient sync) and the sharded ones (zeroed, ``.grad = None``)."""
        for i in self._grad_indices:
            self.params[i].unsharded.grad = None
            self.params[i].sharded.grad = None
        self.grads.zero()
