"""How optimizer state is laid out: across ranks (whole blocks per rank) and in its files.

## Across ranks

Every rank's piece of a parameter holds whole optimizer blocks: checked on every rank at once.

A block-wise optimizer (8-bit AdamW's quantization blocks, Shampoo's preconditioner bands)
needs each block on one rank. Whether a piece splits a block depends on the *shard group's*
plan -- the 1-D mesh, or under HSDP the ``"shard"`` dimension of the mesh, whose size picks
the shard size -- not on the parameter alone.

[Note: layout checked from the plan] At the optimizer's first step (after a checkpoint load,
which refuses such layouts itself), each parameter's group plan gives every rank's piece, so
every rank finds the same split block and raises the same error (a check of its own piece only
would raise on some ranks while the others wait in the next collective).

[Note: per-block state is ragged over blocks] State with one entry, or one fixed-shape row, per
optimizer block (8-bit AdamW's absmax, Shampoo's stacked preconditioners) is a
:class:`RaggedDTensor` itself: its global shape is ``(blocks of the whole tensor,) + the
per-block shape``, and rank ``r``'s piece is the rows of the blocks inside rank ``r``'s range of
the parameter (a ``RaggedShard`` with one count per rank). No block crosses a rank
([Note: layout checked from the plan]), so the ranks' blocks add up to the whole tensor's, and
DCP saves and reshards this state as it does the parameter: at any world size and granularity
whose pieces keep the blocks whole.

## In a state file

How one parameter group's optimizer state is laid out in its file and staging buffer.

[Note: state layout] A group's payload is its state tensors' bytes, one region per device
(so each region moves to or from its device in one copy), every tensor at a multiple of
64 bytes (a view of any dtype is then aligned). A DTensor's local tensor is stored, and its
spec kept in memory to rebuild it; non-tensor values (a Python ``step``) stay in memory.
The layout is rebuilt when the state's keys, dtypes, shapes or devices change (the first
step, a parameter that gets its first gradient); otherwise a step writes in place.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..primitives.placement import RaggedShard
from ..primitives.ragged_tensor import RaggedDTensor, is_ragged, local_piece, ragged_spec
from ..runtime.param_group import slot_of

__all__ = ["check_every_rank_piece", "per_block_state", "keep_saved_dtypes",
           "Slot", "Layout", "Stage", "build_layout", "signature_of", "rebuild", "local_of"]


# ---- across ranks: every rank's piece holds whole blocks -----------------------------------

BlockSpan = Callable[[int, int], Tuple[int, int]]
"""``(start, end)`` of a piece in elements of the flat parameter -> ``(first, last)`` block."""


def per_block_state(piece: torch.Tensor, param: torch.Tensor, block_span: BlockSpan, total: int,
                    like: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``piece`` (this rank's per-block state, one row per block of its piece of ``param``) in
    the layout of [Note: per-block state is ragged over blocks]: a :class:`RaggedDTensor` of
    ``total`` blocks for a sharded ``param``, ``piece`` itself for a plain one. ``like``: the
    state this replaces (a step's new values): its layout is reused when it matches, so a
    step does not walk every rank's range again."""
    piece = local_piece(piece)
    if not is_ragged(param):
        return piece
    if (is_ragged(like) and like.dtype == piece.dtype and tuple(like.shape) == (total,) + tuple(piece.shape[1:])
            and like._local_tensor.numel() == piece.numel() and like._spec.mesh is param._spec.mesh):
        return RaggedDTensor.from_piece(piece.reshape(-1), like._spec)
    placement = param.ragged_placement
    counts = []
    for rank in range(placement.world_size):
        start, end = placement.local_range(rank)
        first, last = block_span(start, end) if end > start else (0, 0)
        counts.append(last - first)
    per_block = tuple(piece.shape[1:])
    if sum(counts) != total or piece.shape[0] != counts[param._spec.mesh.get_local_rank(param._spec.mesh.ndim - 1)]:
        raise ValueError(f"per-block state of shape {tuple(piece.shape)} does not match the blocks {counts} of a "
                         f"parameter of shape {_shape(param)} ({total} blocks in all)")
    numel = max(1, int(torch.Size(per_block).numel()))
    spec = ragged_spec(param._spec.mesh, RaggedShard(numel, tuple(counts)), (total,) + per_block, piece.dtype)
    return RaggedDTensor.from_piece(piece.reshape(-1), spec)


