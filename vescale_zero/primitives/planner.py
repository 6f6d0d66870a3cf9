"""The structure-aware planner: pack one FSDP group into one flat, evenly sharded buffer.

Given tensors ``t`` with ``numel_t`` elements and atomic block size ``granularity_t``,
choose a start offset ``offset_t`` for each and a shard size ``S``::

    global buffer, world size m = 3, shard size S
    |<------ rank 0 ------>|<------ rank 1 ------>|<------ rank 2 ------>|
    [ tensor A    ][pad][ tensor B (blocks)  |  ... ][ C ][pad][ D      ][pad]
                                             ^ k*S falls on a block boundary of B

    minimise   S                        (padding = m*S - sum(numel_t))
    subject to tensors are contiguous, non-overlapping, inside [0, m*S), laid out in one
               order: the model's, or another one `plan` tries (see its `search_orders`)
               every rank boundary k*S strictly inside a tensor is one of its block
               boundaries: (k*S - offset_t) % granularity_t == 0
               S % align == 0
               offset_t % start_align == 0      (start_align divides align)

The shard size is the smallest feasible one for the order used (exact, see [Note: exact search]
and [Note: aligned starts]); `shard_lower_bound` is a bound no order can beat.

[Note: plan is a pure function]
The plan depends only on (numels, granularities, world size, align, start_align,
search_orders): it is deterministic and identical on every rank, so no rank ever
communicates to agree on it.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, List, Optional, Sequence, Tuple

from .placement import RaggedShard

__all__ = ["TensorSpec", "ShardPlan", "plan", "shard_lower_bound", "MODEL_ORDER", "SEARCH_ABOVE_BOUND",
           "OptimizerUnits", "StepTraffic", "StepBytes", "PlacementChoice", "optimizer_aware_plan", "unit_pieces",
           "PIECEWISE", "PLACED"]

MODEL_ORDER = "model"
# `plan(search_orders=None)` tries other orders when the model's pads more than this
# fraction of the global buffer above `shard_lower_bound`.
SEARCH_ABOVE_BOUND = 0.01


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

    ``offsets[i]`` is where ``specs[i]`` starts, a multiple of ``start_align``; ``S`` is a
    multiple of ``align``. ``order`` names the order the tensors are laid out in:
    ``"model"`` (the order of ``specs``: offsets never decrease with ``i``) or one of the orders
    ``plan`` tries besides, e.g. ``"granularity descending"`` (offsets then need not
    increase with ``i``; they are still listed per tensor, in the order of ``specs``).
    """

    specs: Tuple[TensorSpec, ...]
    world_size: int
    shard_size: int
    offsets: Tuple[int, ...]
    align: int = 1
    start_align: int = 1
    order: str = MODEL_ORDER

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
#
# [Note: aligned starts]
# Offsets must be multiples of a = start_align, and a | align | S, so every rank boundary is
# a multiple of a too. Round each tensor up to e' = round_up(e, a) and its block up to
# g' = lcm(g, a). For an aligned offset l the two problems agree:
#   * the boundaries strictly inside [l, l+e) and [l, l+e') are the same (no multiple of a
#     lies in [l+e, l+e') but l+e' itself), and [l, l+e) ends inside [0, m*S) iff [l, l+e') does;
#   * a boundary b inside is on a block boundary iff (b - l) % g' == 0 (b - l is a multiple
#     of a anyway), and g' | S iff g | S;
#   * the next tensor starts at round_up(l + e, a) = l + e' or later.
# So we plan the rounded tensors with the search above, unchanged: all their lengths and
# blocks, S and hence every rank boundary are multiples of a, so `_place` puts every tensor
# at a multiple of a (it starts at the cursor, a boundary, or a whole number of blocks
# g' before one), and since that greedy layout is optimal among *all* layouts of the
# rounded tensors, it is optimal among the aligned ones: the search stays exact. (A rounded
# tensor need not be whole blocks of g': its last block is short; nothing above assumes
# otherwise.) The bound of `shard_lower_bound` is taken over the rounded tensors as well:
# every aligned layout is one of them, in any order.


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


class _Stream:
    """The tensors laid end to end, without padding (rounded up to the start alignment by
    the caller, see [Note: aligned starts])."""

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


