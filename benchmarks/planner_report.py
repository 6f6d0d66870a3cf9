"""Padding and planning time of the planner on real model shapes, beside FSDP2 and ZeRO-3.

    .venv/bin/python benchmarks/planner_report.py [--sizes 8 64 1000 10000] [--all-groups] [--align 8]

For each model's largest transformer-layer group (every group, embedding and head too, with
``--all-groups``), granularity preset and FSDP size: the shard size per rank of the plan;
padding (% of the padded buffer) of the model's order, of the plan (``plan``'s default: other
orders are tried where the model's pads more than 1% above the bound), of the best order the
search finds, of the order-independent lower bound, of FSDP2's dim-0 padding and of ZeRO-3's
flat padding; the planning time (default plan, best of 3 runs) and the order the plan uses.
``--align`` (elements; default 1) is the shard and start alignment, e.g. 8: fully_shard's 16
bytes for bf16.
"""

from __future__ import annotations

import argparse
import time
from typing import List, NamedTuple

from vescale_zero.primitives.planner import MODEL_ORDER, plan, shard_lower_bound
from vescale_zero.tools.model_shapes import MODEL_NAMES, Group, fsdp2_padding, group_specs, layer_groups, zero3_padding

POLICIES = ("element", "row", "16rows", "128rows")
DEFAULT_SIZES = [2**k for k in range(3, 15)] + [1000, 10000]


class Row(NamedTuple):
    model: str
    group: str
    policy: str
    ranks: int
    shard: int
    kept: float  # the model's order
    ours: float  # plan's default
    reordered: float  # the best order searched
    bound: float
    fsdp2: float
    zero3: float
    ms: float
    order: str


def _pct(pad: int, total: int) -> float:
    return 100.0 * pad / (total + pad)


def _plan_ms(specs, m: int, align: int) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        plan(specs, m, align)
        best = min(best, 1e3 * (time.perf_counter() - t0))
    return best


def _rows(model: str, group: str, shapes: Group, sizes: List[int], align: int) -> List[Row]:
    rows = []
    for policy in POLICIES:
        specs = group_specs(shapes, policy)
        total = sum(s.numel for s in specs)
        for m in sizes:
            p = plan(specs, m, align)
            rows.append(Row(model, group, policy, m, p.shard_size,
                            _pct(plan(specs, m, align, search_orders=False).padding, total), _pct(p.padding, total),
                            _pct(plan(specs, m, align, search_orders=True).padding, total),
                            _pct(m * shard_lower_bound(specs, m, align) - total, total),
                            _pct(fsdp2_padding(shapes, m), total), _pct(zero3_padding(shapes, m), total),
                            _plan_ms(specs, m, align), p.order))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES)
    p.add_argument("--models", nargs="+", default=list(MODEL_NAMES), choices=MODEL_NAMES)
    p.add_argument("--all-groups", action="store_true", help="every group, not only the largest layer")
    p.add_argument("--align", type=int, default=1, help="shard and start alignment in elements (default 1)")
    args = p.parse_args()
    rows: List[Row] = []
    for model in args.models:
        groups = layer_groups(model)
        if not args.all_groups:
            layers = [g for g in groups if g.endswith("layer")]
            largest = max(layers, key=lambda g: sum(s.numel for s in group_specs(groups[g], "element")))
            groups = {largest: groups[largest]}
        for group, shapes in groups.items():
            rows += _rows(model, group, shapes, args.sizes, args.align)

    print(f"{'model':17s} {'group':13s} {'blocks':8s} {'ranks':>6s} {'shard':>13s} {'model%':>7s} {'ours%':>7s} "
          f"{'reord%':>7s} {'bound%':>7s} {'fsdp2%':>7s} {'zero3%':>7s} {'ms':>6s}  order")
    for r in rows:
        print(f"{r.model:17s} {r.group:13s} {r.policy:8s} {r.ranks:6d} {r.shard:13,d} {r.kept:7.2f} {r.ours:7.2f} "
              f"{r.reordered:7.2f} {r.bound:7.2f} {r.fsdp2:7.2f} {r.zero3:7.3f} {r.ms:6.2f}  {r.order}")

    slowest = max(rows, key=lambda r: r.ms)
    print(f"\n{len(rows)} plans (align {args.align}); slowest {slowest.ms:.2f} ms "
          f"({slowest.model} {slowest.group} {slowest.policy} at {slowest.ranks} ranks)")
    big = [r for r in rows if r.ranks >= 10000]
    if big:
        print(f"at >= 10,000 ranks: slowest {max(r.ms for r in big):.2f} ms")
    print(f"at the order-independent bound: {sum(abs(r.ours - r.bound) < 1e-12 for r in rows)}")
    print(f"in another order than the model's: {sum(r.order != MODEL_ORDER for r in rows)}")
    for policy in ("element", "row"):
        worse = [r for r in rows if r.policy == policy and r.ours > r.fsdp2]
        print(f"{policy}: more padding than FSDP2 in {len(worse)} of {sum(r.policy == policy for r in rows)} plans "
              f"({sum(r.ours > r.bound for r in worse)} of them above the bound)")
    print("most padding per preset (model order / plan / best order / bound):")
    for policy in POLICIES:
        w = max((r for r in rows if r.policy == policy), key=lambda r: r.ours)
        print(f"  {policy:8s} {w.kept:6.2f}% / {w.ours:6.2f}% / {w.reordered:6.2f}% / {w.bound:6.2f}%  "
              f"{w.model} {w.group} at {w.ranks} ranks ({w.order})")


if __name__ == "__main__":
    main()
