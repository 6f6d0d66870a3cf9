"""FSDP2's ``fully_shard`` arguments that need a reading on RaggedShard: a list of modules,
``shard_placement_fn`` and ``dp_mesh_dims``.

[Note: several modules as one group]
``fully_shard([norm, head])`` makes one group of the parameters of every module in the list (a
parameter two of them share, tied weights, is one parameter of the group), as FSDP2 does: each
module gets the group's hooks and its class becomes a ``RaggedFSDPModule`` sharing one state, so
the forward of any of them gathers the group (a gather of a group already gathered is a no-op)
and its backward waits for the gradients of every call, whichever modules ran. The list must sit
under one root module (a ``fully_shard`` of a module containing them), as FSDP2 requires.
Between the members' forwards the group follows its ``reshard_after_forward``: resharded when
another group's forward starts (and gathered again by the next member), or kept.

[Note: shard placements as blocks]
FSDP2's ``shard_placement_fn(param)`` picks the ``Shard(d)`` each parameter is cut on, on the
``fully_shard`` mesh or (``ShardPlacementResult``) on a mesh of its own. A RaggedShard cuts the
flattened tensor into blocks instead, each rank a contiguous range of whole blocks, so each
answer is read as the block it keeps whole:

* ``None``: the ``granularity`` policy's block (FSDP2's default ``Shard(0)`` on the mesh);
* ``Shard(0)``: one row (``granularity="row"``); ``Shard(d)``: one slice along ``d``, the
  ``stride(d) = prod(shape[d+1:])`` elements ``Shard(d)`` never separates (of a tensor-parallel
  parameter: of its TP-local tensor). The pieces are rows of those slices, not FSDP2's column
  chunks: the values, the training and the checkpoints (global boxes) are the same, and no
  per-parameter padding arises (the reason torchtitan asks for ``Shard(1)`` on experts);
* another placement is refused, and so is a mesh whose ranks are not the ``fully_shard``
  mesh's: a group is gathered over one process group here. Parameters on another mesh (MoE
  experts over the expert-data-parallel mesh) are sharded by a ``fully_shard`` of their own
  module with that mesh, before the enclosing module's (runtime [Note: meshes]).

[Note: full-DTensor parameters]
``dp_mesh_dims`` (FSDP2's ``DataParallelMeshDims``; torchtitan's ``spmd_backend="full_dtensor"``)
says that ``mesh`` is the whole SPMD mesh and names its data-parallel dimensions: every parameter
is a DTensor on that mesh, ``Replicate()`` on them (``Shard``/``Replicate`` on the others). The
group is sharded over the one ``shard`` dimension (replicated over ``replicate``: HSDP); the
sharded parameters are ``RaggedDTensor``s on the same mesh, ``RaggedShard`` there and the
parameter's own placements elsewhere; the module computes with the DTensors it had (their local
tensors views of the group's full buffer), as with tensor parallelism
(tensor_parallel [Note: ragged inside the tensor-parallel piece]). A gradient's placement on the
data-parallel dimensions (a ``Partial`` sum over the batch's shards) is left to the group's
reduction, as FSDP2 leaves it. Several ``shard`` or ``replicate`` dimensions (FSDP2 flattens them,
e.g. ``("dp_shard", "cp")`` under context parallelism) and a ``replicate``-only mode are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from ..primitives.granularity import GranularityPolicy, resolve_granularities
from ..primitives.tensor_parallel import TensorParallelLayout, spmd_layout
from ..torch_compat import shard_placement_result

__all__ = ["OUR_ARGUMENTS", "modules_of", "placement_granularities", "SpmdMesh"]

OUR_ARGUMENTS = ("granularity", "align_bytes", "fp8_all_gather_tile", "fp8_all_gather_filter", "optimizer_aware")
"""``fully_shard``'s keyword arguments beyond FSDP2's."""


def modules_of(module: Any) -> Tuple[nn.Module, ...]:
    """The modules of ``fully_shard``'s first argument, one or a list
    ([Note: several modules as one group]); containers without a ``forward`` are refused, as FSDP2
    refuses them (their hooks would never run)."""
    if isinstance(module, nn.Module):
        modules: Tuple[Any, ...] = (module,)
    elif isinstance(module, (list, tuple)) and module:
        modules = tuple(module)
    else:
        raise TypeError(f"fully_shard takes a module or a non-empty list of modules, got {module!r}")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard takes a module or a list of modules, got a list holding {type(m).__name__}")
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ValueError(
                f"fully_shard does not support containers that do not implement forward: a {type(m).__name__} "
                "is never called, so the group's hooks would never run; apply fully_shard to each of its modules, "
                "or pass them as one group, fully_shard(list(container))")
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("fully_shard: the list of modules names one module twice")
    inner = [m for m in modules if any(m is not o and any(m is s for s in o.modules()) for o in modules)]
    return tuple(m for m in modules if not any(m is i for i in inner))  # FSDP2 keeps the outermost ones


def _ranks(group: Optional[dist.ProcessGroup]) -> Optional[List[int]]:
    return None if group is None else dist.get_process_group_ranks(group)


def placement_granularities(named: Sequence[Tuple[str, nn.Parameter, Any]], held: Sequence[Tuple[str, torch.Tensor]],
                            shard_placement_fn: Callable[[nn.Parameter], Any], policy: GranularityPolicy,
                            shard_group: dist.ProcessGroup, replicate_group: Optional[dist.ProcessGroup]
                            ) -> Dict[str, int]:
    """Each parameter's block from ``shard_placement_fn`` ([Note: shard placements as blocks]),
    ``policy``'s where it answers ``None``."""
    base = resolve_granularities(held, policy)
    out: Dict[str, int] = {}
    for (name, param, _), (_, local), g in zip(named, held, base):
        placement, group, replicas = shard_placement_result(shard_placement_fn(param))
        if group is not None and (_ranks(group) != _ranks(shard_group) or _ranks(replicas) != _ranks(replicate_group)):
            raise NotImplementedError(
                f"shard_placement_fn put {name!r} on another mesh (shard ranks {_ranks(group)}, replicas "
                f"{_ranks(replicas)}) than fully_shard's (shard ranks {_ranks(shard_group)}, replicas "
                f"{_ranks(replicate_group)}): a vescale_zero group is gathered over one mesh. Shard the module "
                "holding those parameters with a fully_shard call of its own on that mesh first, e.g. "
                "fully_shard(block.moe.experts, mesh=edp_mesh), then this module")
        if placement is None:
            out[name] = g
            continue
        if type(placement) is not Shard:
            raise NotImplementedError(
                f"shard_placement_fn returned {placement!r} for {name!r}; fully_shard takes Shard(dim) (the "
                "parameter's blocks are then whole slices along dim) or None (the granularity policy's)")
        dim = placement.dim + local.dim() if placement.dim < 0 else placement.dim
        if not 0 <= dim < max(local.dim(), 1):
            raise ValueError(f"shard_placement_fn returned Shard({placement.dim}) for {name!r} of shape "
                             f"{tuple(local.shape)}, which has no such dimension")
        out[name] = max(1, math.prod(local.shape[dim + 1:])) if local.numel() else 1
    return out


