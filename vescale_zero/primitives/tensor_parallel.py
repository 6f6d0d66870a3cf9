"""Tensor parallelism beside ``fully_shard``: parameters that ``parallelize_module`` made DTensors.

torchtitan's recipe (2-D: ``("dp", "tp")``; 3-D with HSDP: ``("replicate", "shard", "tp")``)::

    world = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(block, world["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    fully_shard(block, mesh=world["dp"])          # HSDP: mesh=world["replicate", "shard"]

[Note: ragged inside the tensor-parallel piece]
A parameter ``parallelize_module`` made a DTensor on the tp mesh (``ColwiseParallel``:
``Shard(0)``, ``RowwiseParallel``: ``Shard(1)``, ``SequenceParallel``: ``Replicate()``)
joins its group with its *TP-local* tensor (``p.to_local()``): the planner packs that,
the granularity cuts that into blocks, the gathers rebuild that, and the module gets back
the DTensor it expects (the same tp mesh and placements, its local tensor a view of the
group's full buffer)::

    W (8, 6), ColwiseParallel over tp = 2, fully_shard over dp = 2, granularity one row
      tp rank 0: TP-local rows 0-3 of W -> RaggedShard over dp: dp 0 rows 0-1, dp 1 rows 2-3
      tp rank 1: TP-local rows 4-7 of W -> RaggedShard over dp: dp 0 rows 4-5, dp 1 rows 6-7
    RowwiseParallel (Shard(1)): the TP-local tensor is (8, 3); its "row" is 3 elements

* No block ever straddles two TP slices: blocks are cut from the TP-local tensor, whatever
  the granularity (the design's rule "for a ``Shard(d>0)`` neighbour the granularity is a
  multiple of ``stride(d)``" holds by construction; granularity presets name rows of the
  TP-local tensor).
* The sharded parameter is a ``RaggedDTensor`` with the global shape on the mesh of the
  shard dimension and the tp dimensions, sliced from the world mesh in its order, placed
  ``(RaggedShard, <TP placement>)``; its local tensor is a flat range of the TP-local
  tensor. Under HSDP the replicate dimension is left out
  (ragged_tensor [Note: one mesh dimension]). Code that needs the ragged dimension finds it by type.
* Its whole tensor (``full_tensor()``), its checkpoint boxes (global coordinates: the
  TP-local tensor's global offset plus a box of the ragged range inside it) and its norms
  (partial over the shard and the tp-sharded dimensions) come from that spec alone.
* Gradients: autograd gives the unsharded DTensor parameter a DTensor gradient; it is
  redistributed to the parameter's placements (a ``SequenceParallel`` norm's gradient is
  ``Partial`` over tp: summed), and its local tensor is reduced over dp as any other.
* Parameters that are not DTensors keep the 1-D layout over the shard group, as PyTorch
  FSDP2 keeps them (torch's ``clip_grad_norm_`` therefore refuses a model mixing both, for
  either FSDP; ``vz.clip_grad_norm_`` takes it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..torch_compat import DTensorSpec, TensorMeta, local_shape_and_global_offset
from .placement import RaggedShard

__all__ = ["TensorParallelLayout", "tensor_parallel_layouts", "local_tensor", "local_gradient", "tp_local_box",
           "whole_from_tp_local", "tp_local_of_whole", "reduction_dims", "refuse_tensor_parallel", "USE_DCP",
           "DP_DIMS_ATTR", "spmd_layout"]

DP_DIMS_ATTR = "_vescale_dp_mesh_dims"
"""On a parameter of FSDP2's full-DTensor mode (and the group's objects standing for it): the
data-parallel dimensions of its mesh, whose gradient placements the group's reduction handles
itself (:func:`local_gradient`)."""

USE_DCP = ("save and load with torch.distributed.checkpoint (dcp.save / dcp.load of get_model_state_dict(model) and "
           "get_optimizer_state_dict(model, optimizer)), which reshards to other data-parallel sizes")
"""What a refusal of tensor-parallel parameters by one of our checkpoint formats proposes instead."""


@dataclass(frozen=True)
class TensorParallelLayout:
    """Where a tensor-parallel parameter of a group lives
    ([Note: ragged inside the tensor-parallel piece]): ``spec``, its own DTensor spec on the tp
    mesh (placements, global shape and stride); ``mesh``, the (shard, tp...) mesh of its ragged
    tensors; ``ragged_dim``, the shard dimension of ``mesh``; ``tp_dims``, for each other
    dimension of ``mesh``, its dimension in ``spec.mesh``."""

    spec: DTensorSpec
    mesh: DeviceMesh
    ragged_dim: int
    tp_dims: Tuple[int, ...]

    @property
    def shape(self) -> torch.Size:
        """The global shape."""
        return self.spec.shape

    def placements(self, ragged: RaggedShard) -> Tuple[Placement, ...]:
        """The sharded parameter's placements on :attr:`mesh`."""
        others = iter(self.tp_dims)
        return tuple(ragged if d == self.ragged_dim else self.spec.placements[next(others)]
                     for d in range(self.mesh.ndim))

    def unsharded(self, local: torch.Tensor) -> DTensor:
        """The DTensor the module computes with: ``local`` (a view of the group's full
        buffer, the TP-local tensor) on the tp mesh, as ``parallelize_module`` left it."""
        meta = self.spec.tensor_meta
        spec = DTensorSpec(self.spec.mesh, self.spec.placements,
                           tensor_meta=TensorMeta(meta.shape, meta.stride, local.dtype))
        return DTensor(local, spec, requires_grad=False)


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """What a group holds of ``param``: a DTensor's TP-local tensor, else ``param`` itself."""
    return param._local_tensor if isinstance(param, DTensor) else param


