"""The planner: every constraint of the formal problem, exactness, and quality on real models."""

from __future__ import annotations

import functools
import itertools
import time
from typing import Optional, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vescale_zero.model_shapes import MODEL_NAMES, fsdp2_padding, granularity, group_specs, layer_groups, zero3_padding
from vescale_zero.planner import ShardPlan, TensorSpec, plan, shard_lower_bound


def assert_valid(p: ShardPlan) -> None:
    """Every constraint of the formal problem (system.md, part 2), in any order of the tensors."""
    m, S = p.world_size, p.shard_size
    assert S >= 1 and S % p.align == 0
    end = 0
    for i in sorted(range(len(p.specs)), key=lambda i: (p.offsets[i], p.specs[i].numel)):
        spec, off = p.specs[i], p.offsets[i]
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


def _blocks(g: int, blocks: int) -> TensorSpec:
    return TensorSpec(g * blocks, g)


def _whole(numel: int) -> TensorSpec:
    return TensorSpec(numel, max(numel, 1))


specs_strategy = st.lists(
    st.one_of(
        st.builds(_blocks, st.one_of(st.integers(1, 9), st.sampled_from([2, 7, 13, 64, 97, 128, 4096])), st.integers(0, 40)),
        st.builds(_whole, st.integers(0, 5000)),  # the whole tensor is one block
    ),
    min_size=1,
    max_size=12,
)
world_sizes = st.one_of(st.integers(1, 40), st.sampled_from([64, 96, 1000, 4096, 10007, 16384]), st.integers(1, 16384))
aligns = st.sampled_from([1, 2, 16, 128])


@settings(max_examples=300, deadline=None)
@given(specs_strategy, world_sizes, aligns)
def test_every_constraint_holds(specs, world_size, align):
    p = plan(specs, world_size, align)
    assert_valid(p)
    assert list(p.offsets) == sorted(p.offsets), "the given order is kept"
    assert plan(specs, world_size, align) == p  # deterministic: a pure function of its input


@settings(max_examples=150, deadline=None)
@given(specs_strategy, world_sizes, aligns)
def test_searching_orders_is_valid_and_never_worse(specs, world_size, align):
    p = plan(specs, world_size, align, search_orders=True)
    assert_valid(p)
    assert shard_lower_bound(specs, world_size, align) <= p.shard_size <= plan(specs, world_size, align).shard_size
    assert plan(specs, world_size, align, search_orders=True) == p


# ---- exactness --------------------------------------------------------------------------


