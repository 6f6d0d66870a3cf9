"""Every rank's piece of a parameter holds whole optimizer blocks: checked on every rank at once.

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
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

from ..param_group import slot_of
from ..placement import RaggedShard
from ..ragged_tensor import RaggedDTensor, is_ragged, local_piece, ragged_spec

__all__ = ["check_every_rank_piece", "per_block_state", "keep_saved_dtypes"]

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