def local_gradient(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """An unsharded parameter's gradient as the group reduces it: a DTensor gradient placed
    as its parameter (a ``Partial`` one summed over tp first: collective), its local tensor.
    On the data-parallel dimensions of a full-DTensor parameter (``DP_DIMS_ATTR``) the gradient
    keeps its placement: its local tensor is this rank's part, which the group reduces
    (a ``Partial`` sum over the batch's shards), as FSDP2 reduces it."""
    if not isinstance(grad, DTensor):
        return grad
    if isinstance(param, DTensor) and tuple(grad.placements) != tuple(param.placements):
        dp = getattr(param, DP_DIMS_ATTR, ())
        target = tuple(g if d in dp else p for d, (g, p) in enumerate(zip(grad.placements, param.placements)))
        if target != tuple(grad.placements):
            grad = grad.redistribute(param.device_mesh, target)
    return grad._local_tensor


def _is_ragged(placement: Placement) -> bool:
    return isinstance(placement, RaggedShard)


def _tp_placements(spec: DTensorSpec) -> List[Placement]:
    return [Replicate() if _is_ragged(p) else p for p in spec.placements]


def tp_local_box(spec: DTensorSpec) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """``(shape, global offset)`` of this rank's TP-local tensor of a ragged spec (the whole
    tensor at offset zero when no dimension but the ragged one shards it)."""
    shape = tuple(spec.shape)
    if all(_is_ragged(p) or p.is_replicate() for p in spec.placements):
        return shape, (0,) * len(shape)
    return local_shape_and_global_offset(shape, spec.mesh, _tp_placements(spec))


def whole_from_tp_local(local: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    """The global tensor from this rank's TP-local tensor (gathered over the tp dimensions:
    collective; the tensor itself, reshaped, when no tp dimension shards it)."""
    if all(_is_ragged(p) or p.is_replicate() for p in spec.placements):
        return local.reshape(spec.shape)
    shape, _ = tp_local_box(spec)
    return DTensor.from_local(local.reshape(shape), spec.mesh, _tp_placements(spec), run_check=False,
                              shape=spec.shape, stride=spec.stride).full_tensor()


def tp_local_of_whole(whole: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    """This rank's TP-local part of the global tensor ``whole`` (no communication)."""
    shape, offset = tp_local_box(spec)
    out = whole.reshape(spec.shape)
    for dim, (start, size) in enumerate(zip(offset, shape)):
        if size != out.shape[dim]:
            out = out.narrow(dim, start, size)
    return out


def reduction_dims(spec: DTensorSpec) -> List[int]:
    """The mesh dimensions over which a ragged tensor's elements are spread (the ragged one
    and the tp-sharded ones): a sum or norm reduces over these, not over replicas."""
    return [d for d, p in enumerate(spec.placements) if _is_ragged(p) or isinstance(p, Shard)]


def _ragged_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh, name: str) -> Tuple[DeviceMesh, int, Tuple[int, ...]]:
    """``(mesh, ragged_dim, tp_dims)`` of :class:`TensorParallelLayout` for a parameter on
    ``tp_mesh`` sharded over ``dp_mesh`` (its last dimension: the shard one under HSDP): the
    world mesh ``dp_mesh`` was sliced from, sliced to those dimensions. ``tp_mesh`` is compared
    by value with the world's tp dimensions (DTensor's caches may hand back an equal mesh
    object sliced from another world mesh)."""
    root = dp_mesh._get_root_mesh()
    dims = tuple(root.mesh_dim_names or ())
    shard = (dp_mesh.mesh_dim_names or (None,))[-1]
    tp_names = tuple(tp_mesh.mesh_dim_names or ())
    names = (shard, *tp_names)
    # dimensions in the world mesh's order; a flattened one (torchtitan's "dp_shard_cp") is not
    # among its dimensions: then the shard dimension first, as such meshes put data parallelism
    ordered = tuple(sorted(names, key=dims.index)) if all(n in dims for n in names) else names
    try:
        usable = tp_names and shard is not None and shard not in tp_names and root[tp_names] == tp_mesh
        mesh = root[ordered] if usable else None
    except (KeyError, RuntimeError, ValueError):  # torch's refusals of a slice
        mesh = None
    if mesh is None:
        raise ValueError(
            f"fully_shard: {name!r} is a DTensor on the mesh {tp_mesh} (tensor parallelism), but the mesh given to "
            f"fully_shard, {dp_mesh}, is not another named dimension of the same world mesh; slice both from one "
            "init_device_mesh(device_type, (dp, tp), mesh_dim_names=('dp', 'tp')): parallelize_module(..., "
            "world['tp']) and fully_shard(..., mesh=world['dp']) (HSDP: world['replicate', 'shard'])"
        )
    return mesh, ordered.index(shard), tuple(tp_names.index(n) for n in ordered if n != shard)


def tensor_parallel_layouts(params: Sequence[Tuple[str, torch.Tensor]], mesh: Any,
                            unsupported: Dict[str, bool]) -> List[Optional[TensorParallelLayout]]:
    """The layout of each of a group's ``(name, parameter)`` (``None`` for a parameter that is
    not a DTensor). ``mesh``: the one ``fully_shard`` was given; ``unsupported``: options of
    ``fully_shard`` (name -> whether set) that refuse tensor-parallel parameters."""
    dtensors = [(n, p) for n, p in params if isinstance(p, DTensor)]
    if not dtensors:
        return [None] * len(params)
    name, first = dtensors[0]
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(
            f"fully_shard: {name!r} is a DTensor on the mesh {first.device_mesh} (tensor parallelism); pass the "
            "data-parallel dimension of the same world mesh, fully_shard(..., mesh=world['dp']) (HSDP: "
            f"world['replicate', 'shard']), not {'None' if mesh is None else type(mesh).__name__}"
        )
    for option, used in unsupported.items():
        if used:
            raise NotImplementedError(
                f"fully_shard: {option} is not supported with tensor-parallel (DTensor) parameters such as {name!r} "
                f"on {first.device_mesh}; leave it unset for modules parallelized by parallelize_module"
            )
    meshes: Dict[DeviceMesh, Tuple[DeviceMesh, int, Tuple[int, ...]]] = {}
    out: List[Optional[TensorParallelLayout]] = []
    for name, p in params:
        if not isinstance(p, DTensor):
            out.append(None)
            continue
        spec = p._spec
        if not all(type(pl) is Shard or pl.is_replicate() for pl in spec.placements):
            raise NotImplementedError(
                f"fully_shard: {name!r} is a DTensor placed {spec.placements}; tensor-parallel parameters must be "
                "placed Shard(dim) or Replicate() on each tp dimension (ColwiseParallel, RowwiseParallel, "
                "SequenceParallel)"
            )
        if not p.is_contiguous():
            raise NotImplementedError(f"fully_shard: the DTensor parameter {name!r} is not contiguous (stride "
                                      f"{p.stride()}); make it contiguous before fully_shard")
        if spec.mesh not in meshes:
            meshes[spec.mesh] = _ragged_mesh(mesh, spec.mesh, name)
        out.append(TensorParallelLayout(spec, *meshes[spec.mesh]))
    return out


def spmd_layout(name: str, param: torch.Tensor, mesh: DeviceMesh, shard_dim: int,
                dp_dims: Tuple[int, ...]) -> TensorParallelLayout:
    """The layout of a parameter of FSDP2's full-DTensor mode (``fully_shard(...,
    dp_mesh_dims=...)``): a DTensor on the whole SPMD ``mesh``, ``Replicate()`` on its
    data-parallel dimensions ``dp_dims``, sharded over ``shard_dim``. Its ragged tensors live on
    ``mesh`` itself (``RaggedShard`` on ``shard_dim``, the parameter's own placements on the
    others), and the module computes with the DTensor it had, its local tensor a view of the
    group's full buffer: the tensor-parallel layout with ``mesh`` as both meshes."""
    if not isinstance(param, DTensor):
        raise ValueError(
            f"fully_shard(..., dp_mesh_dims=...): {name!r} is a plain tensor; with dp_mesh_dims every parameter must "
            f"be a DTensor on the whole SPMD mesh {mesh} (e.g. via distribute_module), as FSDP2 requires")
    spec = param._spec
    if spec.mesh != mesh:
        raise ValueError(f"fully_shard(..., dp_mesh_dims=...): {name!r} is a DTensor on {spec.mesh}, not on the mesh "
                         f"given to fully_shard, {mesh}")
    names = mesh.mesh_dim_names
    for d in dp_dims:
        if not spec.placements[d].is_replicate():
            raise ValueError(f"fully_shard(..., dp_mesh_dims=...): {name!r} is placed {spec.placements[d]} on the "
                             f"data-parallel dimension {names[d]!r}; it must be Replicate() there, as FSDP2 requires")
    if not all(type(pl) is Shard or pl.is_replicate() for pl in spec.placements):
        raise NotImplementedError(f"fully_shard: {name!r} is a DTensor placed {spec.placements}; parameters must be "
                                  "placed Shard(dim) or Replicate() on each non-data-parallel dimension")
    if not param.is_contiguous():
        raise NotImplementedError(f"fully_shard: the DTensor parameter {name!r} is not contiguous (stride "
                                  f"{param.stride()}); make it contiguous before fully_shard")
    return TensorParallelLayout(spec, mesh, shard_dim, tuple(d for d in range(mesh.ndim) if d != shard_dim))


def refuse_tensor_parallel(groups: Iterable[Any], what: str, instead: str) -> None:
    """Raise ``NotImplementedError`` if any of ``groups`` (``ParamGroup``) holds a
    tensor-parallel parameter: ``what`` does not support them, ``instead`` says what does."""
    for group in groups:
        tp = [m.fqn for m in group.managed if m.tp is not None]
        if tp:
            raise NotImplementedError(
                f"{what} does not support tensor-parallel (DTensor) parameters such as {tp[0]!r}; {instead}")
