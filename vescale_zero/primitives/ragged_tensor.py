"""RaggedDTensor: a DTensor whose placement is RaggedShard; the sharded parameters' type.

::

    global tensor (48, 32), flat, RaggedShard over 3 ranks (granularity 32: whole rows)
    |<------- rank 0 ------->|<-- rank 1 -->|<------ rank 2 ------>|
    RaggedDTensor on rank 1:  .shape == (48, 32)   (global, what torch code reads)
                              .placements == (RaggedShard(...),)
                              ._local_tensor: rank 1's flat range, a *view* of the group's
                                              DBuffer shard (zero-copy: no data of its own)

[Note: ops on ragged tensors]
torch 2.13's DTensor has no sharding rules for a placement it does not know, so this
subclass answers the ops itself (``__torch_dispatch__``), in three kinds:

* element-wise: pointwise ops, ``_foreach_*``, fused optimizer kernels, copies, ``*_like``
  factories. Every ragged argument in one position has the same layout as the others in
  that position (a parameter, its gradient, its optimizer state), so the op runs on the
  local pieces and its results get the layout back: what an optimizer does is exact and
  costs one unwrap per tensor (torch's element-wise optimizers skip even that: their lists
  are unwrapped once per step, local_optim_steps
  [Note: torch's optimizers step the local pieces]). Plain 0-dim tensors (Adam's ``step``, a
  grad scale) and replicated DTensors (a clip coefficient) join as they are.
* reductions to a number: ``_foreach_norm`` gives DTensors *partial* over the shard
  dimension (torch's own ``_NormPartial``), so torch's ``clip_grad_norm_`` reduces the norms
  across ranks exactly as it does for FSDP2's ``Shard(0)`` parameters (one all-reduce when the
  total is used); a single ``linalg_vector_norm`` / ``sum`` is reduced at once (a replicated
  DTensor), so its ``item()`` is the whole tensor's value on every rank.
* anything else (matmul, indexing, views that need the whole tensor): an error that names
  the op and the ways out (``full_tensor()``, ``to_local()``, ``vz.gathered_parameters``).
  A silently wrong answer is never given.

``full_tensor()`` / ``redistribute(placements=[Replicate()])`` gather the whole tensor;
``torch.distributed.checkpoint`` writes and reads each rank's range as at most
``2 * ndim - 1`` boxes (``state_dict.flat_range_boxes``) that are views of the local piece.
torch's own DTensor functions that meet a RaggedShard placement (``DTensor.from_local``,
``distribute_tensor``, a redistribute *to* a ragged layout, full state-dict loads) are routed
here by :mod:`vescale_zero.primitives.dtensor_interop`.

[Note: pickling a ragged tensor]
torch 2.13 gives a DTensor the storage offset of its local tensor, and pickles a wrapper
whose offset is not zero as if it had storage of its own ("Attempted to access the data
pointer on an invalid python storage"); a ragged tensor's piece is a view at an offset of its
group's shard. So a ragged tensor pickles as its piece (a view: ``torch.save`` stores the
shard's storage once for all the pieces of a state dict) and its spec, and is rebuilt from
them (:func:`_rebuild_ragged`, allow-listed for ``torch.load(weights_only=True)`` as torch
allow-lists DTensor): a sharded state dict saved per rank loads back, at the same world size,
with ``load_state_dict``. The mesh inside the spec is found again by its process group's name,
as a DTensor's is.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from ..torch_compat import DTensorSpec, TensorMeta, honour_torch_dispatch, tree_flatten, tree_unflatten
from ..torch_compat import NormPartial as _NormPartial
from ..torch_compat import optim_foreach_supported_types as _optim_foreach_types
from ..torch_compat import utils_foreach_supported_types as _util_foreach_types
from .comm_device import collective_device
from .placement import RaggedShard, ShardedRange, flat_range_boxes
from .tensor_parallel import reduction_dims, tp_local_box, tp_local_of_whole, whole_from_tp_local

__all__ = ["RaggedDTensor", "ragged_spec", "shard_mesh", "local_piece", "is_ragged", "like_param", "local_rows",
           "ragged_from_full", "ragged_placement_of", "check_ragged_piece"]

aten = torch.ops.aten


_MESHES: Dict[Tuple[int, str], Tuple[dist.ProcessGroup, DeviceMesh]] = {}


def shard_mesh(group: dist.ProcessGroup, device: torch.device) -> DeviceMesh:
    """The 1-D mesh of a shard group, on which ragged tensors live.

    [Note: one mesh dimension] HSDP replicas hold equal shards, so a ragged tensor is
    described on its shard group alone: a norm reduces over the shard group (what
    ``vz.clip_grad_norm_`` does), and ``torch.distributed.checkpoint`` drops the replicas'
    duplicate boxes (same offsets) when it plans a save. (Beside tensor parallelism the tp
    dimensions join the shard one, the replicas still left out:
    tensor_parallel [Note: ragged inside the tensor-parallel piece].) A meta-device group's mesh takes the
    backend's device type (it is rebuilt when the group leaves the meta device)."""
    device_type = device.type
    if device_type == "meta":
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        use_accelerator = accelerator is not None and dist.get_backend(group) != "gloo"
        device_type = accelerator.type if use_accelerator else "cpu"
    key = (id(group), device_type)
    hit = _MESHES.get(key)
    if hit is None or hit[0] is not group:
        hit = (group, DeviceMesh.from_group(group, device_type))
        _MESHES[key] = hit
    return hit[1]


