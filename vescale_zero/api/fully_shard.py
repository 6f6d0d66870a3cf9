"""``fully_shard``: FSDP2-style per-module sharding on RaggedShard / DBuffer.

Usage mirrors ``torch.distributed.fsdp.fully_shard``: apply it to each block, then to the
root; each call makes one group of the parameters not already in a sub-module's group::

    for block in model.blocks:
        fully_shard(block, granularity="row")
    fully_shard(model)                      # embeddings, final norm, head
    opt = torch.optim.AdamW(model.parameters())   # sharded (1-D, local) parameters

The hooks and the per-iteration machinery live in :mod:`vescale_zero.runtime.hooks`
([Note: the iteration], [Note: recompute]); the one reduce-scatter order in
:mod:`vescale_zero.runtime.scheduler` ([Note: one order of reduce-scatters]); a group's buffers in
:mod:`vescale_zero.runtime.param_group`.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy

from .. import host_patches
from ..primitives.granularity import GranularityPolicy, resolve_granularities
from ..primitives.tensor_parallel import DP_DIMS_ATTR, local_tensor, tensor_parallel_layouts
from ..runtime.eager_hooks import outside_compile
from ..runtime.fp8_gather import FP8Filter, default_fp8_filter, tile_band_granularity
from ..runtime.hooks import STATE_ATTR, ModuleState, in_backward_pass
from ..runtime.job_timeout import carry_job_timeout
from ..runtime.offload import HostOffload, resolve_offload_policy
from ..runtime.param_group import GroupState, ManagedParam, ParamGroup
from ..runtime.post_forward import post_forward_group
from .fsdp2_arguments import OUR_ARGUMENTS, SpmdMesh, modules_of, placement_granularities
from .fsdp_module import BUFFER_NEEDS_INIT, RECIPE_ATTR, RaggedFSDPModule
from .layer_discovery import find_layer_classes
from .optimizer_aware import OptimizerAware, PlacementChoice, choose_placement, resolve_optimizer_aware
from .stale_params import CLAIMED_ATTR, SHARDED_AS_ATTR, watch_optimizers

__all__ = ["fully_shard", "fully_shard_layers", "resolve_reshard_after_forward", "post_forward_size",
           "RaggedFSDPModule", "MixedPrecisionPolicy", "CPUOffloadPolicy", "OffloadPolicy", "DEFAULT_ALIGN_BYTES",
           "groups_of", "sharded_counterpart", "BUFFER_NEEDS_INIT", "HSDP_DIM_NAMES", "GroupRecipe", "build_group"]

DEFAULT_ALIGN_BYTES = 16
"""Each rank's shard starts on this many bytes in every role's buffer (NCCL likes 16)."""

_STATE = STATE_ATTR
_SHARDED_AS = SHARDED_AS_ATTR  # on an original parameter: the sharded parameter replacing it
_CLAIMED = CLAIMED_ATTR  # set on every parameter object a group manages
_CLASS_CACHE: Dict[type, type] = {}


def groups_of(module: nn.Module) -> List[ParamGroup]:
    """Every parameter group at or under ``module``, in module order (a group of several
    modules once: [Note: several modules as one group])."""
    groups = [m.vescale_group for m in module.modules()
              if isinstance(m, RaggedFSDPModule) and m.vescale_group is not None]
    return list({id(g): g for g in groups}.values())


HSDP_DIM_NAMES = (("replicate", "shard"), ("dp_replicate", "dp_shard"))
"""The names a 2-D (HSDP) mesh's dimensions may have, outer (replicas) first: ours and FSDP2's."""


def _mesh_groups(mesh: Union[DeviceMesh, dist.ProcessGroup, None], device: Optional[torch.device]):
    """``(shard group, replicate group or None)`` of a ``mesh`` argument (see [Note: HSDP mesh])."""
    if not dist.is_initialized():
        raise RuntimeError("fully_shard needs torch.distributed to be initialised (dist.init_process_group) first")
    if mesh is None:
        return dist.group.WORLD, None
    if isinstance(mesh, dist.ProcessGroup):
        return mesh, None
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh, a ProcessGroup or None, got {type(mesh).__name__}")
    if device is not None and mesh.device_type != device.type:
        raise ValueError(
            f"mesh device type {mesh.device_type!r} does not match the parameters' device {device}; "
            f"build the mesh with init_device_mesh({device.type!r}, ...) or move the module to {mesh.device_type}"
        )
    if mesh.ndim == 1:
        return mesh.get_group(), None
    accepted = " or ".join(repr(n) for n in HSDP_DIM_NAMES)
    if mesh.ndim != 2:
        raise ValueError(
            f"fully_shard takes a 1-D mesh (shard) or a 2-D mesh (HSDP: replicate x shard), got a {mesh.ndim}-D mesh "
            f"{tuple(mesh.shape)} named {mesh.mesh_dim_names}; pass the data-parallel sub-mesh, e.g. "
            f"mesh[{HSDP_DIM_NAMES[0]!r}], with dimension names {accepted}"
        )
    names = tuple(mesh.mesh_dim_names or ())
    if names not in HSDP_DIM_NAMES:
        raise ValueError(
            f"fully_shard: a 2-D (HSDP) mesh must name its dimensions {accepted} (replicas outer, shard inner), "
            f"got {mesh.mesh_dim_names}; build it with init_device_mesh(device_type, (replicas, shard), "
            f"mesh_dim_names={HSDP_DIM_NAMES[0]!r})"
        )
    # [Note: HSDP sub-mesh] Beside tensor or pipeline parallelism the data-parallel mesh is
    # a slice of a mesh over the whole world (FSDP2's world_mesh["dp_replicate", "dp_shard"],
    # Megatron's RaggedFSDP): the mesh it was sliced from must cover the world, and this
    # rank must be in the slice. A mesh of its own covers the world itself.
    world = dist.get_world_size()
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    if root.size() != world or sorted(root.mesh.flatten().tolist()) != list(range(world)):
        raise ValueError(
            f"fully_shard: the HSDP mesh {tuple(mesh.shape)} covers {mesh.size()} ranks "
            f"{sorted(mesh.mesh.flatten().tolist())} but the default process group has {world}; its dimensions must "
            f"multiply to the world size (replicas x shard = {world}), e.g. init_device_mesh(device_type, "
            f"({max(1, world // 2)}, {min(2, world)}), mesh_dim_names={names!r}), or it must be sliced from a "
            "mesh over the whole world (beside tensor parallelism: world_mesh[('replicate', 'shard')])"
        )
    if mesh.get_coordinate() is None:
        raise ValueError(f"fully_shard: rank {dist.get_rank()} is not in the HSDP mesh {mesh.mesh.tolist()}; "
                         "give each rank the data-parallel slice of the world mesh it belongs to")
    replicate, shard = names
    return mesh[shard].get_group(), mesh[replicate].get_group()


def _collect_params(modules: Sequence[nn.Module], ignored: Collection[nn.Parameter] = ()):
    """The parameters of ``modules`` (one group: [Note: several modules as one group]) not inside
    an already sharded sub-module and not ``ignored``, with all their owners. Names are relative
    to the module (with several modules: prefixed by its position in the list, ``"1.weight"``)."""
    owners: Dict[int, List] = {}
    order: List[nn.Parameter] = []
    names: Dict[int, str] = {}
    ignored_ids = {id(p) for p in ignored}

    def visit(mod: nn.Module, prefix: str) -> None:
        for attr, p in mod._parameters.items():
            if p is None or id(p) in ignored_ids:
                continue
            if id(p) not in owners:
                owners[id(p)] = []
                order.append(p)
                names[id(p)] = prefix + attr
            owners[id(p)].append((mod, attr))
        for child_name, child in mod._modules.items():
            if child is not None and not isinstance(child, RaggedFSDPModule):
                visit(child, f"{prefix}{child_name}.")

    for i, module in enumerate(modules):
        visit(module, "" if len(modules) == 1 else f"{i}.")
    for p in order:
        if hasattr(p, _CLAIMED):
            raise ValueError(
                f"parameter {names[id(p)]!r} is already managed by the fully_shard group of "
                f"{getattr(p, _CLAIMED)!r} (a tied/shared parameter used in two groups). Apply fully_shard to a "
                "module that contains every user of the tied parameter (e.g. the root), or pass every user in one "
                "call, fully_shard([embedding, head]), not to each user separately."
            )
    return [(names[id(p)], p, tuple(owners[id(p)])) for p in order]


def resolve_reshard_after_forward(value: Union[bool, int, None], shard_size: int) -> Optional[bool]:
    """``reshard_after_forward`` as FSDP2 accepts it, for a shard group of ``shard_size`` ranks:
    ``None`` (FSDP2's default: ``True``, ``False`` for the root), a bool, or the number of ranks
    to reshard to after forward -- a divisor of ``shard_size``: ``shard_size`` is ``True``, 1 is
    ``False`` (FSDP2 warns that it is not ``True``), one in between is ``True`` with a post-forward
    shard over that many ranks (:func:`post_forward_size`). What FSDP2 refuses (another type, a
    non-divisor) is refused."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise ValueError(f"reshard_after_forward must be a bool, None or an int (the number of ranks to reshard to), "
                         f"got {type(value).__name__} {value!r}")
    if not 1 <= value <= shard_size or shard_size % value:
        raise ValueError(f"reshard_after_forward={value}: an int must divide the shard group's size {shard_size} "
                         f"(1 = keep the full parameters, {shard_size} = reshard to all ranks)")
    if value == 1:
        warnings.warn("reshard_after_forward=1 (int) reshards to a group of 1 rank: the full parameters are kept "
                      "after forward, as reshard_after_forward=False (pass True to free them)", stacklevel=3)
        return False
    return True


