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
import math
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .placement import RaggedShard

__all__ = ["TensorSpec", "ShardPlan", "plan", "shard_lower_bound"]


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
    exact: bool = True
    """``True`` when ``shard_size`` is proven the smallest feasible one for this order."""

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


# [Note: exact search]
# For a fixed order and shard size S, placing each tensor at its earliest feasible offset
# is optimal: an earlier end never hurts what follows, since padding may be inserted.
# From cursor c, with b the first boundary after c, a tensor (e elements, blocks of g):
#   fits before b                       -> at c
#   else crosses b on a block boundary  -> at l = b - g*floor((b-c)/g); fine if S % g == 0
#                                          (then every later boundary is aligned too) or
#                                          if it ends by the next boundary, l + e <= b + S
#   else starts a fresh shard at b      -> the same two tests from c = b; a third shard is
#                                          the same situation shifted by S, so no help.
# Feasibility is not monotone in S, so the smallest S is found by scanning candidates in
# increasing order, but never one by one: a tensor longer than S + g*floor(S/g) must cross
# two boundaries and so *forces* S % g == 0. The forced set only shrinks as S grows, so
# between two thresholds it is constant and only multiples of L = lcm(align, forced g) can
# be feasible; those are tested with the greedy, a few in scalar Python and then in
# growing numpy batches. Every skipped S provably violates a forced constraint.


