"""``RaggedFSDPModule``: what a ``fully_shard`` module offers, FSDP2's ``FSDPModule`` surface.

[Note: FSDPModule methods]
Every module ``fully_shard`` was applied to gets this mixin in its class, and the mixin is a
subclass of torch's ``FSDPModule``: code written for FSDP2 finds its modules the way it finds
FSDP2's (``isinstance(m, FSDPModule)``, torch's ``register_fsdp_forward_method``, the pipelining
schedules' unshard / reshard) and calls the same methods, with FSDP2's meaning and defaults,
``recurse`` included (torch 2.13 and 2.14 have the same 23 public methods). Each is
implemented here -- none falls through to FSDP2's code, which reads FSDP2's own state
(``tests/test_fsdp2_surface.py`` checks that every method ``FSDPModule`` defines is overridden)
-- or refused with an error saying why it cannot mean anything here and what to use instead.
Where FSDP2 tunes its streams or buffers and the result does not depend on it, the setting is
accepted and documented as a hint. The table of every method is ``docs/fsdp2_api.md``.

The hooks that do the work are :class:`vescale_zero.runtime.hooks.ModuleState` (this module's
``_get_fsdp_state()``: torch's ``register_fsdp_forward_method`` calls its ``_pre_forward`` /
``_post_forward``); a group's buffers and collectives are :class:`vescale_zero.runtime.param_group.ParamGroup`'s.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, UnshardHandle

from ..runtime.eager_hooks import outside_compile
from ..runtime.hooks import STATE_ATTR, ModuleState, RootContext
from ..runtime.job_timeout import group_timeout
from ..runtime.param_group import GroupState, ParamGroup
from ..runtime.unused_grads import UNUSED_GRAD_POLICIES

__all__ = ["RaggedFSDPModule", "RaggedUnshardHandle", "BUFFER_NEEDS_INIT", "RECIPE_ATTR"]

BUFFER_NEEDS_INIT = "_vescale_needs_init"
"""Set on a buffer ``to_empty`` emptied while moving a meta group; materialize and loading clear it."""

RECIPE_ATTR = "_vescale_group_recipe"
"""On each module of a group: how ``fully_shard`` built it (``fully_shard.GroupRecipe``), for a cast."""


class RaggedUnshardHandle(UnshardHandle):
    """What ``unshard(async_op=True)`` returns (an ``UnshardHandle``, as FSDP2's): ``wait()``
    finishes the all-gather and installs the full parameters; the module's next forward waits
    for it too if ``wait()`` was not called, and a ``wait()`` after that is a no-op."""

    def __init__(self, group: Optional[ParamGroup]) -> None:
        self._group = group

    def wait(self) -> None:
        group, self._group = self._group, None
        if group is not None and group.state is GroupState.UNSHARDING:
            group.wait_for_unshard()
            group.to_unsharded_params()


def _refuse(method: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"{method} is not supported by vescale_zero's fully_shard: {why}")


class RaggedFSDPModule(FSDPModule):
    """Mixed into the class of every module ``fully_shard`` was applied to ([Note: FSDPModule methods])."""

    # FSDPModule.__new__ builds the original class from the MRO:
    # [RaggedFSDP<Orig>, RaggedFSDPModule, FSDPModule, Orig, ...]
    # host patch torch.distributed.fsdp.FSDPModule._orig_cls_mro_index: checked against torch 2.11.0-2.15.0
    _orig_cls_mro_index = 3

    @property
    def vescale_group(self) -> Optional[ParamGroup]:
        """This module's parameter group (``None`` if every parameter is in a sub-module's)."""
        return getattr(self, STATE_ATTR).group

    # host patch torch.distributed.fsdp.FSDPModule._get_fsdp_state: checked against torch 2.11.0-2.15.0
    def _get_fsdp_state(self) -> ModuleState:
        """This module's hooks (torch's ``register_fsdp_forward_method`` runs their
        ``_pre_forward`` / ``_post_forward`` around the method it registers)."""
        return getattr(self, STATE_ATTR)

    def _states(self, recurse: bool) -> List[ModuleState]:
        """The hooks of this module (and, with ``recurse``, of every ``fully_shard`` module under it),
        each once (several modules may share one: fully_shard's [Note: several modules as one group])."""
        modules = self.modules() if recurse else (self,)
        states = [st for st in (getattr(m, STATE_ATTR, None) for m in modules) if st is not None]
        return list({id(st): st for st in states}.values())

    def _groups(self, recurse: bool) -> List[ParamGroup]:
        return [st.group for st in self._states(recurse) if st.group is not None]

    def _root_context(self) -> RootContext:
        state = getattr(self, STATE_ATTR)
        ctx = state.lazy_init()
        if ctx.root is not state:
            raise RuntimeError(f"{type(self).__name__} is not the root fully_shard module of its model (the "
                               f"outermost one, {type(ctx.root.module).__name__}): call this on the root")
        return ctx

    # ---- gathering ------------------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """Gather this module's group (not recursive) and install the full parameters;
        ``async_op=True`` returns a handle whose ``wait()`` does the install."""
        group = self.vescale_group
        if async_op:
            if group is not None:
                group.unshard(async_op=True)
            return RaggedUnshardHandle(group)
        if group is not None:
            group.unshard()
            group.wait_for_unshard()
            group.to_unsharded_params()
        return None

    def reshard(self) -> None:
        """Free this module's full parameters and install the sharded ones (not recursive)."""
        group = self.vescale_group
        if group is not None:
            group.reshard()

    def hold_full_parameters(self) -> None:
        """Gather every group under this root once and keep the full parameters installed, the
        hooks paused, until :meth:`release_full_parameters`: forwards without grad (generation)
        then gather nothing (runtime [Note: full parameters held])."""
        self._root_context().hold_full_parameters()

    def release_full_parameters(self) -> None:
        """Reshard every group and resume the hooks (no-op unless held)."""
        self._root_context().release_full_parameters()

    @outside_compile
    def reset_iter_state(self) -> None:
        """After a forward or backward raised: wait for the collectives in flight, reshard
        every group, drop what the failed iteration reduced or accumulated, and clear the
        iteration's bookkeeping, so the next iteration starts afresh. Call on the root (FSDP2's
        recovery; runtime [Note: resetting an iteration])."""
        self._root_context().reset_iteration()

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether to free the full parameters after forward (re-gathered in backward); the
        root too when set on it explicitly (by default it stays gathered for backward). As in
        FSDP2, a bool replaces a ``reshard_after_forward=<int>``: no post-forward shard."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"set_reshard_after_forward takes a bool, got {type(reshard_after_forward).__name__} "
                             f"{reshard_after_forward!r}")
        for st in self._states(recurse):
            st.reshard_after_forward = reshard_after_forward
            if st.group is not None and st.group.post_forward is not None:
                st.group.reshard()
                st.group.post_forward = st.group.post_forward_group = None

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Accepted as a hint: every group is resharded at the end of backward whatever this
        says, since an optimizer step may change the shards before the next forward and nothing
        rank-consistent tells whether it did (runtime [Note: nothing stays gathered after forward]);
        ``False`` then costs FSDP2's one all-gather saved, never a stale weight."""
        for st in self._states(recurse):
            st.reshard_after_backward = bool(reshard_after_backward)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False``: backward does not gather this module's parameters (when no gradient needs
        their values, e.g. an embedding); a recompute still does (not recursive, as FSDP2)."""
        group = self.vescale_group
        if group is not None:
            group.unshard_in_backward = bool(unshard_in_backward)

    def set_modules_to_forward_prefetch(self, modules: List[FSDPModule]) -> None:
        """After this module's all-gather in forward, start those of ``modules`` (instead of the
        next group of the previous forward's order, runtime [Note: orders])."""
        getattr(self, STATE_ATTR).forward_prefetch = self._prefetch_states(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: List[FSDPModule]) -> None:
        """In backward, after this module's all-gather, start those of ``modules`` (instead of
        the previous group of the forward's post-hook order, runtime [Note: backward prefetch order])."""
        getattr(self, STATE_ATTR).backward_prefetch = self._prefetch_states(modules, "set_modules_to_backward_prefetch")

    @staticmethod
    def _prefetch_states(modules: Iterable[Any], method: str) -> List[ModuleState]:
        states = []
        for m in modules:
            if not isinstance(m, RaggedFSDPModule):
                raise ValueError(f"{method} takes modules fully_shard was applied to, got {type(m).__name__}")
            states.append(getattr(m, STATE_ATTR))
        return states

    def set_prefetch(self, enabled: bool, *, recurse: bool = True) -> None:
        """Gather the next group (forward) / previous group (backward) asynchronously."""
        for st in self._states(recurse):
            st.prefetch = enabled

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The next root forward waits for ``event`` (recorded after the optimizer step, e.g. on
        another stream) before its first all-gather; used once."""
        getattr(self, STATE_ATTR).post_optim_event = event

    # host patch torch.distributed.fsdp.FSDPModule._set_unshard_async_op: checked against torch 2.11.0-2.15.0
    def _set_unshard_async_op(self, async_op: bool) -> None:
        """FSDP2's private stream setting: accepted, no effect (our pre-forward all-gathers are
        issued on the current stream and waited for there)."""

    # ---- gradient reduction -----------------------------------------------------------------
    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: accumulate full gradients locally; the next synced backward reduces them
        (HSDP: neither the reduce-scatter nor the all-reduce across replicas runs)."""
        for group in self._groups(recurse):
            group.requires_grad_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: ``False`` reduce-scatters but does not all-reduce across replicas; the partial
        results are summed until a backward with all-reduce adds them in (grad_reduce
        [Note: HSDP]). No effect without replicas."""
        for group in self._groups(recurse):
            group.grads.requires_all_reduce = bool(requires_all_reduce)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted as a hint: every backward here finishes its reduce-scatters at its end (the
        sharded ``.grad`` are complete when ``backward()`` returns), so there is nothing to defer."""
        getattr(self, STATE_ATTR).is_last_backward = bool(is_last_backward)

    def reduce_accumulated_grads(self) -> None:
        """Collective; call on the root, after backward. Reduce-scatter, group by group, the
        gradients that backwards without gradient sync accumulated since the last reduction, and
        wait: the sharded ``.grad`` are set when it returns, as after a synced backward
        (scheduler [Note: reducing after backward])."""
        state = getattr(self, STATE_ATTR)
        (state.context or state.lazy_init()).reduce_accumulated()

    def set_gradient_divide_factor(self, factor: Optional[float], *, recurse: bool = False) -> None:
        """Reduce this module's gradients as SUM / ``factor`` over its group's ranks instead of the
        mean; ``None`` restores the mean. Not recursive (FSDP2's meaning: its own group only);
        ``recurse=True`` sets every group under it."""
        if factor is not None and not factor > 0:
            raise ValueError(f"gradient divide factor must be a positive number or None, got {factor!r}")
        for group in self._groups(recurse):
            group.gradient_divide_factor = factor

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's deprecated name of :meth:`set_gradient_divide_factor`."""
        import warnings

        warnings.warn("set_reduce_scatter_divide_factor is deprecated: use set_gradient_divide_factor",
                      FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Collectives reduce with SUM only; the mean (or divide factor) is a division after
        them, on the reduced shard (not recursive, as FSDP2)."""
        group = self.vescale_group
        if group is not None:
            group.grads.force_sum = bool(enable)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Every parameter of a group is always in its one reduce-scatter here (ranks never
        disagree on the collective); this sets what a parameter no rank used gets, as in FSDP2:
        ``True`` a zero gradient (optimizers step it), ``False`` none (``set_unused_grads``)."""
        self.set_unused_grads("zero" if reduce_scatter_unused_params else "none", recurse=recurse)

    def set_unused_grads(self, policy: str, *, recurse: bool = True) -> None:
        """What a parameter gets that no rank used since the last synced backward (unused_grads
        [Note: unused everywhere]): ``"none"`` (default) leaves its sharded ``.grad`` None,
        as DDP and FSDP2 do, so optimizers skip it; ``"zero"`` gives it a zero gradient, as
        ZeRO-3 and Megatron's DDP do, so optimizers step it (weight decay included)."""
        if policy not in UNUSED_GRAD_POLICIES:
            raise ValueError(f"unused-gradient policy must be 'none' (DDP, FSDP2) or 'zero' (ZeRO-3, Megatron), "
                             f"got {policy!r}")
        for group in self._groups(recurse):
            group.usage.policy = policy

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many reduce-scatters (each with its input buffer) may be in flight in backward
        when this module's group issues its own; 1 by default (scheduler [Note: bounded gradient memory])."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be >= 1, got {max_input_buffers}")
        for group in self._groups(recurse):
            group.max_reduce_scatters_in_flight = max_input_buffers

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Collective over the shard ranks: ``True`` runs the reduce-scatters on a process group
        of their own (one per set of ranks, with the shard group's timeout), so they can overlap
        the all-gathers; ``False`` returns them to the shard group."""
        made: Dict[Tuple[int, ...], dist.ProcessGroup] = {}
        for group in self._groups(recurse):
            shard_group = group.process_group
            if not enable:
                group.grads.reduce_group = shard_group
                continue
            ranks = tuple(dist.get_process_group_ranks(shard_group))
            if ranks not in made:
                made[ranks] = dist.new_group(list(ranks), timeout=group_timeout(shard_group),
                                             use_local_synchronization=True)
            group.grads.reduce_group = made[ranks]

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Optional[torch.Stream] = None
                            ) -> None:
        """``hook(reduced)`` runs on this module's group's reduced gradient shard (flat, in the
        reduce dtype, padding included) after the reduce-scatter (HSDP: after the all-reduce
        across replicas) and before the sharded ``.grad`` are set, e.g. to all-reduce it over
        another mesh dimension; ``stream``: run it there (not with HSDP, as FSDP2)."""
        group = self.vescale_group
        if group is None:
            return
        if stream is not None and group.replicate_group is not None:
            raise ValueError("set_all_reduce_hook: stream cannot be set with HSDP (the hook runs after the "
                             "all-reduce across replicas, on its stream)")
        group.grads.all_reduce_hook, group.grads.all_reduce_hook_stream = hook, stream

    def set_custom_all_gather(self, comm: Any) -> None:
        """FSDP2's ``AllGather``: ``comm(output_tensor=, input_tensor=, group=, async_op=)`` runs this
        module's group's one all-gather (its full buffer, which the parameters view, and this
        rank's shard). ``comm.allocate`` is not called: the buffers are the group's, allocated once."""
        group = self.vescale_group
        if group is not None:
            group.gather.comm = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """FSDP2's ``ReduceScatter``: ``comm(output_tensor=, input_tensor=, group=, op=, async_op=)``
        runs this module's group's one reduce-scatter (``op`` is AVG, or SUM with a divide factor
        or ``set_force_sum_reduction_for_comms``). ``comm.allocate`` is not called: the buffers are
        the group's."""
        group = self.vescale_group
        if group is not None:
            group.grads.comm = comm

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Refused when enabling: FSDP2 allocates its staging buffers from the process group's
        allocator; ours gather straight into the parameters' own buffer and reduce from the
        gradients' (no staging copies), which the caching allocator holds."""
        if enable:
            raise _refuse("set_allocate_memory_from_process_group_for_comm(True)",
                          "its all-gathers and reduce-scatters run on the group's own flat buffers (the parameters "
                          "and gradients view them), with no staging buffers to allocate elsewhere; leave it unset")

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """FSDP2's (torch 2.15) for CUDA graph capture: ``False`` (the default) is what every group
        does, freeing the gathered storage at reshard; ``True`` is refused."""
        if keep:
            raise _refuse("set_keep_unsharded_storage(True)",
                          "a group frees its gathered buffer at reshard, and capturing sharded modules in CUDA "
                          "graphs is not supported; to keep parameters gathered, use reshard_after_forward=False")

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """FSDP2's (torch 2.15): ``False`` (the default) is what a backward does here, finishing its
        reduce-scatters at its end; ``True`` is refused."""
        if enabled:
            raise _refuse("set_manual_backward_finalization(True)",
                          "every backward finishes its reduce-scatters at its end; to reduce once after several "
                          "backwards, turn gradient sync off for them and call reduce_accumulated_grads()")

    def finalize_backward(self, *, async_op: bool = False) -> None:
        """FSDP2's (torch 2.15): without manual finalization (refused above) a backward here is
        finalized when it returns, so this has nothing left to do (as FSDP2's after a finished one)."""
        if async_op:
            raise _refuse("finalize_backward(async_op=True)",
                          "a backward is finalized when it returns; call finalize_backward() or nothing")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Refused: FSDP2 puts its all-gather staging buffers in symmetric memory; ours have none."""
        raise _refuse("set_symm_mem_for_comm",
                      "its all-gathers write straight into the group's flat parameter buffer, with no staging "
                      "buffer to place in symmetric memory; leave it unset")

    # ---- module methods -------------------------------------------------------------------
    # host patch torch.distributed.fsdp.FSDPModule._apply: checked against torch 2.11.0-2.15.0
    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        """``nn.Module._apply`` (``to``, ``to_empty``, ``float()``...) on a sharded module.

        [Note: casting and moving sharded parameters] The group's parameters are views of its
        buffers, which the gathers read: ``fn`` is not applied to them (torch would swap in new
        tensors the group never sees) but tried on an empty tensor of the group's dtype and
        device. A change of dtype builds the group again in that dtype (recast
        [Note: a group cast after fully_shard]); a change of device is refused with the
        supported way; a group built on the meta device moves (``model.to_empty(device=d)``
        gives it its persistent shards on ``d``, uninitialised, as ``to_empty`` leaves every
        tensor), never a full parameter. Buffers and parameters outside the group get ``fn`` as
        usual."""
        group = self.vescale_group
        if group is None:
            return super(FSDPModule, self)._apply(fn, recurse)  # the module's own (FSDP2's reads its state)
        with torch.no_grad():
            probe = fn(torch.empty(0, dtype=group.orig_dtype, device=group.device))
        moved = probe.device != group.device
        if moved and group.device.type != "meta":
            raise ValueError(
                f"cannot move the sharded parameters of this {type(self).__name__} to {probe.device} after "
                f"fully_shard (they are {group.orig_dtype} on {group.device}, views of its group's buffers); move "
                "the model before fully_shard"
            )
        if probe.dtype != group.orig_dtype:
            if not probe.dtype.is_floating_point:
                raise ValueError(f"cannot cast the sharded parameters of this {type(self).__name__} to "
                                 f"{probe.dtype}: parameters are floating point")
            from .recast import recast_group  # api/recast.py builds groups with fully_shard's, which imports this

            recast_group(self, probe.dtype)
            group = self.vescale_group
        held = [(owner, attr, owner._parameters[attr]) for m in group.managed for owner, attr in m.owners
                if owner._parameters.get(attr) is not None]
        for owner, attr, _ in held:
            owner._parameters[attr] = None  # skipped by _apply, keeps its place in the module's order
        try:
            module = super(FSDPModule, self)._apply(fn, recurse)
        finally:
            for owner, attr, param in held:
                owner._parameters[attr] = param
        if moved:
            group.leave_meta(probe.device)
            for buffer in self.buffers():  # empty now: vescale_zero.materialize must fill them
                setattr(buffer, BUFFER_NEEDS_INIT, True)
        return module

    def __deepcopy__(self, memo: Dict[int, Any]) -> nn.Module:
        """Refused: a copy would share or duplicate this rank's shards and hold the process
        groups (PyTorch FSDP2 refuses too)."""
        raise RuntimeError(
            f"copy.deepcopy of a fully_shard module ({type(self).__name__}) is not supported: its parameters are "
            "this rank's shards of collective buffers and it holds process groups, neither of which can be copied "
            "(torch.optim.swa_utils.AveragedModel and EMA helpers deepcopy the model too). Make the copy before "
            "fully_shard (and shard the copy as well if it must be sharded), or build an unsharded copy from "
            "vz.full_state_dict(model) (on every rank; it returns the full tensors) with load_state_dict."
        )