def check_every_rank_piece(optimizer: str, param: torch.Tensor, fits: Callable[[int, int], bool], what: str,
                           fix: str) -> None:
    """Raise ``ValueError`` if any rank's piece ``[start, end)`` of ``param`` (a sharded
    parameter of a ``fully_shard`` group) does not satisfy ``fits(start, end)``.

    ``what`` names the block (``"a block of 256 elements"``), ``fix`` the remedy. A
    parameter outside any group is not checked here (the optimizer checks its own piece
    when it steps).
    """
    slot = slot_of(param)
    if slot is None or not is_ragged(param):
        return
    group, index = slot
    placement = param.ragged_placement  # every rank's range of the parameter
    for rank in range(placement.world_size):
        start, end = placement.local_range(rank)
        if end > start and not fits(start, end):
            raise ValueError(
                f"{optimizer}: {what} of {group.managed[index].fqn!r} {_shape(param)} would be split across ranks: "
                f"{_where(group)} rank {rank} of {placement.world_size} would hold elements [{start}, {end}) "
                f"(granularity {placement.granularity}); {fix}"
            )


def _shape(param: torch.Tensor) -> Tuple[int, ...]:
    return tuple(param.shape)  # global: a sharded parameter is a RaggedDTensor


def _where(group) -> str:
    if group.replicate_group is None:
        return "in its shard group"
    ranks = dist.get_process_group_ranks(group.process_group)
    return (f"under HSDP the shard size is planned for the mesh's 'shard' dimension ({len(ranks)} ranks: "
            f"{ranks}), where")