def ragged_spec(mesh: DeviceMesh, placement: RaggedShard, shape: Sequence[int], dtype: torch.dtype,
                placements: Optional[Sequence[Placement]] = None) -> DTensorSpec:
    """The spec of a tensor of global ``shape`` laid out by ``placement`` on the last dimension
    of ``mesh`` (the shard dimension; an HSDP mesh's first dimension replicates), or by
    ``placements``, one per dimension of ``mesh`` with ``placement`` among them (beside tensor
    parallelism: tensor_parallel [Note: ragged inside the tensor-parallel piece])."""
    shape = torch.Size(shape)
    if placements is None:
        placements = (Replicate(),) * (mesh.ndim - 1) + (placement,)
    return DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, _contiguous_stride(shape), dtype))


def _contiguous_stride(shape: Sequence[int]) -> Tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(stride))


def _with_dtype(spec: DTensorSpec, dtype: torch.dtype) -> DTensorSpec:
    meta = spec.tensor_meta
    if meta.dtype == dtype:
        return spec
    return DTensorSpec(spec.mesh, spec.placements, tensor_meta=TensorMeta(meta.shape, meta.stride, dtype))


def is_ragged(t: Any) -> bool:
    return isinstance(t, RaggedDTensor)


def ragged_placement_of(placements: Any) -> Optional[RaggedShard]:
    """The RaggedShard among ``placements`` (``None`` if there is none); refuses a second one, or
    a neighbour other than ``Replicate()`` or ``Shard(d)`` (the layouts of vescale_zero's sharded
    parameters: [Note: one mesh dimension]; beside tensor parallelism, tensor_parallel's
    [Note: ragged inside the tensor-parallel piece])."""
    placements = tuple(placements or ())
    ragged = [p for p in placements if isinstance(p, RaggedShard)]
    if not ragged:
        return None
    if len(ragged) > 1 or not all(p in ragged or type(p) is Shard or p.is_replicate() for p in placements):
        raise NotImplementedError(
            f"placements {placements}: one RaggedShard, with Replicate() or Shard(dim) (tensor parallelism) on the "
            "other mesh dimensions (the layout of a vescale_zero sharded parameter: its placements)"
        )
    return ragged[0]


def ragged_from_full(full: torch.Tensor, mesh: DeviceMesh, placements: Any) -> "RaggedDTensor":
    """A ragged tensor laid out by ``placements`` holding ``full``'s values: this rank's range of
    the whole tensor ``full`` (beside tensor parallelism: of this rank's TP-local part of it; a
    copy, on ``full``'s device; no communication)."""
    placement = ragged_placement_of(placements)
    if placement is None:
        raise ValueError(f"placements {tuple(placements)} hold no RaggedShard")
    spec = ragged_spec(mesh, placement, full.shape, full.dtype, placements)
    rank = check_ragged_piece(spec, None, f"a tensor of shape {tuple(full.shape)}")
    start, end = placement.local_range(rank)
    piece = tp_local_of_whole(full.detach(), spec).reshape(-1)[start:end].clone()
    return RaggedDTensor(piece, spec, requires_grad=False)


def check_ragged_piece(spec: DTensorSpec, local_numel: Optional[int], what: str) -> int:
    """This rank's index on the ragged dimension of ``spec``, once its RaggedShard is checked to
    cut the TP-local tensor of ``spec``'s shape over that dimension's ranks (and ``local_numel``,
    if given, to be this rank's piece's length); ``ValueError`` naming ``what`` otherwise."""
    dim = next(d for d, p in enumerate(spec.placements) if isinstance(p, RaggedShard))
    placement, rank = spec.placements[dim], spec.mesh.get_local_rank(dim)
    tp_local = math.prod(tp_local_box(spec)[0])
    if tp_local != placement.numel or placement.world_size != spec.mesh.size(dim) or (
            local_numel is not None and local_numel != placement.local_numel(rank)):
        raise ValueError(
            f"{what} cannot be laid out by {placement} ({placement.numel} elements over {placement.world_size} ranks"
            f"{'' if local_numel is None else f'; rank {rank} holds {placement.local_numel(rank)}'}) on mesh "
            f"dimension {dim} of {tuple(spec.mesh.shape)} placed {tuple(spec.placements)} ({tp_local} elements each)")
    return rank


def local_piece(t: torch.Tensor) -> torch.Tensor:
    """This rank's flat piece of a ragged tensor (a view: writes land in the shard), or ``t``."""
    return t._local_tensor if isinstance(t, RaggedDTensor) else t


