"""The forward/backward hooks of ``fully_shard`` modules, and what one root's iteration shares.

[Note: the iteration]
forward:  pre-hook   (the root: a new forward, [Note: nothing stays gathered after forward])
                     gather the group (one all-gather into compute.full), install its full
                     parameters, prefetch the next group ([Note: orders]); with grad
                     enabled, an autograd node on the inputs (the input trigger)
          post-hook  reshard (free compute.full, install the sharded parameters) unless it is
                     the root, ``reshard_after_forward=False``, or the group kept for the
                     start of backward ([Note: orders]); with grad enabled, a hook on the
                     outputs for backward ([Note: output views])
backward: pre-hook   (first gradient of an output) gather again, install the full parameters,
                     attach gradient views, prefetch the group backward needs next (see
                     [Note: backward prefetch order]); the first one queues the final callback
          ready      the group's gradients are complete (param_group
                     [Note: when a group's gradients are complete]): it tells the root's
                     scheduler, which reduce-scatters in one order
                     (scheduler [Note: one order of reduce-scatters])
          final      every participating group reduce-scattered, waited for, resharded

[Note: nothing stays gathered after forward]
Outside forward and backward every module holds its *sharded* parameters, so
``parameters()``, ``named_parameters()``, ``state_dict()``, an optimizer built then and
``gathered_parameters`` see the shards whether or not a forward ran, and no full copy
outlives a change of the master shards:
  * a root forward that ran with grad disabled (evaluation, generation, a sanity check)
    reshards every group that did not run with grad in it at its end, the root's and
    ``reshard_after_forward=False`` ones included (PyTorch FSDP2 keeps the root gathered);
  * after a root forward with grad, the groups backward will want first stay gathered (the
    root, ``reshard_after_forward=False``, the kept group); as in FSDP2, the root's and the
    ``reshard_after_forward=False`` groups' modules keep their full parameters registered until
    backward ends or ``reshard()`` (``parameters()`` lists plain tensors meanwhile; a state
    dict reshards first), the kept group's get their sharded parameters back and pre-backward
    installs its full ones again (no new all-gather); a group gathered only by a prefetch that
    its forward never used is resharded;
  * a root forward that finds groups still gathered by an earlier forward (no backward came:
    an evaluation forward with grad, a pipeline schedule's next micro-batch) reshards them
    first: an optimizer step, a load or any write to the shards may have come in between,
    and nothing rank-consistent tells (a version counter misses ``.data`` writes and fused
    optimizers; whether to all-gather must be decided alike on every rank). A backward
    still to come gathers them again; re-gathering costs one all-gather of such a group per
    forward that follows another without a backward in between (a pipeline's warm-up),
    never in a plain forward+backward loop, where the final callback resharded everything.

[Note: orders]
Orders are re-recorded by every root forward (a model may run its groups in another order
from one iteration to the next: conditional blocks, routing), and every rank runs the same
groups in the same order (each gather is a collective), so every decision below is taken
alike on every rank:
  * forward prefetch: the group that followed this one in the previous root forward,
    while this forward has run the same groups in the same order so far; once it departs
    from it, nothing more is prefetched in it (a prefetched group it never runs is
    resharded at its end);
  * the group kept for backward: each group's post-hook keeps it gathered until another
    group's pre- or post-hook runs; the one still kept when the root's forward ends is
    the first one backward needs (its output is the last one made), so it is not
    gathered again. Until the next group starts the kept group is all that is held beyond
    what the previous group's forward held, so the peak does not grow;
  * backward prefetch: the post-hook order of the forward being differentiated
    ([Note: backward prefetch order]), recorded per forward (pipeline schedules run the
    next micro-batches' forwards before this backward).
The reduce-scatter order is the first forward's (scheduler [Note: one order of reduce-scatters]).

[Note: output views]
The pre-backward hook is registered on each output that requires grad, and, for an output
that is a view, on its base instead: an in-place change of a view (``h = block(x);
h.mul_(2)``) replaces the view's autograd history and drops hooks registered on the view,
while a hook on the base's gradient still fires before the module's own backward nodes run
(PyTorch FSDP2 only warns, and backward then reads freed parameters). A view of one of the
module's positional inputs keeps its own hook: nothing of the module runs in its backward.

[Note: backward prefetch order]
Backward reaches groups in the reverse order of their forward *post*-hooks, not of their
pre-hooks: a parent group (a layer's norms around its ``fully_shard`` Linears) runs its
pre-hook before its children's but its post-hook after theirs, and its pre-backward fires
first, when its output's gradient arrives, before its children's backward starts. Prefetching
by the pre-hook order there would gather the group before the parent in forward (the
previous layer's last Linear) a whole layer of backward too early, one group's full
parameters more at the peak; the post-hook order (recorded by every forward, [Note: orders])
names the parent's last child, then the previous layer's parent, then its
last child: what backward needs next. PyTorch FSDP2 prefetches by the same order.

[Note: recompute]
Activation checkpointing runs a module's forward again inside backward, reading the
parameters the module holds. Every form works because the full parameters are installed
whenever backward may read them:
  * outside the module call (Hugging Face's ``gradient_checkpointing_enable``, which
    checkpoints ``forward`` inside ``__call__``): pre-backward installs them;
  * around the module call (``torch.utils.checkpoint``, Megatron's and DeepSpeed's
    checkpoint functions): the recompute runs our forward hooks inside backward (the
    autograd engine has a graph task then); they gather and install, keep the group
    gathered (backward needs it at once), hook the recomputed outputs, and mark the group
    as taking part in this backward even if its first forward ran under ``no_grad``
    (reentrant checkpoints), so its gradients reach the reduce-scatter.

[Note: full parameters held]
``hold_full_parameters`` (a root's) gathers every group once, installs the full parameters
and pauses the hooks: forwards then run on plain full tensors, with no gather per forward
(generation: one forward per token; TRL pauses ZeRO-3's hooks the same way). Only forwards
without grad may run meanwhile (a backward would need the hooks); a forward with grad is
refused. Groups left gathered by an earlier forward are gathered afresh (an optimizer step may
have changed their shards since). ``release_full_parameters`` reshards every group and
resumes the hooks.

[Note: meshes] A sub-module may shard over another group than its root (MoE experts over
the expert-data-parallel group, the rest over data-parallel): each group's collectives
only involve its own ranks, which run the same modules in the same order.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Dict, List, Optional, Set

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..torch_compat import autograd_graph_task_id, queue_backward_callback, tree_flatten, tree_map, tree_unflatten
from .eager_hooks import outside_compile
from .group_progress import GroupState, InputGradTrigger
from .param_group import ParamGroup
from .scheduler import ReduceScatterScheduler
from .unused_grads import drop_unused

__all__ = ["ModuleState", "RootContext", "STATE_ATTR", "in_backward_pass"]

STATE_ATTR = "_vescale_fsdp_state"


def in_backward_pass() -> bool:
    """Whether the autograd engine is running a backward on this thread (a recompute)."""
    return autograd_graph_task_id() != -1


class _InputGradNode(torch.autograd.Function):
    """Identity on a module's inputs whose backward tells the trigger that the call's input
    gradients are computed (see param_group [Note: counting uses])."""

    @staticmethod
    def forward(ctx: Any, trigger: InputGradTrigger, *inputs: torch.Tensor):
        ctx.trigger = trigger
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):
        ctx.trigger.fire()
        return (None,) + grads


def _arm_input_trigger(trigger: InputGradTrigger, args: tuple, kwargs: dict):
    leaves, spec = tree_flatten((args, kwargs))
    # Computed inputs and plain leaves (a reentrant checkpoint's detached inputs), not
    # parameters: a parameter handed to the module (as Megatron hands the shared embedding
    # weight to its output layer) gets its gradient through the node, which would fire before
    # that gradient is accumulated.
    slots = [i for i, t in enumerate(leaves)
             if torch.is_tensor(t) and t.requires_grad and not isinstance(t, nn.Parameter)]
    if not slots:
        return args, kwargs  # blind: no input gradient will tell when this call's backward is over
    outs = _InputGradNode.apply(trigger, *(leaves[i] for i in slots))
    trigger.node = weakref.ref(outs[0].grad_fn)
    for i, out in zip(slots, outs):
        leaves[i] = out
    return tree_unflatten(leaves, spec)


def _pre_backward_targets(output: Any, args: tuple) -> List[torch.Tensor]:
    """The tensors whose gradients announce a module's backward: each output that requires
    grad, or its base if it is a view of something made inside the module
    ([Note: output views]; a view of an input has no backward inside the module)."""
    inputs = {id(a._base if a._base is not None else a) for a in args if torch.is_tensor(a)}
    targets: List[torch.Tensor] = []
    seen: Set[int] = set()
    for t in tree_flatten(output)[0]:
        if not (torch.is_tensor(t) and t.requires_grad):
            continue
        base = t._base
        target = base if base is not None and base.requires_grad and id(base) not in inputs else t
        if id(target) not in seen:
            seen.add(id(target))
            targets.append(target)
    return targets


class _Order:
    """Modules' states in the order of their first hook in one forward ([Note: orders]),
    with O(1) membership and position (a model may have thousands of groups)."""

    def __init__(self) -> None:
        self.states: List["ModuleState"] = []
        self._position: Dict[int, int] = {}

    def add(self, state: "ModuleState") -> bool:
        """Append ``state`` unless it is in already; True if it was appended."""
        if id(state) in self._position:
            return False
        self._position[id(state)] = len(self.states)
        self.states.append(state)
        return True

    def position(self, state: "ModuleState") -> Optional[int]:
        return self._position.get(id(state))

    def at(self, position: int) -> Optional["ModuleState"]:
        return self.states[position] if 0 <= position < len(self.states) else None

    def __len__(self) -> int:
        return len(self.states)


_ORDERS_KEPT = 64
"""Post-hook orders kept for backwards still to come (pipeline micro-batches in flight);
older ones belong to forwards never differentiated (evaluation forwards with grad)."""


class RootContext:
    """Shared by every fully_shard module under one root, for its forwards and backwards."""

    def __init__(self, root: "ModuleState") -> None:
        self.root = root
        self.states: List[ModuleState] = []
        self.forward_id = 0
        self.in_forward = False  # between the root's pre- and post-hook (not a recompute)
        self.forward_grad = False  # the current (or last) root forward runs with grad enabled
        self.held = False  # [Note: full parameters held]
        # [Note: orders]: pre-hook orders (first call of each) of this and the previous root
        # forward, post-hook orders by forward id, the first forward's order for the reduce-scatters
        self.order = _Order()
        self.previous_order = _Order()
        self.departed = True  # this forward left the previous one's order: no more forward prefetch
        self.post_orders: Dict[int, _Order] = {}
        self.kept: Optional[ModuleState] = None  # gathered past its post-hook: [Note: orders]
        self.in_backward = False
        self.scheduler = ReduceScatterScheduler()  # every group's reduce-scatters, in one order

    @property
    def backward_of(self) -> Optional[int]:
        """The last of the root forwards the current backward differentiates (the scheduler's)."""
        return self.scheduler.backward_of

    # ---- [Note: full parameters held] ---------------------------------------------------
    def hold_full_parameters(self) -> None:
        if self.in_forward or self.in_backward:
            raise RuntimeError("hold_full_parameters runs between iterations, not inside a forward or backward")
        for state in self.states:
            group = state.group
            if group is not None:
                if group.state is not GroupState.SHARDED:
                    group.reshard()  # gathered before a step that may have changed the shards
                group.unshard()
                group.wait_for_unshard()
                group.to_unsharded_params()
        self.held = True

    def release_full_parameters(self) -> None:
        if not self.held:
            return
        self.held = False
        for state in self.states:
            if state.group is not None:
                state.group.reshard()

    # ---- a root forward ----------------------------------------------------------------
    def begin_forward(self, grad_enabled: bool) -> None:
        """The root's pre-hook (not a recompute): [Note: nothing stays gathered after forward]."""
        self.forward_id += 1
        self.in_forward, self.forward_grad = True, grad_enabled
        for state in self.states:
            event, state.post_optim_event = state.post_optim_event, None
            if event is not None:
                event.wait()  # set_post_optim_event: the gathers below come after the optimizer step
            group = state.group
            if group is not None and group.state is not GroupState.SHARDED and group.gathered_for is not None:
                group.reshard()  # left gathered by an earlier forward that no backward followed
        self.order = _Order()
        self.scheduler.begin_forward()
        self.departed = not len(self.previous_order)
        self.post_orders[self.forward_id] = _Order()
        if len(self.post_orders) > _ORDERS_KEPT:
            del self.post_orders[min(self.post_orders)]
        self.kept = None

    def note_pre_forward(self, state: "ModuleState", grad_enabled: bool) -> bool:
        """A (non-recompute) pre-hook; True if it is the group's first call in this forward."""
        state.ran_in = self.forward_id
        if grad_enabled:
            state.grad_in = self.forward_id
        if self.kept is not None and self.kept is not state:
            self.release_kept()
        position = len(self.order)
        if not self.order.add(state):
            return False
        if state.group is not None:
            self.scheduler.note_first_call(state.group)
        if self.previous_order.at(position) is not state:
            self.departed = True
        return True

    def note_post_forward(self, state: "ModuleState") -> None:
        """A (non-recompute) post-hook of a group other than the root."""
        self.post_orders.setdefault(self.forward_id, _Order()).add(state)
        if state.group is None:
            return
        if self.kept is not None and self.kept is not state:
            self.release_kept()
        if state.reshard_after_forward and self.in_forward:
            self.kept = state  # until another group's hook runs: [Note: orders]
        elif state.reshard_after_forward and self.forward_grad:
            state.group.reshard_after_forward()  # called outside the root's forward
        elif not self.forward_grad:
            state.group.reshard()  # no backward can follow it

    def release_kept(self) -> None:
        kept, self.kept = self.kept, None
        if kept.group.state is GroupState.UNSHARDED and self.forward_grad:
            kept.group.reshard_after_forward()
        elif kept.group.state is not GroupState.SHARDED:
            kept.group.reshard()

    def end_forward(self, grad_enabled: bool) -> None:
        """The root's post-hook (not a recompute): [Note: nothing stays gathered after forward]."""
        fid = self.forward_id
        self.post_orders.setdefault(fid, _Order()).add(self.root)
        for state in self.states:
            group = state.group
            if group is None or group.state is GroupState.SHARDED:
                continue
            if state.ran_in != fid or (not grad_enabled and state.grad_in != fid):
                group.reshard()  # prefetched for nothing, or no backward can follow
            elif state is self.root and state.reshard_after_forward:
                group.reshard_after_forward()  # the root, set to reshard explicitly: backward gathers it again
            elif state.reshard_after_forward:
                group.to_sharded_params()  # the kept group: stays gathered for backward, the modules show the shards
        self.kept, self.in_forward = None, False
        self.previous_order = self.order
        self.scheduler.end_forward()

    def next_in_forward(self, state: "ModuleState") -> Optional["ModuleState"]:
        """The group to prefetch after ``state``'s first call in this forward ([Note: orders])."""
        if self.departed:
            return None
        return self.previous_order.at(len(self.order))  # ``state`` was the last one added

    def next_in_backward(self, state: "ModuleState", forward_id: Optional[int]) -> Optional["ModuleState"]:
        """The group backward reaches after ``state``'s call in root forward ``forward_id``:
        [Note: backward prefetch order]."""
        order = self.post_orders.get(forward_id)
        position = order.position(state) if order is not None else None
        return order.at(position - 1) if position is not None else None

    @outside_compile
    def final_callback(self) -> None:
        """End of backward: every participating group reduce-scattered (the scheduler), waited
        for, resharded."""
        backward_of = self.backward_of
        usage = self.scheduler.end_backward()
        for state in self.states:
            if state.group is not None:
                state.group.finish_grad_sync()
                state.group.reshard()
                state.group.end_backward(backward_of)
                state.group.settle_host_copies()  # offload [Note: host copies and their streams]
        drop_unused(usage)  # unused_grads [Note: unused everywhere]
        if backward_of is not None:
            for fid in [f for f in self.post_orders if f <= backward_of]:
                del self.post_orders[fid]
        self.in_backward = False

    def reduce_accumulated(self) -> None:
        """Outside backward, the reduction of what backwards without sync accumulated
        (scheduler [Note: reducing after backward])."""
        if self.in_backward:
            raise RuntimeError("reduce_accumulated_grads() inside backward: call it after backward has ended")
        self.scheduler.reduce_accumulated()

    def reset_iteration(self) -> None:
        """[Note: resetting an iteration] After a forward or backward raised (FSDP2's
        ``reset_iter_state``): every collective in flight is waited for, every group resharded,
        what the failed iteration reduced or accumulated dropped (its reduce-scatters in flight,
        its gradients accumulated without sync, HSDP's partial sums, the unsharded ``.grad``),
        and the iteration's bookkeeping cleared; sharded ``.grad`` of earlier iterations stay.
        Gradient accumulation over micro-batches must start again. Full parameters held are
        released. Local: every rank must call it (each waits for its own collectives)."""
        self.scheduler.reset()
        for state in self.states:
            group = state.group
            if group is not None:
                group.reset_iteration()
        self.in_forward = self.in_backward = self.held = False
        self.kept = None
        self.order, self.previous_order = _Order(), _Order()
        self.departed = True
        self.post_orders.clear()


class ModuleState:
    """The hooks of one ``fully_shard`` module (see [Note: the iteration])."""

    # torch's share_comm_ctx (pipeline chunks sharing FSDP2's streams) finds nothing to share:
    # our collectives are issued on the current stream
    _comm_ctx: Any = None
    _fsdp_param_groups: tuple = ()  # torch 2.12 and later read the list
    _fsdp_param_group: Any = None  # torch 2.11 reads the one group

    def __init__(
        self,
        module: nn.Module,
        group: Optional[ParamGroup],
        process_group: dist.ProcessGroup,
        reshard_after_forward: Optional[bool],
        mp_policy: Optional[MixedPrecisionPolicy],
    ) -> None:
        self.module = module
        self.group = group
        self.process_group = process_group
        self._reshard_after_forward = reshard_after_forward  # None: FSDP2's default (see the property)
        self.mp_policy = mp_policy
        self.prefetch = True
        # explicit prefetch lists (set_modules_to_forward/backward_prefetch), instead of the orders
        self.forward_prefetch: Optional[List["ModuleState"]] = None
        self.backward_prefetch: Optional[List["ModuleState"]] = None
        self.post_optim_event: Optional[Any] = None  # the next root forward waits for it (set_post_optim_event)
        self.reshard_after_backward = True  # hints: fsdp_module [Note: FSDPModule methods]
        self.is_last_backward = True
        self.context: Optional[RootContext] = None
        self.ran_in = 0  # the last root forward whose pre-hook ran this module (not a recompute)
        self.grad_in = 0  # ... with grad enabled

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP2's default (``None``): reshard after forward, except the root, which backward needs first."""
        if self._reshard_after_forward is None:
            return not (self.context is not None and self.context.root is self)
        return self._reshard_after_forward

    @reshard_after_forward.setter
    def reshard_after_forward(self, value: bool) -> None:
        self._reshard_after_forward = value

    # ---- lazy root discovery ---------------------------------------------------------
    def lazy_init(self) -> RootContext:
        if self.context is not None:
            return self.context
        ctx = RootContext(self)
        for sub in self.module.modules():
            st = getattr(sub, STATE_ATTR, None)
            if st is None or st.context is not None:
                continue
            st.context = ctx
            ctx.states.append(st)
            if st.group is not None:
                ctx.scheduler.register(st.group)
        return ctx

    # ---- hooks (eager: eager_hooks [Note: hooks outside the compiled graph]) ---------
    @outside_compile
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        ctx = self.lazy_init()
        if ctx.held:
            if torch.is_grad_enabled():
                raise RuntimeError(
                    "a forward with grad enabled while the full parameters are held (hold_full_parameters, or "
                    "DeepSpeed's hooks removed for generation): its backward would find no hooks. Run it under "
                    "torch.no_grad(), or call release_full_parameters() (DeepSpeed: re-add the hooks) first")
            return self._cast_inputs(args, kwargs)  # [Note: full parameters held]
        recompute = in_backward_pass()
        grad_on = torch.is_grad_enabled()
        if self is ctx.root and not recompute:
            ctx.begin_forward(grad_on)
        args, kwargs = self._cast_inputs(args, kwargs)
        first_call = False if recompute else ctx.note_pre_forward(self, grad_on)
        group = self.group
        if group is not None:
            if not recompute and group.follow_requires_grad():
                ctx.scheduler.invalidate_order()
            group.unshard()
            group.wait_for_unshard()
            group.to_unsharded_params()
            if recompute:
                group.note_recompute(grad_on)
            else:
                group.gathered_for = ctx.forward_id
                group.note_forward(grad_on, ctx.forward_id, ctx.in_forward and ctx.forward_grad)
            if grad_on:  # param_group [Note: counting uses]
                trigger = group.new_use(recompute)
                if trigger is not None:
                    args, kwargs = _arm_input_trigger(trigger, args, kwargs)
                    group.add_use(trigger, None if recompute else ctx.forward_id)
        if first_call and self.prefetch:
            explicit = self.forward_prefetch
            for nxt in explicit if explicit is not None else [ctx.next_in_forward(self)]:
                if nxt is not None and nxt.group is not None:
                    nxt.group.unshard(async_op=True)
                    nxt.group.gathered_for = ctx.forward_id
        return args, kwargs

    @outside_compile
    def post_forward(self, module: nn.Module, args: tuple, output: Any):
        ctx = self.context
        if ctx.held:
            return self._cast_output(output)  # [Note: full parameters held]
        recompute = in_backward_pass()  # a recompute's backward needs the params at once
        grad_on = torch.is_grad_enabled()
        if not recompute:
            if self is ctx.root:
                ctx.end_forward(grad_on)
            else:
                ctx.note_post_forward(self)
        if grad_on:
            targets = _pre_backward_targets(output, args)
            if targets:
                fid = ctx.backward_of if recompute else ctx.forward_id
                hook = functools.partial(self._pre_backward, fid)
                torch.autograd.graph.register_multi_grad_hook(targets, hook, mode="any")
        return self._cast_output(output)

    # torch's register_fsdp_forward_method runs these around the method it registers
    _pre_forward = pre_forward
    _post_forward = post_forward

    def _cast_output(self, output: Any) -> Any:
        mp = self.mp_policy
        if mp is None or mp.output_dtype is None:
            return output
        return tree_map(lambda t: t.to(mp.output_dtype) if torch.is_tensor(t) and t.is_floating_point() else t,
                        output)

    def _cast_inputs(self, args: tuple, kwargs: dict):
        mp = self.mp_policy
        if mp is None or not mp.cast_forward_inputs or mp.param_dtype is None:
            return args, kwargs
        cast = lambda t: t.to(mp.param_dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
        return tree_map(cast, args), tree_map(cast, kwargs)

    @outside_compile
    def _pre_backward(self, forward_id: Optional[int], _grad: torch.Tensor) -> None:
        ctx = self.context
        if not ctx.in_backward:  # the first hook of a backward: which forwards it differentiates
            ctx.in_backward = True
            ctx.scheduler.begin_backward(forward_id)
            queue_backward_callback(ctx.final_callback)
        else:
            ctx.scheduler.reached(forward_id)
        group = self.group
        if group is None:
            return
        group.begin_backward()
        if self.prefetch:  # every use: the group before it may have resharded between its own uses
            explicit = self.backward_prefetch
            for prev in explicit if explicit is not None else [ctx.next_in_backward(self, forward_id)]:
                if prev is not None and prev.group is not None and not prev.group.progress.issued \
                        and prev.group.unshard_in_backward:
                    prev.group.unshard(async_op=True)  # a no-op unless it is sharded
