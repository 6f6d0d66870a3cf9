"""The structure-aware planner: pack one FSDP group into one flat, evenly sharded buffer.

Given tensors ``t`` (in the order given) with ``numel_t`` elements and atomic block size
``granularity_t``, choose a start offset ``offset_t`` for each and a shard size ``S``::

    global buffer, world size m = 3, shard size S
    |<------ rank 0 ------>|<------ rank 1 ------>|<------ rank 2 ------>|
    [ tensor A    ][pad][ tensor B (blocks)  |  ... ][ C ][pad][ D      ][pad]
                                             ^ k*S falls on a block boundary of B

    minimise   S                        (padding = m*S - sum(numel_t))
    subject to tensors are contiguous, in order, non-overlapping, inside [0, m*S)
               every rank boundary k*S strictly inside a tensor is one of its block
               boundaries: (k*S - offset_t) % granularity_t == 0
               S % align == 0

[Note: plan is a pure function]
The plan depends only on (numels, granularities, world size, align): it is
deterministic and identical on every rank, so no rank ever communicates to agree on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

from .placement import RaggedShard

__all__ = ["TensorSpec", "ShardPlan", "plan"]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to place: its element count and atomic block size (elements)."""

    numel: int
    granularity: int = 1
    name: str = ""

    def __post_init__(self) -> None:
        label = f"tensor {self.name!r}" if self.name else "tensor"
        if self.numel < 0:
            raise ValueError(f"{label}: numel must be >= 0, got {self.numel}")
        if self.granularity < 1:
            raise ValueError(f"{label}: granularity must be >= 1, got {self.granularity}")
        if self.numel % self.granularity:
            raise ValueError(
                f"{label}: granularity {self.granularity} does not divide numel {self.numel}; "
                f"a block would be split. Choose a divisor of {self.numel}."
            )


@dataclass(frozen=True)
class ShardPlan:
    """The layout of one FSDP group's global buffer; rank ``k`` owns ``[k*S, (k+1)*S)``."""

    specs: Tuple[TensorSpec, ...]
    world_size: int
    shard_size: int
    offsets: Tuple[int, ...]
    align: int = 1

    @property
    def global_size(self) -> int:
        return self.world_size * self.shard_size

    @property
    def padding(self) -> int:
        return self.global_size - sum(s.numel for s in self.specs)

    @property
    def padding_ratio(self) -> float:
        """Padding as a fraction of the global buffer."""
        return self.padding / self.global_size if self.global_size else 0.0

    def rank_range(self, rank: int) -> Tuple[int, int]:
        """``[start, end)`` of ``rank``'s shard in the global buffer."""
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def local_slices(self, rank: int) -> List[Tuple[int, int, int]]:
        """For each tensor: ``(tensor_start, tensor_end, shard_offset)``.

        ``rank`` owns flat elements ``[tensor_start, tensor_end)`` of the tensor, stored
        at ``shard_offset`` inside its shard. Empty ranges are ``(0, 0, 0)``-like with
        ``tensor_start == tensor_end``.
        """
        lo, hi = self.rank_range(rank)
        out = []
        for spec, off in zip(self.specs, self.offsets):
            start = min(max(lo, off), off + spec.numel)
            end = max(min(hi, off + spec.numel), start)
            out.append((start - off, end - off, start - lo if end > start else 0))
        return out

    def placement(self, index: int) -> RaggedShard:
        """The RaggedShard of tensor ``index`` under this plan."""
        spec, off = self.specs[index], self.offsets[index]
        g = spec.granularity
        blocks = []
        for rank in range(self.world_size):
            lo, hi = self.rank_range(rank)
            start = min(max(lo, off), off + spec.numel)
            end = max(min(hi, off + spec.numel), start)
            blocks.append((end - start) // g)
        return RaggedShard(g, tuple(blocks))


def plan(specs: Sequence[TensorSpec], world_size: int, align: int = 1) -> ShardPlan:
    """Plan one group: the smallest shard size for the given order (see module docstring)."""
    raise NotImplementedError  # implemented by the planner work