def local_rows(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a tensor ragged over whole entries of dim 0 (per-block optimizer
    state), shaped ``(entries, *t.shape[1:])``; ``t`` itself if it is not ragged."""
    return t._local_tensor.view(-1, *t.shape[1:]) if isinstance(t, RaggedDTensor) else t


def like_param(piece: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``piece`` (this rank's flat piece, e.g. a gradient view) in ``param``'s layout: a
    :class:`RaggedDTensor` if ``param`` is one, else ``piece`` itself."""
    if isinstance(param, RaggedDTensor):
        return RaggedDTensor(piece, _with_dtype(param._spec, piece.dtype), requires_grad=False)
    return piece


class RaggedDTensor(DTensor):
    """A DTensor with one mesh dimension placed :class:`RaggedShard` (see the module
    docstring): the shard group's, alone, or beside tensor-parallel dimensions
    (tensor_parallel [Note: ragged inside the tensor-parallel piece]; the ragged dimension is
    found by its type). Build one with :meth:`from_piece`; its local tensor is the 1-D piece itself.

    [Note: gathered mode] Inside ``vz.gathered_parameters`` (DeepSpeed's ``GatheredParameters``
    contract) a sharded parameter stands for its whole tensor: ``.data`` is the full tensor
    and every op on the parameter (``nn.init.normal_(p)``, ``p.copy_(t)``) runs on it; on
    exit the modifier rank's values are written back into every rank's shard."""

    _gathered_count = 0  # parameters in gathered mode, process-wide: the dispatch checks them only then

    @staticmethod
    def from_piece(piece: torch.Tensor, spec: DTensorSpec, requires_grad: bool = False) -> "RaggedDTensor":
        spec = _with_dtype(spec, piece.dtype)
        return RaggedDTensor(piece, spec, requires_grad=requires_grad)

    # ---- layout ------------------------------------------------------------------
    @property
    def ragged_dim(self) -> int:
        """The mesh dimension placed :class:`RaggedShard` (the last one but beside tensor parallelism)."""
        placements = self._spec.placements
        if isinstance(placements[-1], RaggedShard):
            return len(placements) - 1
        return next(d for d, p in enumerate(placements) if isinstance(p, RaggedShard))

    @property
    def ragged_placement(self) -> RaggedShard:
        return self._spec.placements[self.ragged_dim]

    @property
    def shard_group(self) -> dist.ProcessGroup:
        return self._spec.mesh.get_group(self.ragged_dim)

    @property
    def sharded_range(self) -> ShardedRange:
        """This rank's piece as ``(start, end, global shape, granularity)``, from the placement:
        what the structure-aware optimizers read, which need whole blocks of the global tensor,
        so a tensor-parallel parameter (its blocks are blocks of its TP-local tensor) refuses."""
        if self._spec.mesh.ndim > 1:
            raise NotImplementedError(
                f"this optimizer needs whole blocks or matrices of each parameter (sharded_range), but the "
                f"tensor-parallel parameter of shape {tuple(self.shape)} placed {self._spec.placements} is "
                "split over tensor-parallel ranks too; use a torch.optim optimizer for tensor-parallel models")
        start, end = self.local_range
        return ShardedRange(start, end, tuple(self.shape), self.ragged_placement.granularity)

    @property
    def local_range(self) -> Tuple[int, int]:
        """``[start, end)`` of this rank's piece in the flat tensor the placement cuts: the
        whole tensor, or beside tensor parallelism this rank's TP-local tensor."""
        dim = self.ragged_dim
        return self._spec.placements[dim].local_range(self._spec.mesh.get_local_rank(dim))

    def __repr__(self) -> str:  # type: ignore[override]
        start, end = self.local_range
        return (f"RaggedDTensor(shape={tuple(self.shape)}, dtype={self.dtype}, {self.ragged_placement}, "
                f"local elements [{start}, {end}) of {self.numel()})")

    # ---- whole tensor ------------------------------------------------------------
    def full_tensor(self, *, grad_placements: Any = None) -> torch.Tensor:  # type: ignore[override]
        """The whole tensor on every rank (one all-gather over the shard group, then over the
        tensor-parallel dimensions if any; not differentiable)."""
        placement, group = self.ragged_placement, self.shard_group
        world = placement.world_size
        width = max(placement.local_numel(r) for r in range(world))
        local = self._local_tensor.detach().reshape(-1)
        where = collective_device(group, local.device)  # an offloaded piece on the host, NCCL: via the device
        send = torch.zeros(width, dtype=local.dtype, device=where)
        send[: local.numel()] = local
        recv = send.new_empty(width * world)
        dist.all_gather_into_tensor(recv, send, group=group)
        pieces = [recv[r * width: r * width + placement.local_numel(r)] for r in range(world)]
        return whole_from_tp_local(torch.cat(pieces), self._spec).to(local.device)

    def redistribute(self, device_mesh: Optional[DeviceMesh] = None, placements: Any = None, *,
                     async_op: bool = False, **kwargs: Any) -> DTensor:  # type: ignore[override]
        """To ``Replicate()`` / ``Shard(d)`` placements (a DTensor as ``distribute_tensor`` gives it)
        or another ragged layout, on the same mesh: every rank gathers the whole tensor once
        (:meth:`full_tensor`) and keeps its part of it. Not differentiable; ``Partial`` is refused."""
        mesh = device_mesh or self._spec.mesh
        if placements is None:
            raise ValueError("redistribute of a ragged-sharded tensor needs placements, e.g. [Replicate()] or "
                             "[Shard(0)]")
        placements = tuple(placements)
        if placements == tuple(self._spec.placements) and mesh == self._spec.mesh:
            return self
        if mesh != self._spec.mesh or len(placements) != mesh.ndim or any(p.is_partial() for p in placements):
            raise NotImplementedError(
                f"a ragged-sharded tensor redistributes on its own mesh {tuple(self._spec.mesh.shape)} to Replicate(), "
                f"Shard(d) or RaggedShard placements, one per mesh dimension, not to {placements} on a mesh of shape "
                f"{tuple(mesh.shape)}: call .full_tensor() for the whole tensor, or .to_local() for this rank's piece"
            )
        full = self.full_tensor()
        if ragged_placement_of(placements) is not None:
            return ragged_from_full(full, mesh, placements)
        # every rank holds the whole tensor: each keeps its part, with no further communication
        return distribute_tensor(full, mesh, placements, src_data_rank=None)

    def to_local(self, *, grad_placements: Any = None) -> torch.Tensor:  # type: ignore[override]
        """This rank's flat piece: a view of the group's shard (writes land in it)."""
        return self._local_tensor

    def __reduce_ex__(self, protocol: Any) -> tuple:
        """[Note: pickling a ragged tensor]: the piece (a view) and the spec."""
        return (_rebuild_ragged, (self._local_tensor.detach(), self._spec, self.requires_grad,
                                  bool(getattr(self, "_is_param", False))))

    def __deepcopy__(self, memo: dict) -> "RaggedDTensor":
        """A copy of this rank's piece in the same layout (``copy.deepcopy`` of a state dict);
        the mesh is shared, not copied (a process group cannot be)."""
        if id(self) in memo:
            return memo[id(self)]
        out = RaggedDTensor(self._local_tensor.detach().clone(), self._spec, requires_grad=self.requires_grad)
        if getattr(self, "_is_param", False):
            out._is_param = True
        memo[id(self)] = out
        return out

    # ---- .data: [Note: .data of a sharded parameter] ------------------------------------
    @property
    def data(self) -> torch.Tensor:  # type: ignore[override]
        """[Note: .data of a sharded parameter] This rank's flat piece, a plain tensor viewing
        the group's shard -- what kernels that bypass torch's dispatcher read and write
        (DeepSpeed's FusedAdam and CPU Adam, apex's multi-tensor kernels, ``p.data.add_`` in
        hand-written updates), and what ZeRO-3's ``.data`` is (a partition, never the whole
        tensor). Element-wise work on ``.data`` of tensors of the same layout (a parameter, its
        gradient, its optimizer state, an EMA copy of it) is exact. The whole tensor is
        ``full_tensor()``, or ``.data`` inside ``vz.gathered_parameters`` ([Note: gathered mode])."""
        full = self.__dict__.get("_gathered_full")
        return full if full is not None else self._local_tensor.data

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """``p.data = t`` writes ``t``'s values: a tensor of the global shape (this rank keeps its
        range), a ragged tensor of the same layout, or a piece shaped as this rank's (what
        ``.data`` gave). The parameter keeps its storage (a view of the group's shard, which the
        gathers read) and dtype; anything else is refused."""
        local = self._local_tensor
        if value.dtype != self.dtype or tuple(value.shape) not in (tuple(self.shape), tuple(local.shape)):
            raise ValueError(
                f"p.data = tensor of shape {tuple(value.shape)} {value.dtype} on a sharded parameter of shape "
                f"{tuple(self.shape)} {self.dtype} (this rank's piece: {tuple(local.shape)}): a sharded parameter "
                "keeps its dtype and storage (a view of its group's shard, which the all-gathers read); assign a "
                "tensor of the same dtype and of the parameter's (or this rank's piece's) shape, whose values are "
                "copied in. To compute in another dtype use fully_shard(..., mp_policy=MixedPrecisionPolicy("
                "param_dtype=...)); to change shapes, change the model before fully_shard"
            )
        with torch.no_grad():
            if isinstance(value, DTensor) or tuple(value.shape) == tuple(self.shape) != tuple(local.shape):
                self.copy_(value)
            else:
                local.copy_(value)

    def enter_gathered(self, full: torch.Tensor) -> None:
        """``full`` (this parameter's whole tensor) stands for it until :meth:`leave_gathered`
        ([Note: gathered mode])."""
        if self.__dict__.get("_gathered_full") is None:
            RaggedDTensor._gathered_count += 1
        self.__dict__["_gathered_full"] = full

    def leave_gathered(self) -> None:
        if self.__dict__.pop("_gathered_full", None) is not None:
            RaggedDTensor._gathered_count -= 1

    # ---- torch.distributed.checkpoint ------------------------------------------------
    def _boxes(self) -> list:
        """This rank's piece as boxes in global coordinates (beside tensor parallelism: boxes of
        the ragged range in the TP-local tensor, moved by that tensor's global offset)."""
        start, end = self.local_range
        shape, offset = tp_local_box(self._spec)
        boxes = flat_range_boxes(shape, start, end)
        if any(offset):
            boxes = [(tuple(o + d for o, d in zip(off, offset)), size, flat) for off, size, flat in boxes]
        return boxes

    def __create_write_items__(self, fqn: str, object: Any) -> list:  # noqa: A002 - DCP's name
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        props = TensorProperties.create_from_tensor(self._local_tensor)
        return [
            WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(off), torch.Size(size)),
                                                  properties=props, size=self.shape))
            for off, size, _ in self._boxes()
        ]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(torch.Size(off), torch.Size(size)) for off, size, _ in self._boxes()]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        start = self.local_range[0]
        for off, size, flat in self._boxes():
            if tuple(off) == tuple(index.offset):
                return self._local_tensor.narrow(0, flat - start, math.prod(size)).view(size)
        raise ValueError(f"no box of this rank's piece of {index.fqn!r} starts at {tuple(index.offset)}")

    # ---- ops: [Note: ops on ragged tensors] -----------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if RaggedDTensor._gathered_count:
            gathered = _run_gathered(func, args, kwargs)
            if gathered is not _NOT_GATHERED:
                return gathered
        handler = _ROUTES.get(func)
        if handler is None:
            handler = _ROUTES[func] = _route(func)
        return handler(func, args, kwargs)