def post_forward_size(value: Union[bool, int, None], shard_size: int) -> Optional[int]:
    """The post-forward group's size of a valid ``reshard_after_forward`` (see
    :func:`resolve_reshard_after_forward`): an int strictly between 1 and ``shard_size``, else
    ``None`` (runtime.post_forward [Note: the post-forward shard])."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 < value < shard_size:
        return None
    return value


def fully_shard(
    module: Union[nn.Module, Sequence[nn.Module]],
    *,
    mesh: Union[DeviceMesh, dist.ProcessGroup, None] = None,
    reshard_after_forward: Union[bool, int, None] = None,
    shard_placement_fn: Optional[Callable[[nn.Parameter], Any]] = None,
    mp_policy: Optional[MixedPrecisionPolicy] = None,
    offload_policy: Optional[OffloadPolicy] = None,
    ignored_params: Optional[Collection[nn.Parameter]] = None,
    dp_mesh_dims: Optional[Any] = None,
    granularity: GranularityPolicy = None,
    align_bytes: int = DEFAULT_ALIGN_BYTES,
    fp8_all_gather_tile: Optional[int] = None,
    fp8_all_gather_filter: Optional[FP8Filter] = None,
    optimizer_aware: Union[bool, OptimizerAware, None] = None,
    **unknown: Any,
) -> Union[nn.Module, Sequence[nn.Module]]:
    """Shard ``module``'s parameters (those not in a sharded sub-module) as one group.

    Takes every argument of ``torch.distributed.fsdp.fully_shard`` with its meaning (the ones
    after ``dp_mesh_dims`` are ours); another keyword is refused naming it.

    Args:
        module: applied to each block first, then to the root (FSDP2 style). A list of modules
            makes one group of all their parameters: the forward of any of them gathers it
            ([Note: several modules as one group]); returned as given.
        mesh: 1-D ``DeviceMesh`` or ``ProcessGroup`` to shard over; ``None`` = default group.
            [Note: HSDP mesh] A 2-D mesh ``init_device_mesh(dev, (replicas, shard),
            mesh_dim_names=("replicate", "shard"))`` (FSDP2's ``("dp_replicate", "dp_shard")``
            too) covering the whole default group, or sliced from a mesh that does (beside
            tensor parallelism, [Note: HSDP sub-mesh]): the group is planned for, gathered and
            reduce-scattered in the shard group, and its reduced shard all-reduced across
            replicas (grad_reduce [Note: HSDP]), the mean over all ranks, as DDP gives.
            Parameters that ``parallelize_module`` made DTensors need the data-parallel slice of
            the same world mesh (``world["dp"]``, HSDP ``world["replicate", "shard"]``): see
            :mod:`vescale_zero.primitives.tensor_parallel`.
            With ``dp_mesh_dims`` it is the whole SPMD mesh (FSDP2's full-DTensor mode).
        reshard_after_forward: FSDP2's argument, with its meaning: ``True`` frees the full
            parameters after forward (re-gathered in backward); ``False`` keeps them until
            backward ends; ``None`` (default) is ``True``, but ``False`` for the root, which
            backward needs first. An int is the number of ranks to reshard to: the shard
            group's size means ``True``, 1 means ``False``; one in between keeps a ``1/n``
            post-forward shard, which backward gathers over ``n`` ranks (a node) only
            (runtime.post_forward [Note: the post-forward shard]); what FSDP2 refuses is refused
            (see :func:`resolve_reshard_after_forward`).
            Outside forward and backward the modules always hold the sharded parameters, and a
            forward with grad disabled leaves nothing gathered
            (runtime [Note: nothing stays gathered after forward]).
        shard_placement_fn: FSDP2's ``param -> None | Shard(d) | ShardPlacementResult``, read as
            each parameter's block (fsdp2_arguments [Note: shard placements as blocks]):
            ``Shard(0)`` whole rows, ``Shard(d)`` whole slices of dim ``d``, ``None`` the
            ``granularity`` policy's; another mesh than ``mesh`` is refused.
        mp_policy: ``torch.distributed.fsdp.MixedPrecisionPolicy``: ``param_dtype`` for
            compute and gathers, ``reduce_dtype`` for the gradient reduce-scatter; the
            sharded (master) parameters keep the module's dtype.
        granularity: each parameter's atomic block, see :mod:`vescale_zero.primitives.granularity`; of a
            tensor-parallel parameter's TP-local tensor (a policy's callable gets that tensor).
        align_bytes: every rank's shard, and every tensor's start, is a multiple of this many
            bytes in each buffer (vectorised and tensor-core kernels want 16 at least).
        fp8_all_gather_tile: gather parameters as float8 (e4m3) with one scale per
            ``tile x tile`` tile (128 is usual) instead of ``param_dtype``: about half the
            bytes of bf16. Only the tensors ``fp8_all_gather_filter`` chooses; the others are
            gathered in ``param_dtype``, in the same single collective. The granularity of an
            FP8 tensor defaults to whole tile bands; a given one must be a multiple of them.
            See :mod:`vescale_zero.runtime.fp8_gather`.
        fp8_all_gather_filter: ``(name, parameter) -> bool``: which tensors
            ``fp8_all_gather_tile`` gathers as FP8 (names as in ``granularity``). Default
            :func:`vescale_zero.runtime.fp8_gather.default_fp8_filter`: tensors of 2+ dimensions (matrices),
            so norms and biases keep ``param_dtype`` as FP8 recipes keep them; pass e.g.
            ``lambda n, p: p.dim() >= 2 and "embed" not in n`` to keep embeddings out too.
        offload_policy: ``torch.distributed.fsdp.CPUOffloadPolicy(pin_memory=True)``: the
            sharded parameters (the master weights), their gradients and so the optimizer's
            state live in host memory and the optimizer steps there; gathers copy the shard to
            the device, reduced gradients are copied back (:mod:`vescale_zero.runtime.offload`).
            ``None`` or ``OffloadPolicy()``: no offload.
        ignored_params: parameters left as they are, as FSDP2 leaves them: not sharded, not
            gathered, their gradients not reduced.
        dp_mesh_dims: FSDP2's ``DataParallelMeshDims`` (torchtitan's full-DTensor mode): ``mesh``
            is the whole SPMD mesh, every parameter a DTensor on it, ``Replicate()`` on the
            dimensions named here; the group is sharded over the ``shard`` one (HSDP: replicated
            over ``replicate``) and the module computes with DTensors as FSDP2's does
            (fsdp2_arguments [Note: full-DTensor parameters]).
        optimizer_aware: ``True`` (Muon's whole matrices) or an ``OptimizerAware``
            (``Muon.optimizer_aware(...)``): keep the matrices whole on one rank where that
            moves fewer bytes per step than the piecewise plan of ``granularity``, counting the
            padding every gather and reduce-scatter pays (:mod:`vescale_zero.api.optimizer_aware`);
            ``vz.sharding_report`` shows the choice.

    Returns:
        ``module`` (a list: as given), the class of each now also a :class:`RaggedFSDPModule`.
    """
    if unknown:
        raise TypeError(f"fully_shard() got an unexpected keyword argument {next(iter(unknown))!r}; it takes "
                        f"torch.distributed.fsdp.fully_shard's arguments and {', '.join(OUR_ARGUMENTS)}")
    modules = modules_of(module)
    for m in modules:
        if isinstance(m, RaggedFSDPModule):
            raise ValueError(
                f"fully_shard was already applied to this {type(m).__name__}; apply it once per module "
                "(each call makes one group of the parameters not yet in a group)"
            )
        if isinstance(m, FSDPModule):  # FSDP2's (ours are FSDPModules too: refused above)
            raise ValueError(
                "module is already sharded by torch.distributed.fsdp.fully_shard; shard each module with one FSDP only"
            )
    offload = resolve_offload_policy(offload_policy)
    host_patches.install("torch.optim")  # [Note: torch's optimizers step the local pieces]
    watch_optimizers()  # stale_params [Note: an optimizer over replaced parameters]
    named = _collect_params(modules, ignored_params or ())
    devices = {p.device for _, p, _ in named}
    # A meta module is sharded as planned; vescale_zero.materialize (or to_empty) gives it
    # its shards later: materialize [Note: deferred initialisation].
    device = next(iter(devices)) if len(devices) == 1 else None
    on_meta = device is not None and device.type == "meta"
    spmd = None
    if dp_mesh_dims is not None:  # fsdp2_arguments [Note: full-DTensor parameters]
        spmd = SpmdMesh.of(mesh, dp_mesh_dims)
        pg, replicate_pg = spmd.shard_group, spmd.replicate_group
    else:
        pg, replicate_pg = _mesh_groups(mesh, None if on_meta else device)
    carry_job_timeout(pg, replicate_pg)  # a stuck peer is an error after the job's timeout: [Note: the job's timeout]
    unsupported = {"fp8_all_gather_tile": fp8_all_gather_tile is not None, "offload_policy": offload is not None,
                   "the meta device (deferred initialisation)": on_meta}
    if spmd is not None:
        tp = spmd.layouts([(n, p) for n, p, _ in named], unsupported)
    else:
        # DTensor parameters (parallelize_module): tensor_parallel [Note: ragged inside the tensor-parallel piece]
        tp = tensor_parallel_layouts([(n, p) for n, p, _ in named], mesh, unsupported)
    held = [(n, local_tensor(p)) for n, p, _ in named]  # what the group holds of each: granularity, shapes
    post_forward = post_forward_size(reshard_after_forward, dist.get_world_size(pg))
    if shard_placement_fn is not None:  # fsdp2_arguments [Note: shard placements as blocks]
        granularity = placement_granularities(named, held, shard_placement_fn, granularity, pg, replicate_pg)
    reshard_after_forward = resolve_reshard_after_forward(reshard_after_forward, dist.get_world_size(pg))

    group = None
    if named:
        fp8 = None
        if fp8_all_gather_tile is not None:
            choose = default_fp8_filter if fp8_all_gather_filter is None else fp8_all_gather_filter
            fp8 = [bool(choose(n, p)) for n, p, _ in named]
            # the tile-band rule binds the FP8 tensors only ([Note: which tensors are FP8])
            bands = {n: tile_band_granularity(p.shape, fp8_all_gather_tile) for (n, p, _), f in zip(named, fp8) if f}
            grans = resolve_granularities(held, bands if granularity is None else granularity)
            for (n, p, _), g in zip(named, grans):
                if n in bands and g % bands[n]:
                    raise ValueError(
                        f"fp8_all_gather_tile={fp8_all_gather_tile}: the granularity of {n!r} {tuple(p.shape)} is "
                        f"{g} elements, which cuts its {fp8_all_gather_tile}x{fp8_all_gather_tile} tiles; use a "
                        f"multiple of {bands[n]} (whole tile bands), leave granularity unset, or keep {n!r} out of "
                        "FP8 with fp8_all_gather_filter"
                    )
        elif fp8_all_gather_filter is not None:
            raise ValueError("fp8_all_gather_filter chooses tensors for an FP8 gather; set fp8_all_gather_tile too")
        else:
            grans = resolve_granularities(held, granularity)
        recipe = GroupRecipe(
            tuple(grans), align_bytes, mp_policy.param_dtype if mp_policy else None,
            mp_policy.reduce_dtype if mp_policy else None, fp8_all_gather_tile, None if fp8 is None else tuple(fp8),
            offload, replicate_pg, None if post_forward is None else post_forward_group(pg, post_forward),
            " + ".join(type(m).__name__ for m in modules))
        aware = resolve_optimizer_aware(optimizer_aware)
        placement = None
        if aware is not None:  # optimizer_aware [Note: placing units against padding]
            placement = choose_placement(held, grans, aware, pg, replicate_pg, recipe.align(named[0][1].dtype),
                                         mp_policy=mp_policy, fp8=fp8_all_gather_tile is not None,
                                         reshard_after_forward=reshard_after_forward)
            recipe = dataclasses.replace(recipe, granularities=tuple(placement.granularities), placement=placement)
        managed = [ManagedParam(n, owners, h.shape, p.requires_grad, layout)
                   for (n, p, owners), (_, h), layout in zip(named, held, tp)]
        if spmd is not None:
            for _, p, _ in named:  # copied onto the group's parameter objects: local_gradient reads it
                setattr(p, DP_DIMS_ATTR, spmd.dp_dims)
        group = build_group(managed, [p for _, p, _ in named], pg, recipe)
        if placement is not None and placement.plan != group.plan:
            raise RuntimeError("fully_shard: the optimizer-aware plan differs from the group's (a planner bug)")
        for (_, original, _), sharded in zip(named, group.sharded_params):
            setattr(original, _SHARDED_AS, sharded)  # lets hosts remap optimizers built earlier
        for m in modules:
            setattr(m, RECIPE_ATTR, recipe)

    state = ModuleState(modules[0], group, pg, reshard_after_forward, mp_policy)
    for m in modules:
        setattr(m, _STATE, state)
        if len(modules) == 1:
            m.register_forward_pre_hook(state.pre_forward, prepend=True, with_kwargs=True)
        else:  # [Note: several modules as one group]
            m.register_forward_pre_hook(functools.partial(_member_pre_forward, state), prepend=True, with_kwargs=True)
        m.register_forward_hook(state.post_forward, prepend=False)
        if group is not None:
            hook = _ShardedForStateDict(state)
            m.register_state_dict_pre_hook(hook)
            m.register_load_state_dict_pre_hook(hook)
            m.register_load_state_dict_post_hook(hook.after_load)
        cls = m.__class__
        if cls not in _CLASS_CACHE:
            _CLASS_CACHE[cls] = type(f"RaggedFSDP{cls.__name__}", (RaggedFSDPModule, cls), {})
        m.__class__ = _CLASS_CACHE[cls]
    return module


@dataclasses.dataclass(frozen=True)
class GroupRecipe:
    """What ``fully_shard`` built a group from besides its parameters: what a dtype cast after
    ``fully_shard`` plans the group again with (fsdp_module [Note: casting and moving sharded parameters])."""

    granularities: Tuple[int, ...]
    align_bytes: int
    param_dtype: Optional[torch.dtype]  # mp_policy's (None: the parameters' dtype, whatever it is)
    reduce_dtype: Optional[torch.dtype]
    fp8_tile: Optional[int]
    fp8: Optional[Tuple[bool, ...]]
    offload: Optional[HostOffload]
    replicate_group: Optional[dist.ProcessGroup]
    post_forward_group: Optional[dist.ProcessGroup]  # reshard_after_forward=<int>: runtime.post_forward
    label: str  # the class name(s) of the module(s), for errors naming the group
    placement: Optional[PlacementChoice] = None  # optimizer_aware's choice (vz.sharding_report shows it)

    def align(self, dtype: torch.dtype) -> int:
        """Every role's buffer (and the float8 bytes of an FP8 gather) keeps its shards and
        tensor starts on ``align_bytes``: the planner aligns both to this many elements."""
        itemsizes = [torch.empty((), dtype=dtype).element_size()] + ([1] if self.fp8_tile is not None else [])
        itemsizes += [torch.empty((), dtype=d).element_size() for d in (self.param_dtype, self.reduce_dtype) if d]
        return max(1, self.align_bytes // min(itemsizes))


def build_group(managed: Sequence[ManagedParam], originals: Sequence[torch.Tensor], pg: dist.ProcessGroup,
                recipe: GroupRecipe) -> ParamGroup:
    """The group of ``managed`` holding ``originals``' values (this rank's ranges), its
    parameter objects marked as claimed."""
    group = ParamGroup(
        managed, originals, recipe.granularities, pg,
        param_dtype=recipe.param_dtype,
        reduce_dtype=recipe.reduce_dtype,
        align=recipe.align(originals[0].dtype),
        fp8_tile=recipe.fp8_tile,
        replicate_group=recipe.replicate_group,
        fp8=None if recipe.fp8 is None else list(recipe.fp8),
        offload=recipe.offload,
        post_forward_group=recipe.post_forward_group,
    )
    group.placement = recipe.placement  # None: not optimizer-aware
    for p in list(originals) + group.sharded_params + group.unsharded_params:
        setattr(p, _CLAIMED, recipe.label)
    return group


@outside_compile
def _member_pre_forward(state: ModuleState, module: nn.Module, args: tuple, kwargs: dict):
    """The pre-forward hook of a module grouped with others ([Note: several modules as one group])."""
    if state.context is None:
        raise RuntimeError(
            f"fully_shard([...]) of {type(module).__name__} and other modules ran forward as the root: a group of "
            "several modules must sit under one root module; apply fully_shard to a module containing them too "
            "(FSDP2 requires a single root module as well)")
    return state.pre_forward(module, args, kwargs)


class _ShardedForStateDict:
    """[Note: state dicts see the shards] A group still gathered for a backward to come (the
    root, ``reshard_after_forward=False``) holds full buffers, though its modules hold the
    sharded parameters (runtime [Note: nothing stays gathered after forward]). Loading must
    write the shards and drop the stale full ones, so saving and loading reshard the group
    first (outside forward and backward); a backward that follows gathers it again."""

    def __init__(self, state: ModuleState) -> None:
        self.state = state

    @property
    def group(self) -> ParamGroup:
        """The module's group (a cast after ``fully_shard`` builds it anew: fsdp_module
        [Note: casting and moving sharded parameters])."""
        return self.state.group

    @outside_compile
    def __call__(self, *_: Any, **__: Any) -> None:
        if self.group.state is not GroupState.SHARDED and not in_backward_pass():
            self.group.reshard()

    def after_load(self, _module: nn.Module, _incompatible: Any) -> None:
        """``load_state_dict(sd, assign=True)`` put the state dict's tensors into the modules in
        place of the sharded parameters: their values go into the shards (this rank's range of
        a full tensor, or a ragged / DTensor value resharded) and the sharded parameters go back,
        so the optimizer's parameters and the gathers see the loaded weights."""
        group = self.group
        for rp in group.params:
            for owner, attr in rp.managed.owners:
                value = owner._parameters.get(attr)
                if value is None or value is rp.sharded or value is rp.unsharded:
                    continue
                if value.dtype != rp.sharded.dtype:
                    raise ValueError(
                        f"load_state_dict(assign=True): {rp.managed.fqn!r} is {value.dtype} in the state dict and "
                        f"{rp.sharded.dtype} in the sharded model; sharded parameters keep their dtype (views of "
                        "the group's buffers): cast the state dict, or load with assign=False"
                    )
                with torch.no_grad():
                    rp.sharded.copy_(value)
                owner._parameters[attr] = rp.sharded


def sharded_counterpart(param: nn.Parameter) -> nn.Parameter:
    """The sharded parameter that replaced ``param`` (``param`` itself if it was not replaced)."""
    return getattr(param, _SHARDED_AS, param)


def fully_shard_layers(model: nn.Module, layer_classes: Optional[List[str]] = None, **kwargs: Any) -> nn.Module:
    """``fully_shard`` each layer, then the root: the usual FSDP recipe in one call.

    Args:
        layer_classes: class names of the modules that form one group each. Default: the
            model's layers (layer_discovery [Note: finding the layers]: the classes held in
            ``nn.ModuleList``s, else the outermost classes repeated among siblings).
        kwargs: passed to every ``fully_shard`` call; ``reshard_after_forward`` to the
            layers' only (the root keeps FSDP2's default: gathered for backward).
    """
    if layer_classes is None:
        layer_classes = find_layer_classes(model)
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
    kwargs.pop("reshard_after_forward", None)
    return fully_shard(model, **kwargs)
