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

from bisect import bisect_right
from dataclasses import dataclass
import heapq
from itertools import accumulate
import math
from typing import Callable, List, Sequence, Tuple

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
    """The layout of one FSDP group's global buffer; rank ``k`` owns ``[k*S, (k+1)*S)``.

    ``offsets[i]`` is where ``specs[i]`` starts. They increase with ``i`` unless the plan
    was made with ``search_orders=True`` and another order won.
    """

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


# [Note: exact search]
# Lay the tensors end to end without padding (the *stream*, tensor j at [P_j, P_j+1)) and
# describe a layout by its *cuts*: c_k = the stream position that lands on rank boundary
# k*S. Padding sits only between tensors, so a cut is a tensor boundary or a block boundary
# x inside tensor j, allowed if S % g_j == 0 or the rest fits in one shard, P_j+1 - x <= S
# (else a second boundary would cut tensor j off its blocks). Shard k holds [c_k, c_k+1),
# at most S elements. So a layout exists iff the chain
#     c_0 = 0,   c_k+1 = the largest allowed cut <= c_k + S
# reaches the end of the stream within m shards; taking the largest cut is optimal because
# the step is monotone in c_k (an earlier end never hurts what follows). This is the greedy
# "each tensor at its earliest feasible offset" of `_place`, seen one boundary at a time.
#
# Feasibility is not monotone in S, but only because of "S % g_j == 0". Fix a unit U (a
# multiple of `align`) and allow whole-tensor cutting only to the tensors with g_j | U: that
# restricted feasibility *is* monotone in S (the allowed cuts only grow with S, and so does
# every step), and for S a multiple of U it implies true feasibility. Conversely the best S
# is feasible under U = lcm(align, {g_j : g_j | S}). So the smallest S is the smallest, over
# the units U built as LCMs of `align` and the block sizes, of the first multiple of U that
# is feasible under U: one check at the largest multiple below the best so far, then a
# galloping and binary search. The units are walked smallest first, pruned by:
#   * only tensors longer than the smallest possible S can span two boundaries, so only
#     their block sizes enter the units;
#   * a unit whose first multiple >= total/m is not below the best so far, nor its multiples;
#   * a tensor too long to cross only one boundary, e > S + g*floor(S/g), forces g | S (it
#     spans two); that set only grows as S shrinks, so every S below the best so far is a
#     multiple of the block sizes forced at best - 1, and each unit is lifted to them.


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


class _Stream:
    """The tensors laid end to end, without padding."""

    def __init__(self, numels: Sequence[int], grans: Sequence[int]) -> None:
        self.bounds = list(accumulate(numels, initial=0))
        self.numels, self.grans = list(numels), list(grans)
        self.total = self.bounds[-1]

    def reaches_end(self, shard: int, world_size: int, whole: Sequence[bool]) -> bool:
        """Whether the cut chain of [Note: exact search] ends within ``world_size`` shards;
        ``whole[j]``: tensor j may span several boundaries (its block size divides ``shard``)."""
        bounds, cut, used = self.bounds, 0, 0
        while used < world_size:
            reach = cut + shard
            if reach >= self.total:
                return True
            j = bisect_right(bounds, reach) - 1  # bounds[j] <= reach < bounds[j+1]: tensor j is not empty
            start, end, g = bounds[j], bounds[j + 1], self.grans[j]
            nxt = start + (reach - start) // g * g
            if not whole[j] and nxt < end - shard:
                nxt = start
            if nxt <= cut:
                return False
            used += 1
            if whole[j]:  # the next boundaries inside tensor j are block boundaries: skip them
                skip = (end - 1 - nxt) // shard
                nxt, used = nxt + skip * shard, used + skip
            cut = nxt
        return False