def _smallest_shard(stream: _Stream, world_size: int, align: int, below: Optional[int] = None) -> int:
    """The smallest feasible shard size for the stream's order (see [Note: exact search]);
    with ``below``: only shard sizes under it are searched, and ``below`` comes back if none is feasible."""
    low = _round_up(max(1, -(-stream.total // world_size)), align)
    best = max(align, _round_up(stream.total, align))  # everything in shard 0: always feasible
    if below is not None:
        best = min(best, below)
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

        def feasible(s: int, whole: List[bool] = whole) -> bool:
            return stream.reaches_end(s, world_size, whole)

        last = (best - 1) // unit * unit
        if feasible(last):
            best = _first_true(feasible, first, last, unit)
        for g in spanning:
            bigger = math.lcm(unit, g)
            if bigger not in seen and _round_up(low, bigger) < best:
                seen.add(bigger)
                heapq.heappush(units, bigger)
    return best


def _lower_bound(numels: Sequence[int], grans: Sequence[int], world_size: int, align: int) -> int:
    """`shard_lower_bound` of (already rounded) tensors."""
    releases = [(g, _release(e, g)) for e, g in zip(numels, grans)]
    shard = _round_up(max(1, -(-sum(numels) // world_size)), align)
    while True:
        forced = [(g, r) for g, r in releases if shard < r]
        unit = math.lcm(align, *(g for g, _ in forced))
        if shard % unit == 0:
            return shard
        shard = _round_up(min(_round_up(shard, unit), min(r for _, r in forced)), align)


def _check(world_size: int, align: int, start_align: Optional[int]) -> int:
    """Validate the sizes; the start alignment in effect (``None``: ``align``)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if align < 1:
        raise ValueError(f"align must be >= 1 (elements; 1: any shard size), got {align}")
    if start_align is None:
        return align
    if start_align < 1:
        raise ValueError(f"start_align must be >= 1 (elements; 1: tensors may start anywhere), got {start_align}")
    if align % start_align:
        raise ValueError(
            f"start_align={start_align} does not divide align={align}: rank shards start at multiples of align, "
            f"so a tensor starting aligned in the global buffer would not start aligned in its rank's shard. "
            f"Pass align={math.lcm(align, start_align)} (a multiple of both) or a start_align that divides {align}."
        )
    return start_align


def _rounded(specs: Sequence[TensorSpec], start_align: int) -> Tuple[List[int], List[int]]:
    """Numels and block sizes rounded up to the start alignment, see [Note: aligned starts]."""
    return ([_round_up(s.numel, start_align) for s in specs],
            [math.lcm(s.granularity, start_align) for s in specs])


def shard_lower_bound(
    specs: Sequence[TensorSpec], world_size: int, align: int = 1, *, start_align: Optional[int] = None
) -> int:
    """A shard size that no layout in *any* order can beat (``align``, ``start_align`` as in :func:`plan`).

    With each tensor rounded up to the start alignment (numel to a multiple of it, block to the
    LCM of both, see [Note: aligned starts]): the smallest S >= total/m (a multiple of
    ``align``) with S % g == 0 for every tensor too long to cross only one boundary
    (e > S + g*floor(S/g): it must span two, so S % g == 0). That set only shrinks as S
    grows, so the search steps to the next LCM multiple or release point.
    """
    start_align = _check(world_size, align, start_align)
    return _lower_bound(*_rounded(specs, start_align), world_size, align)


def _alternative_orders(specs: Sequence[TensorSpec]) -> List[Tuple[str, List[int]]]:
    """A few deterministic orders besides the model's, named: by block size, by size, both
    directions (a stable sort: ties keep the model's order)."""
    idx = range(len(specs))
    keys = (("granularity", lambda i: specs[i].granularity), ("numel", lambda i: specs[i].numel))
    return [(f"{name} {'descending' if rev else 'ascending'}", sorted(idx, key=key, reverse=rev))
            for name, key in keys for rev in (True, False)]


def plan(
    specs: Sequence[TensorSpec],
    world_size: int,
    align: int = 1,
    *,
    start_align: Optional[int] = None,
    search_orders: Optional[bool] = None,
) -> ShardPlan:
    """Plan one group: the smallest shard size for the order used (see module docstring).

    Alignment, in elements. ``S`` is a multiple of ``align``, every tensor starts at a multiple
    of ``start_align``, and ``start_align`` divides ``align``, so rank boundaries are aligned
    too: each rank's piece of a tensor starts aligned both in the global buffer and in the
    rank's own shard (at a rank boundary, or where the tensor starts)::

        align = 8, start_align = 4, m = 2: A (5 elements), B (12, blocks of 4), C (6)
        0       8       16      24      32
        AAAAA...BBBBBBBBBBBBCCCCCC......      S = 16: the first multiple of 8 that fits
        ^       ^       |   ^           |     ^ offsets 0, 8, 20: multiples of 4
        A ends at 5, so B starts at 8 (the next multiple of 4); B crosses the boundary
        at 16 after 8 elements, two whole blocks; rank 1 holds B's last block at local
        offset 0 and C at local offset 4.

    Args:
        specs: the tensors, in the model's order.
        world_size: ranks in the group (>= 1).
        align: the shard size is a multiple of this many elements (>= 1); ``fully_shard``
            passes 16 bytes over the smallest itemsize of the group's buffers.
        start_align: every tensor's offset is a multiple of this many elements; it must divide
            ``align``. ``None`` (default): ``align``, so with ``fully_shard``'s ``align`` every
            tensor and every rank's piece of it starts on 16 bytes. ``1``: tensors start anywhere.
        search_orders: also plan the orders of :func:`_alternative_orders` and keep the one
            with the smallest shard (ties: the earlier order, the model's first); ``None``
            (default): only when the model's order pads more than ``SEARCH_ABOVE_BOUND`` (1%)
            of the global buffer above :func:`shard_lower_bound`. ``ShardPlan.order`` says
            which order won. The search stops early once an order meets the bound.

    Raises:
        ValueError: ``world_size`` or ``align`` below 1, or a ``start_align`` that is below 1 or
            does not divide ``align``.
    """
    start_align = _check(world_size, align, start_align)
    specs = tuple(specs)
    numels, grans = _rounded(specs, start_align)
    shard = _smallest_shard(_Stream(numels, grans), world_size, align)
    name, order = MODEL_ORDER, list(range(len(specs)))
    if search_orders is not False:
        bound = _lower_bound(numels, grans, world_size, align)
        if search_orders is None:
            search_orders = shard - bound > SEARCH_ABOVE_BOUND * shard  # of the global buffer: m*(S - bound) / (m*S)
        for alt_name, alt in _alternative_orders(specs) if search_orders else ():
            if shard == bound:
                break  # no order does better
            alt_shard = _smallest_shard(_Stream([numels[i] for i in alt], [grans[i] for i in alt]), world_size, align,
                                        below=shard)
            if alt_shard < shard:
                shard, name, order = alt_shard, alt_name, alt
    placed = _place([numels[i] for i in order], [grans[i] for i in order], shard)
    offsets = [0] * len(specs)
    for i, off in zip(order, placed):
        offsets[i] = off
    return ShardPlan(specs, world_size, shard, tuple(offsets), align, start_align, name)


# ---- the optimizer-aware plan ------------------------------------------------------------

@dataclass(frozen=True)
class OptimizerUnits:
    """A tensor's optimizer units: consecutive runs of ``size`` elements that a matrix optimizer
    computes on whole (a Muon matrix: the whole tensor; one head's or one expert's rows; a
    Shampoo tile band), each costing ``cost`` on the rank that computes it (Muon: ``m*n*min(m, n)``,
    proportional to its Newton-Schulz FLOPs)."""

    size: int
    cost: float = 0.0


@dataclass(frozen=True)
class StepTraffic:
    """What one group moves in one training step, for :func:`optimizer_aware_plan`'s cost model.

    ``gathers`` all-gathers of ``gather_itemsize``-byte elements (2 with ``reshard_after_forward``:
    forward and backward, 1 without; times the micro-batches), ``reduce_scatters`` of
    ``reduce_itemsize``-byte elements, each followed by an all-reduce of the shard across
    ``replicas`` (HSDP); the optimizer moves a unit that is not whole on one rank ``unit_moves``
    times (Muon: to its root and back) in ``unit_itemsize``-byte elements (fp32 momentum: 4)."""

    gather_itemsize: int
    reduce_itemsize: int
    gathers: int = 2
    reduce_scatters: int = 1
    replicas: int = 1
    unit_itemsize: int = 4
    unit_moves: int = 2

    def __post_init__(self) -> None:
        for name in ("gather_itemsize", "reduce_itemsize", "unit_itemsize", "replicas"):
            if getattr(self, name) < 1:
                raise ValueError(f"StepTraffic.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("gathers", "reduce_scatters", "unit_moves"):
            if getattr(self, name) < 0:
                raise ValueError(f"StepTraffic.{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class StepBytes:
    """[Note: bytes per rank per step] The bytes one rank receives in one training step, by
    collective: what crosses its link, the same whichever algorithm the backend runs (ring,
    tree, pairwise). An all-gather or a reduce-scatter of a buffer of ``m*S`` elements brings
    ``(m-1)*S`` into each rank; an all-reduce of the shard across ``r`` replicas ``2*(r-1)/r*S``;
    the optimizer's moves bring in what other ranks send it. Each rank sends as much as it
    receives in all of them (a rank's pieces travel to their roots and come back; its roots'
    pieces come in and go back), so the figure is also what it sends. ``optimizer`` is the mean
    over the ranks (the roots receive more than others)."""

    all_gather: int
    reduce_scatter: int
    replicas: int
    optimizer: float

    @property
    def total(self) -> float:
        return self.all_gather + self.reduce_scatter + self.replicas + self.optimizer


@dataclass(frozen=True)
class PlacementChoice:
    """What :func:`optimizer_aware_plan` chose for one group, and why.

    ``plan`` is the layout, made by :func:`plan` from ``granularities`` (shard with them and the
    same plan comes back: [Note: plan is a pure function]); ``choice`` names it: ``"piecewise"``
    (the granularities asked for), ``"placed"`` (every optimizer unit whole on one rank) or
    ``"placed up to N elements"`` (the units of at most N elements whole, larger ones in
    pieces); ``whole[i]``: every unit of tensor ``i`` lies on one rank under ``plan`` (by design
    or because no rank boundary happens to cut it; ``None`` for a tensor without units);
    ``step_bytes`` per rank per step under ``plan`` and ``piecewise_bytes`` under the piecewise
    plan ([Note: bytes per rank per step]); ``unit_cost`` per rank: the cost of the units each
    rank computes, a split unit counted on the rank that holds its largest piece."""

    plan: ShardPlan
    granularities: Tuple[int, ...]
    choice: str
    whole: Tuple[Optional[bool], ...]
    step_bytes: StepBytes
    piecewise_bytes: StepBytes
    unit_cost: Tuple[float, ...]


PIECEWISE = "piecewise"
PLACED = "placed"


def unit_pieces(plan_: ShardPlan, index: int, unit: int) -> List[List[Tuple[int, int]]]:
    """For each unit of ``unit`` elements of tensor ``index``: its ``(rank, elements)`` pieces, in rank order."""
    spec, off, shard = plan_.specs[index], plan_.offsets[index], plan_.shard_size
    out = []
    for start in range(off, off + spec.numel, unit):
        end, pieces, at = start + unit, [], start
        while at < end:
            rank = at // shard
            stop = min(end, (rank + 1) * shard)
            pieces.append((rank, stop - at))
            at = stop
        out.append(pieces)
    return out


def _check_units(specs: Sequence[TensorSpec], units: Sequence[Optional[OptimizerUnits]]) -> None:
    if len(units) != len(specs):
        raise ValueError(f"optimizer_aware_plan: {len(units)} unit entries for {len(specs)} tensors; give one per "
                         "tensor (None for a tensor the optimizer does not compute on in units)")
    for spec, unit in zip(specs, units):
        if unit is not None and (unit.size < 1 or spec.numel % unit.size):
            raise ValueError(f"optimizer unit of {unit.size} elements for tensor {spec.name!r} of {spec.numel} "
                             f"elements: a unit must be >= 1 element and divide the tensor; use a divisor of "
                             f"{spec.numel} (the whole tensor: {spec.numel})")


def _evaluate(plan_: ShardPlan, units: Sequence[Optional[OptimizerUnits]], traffic: StepTraffic):
    """``(StepBytes, whole per tensor, unit cost per rank)`` of ``plan_``."""
    m, s = plan_.world_size, plan_.shard_size
    moved, whole, cost = 0, [], [0.0] * m
    for i, unit in enumerate(units):
        if unit is None:
            whole.append(None)
            continue
        one_rank = True
        for pieces in unit_pieces(plan_, i, unit.size):
            rank, most = max(pieces, key=lambda rp: (rp[1], -rp[0]))
            moved += unit.size - most
            cost[rank] += unit.cost
            one_rank = one_rank and len(pieces) == 1
        whole.append(one_rank)
    r = traffic.replicas
    step = StepBytes(
        all_gather=traffic.gathers * (m - 1) * s * traffic.gather_itemsize,
        reduce_scatter=traffic.reduce_scatters * (m - 1) * s * traffic.reduce_itemsize,
        replicas=traffic.reduce_scatters * (2 * (r - 1) * s * traffic.reduce_itemsize) // r,
        optimizer=traffic.unit_moves * moved * traffic.unit_itemsize / m,
    )
    return step, tuple(whole), tuple(cost)


def optimizer_aware_plan(
    specs: Sequence[TensorSpec],
    units: Sequence[Optional[OptimizerUnits]],
    world_size: int,
    traffic: StepTraffic,
    align: int = 1,
    *,
    max_candidates: int = 8,
    force: Optional[str] = None,
) -> PlacementChoice:
    """The plan of one group that moves the fewest bytes per rank per step, counting the
    optimizer's moves: today's piecewise plan, or one that keeps optimizer units whole on one rank.

    [Note: placing units against padding]
    A matrix optimizer (Muon) needs each unit whole on one rank. A unit the plan cuts travels
    to one rank and back every step (``unit_moves`` times its bytes less the piece already
    there); a unit the plan keeps whole on one rank travels nowhere. Keeping it whole is a
    granularity of one unit, which costs padding, and padding is paid by every all-gather and
    reduce-scatter of every step ([Note: bytes per rank per step]). The candidates: the
    piecewise plan (the granularities of ``specs``), and for each distinct unit size ``t`` (the
    ``max_candidates`` largest; the largest is "every unit whole") the plan whose units of at
    most ``t`` elements are blocks (a unit longer than the piecewise shard can only be whole
    by making the shard as long). Each costs the bytes each rank receives per step; the least
    wins, the earlier (fewer units placed) on a tie. Placing pays where a group has many units
    and few ranks (little padding); at large shard groups the piecewise plan wins and nothing
    changes. The units' cost (Newton-Schulz FLOPs) is reported per rank, not traded against
    bytes: a unit on one rank must be computed there.

    Every candidate is :func:`plan` of the same specs with other granularities, ``align`` as
    given: the choice is a pure function too ([Note: plan is a pure function]). ``force``:
    ``"piecewise"`` or ``"placed"`` (every unit whole) returns that plan, scored, whatever it costs.
    """
    specs = tuple(specs)
    _check_units(specs, units)
    if max_candidates < 1:
        raise ValueError(f"optimizer_aware_plan: max_candidates must be >= 1, got {max_candidates}")
    if force not in (None, PIECEWISE, PLACED):
        raise ValueError(f"optimizer_aware_plan: force must be None, {PIECEWISE!r} or {PLACED!r}, got {force!r}")
    grans = tuple(s.granularity for s in specs)
    piecewise = plan(specs, world_size, align)
    base = _evaluate(piecewise, units, traffic)
    best = (base[0].total, PIECEWISE, grans, piecewise, base)
    if force is not None:
        best = (math.inf,) + best[1:] if force == PLACED else (-math.inf,) + best[1:]
        max_candidates = 1 if force == PLACED else 0
    sizes = sorted({u.size for u in units if u is not None})
    tried = {grans}

    def consider(name: str, placed: Tuple[int, ...]) -> Tuple[bool, ...]:
        """Score the plan of granularities ``placed``; its ``whole`` flags."""
        nonlocal best
        candidate = plan([TensorSpec(s.numel, g, s.name) for s, g in zip(specs, placed)], world_size, align)
        scored = _evaluate(candidate, units, traffic)
        tried.add(placed)
        if scored[0].total < best[0]:
            best = (scored[0].total, name, placed, candidate, scored)
        return scored[1]

    if world_size > 1 and sizes and max_candidates:
        for t in sizes[-max_candidates:]:
            placed = tuple(math.lcm(g, u.size) if u is not None and u.size <= t else g for g, u in zip(grans, units))
            if placed not in tried:
                consider(PLACED if t == sizes[-1] else f"{PLACED} up to {t:,} elements", placed)
        # the units the piecewise plan cuts, made whole; then those the new plan cuts, and so on
        placed, whole = grans, base[1]
        for _ in range(max_candidates if force is None else 0):
            cut = [u is not None and not w for u, w in zip(units, whole)]
            if not any(cut):
                break
            placed = tuple(math.lcm(g, u.size) if c else g for g, u, c in zip(placed, units, cut))
            if placed in tried:
                break
            n = sum(g != g0 for g, g0 in zip(placed, grans))
            whole = consider(f"{PLACED} where cut ({n} tensor{'s' if n != 1 else ''})", placed)
    _, name, chosen, chosen_plan, (step, whole, cost) = best
    return PlacementChoice(chosen_plan, chosen, name, whole, step, base[0], cost)