_NOT_GATHERED = object()


def _rebuild_ragged(piece: torch.Tensor, spec: DTensorSpec, requires_grad: bool, is_param: bool) -> torch.Tensor:
    """The ragged tensor (an ``nn.Parameter`` if it was one) that ``__reduce_ex__`` pickled:
    [Note: pickling a ragged tensor]."""
    t = RaggedDTensor(piece, _with_dtype(spec, piece.dtype), requires_grad=requires_grad and not is_param)
    return torch.nn.Parameter(t, requires_grad=requires_grad) if is_param else t


def _route(func: Any) -> Callable:
    """The handler of ``func`` ([Note: ops on ragged tensors]), found once per op overload
    (``_ROUTES``): an optimizer step dispatches the same few ops for every parameter."""
    handler = _HANDLERS.get(func.overloadpacket)
    if handler is not None:
        return handler
    if func.overloadpacket.__name__.startswith("_foreach_") or func.overloadpacket in _FUSED_OPTIMIZERS:
        return _foreach
    if torch.Tag.pointwise in func.tags or func.overloadpacket in _ELEMENTWISE:
        return functools.partial(_elementwise, func._schema.is_mutable)
    return _refuse


def _refuse(func: Any, args: tuple, kwargs: dict) -> Any:
    raise NotImplementedError(_unsupported(func))


