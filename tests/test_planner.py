"""The planner: every constraint of the formal problem, exactness, and quality on real models."""

from __future__ import annotations

import functools
import itertools
import time
from typing import Optional, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vescale_zero.primitives.planner import (
    MODEL_ORDER,
    SEARCH_ABOVE_BOUND,
    ShardPlan,
    TensorSpec,
    _alternative_orders,
    plan,
    shard_lower_bound,
)
from vescale_zero.tools.model_shapes import (
    MODEL_NAMES,
    fsdp2_padding,
    granularity,
    group_specs,
    layer_groups,
    zero3_padding,
)


def assert_valid(p: ShardPlan) -> None:
    """Every constraint of the formal problem (system.md, part 2), in any order of the tensors."""
    m, S, a = p.world_size, p.shard_size, p.start_align
    assert S >= 1 and S % p.align == 0 and p.align % a == 0
    end = 0
    for i in sorted(range(len(p.specs)), key=lambda i: (p.offsets[i], p.specs[i].numel)):
        spec, off = p.specs[i], p.offsets[i]
        assert off % a == 0, f"{spec} starts at {off}, not a multiple of start_align {a}"
        assert off >= end, "tensors must not overlap"
        end = off + spec.numel
        for k in range(off // S + 1, (end - 1) // S + 1):  # the boundaries strictly inside
            assert (k * S - off) % spec.granularity == 0, f"rank boundary {k * S} splits a block of {spec}"
    assert end <= m * S
    assert p.padding == m * S - sum(s.numel for s in p.specs)
    for i, spec in enumerate(p.specs):  # the placement agrees with the per-rank slices
        placement = p.placement(i)
        assert placement.world_size == m and placement.numel == spec.numel
        touched = range(p.offsets[i] // S, min(m, (p.offsets[i] + spec.numel) // S + 1))
        for rank in {0, m - 1, *touched}:
            start, stop, at = p.local_slices(rank)[i]
            assert placement.local_range(rank) == (start, stop)
            if stop > start:
                assert rank * S + at == p.offsets[i] + start
                assert at % a == 0 and start % a == 0, "each rank's piece starts aligned, in its shard and its tensor"
    # the tensors lie in the order the plan names (empty ones sit anywhere between)
    order = list(range(len(p.specs))) if p.order == MODEL_ORDER else dict(_alternative_orders(p.specs))[p.order]
    laid = [i for i in order if p.specs[i].numel]
    assert [p.offsets[i] for i in laid] == sorted(p.offsets[i] for i in laid), f"not laid out in {p.order!r} order"


def _blocks(g: int, blocks: int) -> TensorSpec:
    return TensorSpec(g * blocks, g)


def _whole(numel: int) -> TensorSpec:
    return TensorSpec(numel, max(numel, 1))


def _alignments(aligns: Sequence[int]):
    """(align, start_align): start_align is None (= align) or a divisor of align."""
    return st.sampled_from(aligns).flatmap(
        lambda a: st.tuples(st.just(a), st.sampled_from([None] + [d for d in range(1, a + 1) if a % d == 0])))


specs_strategy = st.lists(
    st.one_of(
        st.builds(_blocks, st.one_of(st.integers(1, 9), st.sampled_from([2, 7, 13, 64, 97, 128, 4096])),
                  st.integers(0, 40)),
        st.builds(_whole, st.integers(0, 5000)),  # the whole tensor is one block
    ),
    min_size=1,
    max_size=12,
)
world_sizes = st.one_of(st.integers(1, 40), st.sampled_from([64, 96, 1000, 4096, 10007, 16384]), st.integers(1, 16384))
alignments = _alignments([1, 2, 8, 16, 128])


@settings(max_examples=300, deadline=None)
@given(specs_strategy, world_sizes, alignments)
def test_every_constraint_holds(specs, world_size, alignment):
    align, start_align = alignment
    p = plan(specs, world_size, align, start_align=start_align, search_orders=False)
    assert_valid(p)
    assert p.start_align == (align if start_align is None else start_align)
    assert p.order == MODEL_ORDER and list(p.offsets) == sorted(p.offsets), "the given order is kept"
    assert plan(specs, world_size, align, start_align=start_align, search_orders=False) == p  # a pure function


@settings(max_examples=150, deadline=None)
@given(specs_strategy, world_sizes, alignments)
def test_orders_are_searched_when_the_model_order_pads_1pct_above_the_bound(specs, world_size, alignment):
    align, start_align = alignment
    model, searched, auto = (plan(specs, world_size, align, start_align=start_align, search_orders=s)
                             for s in (False, True, None))
    assert_valid(searched)  # the plan is one of `searched`, `model`, below
    bound = shard_lower_bound(specs, world_size, align, start_align=start_align)
    assert bound <= searched.shard_size <= model.shard_size
    if searched.order != MODEL_ORDER:
        assert searched.shard_size < model.shard_size, "another order only where it pads less"
    above = (model.shard_size - bound) / model.shard_size  # of the global buffer: m*(S - bound) / (m*S)
    assert auto == (searched if above > SEARCH_ABOVE_BOUND else model)
    assert plan(specs, world_size, align, start_align=start_align) == auto


def test_the_docstring_example_and_an_unaligned_start_of_old():
    a, b, c = TensorSpec(5, 1, "A"), TensorSpec(12, 4, "B"), TensorSpec(6, 1, "C")
    p = plan([a, b, c], 2, 8, start_align=4)
    assert (p.shard_size, p.offsets) == (16, (0, 8, 20))
    assert p.local_slices(1) == [(5, 5, 0), (8, 12, 0), (0, 6, 4)]
    # a 4097-element bias first: it used to push every later tensor off 16 bytes
    specs = [TensorSpec(4097, 1, "bias"), TensorSpec(4096 * 4096, 1, "w"), TensorSpec(4096, 4096, "norm")]
    assert plan(specs, 8, 8, start_align=1).offsets == (0, 4097, 16781313)
    p = plan(specs, 8, 8)  # fully_shard's align for bf16: tensors now start on 16 bytes by default
    assert p.offsets == (0, 4104, 16781320) and p.start_align == 8
    assert_valid(p)


# ---- exactness --------------------------------------------------------------------------


def _round_up(x: int, a: int) -> int:
    return -(-x // a) * a


def _splits_no_block(off: int, e: int, g: int, S: int) -> bool:
    return all((k * S - off) % g == 0 for k in range(off // S + 1, (off + e - 1) // S + 1))


def _fits_by_enumeration(specs: Sequence[TensorSpec], m: int, S: int, a: int) -> bool:
    """Whether any layout fits, trying every aligned offset of every tensor (no greedy argument)."""

    @functools.lru_cache(maxsize=None)
    def place(i: int, cursor: int) -> bool:
        if i == len(specs):
            return True
        e, g = specs[i].numel, specs[i].granularity
        return any(_splits_no_block(off, e, g, S) and place(i + 1, off + e)
                   for off in range(_round_up(cursor, a), m * S - e + 1, a))

    return place(0, 0)


def _first_fit_end(specs: Sequence[TensorSpec], m: int, S: int, a: int) -> Optional[int]:
    """Each tensor at the first aligned offset that splits no block, found by trying them one
    by one; where the last one ends, or None if some tensor fits nowhere inside ``[0, m*S)``."""
    cursor = 0
    for spec in specs:
        cursor = next((off + spec.numel for off in range(_round_up(cursor, a), m * S - spec.numel + 1, a)
                       if _splits_no_block(off, spec.numel, spec.granularity, S)), None)
        if cursor is None:
            return None
    return cursor


def _smallest_by_scan(specs: Sequence[TensorSpec], m: int, align: int, fits) -> int:
    total = sum(s.numel for s in specs)
    first = -(-max(1, -(-total // m)) // align) * align
    return next(S for S in itertools.count(first, align) if fits(specs, m, S))


tiny_specs = st.lists(st.one_of(st.builds(_blocks, st.integers(1, 4), st.integers(0, 4)),
                                st.builds(_whole, st.integers(0, 6))),
                      min_size=1, max_size=4)
tiny_alignments = st.sampled_from([(1, 1), (2, 1), (2, 2), (3, 3), (4, 1), (4, 2), (4, 4), (6, 2), (6, 3), (6, 6)])


@settings(max_examples=300, deadline=None)
@given(tiny_specs, st.integers(1, 5), tiny_alignments)
def test_shard_size_is_the_smallest_by_enumeration(specs, world_size, alignment):
    """Exhaustive scan over shard sizes, each checked over every combination of aligned offsets."""
    align, start_align = alignment
    fits = lambda sp, m, S: _fits_by_enumeration(sp, m, S, start_align)  # noqa: E731
    p = plan(specs, world_size, align, start_align=start_align, search_orders=False)
    assert p.shard_size == _smallest_by_scan(specs, world_size, align, fits)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.one_of(st.builds(_blocks, st.sampled_from([1, 2, 3, 5, 7, 8, 12, 16]), st.integers(0, 12)),
                       st.builds(_whole, st.integers(0, 60))), min_size=1, max_size=8),
    st.one_of(st.integers(1, 16), st.sampled_from([24, 37, 64])),
    _alignments([1, 2, 3, 4, 8, 12, 16, 128]),
)
def test_shard_size_is_the_smallest_by_scan(specs, world_size, alignment):
    """Larger cases: every shard size in turn, each checked by a one-offset-at-a-time first fit
    (itself checked against full enumeration above)."""
    align, start_align = alignment
    a = align if start_align is None else start_align
    fits = lambda sp, m, S: _first_fit_end(sp, m, S, a) is not None  # noqa: E731
    p = plan(specs, world_size, align, start_align=start_align, search_orders=False)
    assert p.shard_size == _smallest_by_scan(specs, world_size, align, fits)


@settings(max_examples=150, deadline=None)
@given(tiny_specs, st.integers(1, 4), tiny_alignments)
def test_lower_bound_holds_for_every_order(specs, world_size, alignment):
    """The bound never exceeds the optimum over all orders (each exact, as proven above)."""
    align, start_align = alignment
    kept = {"start_align": start_align, "search_orders": False}
    best = min(plan([specs[i] for i in order], world_size, align, **kept).shard_size
               for order in itertools.permutations(range(len(specs))))
    bound = shard_lower_bound(specs, world_size, align, start_align=start_align)
    assert bound <= best <= plan(specs, world_size, align, start_align=start_align, search_orders=True).shard_size


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="does not divide numel 10"):
        TensorSpec(10, 4, "w")
    with pytest.raises(ValueError, match="world_size"):
        plan([TensorSpec(4)], 0)
    with pytest.raises(ValueError, match="align must be >= 1"):
        plan([TensorSpec(4)], 2, align=0)
    with pytest.raises(ValueError, match="start_align must be >= 1"):
        plan([TensorSpec(4)], 2, align=8, start_align=0)
    with pytest.raises(ValueError, match=r"start_align=4 does not divide align=6.*Pass align=12"):
        plan([TensorSpec(4)], 2, align=6, start_align=4)
    with pytest.raises(ValueError, match="start_align=16 does not divide align=8"):
        shard_lower_bound([TensorSpec(4)], 2, align=8, start_align=16)


def test_granularity_presets():
    assert granularity((576, 7168), "element") == 1
    assert granularity((576, 7168), "row") == 7168
    assert granularity((576, 7168), "128rows") == 96 * 7168  # 128 rows do not divide 576: 96 do
    assert granularity((7168,), "row") == 1 and granularity((7168,), "16rows") == 16


# ---- quality on real models ---------------------------------------------------------------
# At align = start_align = 1, the problem itself, comparable with FSDP2's and ZeRO-3's padding
# (neither aligns starts); `test_aligned_starts_cost_nothing_on_real_models` shows the layouts
# at fully_shard's 16-byte alignment pad the same (S rounded to the alignment aside).

FSDP_SIZES = [2**k for k in range(3, 15)] + [6, 24, 96, 1000, 10000]
CASES = [(model, group) for model in MODEL_NAMES for group in layer_groups(model)]
@pytest.mark.parametrize("model,group", CASES)
def test_element_granularity_pads_as_little_as_zero3(model, group):
    """S = ceil(total/m), so the padding is ZeRO-3's, (-total) % m; FSDP2's padding makes every
    parameter a multiple of m, so it is congruent to -total mod m and never smaller."""
    shapes = layer_groups(model)[group]
    for m in FSDP_SIZES:
        p = plan(group_specs(shapes, "element"), m)
        assert p.padding == zero3_padding(shapes, m) <= fsdp2_padding(shapes, m), m


# [Note: where row blocks cannot match FSDP2]
# FSDP2 pads each parameter on its own and interleaves them per rank; one contiguous buffer
# cut at k*S cannot always do as well. A tensor with e > S + g*floor(S/g) cannot be held by
# two ranks (at most g*floor(S/g) before the boundary, S after), so it spans two boundaries
# and S % g == 0, whatever the order. E.g. Llama-3-70B's layer at 8 ranks: gate/up/down
# (28672x8192 = 235M elements each) exceed 2S for S ~ total/8 = 107M, so 8192 and 28672
# divide S; the least multiple of their LCM 57344 above total/8 is 1866 * 57344, padding
# 376,832 elements (0.044%) where FSDP2 pads nothing. `shard_lower_bound` is that argument;
# where the plan meets it, no contiguous layout in any order pads less. The cases below pad
# more than FSDP2 while the bound does not forbid matching it: the model order's optimum
# (exact), and no order of `search_orders` reaches FSDP2 either.
ROW_ABOVE_FSDP2_BY_ORDER = {  # (model, group, ranks): padding, # excess over FSDP2, of the group
    ("deepseek-v3-671b", "dense_layer", 8): 49152,  # +0.0084%
    ("deepseek-v3-671b", "moe_layer", 8): 24576,  # +0.0002%
    ("deepseek-v3-671b", "moe_layer", 16): 49152,  # +0.0004%
    ("deepseek-v3-671b", "moe_layer", 32): 49152,  # +0.0004%
    ("deepseek-v3-671b", "moe_layer", 64): 49152,  # +0.0004%
    ("deepseek-v3-671b", "moe_layer", 128): 1884160,  # +0.0124% (search_orders: 49152, below FSDP2)
    ("deepseek-v3-671b", "moe_layer", 512): 18661376,  # +0.1183%
    ("deepseek-v3-671b", "moe_layer", 1024): 119324672,  # +0.9293%
    ("qwen3-30b-a3b", "decoder_layer", 8): 3840,  # +0.0006%
    ("qwen3-30b-a3b", "decoder_layer", 16): 12032,  # +0.0019%
    ("qwen3-30b-a3b", "decoder_layer", 32): 28416,  # +0.0046%
    ("qwen3-30b-a3b", "decoder_layer", 64): 28416,  # +0.0046%
    ("qwen3-30b-a3b", "decoder_layer", 128): 28416,  # +0.0046%
}


@pytest.mark.parametrize("model,group", CASES)
def test_row_granularity_matches_fsdp2_unless_impossible(model, group):
    shapes = layer_groups(model)[group]
    specs = group_specs(shapes, "row")
    for m in FSDP_SIZES:
        p = plan(specs, m)
        if (model, group, m) in ROW_ABOVE_FSDP2_BY_ORDER:
            assert p.padding == ROW_ABOVE_FSDP2_BY_ORDER[model, group, m]
        else:
            assert p.padding <= fsdp2_padding(shapes, m) or p.shard_size == shard_lower_bound(specs, m), m


# Where every rank holds >= 32 blocks of the group's largest block (S >= 32 * max g), padding
# is <= 3% unless the bound of [Note: where row blocks cannot match FSDP2] forbids it: S must
# then be a multiple of the LCM of the block sizes of the tensors spanning two boundaries,
# which can be far above the largest block (DeepSeek-V3's dense layer at row granularity:
# LCM 1,032,192 = 56 * 18432; 11.7% at 128 ranks, 44.8% at 512, 96.6% at 16384). One case
# exceeds 3% above the bound (fraction of the buffer): no order tried pads less than the
# model's. (Before `plan` searched orders by default, DeepSeek-V3's MoE layer at 16 rows and
# 1024 ranks was here too, at 10.69%; it is now at the bound, 4.74%: see SEARCHED.)
ABOVE_3PCT = {
    ("deepseek-v3-671b", "moe_layer", "16rows", 1000): 0.08548,  # bound 2.45%
}

# Every case of CASES x presets x FSDP_SIZES where the model's order pads more than 1% of the
# buffer above the bound, so that `plan` tries other orders by default (the same cases, and
# figures, at fully_shard's 16-byte alignment): the padding of the model's order, of the plan,
# and the order of the plan.
SEARCHED = {
    ("deepseek-v3-671b", "moe_layer", "16rows", 1024): (0.106917, 0.047378, "granularity descending"),  # = bound
    ("qwen3-30b-a3b", "decoder_layer", "16rows", 512): (0.071478, 0.022608, "granularity descending"),  # = bound
    ("qwen3-30b-a3b", "decoder_layer", "128rows", 64): (0.016136, 0.009576, "granularity descending"),  # bound 0
    ("deepseek-v3-671b", "moe_layer", "16rows", 1000): (0.085483, 0.085483, MODEL_ORDER),  # bound 2.45%
    ("deepseek-v3-671b", "moe_layer", "row", 1000): (0.016318, 0.016318, MODEL_ORDER),  # bound 0.38%
    ("qwen3-30b-a3b", "decoder_layer", "128rows", 128): (0.022608, 0.022608, MODEL_ORDER),  # bound 0
}


@pytest.mark.parametrize("model,group", CASES)
@pytest.mark.parametrize("policy", ["row", "16rows", "128rows"])
def test_at_most_3pct_where_each_rank_holds_32_blocks(model, group, policy):
    shapes = layer_groups(model)[group]
    specs = group_specs(shapes, policy)
    for m in FSDP_SIZES:
        p, bound = plan(specs, m), shard_lower_bound(specs, m)
        searched = p.order != MODEL_ORDER or p.shard_size - bound > SEARCH_ABOVE_BOUND * p.shard_size
        assert searched == ((model, group, policy, m) in SEARCHED), m
        if p.shard_size < 32 * max(s.granularity for s in specs):
            continue
        if (model, group, policy, m) in ABOVE_3PCT:
            assert p.padding_ratio == pytest.approx(ABOVE_3PCT[model, group, policy, m], abs=1e-5)
        else:
            assert p.padding_ratio <= 0.03 or p.shard_size == bound, (m, p.padding_ratio)


@pytest.mark.parametrize("case", sorted(SEARCHED))
def test_orders_are_searched_by_default_on_real_models(case):
    model, group, policy, m = case
    specs = group_specs(layer_groups(model)[group], policy)
    kept, p = plan(specs, m, search_orders=False), plan(specs, m)
    assert (kept.padding_ratio, p.padding_ratio) == pytest.approx(SEARCHED[case][:2], abs=1e-6)
    assert p.order == SEARCHED[case][2]
    assert p.order == MODEL_ORDER or p.shard_size < kept.shard_size
    if p.shard_size == shard_lower_bound(specs, m):
        assert p.order != MODEL_ORDER


def test_the_model_order_is_kept_within_1pct_of_the_bound():
    """DeepSeek-V3's MoE layer, row blocks, 128 ranks: another order pads less (0.0004% vs
    0.0164%), but the model's is within 1% of the bound, so it is kept unless asked."""
    specs = group_specs(layer_groups("deepseek-v3-671b")["moe_layer"], "row")
    p, searched = plan(specs, 128), plan(specs, 128, search_orders=True)
    assert p.order == MODEL_ORDER and p.padding == 1884160
    assert searched.order == "granularity descending" and searched.padding == 49152


@pytest.mark.parametrize("model,group", CASES)
def test_aligned_starts_cost_nothing_on_real_models(model, group):
    """At fully_shard's alignment for bf16 (16 bytes = 8 elements), every tensor starts aligned and the
    shard size is the one of unaligned starts: the real shapes are multiples of 8 elements."""
    shapes = layer_groups(model)[group]
    for policy in ("element", "row", "16rows", "128rows"):
        specs = group_specs(shapes, policy)
        for m in FSDP_SIZES:
            p = plan(specs, m, 8)
            assert p.start_align == 8 and all(off % 8 == 0 for off in p.offsets)
            assert p.shard_size == plan(specs, m, 8, start_align=1).shard_size, (policy, m)


def test_largest_groups_plan_fast_at_scale():
    """A generous regression guard, with the order search on; benchmarks/planner_report.py
    reports the real timings (tens of milliseconds at most)."""
    for model in MODEL_NAMES:
        shapes = max(layer_groups(model).values(), key=lambda g: sum(s.numel for s in group_specs(g, "element")))
        for policy in ("element", "row", "16rows", "128rows"):
            specs = group_specs(shapes, policy)
            for m in (8, 1024, 16384):
                for search_orders in (None, True):
                    t0 = time.perf_counter()
                    plan(specs, m, 8, search_orders=search_orders)
                    assert time.perf_counter() - t0 < 0.5, (model, policy, m, search_orders)