def keep_saved_dtypes(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """After ``torch.optim.Optimizer.load_state_dict(state_dict)``: put back the state tensors
    as saved (dtype kept, on the parameter's device). torch casts floating-point state to the
    parameter's dtype, which turns 8-bit codes into floats and rounds fp32 state (absmax,
    preconditioners, moments kept in fp32) to a bf16 parameter's precision."""
    saved = state_dict["state"]
    ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
    for pid, p in zip(ids, (p for group in optimizer.param_groups for p in group["params"])):
        for key, value in saved.get(pid, {}).items():
            if torch.is_tensor(value) and key != "step":
                optimizer.state[p][key] = value.to(device=local_piece(p).device, copy=True)


# ---- in a state file ------------------------------------------------------------------------

_ALIGN = 64  # every state tensor starts on this many bytes of the buffer (any dtype's view is aligned)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class Slot:
    """Where one state tensor lives in a group's payload, and how to rebuild it."""

    device: torch.device
    dtype: torch.dtype
    shape: Tuple[int, ...]  # of the local tensor
    cls: Optional[type]  # the DTensor class for a DTensor (its local tensor is stored), else None
    spec: Any  # the DTensor's spec
    offset: int
    nbytes: int


@dataclass
class Layout:
    """One group's state on disk: per parameter, its keys in order, each a slot or a value."""

    params: List[torch.Tensor]
    entries: List[List[Tuple[Any, Optional[Slot]]]]  # (key, slot); None: a non-tensor value in ``values``
    values: Dict[Tuple[int, Any], Any]
    nbytes: int
    regions: Dict[torch.device, Tuple[int, int]]  # device -> its [start, end) of the payload
    signature: tuple
    digest: int
    index: Dict[int, int] = field(default_factory=dict)  # id(param) -> position in params


def local_of(value: torch.Tensor) -> torch.Tensor:
    return value._local_tensor if isinstance(value, DTensor) else value


def describe(value: Any) -> tuple:
    if not torch.is_tensor(value):
        return ("value",)
    local = local_of(value)
    spec = value._spec if isinstance(value, DTensor) else None
    return (local.device, local.dtype, tuple(local.shape), type(value) if spec is not None else None, spec)


def signature_of(params: List[torch.Tensor], states: Dict[torch.Tensor, dict]) -> tuple:
    return tuple((id(p), tuple((k, describe(v)) for k, v in states[p].items())) for p in params)


def build_layout(params: List[torch.Tensor], states: Dict[torch.Tensor, dict], signature: tuple) -> Layout:
    tensors = [(i, k, v) for i, p in enumerate(params) for k, v in states[p].items() if torch.is_tensor(v)]
    devices: List[torch.device] = []
    for _, _, v in tensors:
        if local_of(v).device not in devices:
            devices.append(local_of(v).device)
    slots: Dict[Tuple[int, Any], Slot] = {}
    regions: Dict[torch.device, Tuple[int, int]] = {}
    offset = 0
    for device in devices:  # one contiguous region per device: one copy to / from its buffer
        start = offset
        for i, k, v in tensors:
            local = local_of(v)
            if local.device == device:
                nbytes = local.numel() * local.element_size()
                spec = v._spec if isinstance(v, DTensor) else None
                slots[(i, k)] = Slot(device, local.dtype, tuple(local.shape), type(v) if spec is not None else None,
                                      spec, offset, nbytes)
                offset += _aligned(nbytes)
        regions[device] = (start, offset)
    entries = [[(k, slots.get((i, k))) for k in states[p]] for i, p in enumerate(params)]
    described = repr([[(repr(k), None if s is None else (str(s.device), str(s.dtype), s.shape, s.offset))
                       for k, s in e] for e in entries])
    layout = Layout(list(params), entries, {}, offset, regions, signature, zlib.crc32(described.encode()))
    layout.index = {id(p): i for i, p in enumerate(params)}
    return layout


def rebuild(slot: Slot, local: torch.Tensor) -> torch.Tensor:
    return local if slot.cls is None else slot.cls(local, slot.spec, requires_grad=False)


class Stage:
    """One staging buffer: a host tensor, and one tensor per accelerator device holding state."""

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self.host: Optional[torch.Tensor] = None
        self.on_device: Dict[torch.device, torch.Tensor] = {}

    def ensure(self, layout: Layout) -> None:
        """Big enough for ``layout`` (a new tensor if not: an older one may still be written out)."""
        if self.host is None or self.host.numel() < layout.nbytes:
            self.host = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        for device, (start, end) in layout.regions.items():
            buf = self.on_device.get(device)
            if device.type != "cpu" and (buf is None or buf.numel() < end - start):
                self.on_device[device] = torch.empty(end - start, dtype=torch.uint8, device=device)

    def view(self, slot: Slot, layout: Layout) -> torch.Tensor:
        if slot.device.type == "cpu":
            raw = self.host[slot.offset : slot.offset + slot.nbytes]
        else:
            start = layout.regions[slot.device][0]
            raw = self.on_device[slot.device][slot.offset - start : slot.offset - start + slot.nbytes]
        return raw.view(slot.dtype).view(slot.shape)

    def to_devices(self, layout: Layout) -> None:
        for device, (start, end) in layout.regions.items():
            if device.type != "cpu":
                self.on_device[device][: end - start].copy_(self.host[start:end])

    def from_devices(self, layout: Layout) -> None:
        for device, (start, end) in layout.regions.items():
            if device.type != "cpu":
                self.host[start:end].copy_(self.on_device[device][: end - start])

    def holds(self, t: torch.Tensor) -> bool:
        ptr = local_of(t).untyped_storage().data_ptr()
        return any(b is not None and b.untyped_storage().data_ptr() == ptr
                   for b in [self.host, *self.on_device.values()])

    def nbytes(self) -> int:
        return sum(b.numel() for b in [self.host, *self.on_device.values()] if b is not None)