def _run_gathered(func: Any, args: tuple, kwargs: dict) -> Any:
    """[Note: gathered mode]: an op on parameters standing for their full tensors runs on those."""
    leaves, spec = tree_flatten((args, kwargs))
    if not any(isinstance(t, RaggedDTensor) and t.__dict__.get("_gathered_full") is not None for t in leaves):
        return _NOT_GATHERED
    full = [t.__dict__.get("_gathered_full") if isinstance(t, RaggedDTensor) else t for t in leaves]
    if any(f is None for f, t in zip(full, leaves) if isinstance(t, RaggedDTensor)):
        raise NotImplementedError(f"{func}: a gathered parameter was combined with a sharded one; gather both")
    local_args, local_kwargs = tree_unflatten(full, spec)
    out = func(*local_args, **local_kwargs)
    if func._schema.is_mutable and args and isinstance(args[0], RaggedDTensor):
        return args[0]
    return out


def _unsupported(func: Any) -> str:
    return (
        f"{func} is not supported on a ragged-sharded tensor (a vescale_zero sharded parameter, its gradient or "
        "optimizer state: each rank holds a flat range of whole blocks). Element-wise ops, _foreach_* ops, fused "
        "optimizers and norms work; for anything else read the whole tensor with .full_tensor() (or "
        "vz.gathered_parameters([...]) to change it), or this rank's flat piece with .to_local()"
    )


def _unwrap(t: Any) -> Any:
    """A ragged tensor's piece; a replicated (or partial: reduced first) DTensor's local value."""
    if type(t) is RaggedDTensor:
        return t._local_tensor
    if isinstance(t, DTensor):
        if any(p.is_partial() for p in t.placements):
            t = t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim)
        if not all(isinstance(p, Replicate) for p in t.placements):
            raise NotImplementedError(
                f"a ragged-sharded tensor cannot be combined with a DTensor placed {t.placements}: "
                "only replicated (or partial) DTensors mix with it"
            )
        return t._local_tensor
    return t


def _check_plain(t: Any, func: Any) -> None:
    if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.dim() > 0:
        raise NotImplementedError(
            f"{func}: a ragged-sharded tensor was combined with a plain tensor of shape {tuple(t.shape)}; the plain "
            "tensor has no layout to match the ragged pieces. Use .to_local() on the ragged tensor to work on "
            "this rank's flat piece, or make the other operand a DTensor of the same layout (e.g. torch.zeros_like)"
        )


def _elementwise(mutable: bool, func: Any, args: tuple, kwargs: dict) -> Any:
    """Runs ``func`` on the local pieces; its results get the layout back. ``mutable``: ``func``
    writes its first argument (in place: that argument is the result)."""
    if not all(type(a) is not list and type(a) is not tuple for a in (*args, *kwargs.values())):
        return _elementwise_tree(mutable, func, args, kwargs)
    layout: Optional[DTensorSpec] = None  # the usual call (tensors and numbers): no pytree walk

    def local(t: Any) -> Any:
        nonlocal layout
        if type(t) is not RaggedDTensor:
            return _unwrap_other(t, func)
        if layout is None:
            layout = t._spec
        elif t._spec is not layout:
            _check_same_layout(func, layout, t)
        return t._local_tensor

    local_args = [local(t) for t in args]
    out = func(*local_args, **{k: local(v) for k, v in kwargs.items()}) if kwargs else func(*local_args)
    if mutable and args and type(args[0]) is RaggedDTensor:
        return args[0]  # in place: the first argument is the result
    return _wrap(out, layout)


def _check_same_layout(func: Any, layout: DTensorSpec, t: "RaggedDTensor") -> None:
    if t._spec.placements != layout.placements or t.shape != layout.shape:
        raise NotImplementedError(
            f"{func}: ragged tensors of different layouts ({layout.placements[-1]} {tuple(layout.shape)} "
            f"vs {t._spec.placements[-1]} {tuple(t.shape)}) cannot be combined element-wise"
        )


def _elementwise_tree(mutable: bool, func: Any, args: tuple, kwargs: dict) -> Any:
    leaves, spec = tree_flatten((args, kwargs))
    layout: Optional[DTensorSpec] = None
    for t in leaves:
        if isinstance(t, RaggedDTensor):
            if layout is None:
                layout = t._spec
            else:
                _check_same_layout(func, layout, t)
        else:
            _check_plain(t, func)
    local_args, local_kwargs = tree_unflatten([_unwrap(t) for t in leaves], spec)
    out = func(*local_args, **local_kwargs)
    if mutable and args and isinstance(args[0], RaggedDTensor):
        return args[0]  # in place: the first argument is the result
    return _wrap(out, layout)


def _wrap(out: Any, layout: DTensorSpec) -> Any:
    if isinstance(out, torch.Tensor) and not isinstance(out, DTensor):
        return RaggedDTensor(out, _with_dtype(layout, out.dtype), requires_grad=False)
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap(o, layout) for o in out)
    return out


def _unwrap_other(t: Any, func: Any) -> Any:
    """:func:`_unwrap` for what is not a ragged tensor (checked: a plain tensor must be 0-dim)."""
    if t is None or not isinstance(t, torch.Tensor):
        return t
    _check_plain(t, func)
    return _unwrap(t)