def _place(numels: Sequence[int], grans: Sequence[int], shard: int) -> Optional[List[int]]:
    """Greedy offsets for shard size ``shard``; ``None`` if some tensor cannot be placed."""
    cur, offsets = 0, []
    for e, g in zip(numels, grans):
        placed = None
        for c in (cur, (cur // shard + 1) * shard):
            b = (c // shard + 1) * shard
            if c + e <= b:
                placed = c
                break
            start = b - g * ((b - c) // g)
            if shard % g == 0 or start + e <= b + shard:
                placed = start
                break
        if placed is None:
            return None
        offsets.append(placed)
        cur = placed + e
    return offsets


def _feasible_batch(numels: Sequence[int], grans: Sequence[int], shards: np.ndarray, world_size: int) -> np.ndarray:
    """The greedy of :func:`_place` for many shard sizes at once: which are feasible."""
    cur = np.zeros_like(shards)
    ok = np.ones(shards.shape, dtype=bool)
    for e, g in zip(numels, grans):
        if e == 0:
            continue
        b = (cur // shards + 1) * shards
        fits = cur + e <= b
        aligned = shards % g == 0
        start = b - g * ((b - cur) // g)
        cross = aligned | (start + e <= b + shards)
        fresh_start = b + shards - g * (shards // g)
        fresh_fits = e <= shards
        fresh_cross = aligned | (fresh_start + e <= b + 2 * shards)
        place = np.where(fits, cur, np.where(cross, start, np.where(fresh_fits, b, fresh_start)))
        ok &= fits | cross | fresh_fits | fresh_cross
        cur = place + e
    return ok & (cur <= world_size * shards)


def _release_threshold(e: int, g: int) -> int:
    """Smallest S with S + g*floor(S/g) >= e: from there on (e, g) forces nothing."""
    lo, hi = 1, max(1, e)
    while lo < hi:
        mid = (lo + hi) // 2
        if mid + g * (mid // g) >= e:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def _forced_regions(numels: Sequence[int], grans: Sequence[int], world_size: int, align: int):
    """Yield ``(first, last, unit)``: in increasing order, the ranges of S where the forced
    set is constant, each with its first admissible S and the step between admissible ones."""
    total = sum(numels)
    upper = max(align, _round_up(total, align))  # everything in shard 0: always feasible
    pairs = sorted({(e, g) for e, g in zip(numels, grans) if e > 0 and g > 1})
    thresholds = {pair: _release_threshold(*pair) for pair in pairs}
    shard = max(align, _round_up(-(-total // world_size), align))
    while shard <= upper:
        forced = [pair for pair in pairs if shard < thresholds[pair]]
        unit = align
        for _, g in forced:
            unit = math.lcm(unit, g)
        release = min((thresholds[p] for p in forced), default=upper + 1)
        first = _round_up(shard, unit)
        if first < release:
            last = min(release - 1, upper)
            if first <= last:
                yield first, last, unit
        shard = _round_up(max(release, shard + 1), align)


def shard_lower_bound(specs: Sequence[TensorSpec], world_size: int, align: int = 1) -> int:
    """A shard size no layout in *any* order can beat: the smallest S >= total/m (multiple of
    ``align``) that meets every forced constraint (see [Note: exact search])."""
    numels, grans = [s.numel for s in specs], [s.granularity for s in specs]
    return next(_forced_regions(numels, grans, world_size, align), (max(align, _round_up(sum(numels), align)),))[0]


_EXACT_BUDGET = 1 << 14  # greedy evaluations of candidate shard sizes before the fallback


def _smallest_shard(numels: Sequence[int], grans: Sequence[int], world_size: int, align: int) -> Tuple[int, bool]:
    """``(S, exact)``: the smallest feasible S, or the fallback's S if the budget ran out."""
    spent = 0
    for first, last, unit in _forced_regions(numels, grans, world_size, align):
        candidates = range(first, last + 1, unit)
        for s in candidates[:4]:
            if _end_if_feasible(numels, grans, s) <= world_size * s:
                return s, True
        spent += min(4, len(candidates))
        batch, start = 64, 4
        while start < len(candidates):
            if spent >= _EXACT_BUDGET:
                return _lcm_chain_search(numels, grans, world_size, align, first), False
            chunk = np.arange(candidates[start], candidates[min(start + batch, len(candidates)) - 1] + 1, unit, dtype=np.int64)
            ok = _feasible_batch(numels, grans, chunk, world_size)
            if ok.any():
                return int(chunk[int(np.argmax(ok))]), True
            spent += len(chunk)
            start += batch
            batch = min(batch * 4, 1 << 12)
    return max(align, _round_up(sum(numels), align)), True


def _lcm_chain_search(numels: Sequence[int], grans: Sequence[int], world_size: int, align: int, low: int) -> int:
    """The original work's heuristic, for when the exact scan is too long: for each step G in
    the running LCM of the sorted block sizes (from ``align``), binary-search the smallest
    feasible multiple of G (assuming feasibility is monotone along multiples of G); best S."""
    upper = max(align, _round_up(sum(numels), align))
    feasible = lambda s: _end_if_feasible(numels, grans, s) <= world_size * s  # noqa: E731
    best, step = upper, align
    for g in [align] + sorted(set(grans)):
        step = math.lcm(step, g)
        if step > best:
            break
        lo, hi = -(-low // step), best // step
        if hi < lo or not feasible(hi * step):
            continue
        while lo < hi:
            mid = (lo + hi) // 2
            if feasible(mid * step):
                hi = mid
            else:
                lo = mid + 1
        best = min(best, lo * step)
    return best


def _end_if_feasible(numels: Sequence[int], grans: Sequence[int], shard: int) -> float:
    """Where the greedy layout ends for ``shard``, or infinity if it cannot be placed."""
    offsets = _place(numels, grans, shard)
    if offsets is None:
        return math.inf
    return offsets[-1] + numels[-1] if offsets else 0


def plan(specs: Sequence[TensorSpec], world_size: int, align: int = 1) -> ShardPlan:
    """Plan one group: the smallest shard size for the given order (see module docstring).

    Args:
        specs: the tensors, in the order they are laid out (the model's order).
        world_size: ranks in the group (>= 1).
        align: the shard size is a multiple of this many elements (>= 1).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    specs = tuple(specs)
    numels = [s.numel for s in specs]
    grans = [s.granularity for s in specs]
    shard, exact = _smallest_shard(numels, grans, world_size, align) if specs else (align, True)
    offsets = _place(numels, grans, shard) or []
    return ShardPlan(specs, world_size, shard, tuple(offsets), align, exact)