def _place(numels: Sequence[int], grans: Sequence[int], shard: int) -> List[int]:
    """Offsets of the greedy layout for ``shard``: each tensor at its earliest feasible offset
    (``shard`` must be feasible; see [Note: exact search])."""
    cur, offsets = 0, []
    for e, g in zip(numels, grans):
        for c in (cur, (cur // shard + 1) * shard):  # here, else from the next boundary on
            b = (c // shard + 1) * shard
            if c + e <= b:
                start = c
                break
            start = b - g * ((b - c) // g)  # cross b on a block boundary
            if shard % g == 0 or start + e <= b + shard:
                break
        offsets.append(start)
        cur = start + e
    return offsets


def _first_true(pred: Callable[[int], bool], first: int, last: int, unit: int) -> int:
    """The smallest ``s`` in ``first, first+unit, ..., last`` with ``pred(s)``, for a monotone
    ``pred`` with ``pred(last)``: gallop up from ``first`` (the answer is usually close), then bisect."""
    lo, hi, step = -1, (last - first) // unit, 1  # pred(first + lo*unit) false, pred(first + hi*unit) true
    while lo + step < hi:
        if pred(first + (lo + step) * unit):
            hi = lo + step
            break
        lo, step = lo + step, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pred(first + mid * unit):
            hi = mid
        else:
            lo = mid
    return first + hi * unit


def _release(e: int, g: int) -> int:
    """Smallest S with e <= S + g*floor(S/g), the most a tensor crossing one boundary can hold."""
    q = e // (2 * g)
    return e - q * g if e - 2 * q * g < g else (q + 1) * g


def _smallest_shard(stream: _Stream, world_size: int, align: int) -> int:
    """The smallest feasible shard size for the stream's order (see [Note: exact search])."""
    low = _round_up(max(1, -(-stream.total // world_size)), align)
    best = max(align, _round_up(stream.total, align))  # everything in shard 0: always feasible
    releases = [(_release(e, g), g) for e, g in zip(stream.numels, stream.grans) if e > low and align % g]
    spanning = sorted({g for _, g in releases})
    units, seen, tried = [align], {align}, set()
    while units:
        unit = math.lcm(heapq.heappop(units), *(g for r, g in releases if r >= best))  # forced below best
        first = _round_up(low, unit)
        if first >= best or unit in tried:
            continue  # nothing below best on its multiples, or already tried (and its multiples queued)
        tried.add(unit)
        whole = [unit % g == 0 for g in stream.grans]
        feasible = lambda s: stream.reaches_end(s, world_size, whole)  # noqa: E731
        last = (best - 1) // unit * unit
        if feasible(last):
            best = _first_true(feasible, first, last, unit)
        for g in spanning:
            bigger = math.lcm(unit, g)
            if bigger not in seen and _round_up(low, bigger) < best:
                seen.add(bigger)
                heapq.heappush(units, bigger)
    return best


def shard_lower_bound(specs: Sequence[TensorSpec], world_size: int, align: int = 1) -> int:
    """A shard size that no layout in *any* order can beat: the smallest S >= total/m (a
    multiple of ``align``) with S % g == 0 for every tensor too long to cross only one
    boundary (e > S + g*floor(S/g): it must span two, so S % g == 0). That set only
    shrinks as S grows, so the search steps to the next LCM multiple or release point."""
    total = sum(s.numel for s in specs)
    shard = _round_up(max(1, -(-total // world_size)), align)
    while True:
        forced = [(s.granularity, _release(s.numel, s.granularity)) for s in specs if shard < _release(s.numel, s.granularity)]
        unit = math.lcm(align, *(g for g, _ in forced))
        if shard % unit == 0:
            return shard
        shard = _round_up(min(_round_up(shard, unit), min(r for _, r in forced)), align)


def _alternative_orders(specs: Sequence[TensorSpec]) -> List[List[int]]:
    """A few deterministic orders besides the model's: by block size, by size, both directions."""
    idx = range(len(specs))
    keys = [lambda i: specs[i].granularity, lambda i: specs[i].numel]
    return [sorted(idx, key=k, reverse=r) for k in keys for r in (True, False)]


def plan(specs: Sequence[TensorSpec], world_size: int, align: int = 1, *, search_orders: bool = False) -> ShardPlan:
    """Plan one group: the smallest shard size for the given order (see module docstring).

    Args:
        specs: the tensors, in the order they are laid out (the model's order).
        world_size: ranks in the group (>= 1).
        align: the shard size is a multiple of this many elements (>= 1).
        search_orders: also try the orders of :func:`_alternative_orders` and keep the one
            with the smallest shard (ties: the given order). Offsets are still listed in the
            given order, but may then not increase.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    specs = tuple(specs)
    orders = [list(range(len(specs)))] + (_alternative_orders(specs) if search_orders else [])
    best_shard, best_order = None, orders[0]
    for order in orders:
        stream = _Stream([specs[i].numel for i in order], [specs[i].granularity for i in order])
        shard = _smallest_shard(stream, world_size, align)
        if best_shard is None or shard < best_shard:
            best_shard, best_order = shard, order
    placed = _place([specs[i].numel for i in best_order], [specs[i].granularity for i in best_order], best_shard)
    offsets = [0] * len(specs)
    for i, off in zip(best_order, placed):
        offsets[i] = off
    return ShardPlan(specs, world_size, best_shard, tuple(offsets), align)