def _foreach(func: Any, args: tuple, kwargs: dict) -> Any:
    """``_foreach_*`` / fused optimizer kernels: list positions pair up; each keeps its layout.
    The hot path of every optimizer step: one type check and one attribute read per tensor."""
    layouts: Optional[List[Optional[DTensorSpec]]] = None
    local_args = []
    for a in args:
        if type(a) is list or type(a) is tuple:
            local_args.append([t._local_tensor if type(t) is RaggedDTensor else _unwrap_other(t, func) for t in a])
            if layouts is None and any(type(t) is RaggedDTensor for t in a):
                layouts = [t._spec if type(t) is RaggedDTensor else None for t in a]
        else:
            local_args.append(_unwrap_other(a, func))
    local_kwargs = {k: ([_unwrap_other(t, func) for t in v] if isinstance(v, (list, tuple)) else
                        _unwrap_other(v, func)) for k, v in kwargs.items()}
    if func.overloadpacket is aten._foreach_norm:
        return _foreach_norm(func, args, local_args, local_kwargs)
    out = func(*local_args, **local_kwargs)
    if not out or layouts is None or not isinstance(out, (list, tuple)):
        return out
    return [RaggedDTensor(o, _with_dtype(lay, o.dtype), requires_grad=False) if lay is not None else o
            for o, lay in zip(out, layouts)]


# ---- reductions: partial over the shard dimension ------------------------------------------
def _partial_result(value: torch.Tensor, like: RaggedDTensor, partial: Any) -> DTensor:
    """``value`` (this rank's part of a reduction of ``like``) as a DTensor partial over the
    dimensions ``like``'s elements are spread over (its shard and tensor-parallel ones)."""
    mesh = like._spec.mesh
    spread = reduction_dims(like._spec)
    placements = tuple(partial if d in spread else Replicate() for d in range(mesh.ndim))
    spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(value.shape, value.stride(), value.dtype))
    return DTensor(value, spec, requires_grad=False)


def _reduced(partial: DTensor) -> DTensor:
    """A single reduction is reduced at once (one all-reduce), so ``p.norm().item()`` is the
    whole tensor's norm on every rank: a partial result's ``item()`` would be this rank's part.
    ``_foreach_norm`` (what ``clip_grad_norm_`` calls for many tensors) stays partial: torch's
    own code reduces the norms it stacks, with one all-reduce in all."""
    return partial.redistribute(partial.device_mesh, [Replicate()] * partial.device_mesh.ndim)


def _norm_type(value: Any) -> float:
    return 2.0 if value is None else float(value)


