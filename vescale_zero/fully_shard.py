"""``fully_shard``: FSDP2-style per-module sharding on RaggedShard / DBuffer.

Usage mirrors ``torch.distributed.fsdp.fully_shard``: apply it to each block, then to the
root; each call makes one group of the parameters not already in a sub-module's group::

    for block in model.blocks:
        fully_shard(block, granularity="row")
    fully_shard(model)                      # embeddings, final norm, head
    opt = torch.optim.AdamW(model.parameters())   # sharded (1-D, local) parameters

[Note: the iteration]
forward:  pre-hook   unshard (one all-gather into compute.full), swap in full params,
                     prefetch the next group in forward order (async)
          post-hook  reshard (free compute.full, swap in sharded params) unless it is the
                     root or ``reshard_after_forward=False``; hook the outputs for backward
backward: pre-hook   (first grad of an output) re-gather, attach gradient views,
                     prefetch the previous group; the first one queues the final callback
          post       when the group's last gradient is accumulated: async reduce-scatter
          final      every group that ran forward: reduce-scatter if not yet done, wait,
                     attach sharded ``.grad``, reshard
The forward order is recorded in the first iteration and used for prefetching after it.

[Note: meshes] A sub-module may shard over another group than its root (MoE experts over
the expert-data-parallel group, the rest over data-parallel): each group's collectives
only involve its own ranks, which run the same modules in the same order.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.utils._pytree import tree_flatten, tree_map

from .fp8_gather import tile_band_granularity
from .granularity import GranularityPolicy, resolve_granularities
from .param_group import ManagedParam, ParamGroup

__all__ = ["fully_shard", "fully_shard_layers", "RaggedFSDPModule", "MixedPrecisionPolicy", "DEFAULT_ALIGN_BYTES", "groups_of", "sharded_counterpart"]

DEFAULT_ALIGN_BYTES = 16
"""Each rank's shard starts on this many bytes in every role's buffer (NCCL likes 16)."""

_STATE = "_vescale_fsdp_state"
_SHARDED_AS = "_vescale_sharded_as"  # on an original parameter: the sharded parameter replacing it
_CLAIMED = "_vescale_fsdp_group_of"  # set on every parameter object a group manages


class _RootContext:
    """Shared by every fully_shard module under one root, for one root forward/backward."""

    def __init__(self, root: "_FSDPState") -> None:
        self.root = root
        self.states: List[_FSDPState] = []
        self.forward_order: List[_FSDPState] = []
        self.order_frozen = False
        self.in_backward = False
        self.reducing: List[ParamGroup] = []  # reduce-scatters issued, not yet waited on

    def reduce_issued(self, group: ParamGroup) -> None:
        """[Note: bounded gradient memory] Keep one reduce-scatter in flight: when a group
        issues its own, wait for the older ones and free their full gradient buffers, so
        backward holds at most two groups' full gradients instead of all of them."""
        self.reducing.append(group)
        while len(self.reducing) > 1:
            self.reducing.pop(0).finish_grad_sync()

    def last_before_root(self) -> Optional["_FSDPState"]:
        """[Note: last group] The group that runs forward last before the root finishes is
        the first one backward needs: resharding it after forward would only gather it
        again at once. It stays gathered (from the second iteration, once the order is
        known); peak memory is unchanged, since backward holds it at that point anyway."""
        if not self.order_frozen:
            return None
        for state in reversed(self.forward_order):
            if state is not self.root:
                return state
        return None

    def next_in_order(self, state: "_FSDPState", step: int) -> Optional["_FSDPState"]:
        if not self.order_frozen or state not in self.forward_order:
            return None
        i = self.forward_order.index(state) + step
        return self.forward_order[i] if 0 <= i < len(self.forward_order) else None

    def final_callback(self) -> None:
        """End of backward: every group's gradients reduced and its parameters resharded."""
        for state in reversed(self.forward_order + [s for s in self.states if s not in self.forward_order]):
            group = state.group
            if group is not None and group.ran_forward:
                group.post_backward()
        self.reducing.clear()
        for state in self.states:
            if state.group is not None:
                state.group.finish_grad_sync()
                state.group.reshard()
                state.group.ran_forward = False
        self.in_backward = False


