"""RaggedShard: the placement of one tensor over the ranks of an FSDP group.

A tensor is viewed flat (row-major, contiguous) and cut into *atomic blocks* of
``granularity`` consecutive elements. Each rank owns one contiguous range of whole
blocks; ranges may differ in size and may be empty::

    tensor (flat), granularity g = 4, 5 blocks, 3 ranks
    | b0 | b1 | b2 | b3 | b4 |
    |  rank 0 | r1 | rank 2  |      blocks_per_rank = (2, 1, 2)
    |<-- 8 -->|<4>|<-- 8 -->|      elements per rank

Row-wise ``Shard(0)`` is ``granularity = row length`` with an even split, and flat
element-wise sharding (ZeRO-3, FSDP1) is ``granularity = 1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

from ..torch_compat import Placement, init_placement_base

__all__ = ["RaggedShard", "ShardedRange", "Box", "flat_range_boxes"]


@dataclass(frozen=True)
class RaggedShard(Placement):
    """Rank ``k`` owns blocks ``[sum(blocks_per_rank[:k]), sum(blocks_per_rank[:k+1]))``.

    A DTensor placement (``vescale_zero.primitives.ragged_tensor.RaggedDTensor`` carries it on the shard
    dimension of its mesh), so torch code can tell a ragged-sharded tensor from others."""

    granularity: int
    blocks_per_rank: Tuple[int, ...]

    def __post_init__(self) -> None:
        # [Note: the C++ placement base] torch's Placement is a C++ class: its __init__ must run
        # (a dataclass's does not call it), or every method torch calls on the placement --
        # is_shard(), ==, redistribute's checks -- reads an uninitialised object (SIGSEGV).
        init_placement_base(self)
        if self.granularity < 1:
            raise ValueError(f"RaggedShard granularity must be >= 1, got {self.granularity}")
        if any(b < 0 for b in self.blocks_per_rank):
            raise ValueError(f"RaggedShard blocks_per_rank must be >= 0, got {self.blocks_per_rank}")

    @property
    def world_size(self) -> int:
        return len(self.blocks_per_rank)

    @property
    def numel(self) -> int:
        """Elements of the whole tensor."""
        return self.granularity * sum(self.blocks_per_rank)

    def local_range(self, rank: int) -> Tuple[int, int]:
        """``[start, end)`` in elements of the flat tensor that ``rank`` owns."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} is outside this placement's {self.world_size} ranks")
        start = sum(self.blocks_per_rank[:rank]) * self.granularity
        return start, start + self.blocks_per_rank[rank] * self.granularity

    def local_numel(self, rank: int) -> int:
        return self.blocks_per_rank[rank] * self.granularity

    def __reduce__(self) -> tuple:  # the C++ Placement base does not pickle dataclass fields
        return (RaggedShard, (self.granularity, self.blocks_per_rank))

    def __repr__(self) -> str:
        return f"RaggedShard(g={self.granularity}, blocks={list(self.blocks_per_rank)})"


Box = Tuple[Tuple[int, ...], Tuple[int, ...], int]
"""``(offsets, sizes, flat_start)``: a rectangular box of a tensor and where it starts in the
tensor's flat (row-major) order."""


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> List[Box]:
    """The flat range ``[start, end)`` of a row-major tensor of ``shape`` as rectangular boxes:
    in flat order, each contiguous (ones, one partial dimension, then whole dimensions), at
    most ``2 * ndim - 1`` of them, covering exactly the range (a head of part of a row, whole
    rows, a tail, recursively)."""
    shape = tuple(int(d) for d in shape)
    if end <= start:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    first, last = start // inner, (end - 1) // inner
    if first == last:  # inside one row: that row's boxes, one dimension down
        return [((first,) + o, (1,) + z, first * inner + f)
                for o, z, f in flat_range_boxes(shape[1:], start - first * inner, end - first * inner)]
    boxes: List[Box] = []
    whole_from, whole_to = first, end // inner
    if start % inner:  # head: the end of row `first`
        boxes += [((first,) + o, (1,) + z, first * inner + f)
                  for o, z, f in flat_range_boxes(shape[1:], start % inner, inner)]
        whole_from = first + 1
    if whole_to > whole_from:
        boxes.append(((whole_from,) + (0,) * (len(shape) - 1), (whole_to - whole_from,) + shape[1:],
                      whole_from * inner))
    if end % inner:  # tail: the start of row `whole_to`
        boxes += [((whole_to,) + o, (1,) + z, whole_to * inner + f)
                  for o, z, f in flat_range_boxes(shape[1:], 0, end % inner)]
    return boxes


@dataclass(frozen=True)
class ShardedRange:
    """Which flat elements ``[start, end)`` of a full tensor of ``shape`` this rank's piece
    holds, and the block size its layout keeps whole: a view of a ragged tensor's placement on
    this rank (``RaggedDTensor.sharded_range``, derived, never stored), what the
    structure-aware optimizers read."""

    start: int
    end: int
    shape: Tuple[int, ...]
    granularity: int