def _vector_norm(func: Any, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dim = args[2] if len(args) > 2 else kwargs.get("dim", None)
    if not isinstance(x, RaggedDTensor) or dim not in (None, (), []):
        raise NotImplementedError(_unsupported(func))
    p = _norm_type(ord_)
    local_args = [_unwrap(a) for a in args]
    empty = not local_args[0].numel()
    if empty:  # [Note: empty pieces in norms]
        local_args[0] = local_args[0].new_zeros(1)
    local = func(*local_args, **{k: _unwrap(v) for k, v in kwargs.items()})
    if empty:
        local = torch.full_like(local, _norm_identity(p))
    return _reduced(_partial_result(local, x, _norm_partial(p)))


def _norm_identity(p: float) -> float:
    """The norm of an empty piece, as the reduction across ranks needs it
    ([Note: empty pieces in norms]): 0 for ``p >= 0`` (the max of the pieces' inf-norms, the sum
    of their ``|x|^p``, of their non-zero counts), +inf for ``p < 0`` (the min of the -inf
    norms; a negative ``p``'s sum of ``|x|^p`` then gets ``inf ** p = 0``)."""
    return math.inf if p < 0 else 0.0


def _norm_partial(p: float) -> Any:
    if math.isinf(p):
        return Partial("max" if p > 0 else "min")
    if p == 0:
        return Partial("sum")  # the count of non-zeros adds up
    return _NormPartial(p)


def _foreach_norm(func: Any, args: tuple, local_args: list, local_kwargs: dict) -> Any:
    """[Note: empty pieces in norms] A rank may own nothing of a tensor, and torch refuses some
    norms of an empty tensor (inf, -inf) that the other ranks compute; one rank raising while the
    others go on to the reduction leaves them waiting. So every rank computes on real tensors:
    an empty piece is replaced by one zero (its arguments are checked as everywhere else: an
    error is raised on every rank alike) and its norm set to the reduction's identity."""
    tensors = args[0]
    ord_ = local_args[1] if len(local_args) > 1 else local_kwargs.get("ord", 2)
    p = _norm_type(ord_)
    pieces = list(local_args[0])
    empty = [i for i, (t, whole) in enumerate(zip(pieces, tensors))
             if isinstance(whole, RaggedDTensor) and not t.numel()]
    for i in empty:
        pieces[i] = pieces[i].new_zeros(1)
    out = list(func(pieces, *local_args[1:], **local_kwargs))
    for i in empty:
        out[i] = torch.full_like(out[i], _norm_identity(p))
    return [_partial_result(o, t, _norm_partial(p)) if isinstance(t, RaggedDTensor) else o
            for o, t in zip(out, tensors)]


def _sum(func: Any, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    dim = args[1] if len(args) > 1 and not isinstance(args[1], torch.dtype) else kwargs.get("dim", None)
    if dim not in (None, (), []):
        raise NotImplementedError(_unsupported(func))
    local = func(*[_unwrap(a) for a in args], **kwargs)
    return _reduced(_partial_result(local, x, Partial("sum")))


def _copy(func: Any, args: tuple, kwargs: dict) -> Any:
    """``dst.copy_(src)`` into a ragged tensor: this rank's range of ``src``'s values (a
    ragged tensor of the same layout: its piece; of another layout or a DTensor: its full
    tensor, a collective; a plain tensor of the global shape: its range; a scalar: broadcast)."""
    dst, src = args[0], args[1]
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    if not isinstance(dst, RaggedDTensor):
        raise NotImplementedError(
            "copying a ragged-sharded tensor into a plain tensor: read its whole value with .full_tensor() (every "
            "rank of its group must call it), or this rank's piece with .to_local()")
    if isinstance(src, RaggedDTensor) and src._spec.placements == dst._spec.placements:
        piece = src._local_tensor
    elif torch.is_tensor(src) and not isinstance(src, DTensor) and src.numel() == 1 and src.dim() <= 1:
        piece = src.reshape(())
    else:
        whole = src.full_tensor() if isinstance(src, DTensor) else src
        if tuple(whole.shape) != tuple(dst.shape):
            raise ValueError(f"copy_: source of shape {tuple(whole.shape)} into a sharded tensor of shape "
                             f"{tuple(dst.shape)}")
        start, end = dst.local_range
        piece = tp_local_of_whole(whole, dst._spec).reshape(-1)[start:end]
    dst._local_tensor.copy_(piece, non_blocking=non_blocking)
    return dst


def _detach_like(func: Any, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    return RaggedDTensor(func(x._local_tensor, *args[1:], **kwargs), x._spec, requires_grad=False)


def _other_piece(x: "RaggedDTensor", other: Any, func: Any) -> torch.Tensor:
    """``other``'s values at ``x``'s piece, for a comparison: ``other``'s piece if it is a ragged
    tensor of ``x``'s layout; this rank's range of a plain tensor of ``x``'s global shape; of a
    DTensor's whole tensor (collective) otherwise."""
    if isinstance(other, RaggedDTensor) and other._spec.placements == x._spec.placements and other.shape == x.shape:
        return other._local_tensor
    whole = other.full_tensor() if isinstance(other, DTensor) else other
    if not torch.is_tensor(whole) or tuple(whole.shape) != tuple(x.shape):
        raise NotImplementedError(
            f"{func}: a ragged-sharded tensor of shape {tuple(x.shape)} compared with "
            f"{tuple(whole.shape) if torch.is_tensor(whole) else type(whole).__name__}; compare it with a tensor of "
            "its shape (a plain one, or a DTensor), or compare .full_tensor()")
    start, end = x.local_range
    return tp_local_of_whole(whole, x._spec).reshape(-1)[start:end].to(x._local_tensor.device)


def _agree(value: bool, like: "RaggedDTensor") -> bool:
    """Whether ``value`` holds on every rank over which ``like``'s elements are spread (one all-reduce)."""
    flag = torch.tensor([1 if value else 0], device=collective_device(like.shard_group, like._local_tensor.device))
    for dim in reduction_dims(like._spec):
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=like._spec.mesh.get_group(dim))
    return bool(flag.item())


def _equal(func: Any, args: tuple, kwargs: dict) -> bool:
    """``torch.equal`` with a ragged tensor: equal pieces on every rank (local, then one all-reduce)."""
    a, b = args
    x, other = (a, b) if isinstance(a, RaggedDTensor) else (b, a)
    mine = x._local_tensor
    theirs = _other_piece(x, other, func)
    return _agree(mine.dtype == theirs.dtype and torch.equal(mine, theirs), x)


def _allclose(func: Any, args: tuple, kwargs: dict) -> bool:
    """``torch.allclose`` with a ragged tensor: close pieces on every rank."""
    a, b = args[0], args[1]
    x, other = (a, b) if isinstance(a, RaggedDTensor) else (b, a)
    mine, theirs = x._local_tensor, _other_piece(x, other, func)
    pair = (mine, theirs) if x is a else (theirs, mine)
    return _agree(bool(func(*pair, *args[2:], **kwargs)), x)


# ---- reductions of a whole ragged tensor: [Note: ops on ragged tensors] ---------------------------
def _whole(dim: Any, ndim: int) -> bool:
    """Whether ``dim`` (a reduction's argument) means every dimension."""
    if dim is None or dim == () or dim == []:
        return True
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted(d % max(ndim, 1) for d in dims) == list(range(ndim))


def _identity(op: str, dtype: torch.dtype) -> Any:
    """The value an empty piece contributes to an all-reduce of ``op``."""
    if op == "sum":
        return 0
    if dtype == torch.bool:
        return op == "min"
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    return (info.min if not dtype.is_floating_point else -math.inf) if op == "max" else \
        (info.max if not dtype.is_floating_point else math.inf)


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _reduce_whole(op: str, local: Callable[[torch.Tensor], torch.Tensor], x: "RaggedDTensor") -> DTensor:
    """``local(piece)`` all-reduced with ``op`` over the ranks ``x``'s elements are spread over:
    a replicated DTensor of the whole tensor's value (an empty piece contributes ``op``'s identity)."""
    piece = x._local_tensor
    if piece.numel():
        value = local(piece)
    else:  # [Note: empty pieces in norms]: the reduction's identity, computed alike on every rank
        value = local(piece.new_zeros(1))
        value = torch.full_like(value, _identity(op, value.dtype))
    wire = value.to(torch.int32) if value.dtype == torch.bool else value
    wire = wire.to(collective_device(x.shard_group, wire.device))
    for dim in reduction_dims(x._spec):
        dist.all_reduce(wire, op=_REDUCE_OPS[op], group=x._spec.mesh.get_group(dim))
    value = wire.to(value.device).to(value.dtype)
    mesh = x._spec.mesh
    spec = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tensor_meta=TensorMeta(value.shape, value.stride(),
                                                                                 value.dtype))
    return DTensor(value, spec, requires_grad=False)


def _reduction(op: str, dim_at: Optional[int] = None) -> Callable:
    """The handler of a whole-tensor reduction (``x.max()``, ``x.amax()``, ``x.all()``...): local,
    then one all-reduce; a reduction over some dimensions only is refused."""
    def handler(func: Any, args: tuple, kwargs: dict) -> Any:
        if torch.Tag.pointwise in func.tags:  # torch.max(a, b): element-wise
            return _elementwise(func._schema.is_mutable, func, args, kwargs)
        x = args[0]
        dim = kwargs.get("dim", args[dim_at] if dim_at is not None and len(args) > dim_at else None)
        if not isinstance(x, RaggedDTensor) or (dim_at is not None and not _whole(dim, x.dim())) or (
                dim_at is None and len(args) > 1):
            raise NotImplementedError(_unsupported(func))
        return _reduce_whole(op, lambda t: func(t, *args[1:], **kwargs), x)
    return handler


def _mean(func: Any, args: tuple, kwargs: dict) -> Any:
    """The whole tensor's mean: the pieces' sums, one all-reduce, divided by the element count."""
    x = args[0]
    dim = args[1] if len(args) > 1 and not isinstance(args[1], torch.dtype) else kwargs.get("dim", None)
    if not isinstance(x, RaggedDTensor) or not _whole(dim, x.dim()):
        raise NotImplementedError(_unsupported(func))
    dtype = kwargs.get("dtype") or x.dtype
    total = _reduce_whole("sum", lambda t: t.sum(dtype=dtype), x)
    return DTensor(total._local_tensor / x.numel(), total._spec, requires_grad=False)


def _new_factory(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """``p.new_empty(shape)`` / ``new_zeros`` / ``new_ones`` / ``new_full``: a plain tensor of
    ``shape`` (the piece's dtype and device unless given), the same on every rank, as DTensor
    gives a replicated one (torchtitan's fused-QKV init draws into them, then ``copy_``s)."""
    return func(args[0]._local_tensor, *args[1:], **kwargs)


# [Note: random fills draw the whole tensor]
# An init function on a sharded parameter (``nn.init.normal_(p)``, ``trunc_normal_``,
# ``kaiming_uniform_``, a model's ``init_weights()`` / ``reset_parameters()`` after ``to_empty``)
# fills it in place from the random generator. Each rank draws the *whole* tensor (its global
# shape, on its piece's device, with the op's arguments and generator) and keeps its range, so
# with the same seed on every rank the pieces form the tensor the unsharded model gets, bit for
# bit, and every rank's generator advances as the unsharded model's does (the next init draws
# the same numbers too). The element-wise steps around a draw (trunc_normal_'s rejection
# masks, erfinv, scaling) run on the pieces, and its ``mask.any()`` is a whole-tensor reduction
# (one all-reduce), so every rank takes the branch the unsharded tensor takes. Memory: one full
# tensor of the parameter, for the length of the draw. (An offset into the generator's stream
# per rank would save it, but CPU generators have no offsets and CUDA's Philox kernels lay
# values out by launch geometry, so the whole draw is what is equal everywhere.)
def _random_fill(func: Any, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    if not isinstance(x, RaggedDTensor) or any(torch.is_tensor(a) and a.dim() > 0 for a in args[1:]):
        raise NotImplementedError(_unsupported(func))
    piece = x._local_tensor
    local_args = [_unwrap_other(a, func) for a in args[1:]]
    whole = torch.empty(x.shape, dtype=x.dtype, device=piece.device)
    func(whole, *local_args, **kwargs)
    start, end = x.local_range
    piece.copy_(tp_local_of_whole(whole, x._spec).reshape(-1)[start:end])
    return x


_HANDLERS: Dict[Any, Callable] = {
    aten.linalg_vector_norm: _vector_norm,
    aten.copy_: _copy,
    aten.sum: _sum,
    aten.detach: _detach_like,
    aten.alias: _detach_like,
    aten.equal: _equal,
    aten.allclose: _allclose,
    aten.mean: _mean,
    aten.max: _reduction("max"),
    aten.min: _reduction("min"),
    aten.amax: _reduction("max", dim_at=1),
    aten.amin: _reduction("min", dim_at=1),
    aten.all: _reduction("min"),
    aten.any: _reduction("max"),
    aten.count_nonzero: _reduction("sum", dim_at=1),
    **{op: _new_factory for op in (aten.new_empty, aten.new_zeros, aten.new_ones, aten.new_full,
                                   aten.new_empty_strided)},
    **{op: _random_fill for op in (aten.uniform_, aten.normal_, aten.bernoulli_, aten.random_, aten.exponential_,
                                   aten.cauchy_, aten.log_normal_, aten.geometric_)},
}

_ELEMENTWISE = {
    aten.zero_, aten.fill_, aten.clone, aten._to_copy, aten.zeros_like, aten.ones_like,
    aten.empty_like, aten.full_like, aten.rand_like, aten.randn_like, aten.lerp, aten.lerp_, aten.where,
    aten.clamp, aten.clamp_, aten.clamp_min, aten.clamp_min_, aten.clamp_max, aten.clamp_max_, aten.nan_to_num,
    aten.nan_to_num_, aten.masked_fill, aten.masked_fill_, aten.isfinite, aten.isnan, aten.isinf,
}

# torch picks its foreach / fused optimizer and clipping kernels by exact type (DTensor is listed,
# a subclass is not): without this an AdamW on ragged parameters falls back to its per-tensor loop.
for _types in (_optim_foreach_types, _util_foreach_types):
    if RaggedDTensor not in _types:
        _types.append(RaggedDTensor)
honour_torch_dispatch(RaggedDTensor)  # torch 2.11's DTensor fast path would skip our dispatch

_FUSED_OPTIMIZERS = {aten._fused_adam_, aten._fused_adamw_, aten._fused_sgd_, aten._fused_adagrad_}
_ROUTES: Dict[Any, Callable] = {}  # op overload -> its handler (_route)

# [Note: pickling a ragged tensor]: torch.load(weights_only=True) rebuilds them, as it does DTensors.
torch.serialization.add_safe_globals([RaggedDTensor, RaggedShard, _rebuild_ragged])