def _splits_no_block(off: int, e: int, g: int, S: int) -> bool:
    return all((k * S - off) % g == 0 for k in range(off // S + 1, (off + e - 1) // S + 1))


def _fits_by_enumeration(specs: Sequence[TensorSpec], m: int, S: int) -> bool:
    """Whether any layout fits, trying every offset of every tensor (no greedy argument)."""

    @functools.lru_cache(maxsize=None)
    def place(i: int, cursor: int) -> bool:
        if i == len(specs):
            return True
        e, g = specs[i].numel, specs[i].granularity
        return any(_splits_no_block(off, e, g, S) and place(i + 1, off + e) for off in range(cursor, m * S - e + 1))

    return place(0, 0)


def _first_fit_end(specs: Sequence[TensorSpec], m: int, S: int) -> Optional[int]:
    """Each tensor at the first offset that splits no block, found by trying them one by one;
    where the last one ends, or None if some tensor fits nowhere inside ``[0, m*S)``."""
    cursor = 0
    for spec in specs:
        cursor = next((off + spec.numel for off in range(cursor, m * S - spec.numel + 1)
                       if _splits_no_block(off, spec.numel, spec.granularity, S)), None)
        if cursor is None:
            return None
    return cursor


def _smallest_by_scan(specs: Sequence[TensorSpec], m: int, align: int, fits) -> int:
    total = sum(s.numel for s in specs)
    first = -(-max(1, -(-total // m)) // align) * align
    return next(S for S in itertools.count(first, align) if fits(specs, m, S))


tiny_specs = st.lists(st.one_of(st.builds(_blocks, st.integers(1, 4), st.integers(0, 4)), st.builds(_whole, st.integers(0, 6))),
                      min_size=1, max_size=4)


@settings(max_examples=200, deadline=None)
@given(tiny_specs, st.integers(1, 5), st.sampled_from([1, 2, 3]))
def test_shard_size_is_the_smallest_by_enumeration(specs, world_size, align):
    """Exhaustive scan over shard sizes, each checked over every combination of offsets."""
    assert plan(specs, world_size, align).shard_size == _smallest_by_scan(specs, world_size, align, _fits_by_enumeration)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.one_of(st.builds(_blocks, st.sampled_from([1, 2, 3, 5, 7, 8, 12, 16]), st.integers(0, 12)),
                       st.builds(_whole, st.integers(0, 60))), min_size=1, max_size=8),
    st.one_of(st.integers(1, 16), st.sampled_from([24, 37, 64])),
    aligns,
)
def test_shard_size_is_the_smallest_by_scan(specs, world_size, align):
    """Larger cases: every shard size in turn, each checked by a one-offset-at-a-time first fit
    (itself checked against full enumeration above)."""
    fits = lambda sp, m, S: _first_fit_end(sp, m, S) is not None  # noqa: E731
    assert plan(specs, world_size, align).shard_size == _smallest_by_scan(specs, world_size, align, fits)


@settings(max_examples=100, deadline=None)
@given(tiny_specs, st.integers(1, 4), st.sampled_from([1, 2]))
def test_lower_bound_holds_for_every_order(specs, world_size, align):
    best = min(plan([specs[i] for i in order], world_size, align).shard_size
               for order in itertools.permutations(range(len(specs))))
    assert shard_lower_bound(specs, world_size, align) <= best <= plan(specs, world_size, align, search_orders=True).shard_size


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="does not divide numel 10"):
        TensorSpec(10, 4, "w")
    with pytest.raises(ValueError, match="world_size"):
        plan([TensorSpec(4)], 0)
    with pytest.raises(ValueError, match="align"):
        plan([TensorSpec(4)], 2, align=0)


def test_granularity_presets():
    assert granularity((576, 7168), "element") == 1
    assert granularity((576, 7168), "row") == 7168
    assert granularity((576, 7168), "128rows") == 96 * 7168  # 128 rows do not divide 576: 96 do
    assert granularity((7168,), "row") == 1 and granularity((7168,), "16rows") == 16


# ---- quality on real models ---------------------------------------------------------------

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
# LCM 1,032,192 = 56 * 18432; 11.7% at 128 ranks, 44.8% at 512, 96.6% at 16384). Only two
# cases exceed 3% through the model order itself (fractions of the buffer):
ABOVE_3PCT_BY_ORDER = {
    ("deepseek-v3-671b", "moe_layer", "16rows", 1000): 0.08548,  # bound 2.45%; search_orders 8.55%
    ("deepseek-v3-671b", "moe_layer", "16rows", 1024): 0.10692,  # bound 4.74%; search_orders 4.74%
}


@pytest.mark.parametrize("model,group", CASES)
@pytest.mark.parametrize("policy", ["row", "16rows", "128rows"])
def test_at_most_3pct_where_each_rank_holds_32_blocks(model, group, policy):
    shapes = layer_groups(model)[group]
    specs = group_specs(shapes, policy)
    for m in FSDP_SIZES:
        p = plan(specs, m)
        if p.shard_size < 32 * max(s.granularity for s in specs):
            continue
        if (model, group, policy, m) in ABOVE_3PCT_BY_ORDER:
            assert p.padding_ratio == pytest.approx(ABOVE_3PCT_BY_ORDER[model, group, policy, m], abs=1e-5)
        else:
            assert p.padding_ratio <= 0.03 or p.shard_size == shard_lower_bound(specs, m), (m, p.padding_ratio)


def test_largest_groups_plan_fast_at_scale():
    """A generous regression guard; benchmarks/planner_report.py reports the real timings."""
    for model in MODEL_NAMES:
        shapes = max(layer_groups(model).values(), key=lambda g: sum(s.numel for s in group_specs(g, "element")))
        for policy in ("element", "row", "16rows", "128rows"):
            for m in (8, 10_000):
                t0 = time.perf_counter()
                plan(group_specs(shapes, policy), m)
                assert time.perf_counter() - t0 < 2.0, (model, policy, m)