@dataclass(frozen=True)
class SpmdMesh:
    """The whole SPMD mesh of FSDP2's full-DTensor mode and its data-parallel dimensions
    ([Note: full-DTensor parameters])."""

    mesh: DeviceMesh
    shard_dim: int
    replicate_dim: Optional[int]

    @staticmethod
    def of(mesh: Any, dp_mesh_dims: Any) -> "SpmdMesh":
        if not isinstance(mesh, DeviceMesh) or not mesh.mesh_dim_names:
            raise ValueError("fully_shard(..., dp_mesh_dims=...) needs mesh= the whole SPMD DeviceMesh, with named "
                             f"dimensions, got {mesh!r}")
        shard = tuple(getattr(dp_mesh_dims, "shard_names", ()))
        replicate = tuple(getattr(dp_mesh_dims, "replicate_names", ()))
        names = tuple(mesh.mesh_dim_names)
        for n in shard + replicate:
            if n not in names:
                raise ValueError(f"Mesh dim name {n!r} of dp_mesh_dims not found in mesh.mesh_dim_names {names}")
        if len(shard) != 1 or len(replicate) > 1:
            raise NotImplementedError(
                f"fully_shard(..., dp_mesh_dims={dp_mesh_dims}): one shard dimension (and at most one replicate "
                "dimension) is supported; several (FSDP2 flattens them, e.g. context parallelism) or none (replicate "
                "only) are not. Name one shard dimension, or pass the data-parallel mesh itself without dp_mesh_dims")
        return SpmdMesh(mesh, names.index(shard[0]), names.index(replicate[0]) if replicate else None)

    @property
    def dp_dims(self) -> Tuple[int, ...]:
        return (self.shard_dim,) + (() if self.replicate_dim is None else (self.replicate_dim,))

    @property
    def shard_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(self.shard_dim)

    @property
    def replicate_group(self) -> Optional[dist.ProcessGroup]:
        return None if self.replicate_dim is None else self.mesh.get_group(self.replicate_dim)

    def layouts(self, params: Sequence[Tuple[str, torch.Tensor]], unsupported: Dict[str, bool]
                ) -> List[TensorParallelLayout]:
        """Each parameter's layout (tensor_parallel's ``spmd_layout``); ``unsupported``: options
        set that full-DTensor parameters refuse, as tensor-parallel ones do."""
        for option, used in unsupported.items():
            if used:
                raise NotImplementedError(f"fully_shard: {option} is not supported with dp_mesh_dims (full-DTensor "
                                          "parameters); leave it unset")
        return [spmd_layout(n, p, self.mesh, self.shard_dim, self.dp_dims) for n, p in params]