class _FSDPState:
    def __init__(
        self,
        module: nn.Module,
        group: Optional[ParamGroup],
        process_group: dist.ProcessGroup,
        reshard_after_forward: bool,
        mp_policy: Optional[MixedPrecisionPolicy],
    ) -> None:
        self.module = module
        self.group = group
        self.process_group = process_group
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = mp_policy
        self.prefetch = True
        self.context: Optional[_RootContext] = None

    # ---- lazy root discovery ---------------------------------------------------------
    def lazy_init(self) -> _RootContext:
        if self.context is not None:
            return self.context
        ctx = _RootContext(self)
        for sub in self.module.modules():
            st = getattr(sub, _STATE, None)
            if st is None or st.context is not None:
                continue
            st.context = ctx
            ctx.states.append(st)
            if st.group is not None:
                st.group.on_reduce_issued = ctx.reduce_issued
        return ctx

    # ---- hooks -----------------------------------------------------------------------
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        ctx = self.lazy_init()
        if self.group is not None:
            if not ctx.order_frozen and self not in ctx.forward_order:
                ctx.forward_order.append(self)
            self.group.unshard()
            self.group.wait_for_unshard()
            self.group.to_unsharded_params()
            if not ctx.in_backward and self.prefetch:
                nxt = ctx.next_in_order(self, +1)
                if nxt is not None and nxt.group is not None:
                    nxt.group.unshard(async_op=True)
        mp = self.mp_policy
        if mp is not None and mp.cast_forward_inputs and mp.param_dtype is not None:
            cast = lambda t: t.to(mp.param_dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, args: tuple, output: Any):
        ctx = self.context
        if ctx.in_backward:  # recomputation inside backward: keep everything gathered
            return output
        grad_on = torch.is_grad_enabled()
        if self.group is not None:
            self.group.ran_forward = self.group.ran_forward or grad_on
            if self.reshard_after_forward and self is not ctx.root and not (grad_on and self is ctx.last_before_root()):
                self.group.reshard()
        if self is ctx.root:
            ctx.order_frozen = True
        if grad_on:
            tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward, mode="any")
        mp = self.mp_policy
        if mp is not None and mp.output_dtype is not None:
            output = tree_map(
                lambda t: t.to(mp.output_dtype) if torch.is_tensor(t) and t.is_floating_point() else t, output
            )
        return output

    def _pre_backward(self, _grad: torch.Tensor) -> None:
        ctx = self.context
        if not ctx.in_backward:
            ctx.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(ctx.final_callback)
        if self.group is not None:
            self.group.pre_backward()
            prev = ctx.next_in_order(self, -1) if self.prefetch else None
            if prev is not None and prev.group is not None:
                prev.group.unshard(async_op=True)


