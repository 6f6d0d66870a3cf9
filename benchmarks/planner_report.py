"""Padding and planning time of the planner on real model shapes, beside FSDP2 and ZeRO-3.

    .venv/bin/python benchmarks/planner_report.py [--sizes 8 64 512 4096 10000 16384]

For each model's layer groups and granularity preset: the shard size per rank, our
padding, the order-independent lower bound's padding, FSDP2's dim-0 padding and
ZeRO-3's flat padding (as % of the padded buffer), and the planning time.
"""

from __future__ import annotations

import argparse
import time

from tqdm import tqdm

from vescale_zero.model_shapes import MODEL_NAMES, fsdp2_padding, group_specs, layer_groups, zero3_padding
from vescale_zero.planner import plan, shard_lower_bound

POLICIES = ("element", "row", "16rows", "128rows")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 512, 1000, 4096, 10000, 16384])
    p.add_argument("--models", nargs="+", default=list(MODEL_NAMES), choices=MODEL_NAMES)
    args = p.parse_args()
    rows, worst_ms, worst_at = [], 0.0, None
    cases = [(m, g, pol) for m in args.models for g in layer_groups(m) for pol in POLICIES]
    for model, group, policy in tqdm(cases, desc="planning"):
        shapes = layer_groups(model)[group]
        specs = group_specs(shapes, policy)
        total = sum(s.numel for s in specs)
        for m in args.sizes:
            t0 = time.perf_counter()
            p_ = plan(specs, m)
            ms = 1e3 * (time.perf_counter() - t0)
            if ms > worst_ms:
                worst_ms, worst_at = ms, (model, group, policy, m)
            lb = shard_lower_bound(specs, m)
            pct = lambda pad, denom: 100.0 * pad / denom  # noqa: E731
            rows.append((model, group, policy, m, p_.shard_size, pct(p_.padding, p_.global_size),
                         pct(m * lb - total, m * lb), pct(fsdp2_padding(shapes, m), total + fsdp2_padding(shapes, m)),
                         pct(zero3_padding(shapes, m), total + zero3_padding(shapes, m)), ms, p_.exact))
    print(f"\n{'model':17s} {'group':13s} {'blocks':8s} {'ranks':>6s} {'shard':>12s} {'ours%':>7s} "
          f"{'bound%':>7s} {'fsdp2%':>7s} {'zero3%':>7s} {'ms':>7s} exact")
    for r in rows:
        print(f"{r[0]:17s} {r[1]:13s} {r[2]:8s} {r[3]:6d} {r[4]:12,d} {r[5]:7.2f} {r[6]:7.2f} {r[7]:7.2f} {r[8]:7.3f} {r[9]:7.1f} {'yes' if r[10] else 'no'}")
    at_bound = sum(1 for r in rows if abs(r[5] - r[6]) < 1e-9)
    print(f"\n{len(rows)} plans: {at_bound} at the order-independent lower bound, "
          f"{sum(1 for r in rows if r[10])} proven exact for the model order; "
          f"slowest {worst_ms:.1f} ms at {worst_at}")
    big = [r for r in rows if r[3] >= 10000]
    print(f"at >= 10,000 ranks: slowest plan {max(r[9] for r in big):.2f} ms" if big else "")


if __name__ == "__main__":
    main()