class RaggedFSDPModule:
    """Mixed into the class of every module ``fully_shard`` was applied to."""

    @property
    def vescale_group(self) -> Optional[ParamGroup]:
        """This module's parameter group (``None`` if every parameter is in a sub-module's)."""
        return getattr(self, _STATE).group

    def unshard(self, async_op: bool = False) -> None:
        """Gather this module's group and install the full parameters."""
        group = self.vescale_group
        if group is not None:
            group.unshard(async_op=async_op)
            group.wait_for_unshard()
            group.to_unsharded_params()

    def reshard(self) -> None:
        group = self.vescale_group
        if group is not None:
            group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: accumulate full gradients locally; the next synced backward reduces them."""
        modules = self.modules() if recurse else [self]
        for m in modules:
            st = getattr(m, _STATE, None)
            if st is not None and st.group is not None:
                st.group.requires_grad_sync = requires_gradient_sync

    def set_prefetch(self, enabled: bool, *, recurse: bool = True) -> None:
        """Gather the next group (forward) / previous group (backward) asynchronously."""
        for m in self.modules() if recurse else [self]:
            st = getattr(m, _STATE, None)
            if st is not None:
                st.prefetch = enabled

    def set_gradient_divide_factor(self, factor: Optional[float], *, recurse: bool = True) -> None:
        """Reduce gradients as SUM / ``factor`` over each group's mesh instead of the mean
        (FSDP2's name). ``None`` restores the mean."""
        if factor is not None and not factor > 0:
            raise ValueError(f"gradient divide factor must be a positive number or None, got {factor!r}")
        for m in self.modules() if recurse else [self]:
            st = getattr(m, _STATE, None)
            if st is not None and st.group is not None:
                st.group.gradient_divide_factor = factor

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        for m in self.modules() if recurse else [self]:
            st = getattr(m, _STATE, None)
            if st is not None:
                st.reshard_after_forward = reshard_after_forward


_CLASS_CACHE: Dict[type, type] = {}


def groups_of(module: nn.Module) -> List[ParamGroup]:
    """Every parameter group at or under ``module``, in module order."""
    return [m.vescale_group for m in module.modules() if isinstance(m, RaggedFSDPModule) and m.vescale_group is not None]


def _process_group(mesh: Union[DeviceMesh, dist.ProcessGroup, None], device: Optional[torch.device]):
    if not dist.is_initialized():
        raise RuntimeError("fully_shard needs torch.distributed to be initialised (dist.init_process_group) first")
    if mesh is None:
        return dist.group.WORLD
    if isinstance(mesh, dist.ProcessGroup):
        return mesh
    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            raise ValueError(
                f"fully_shard takes a 1-D mesh (the data-parallel dimension), got a {mesh.ndim}-D mesh "
                f"{tuple(mesh.shape)}; pass mesh[dim_name] for the dimension to shard over"
            )
        if device is not None and mesh.device_type != device.type:
            raise ValueError(
                f"mesh device type {mesh.device_type!r} does not match the parameters' device {device}; "
                f"build the mesh with init_device_mesh({device.type!r}, ...) or move the module to {mesh.device_type}"
            )
        return mesh.get_group()
    raise TypeError(f"mesh must be a DeviceMesh, a ProcessGroup or None, got {type(mesh).__name__}")


def _collect_params(module: nn.Module):
    """The parameters of ``module`` not inside an already sharded sub-module, with all owners."""
    owners: Dict[int, List] = {}
    order: List[nn.Parameter] = []
    names: Dict[int, str] = {}

    def visit(mod: nn.Module, prefix: str) -> None:
        for attr, p in mod._parameters.items():
            if p is None:
                continue
            if id(p) not in owners:
                owners[id(p)] = []
                order.append(p)
                names[id(p)] = prefix + attr
            owners[id(p)].append((mod, attr))
        for child_name, child in mod._modules.items():
            if child is not None and not isinstance(child, RaggedFSDPModule):
                visit(child, f"{prefix}{child_name}.")

    visit(module, "")
    for p in order:
        if hasattr(p, _CLAIMED):
            raise ValueError(
                f"parameter {names[id(p)]!r} is already managed by the fully_shard group of "
                f"{getattr(p, _CLAIMED)!r} (a tied/shared parameter used in two groups). Apply fully_shard to a "
                "module that contains every user of the tied parameter (e.g. the root), not to each user."
            )
    return [(names[id(p)], p, tuple(owners[id(p)])) for p in order]


def fully_shard(
    module: nn.Module,
    *,
    mesh: Union[DeviceMesh, dist.ProcessGroup, None] = None,
    reshard_after_forward: bool = True,
    mp_policy: Optional[MixedPrecisionPolicy] = None,
    granularity: GranularityPolicy = None,
    align_bytes: int = DEFAULT_ALIGN_BYTES,
    fp8_all_gather_tile: Optional[int] = None,
) -> nn.Module:
    """Shard ``module``'s parameters (those not in a sharded sub-module) as one group.

    Args:
        module: applied to each block first, then to the root (FSDP2 style).
        mesh: 1-D ``DeviceMesh`` or ``ProcessGroup`` to shard over; ``None`` = default group.
        reshard_after_forward: free the full parameters after forward (re-gathered in
            backward); ``False`` keeps them until backward ends. The root never reshards
            after forward.
        mp_policy: ``torch.distributed.fsdp.MixedPrecisionPolicy``: ``param_dtype`` for
            compute and gathers, ``reduce_dtype`` for the gradient reduce-scatter; the
            sharded (master) parameters keep the module's dtype.
        granularity: each parameter's atomic block, see :mod:`vescale_zero.granularity`.
        align_bytes: every rank's shard is a multiple of this many bytes in each buffer.
        fp8_all_gather_tile: gather parameters as float8 (e4m3) with one scale per
            ``tile x tile`` tile (128 is usual) instead of ``param_dtype``: about half the
            bytes of bf16. The granularity defaults to whole tile bands; a given one must
            be a multiple of them. See :mod:`vescale_zero.fp8_gather`.

    Returns:
        ``module``, its class now also a :class:`RaggedFSDPModule`.
    """
    if isinstance(module, RaggedFSDPModule):
        raise ValueError(
            f"fully_shard was already applied to this {type(module).__name__}; apply it once per module "
            "(each call makes one group of the parameters not yet in a group)"
        )
    if isinstance(module, FSDPModule):
        raise ValueError(
            "module is already sharded by torch.distributed.fsdp.fully_shard; shard each module with one FSDP only"
        )
    named = _collect_params(module)
    devices = {p.device for _, p, _ in named}
    if any(d.type == "meta" for d in devices):
        raise ValueError("fully_shard needs materialised parameters; call module.to_empty(device=...) and init first")
    pg = _process_group(mesh, next(iter(devices)) if devices else None)

    group = None
    if named:
        if fp8_all_gather_tile is not None:
            bands = {n: tile_band_granularity(p.shape, fp8_all_gather_tile) for n, p, _ in named}
            grans = resolve_granularities([(n, p) for n, p, _ in named], bands if granularity is None else granularity)
            for (n, p, _), g in zip(named, grans):
                if g % bands[n]:
                    raise ValueError(
                        f"fp8_all_gather_tile={fp8_all_gather_tile}: the granularity of {n!r} {tuple(p.shape)} is "
                        f"{g} elements, which cuts its {fp8_all_gather_tile}x{fp8_all_gather_tile} tiles; use a "
                        f"multiple of {bands[n]} (whole tile bands), or leave granularity unset"
                    )
        else:
            grans = resolve_granularities([(n, p) for n, p, _ in named], granularity)
        itemsizes = [named[0][1].element_size()]
        if mp_policy is not None:
            itemsizes += [torch.empty((), dtype=d).element_size() for d in (mp_policy.param_dtype, mp_policy.reduce_dtype) if d]
        align = max(1, align_bytes // min(itemsizes))
        managed = [ManagedParam(n, owners, p.shape, p.requires_grad) for n, p, owners in named]
        group = ParamGroup(
            managed, [p for _, p, _ in named], grans, pg,
            param_dtype=mp_policy.param_dtype if mp_policy else None,
            reduce_dtype=mp_policy.reduce_dtype if mp_policy else None,
            align=align,
            fp8_tile=fp8_all_gather_tile,
        )
        label = type(module).__name__
        for p in [p for _, p, _ in named] + group.sharded_params + group.unsharded_params:
            setattr(p, _CLAIMED, label)
        for (_, original, _), sharded in zip(named, group.sharded_params):
            setattr(original, _SHARDED_AS, sharded)  # lets hosts remap optimizers built earlier

    state = _FSDPState(module, group, pg, reshard_after_forward, mp_policy)
    setattr(module, _STATE, state)
    module.register_forward_pre_hook(state.pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(state.post_forward, prepend=False)
    cls = module.__class__
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"RaggedFSDP{cls.__name__}", (RaggedFSDPModule, cls), {})
    module.__class__ = _CLASS_CACHE[cls]
    return module


def sharded_counterpart(param: nn.Parameter) -> nn.Parameter:
    """The sharded parameter that replaced ``param`` (``param`` itself if it was not replaced)."""
    return getattr(param, _SHARDED_AS, param)


def fully_shard_layers(model: nn.Module, layer_classes: Optional[List[str]] = None, **kwargs: Any) -> nn.Module:
    """``fully_shard`` each layer, then the root: the usual FSDP recipe in one call.

    Args:
        layer_classes: class names of the modules that form one group each. Default: the
            classes of the modules held in ``nn.ModuleList``s (a model's layers).
        kwargs: passed to every ``fully_shard`` call.
    """
    if layer_classes is None:
        layer_classes = sorted({type(m).__name__ for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst})
    wanted = set(layer_classes)
    found = set()
    for module in list(model.modules()):
        name = type(module).__name__
        if module is not model and name in wanted and not isinstance(module, RaggedFSDPModule):
            found.add(name)
    missing = wanted - found
    if missing:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(f"layer classes {sorted(missing)} are not in the model; its module classes are {present}")
    for module in reversed(list(model.modules())):  # innermost first, like FSDP2's recipe
        if module is not model and type(module).__name__ in wanted and not isinstance(module, RaggedFSDPModule):
            fully_shard(module, **kwargs)
    return fully_shard(model, **kwargs)
