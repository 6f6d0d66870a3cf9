"""``sharding_report``: totals and the layout order of each group (groups stood in for)."""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn

import vescale_zero.api.report as report
from vescale_zero.primitives.planner import MODEL_ORDER, plan
from vescale_zero.tools.model_shapes import group_specs, layer_groups


def test_report_counts_the_groups_laid_out_in_another_order(monkeypatch):
    specs = group_specs(layer_groups("qwen3-30b-a3b")["decoder_layer"], "16rows")
    plans = [plan(specs, 512), plan(specs, 256), plan(specs, 512, search_orders=False), plan(specs[:3], 512)]
    assert [p.order for p in plans] == ["granularity descending", MODEL_ORDER, MODEL_ORDER, MODEL_ORDER]
    stats = SimpleNamespace(all_gather_bytes=0, reduce_scatter_bytes=0, all_gathers=0, reduce_scatters=0)
    monkeypatch.setattr(report, "groups_of", lambda module: [SimpleNamespace(plan=p, stats=stats) for p in plans])
    rep = report.sharding_report(nn.Linear(1, 1))
    assert rep.num_groups == 4 and rep.padding == sum(p.padding for p in plans)
    assert rep.reordered_groups == 1
    assert rep.orders == ((MODEL_ORDER, 3), ("granularity descending", 1))
    assert rep.as_dict()["orders"] == rep.orders


def test_report_of_no_groups(monkeypatch):
    monkeypatch.setattr(report, "groups_of", lambda module: [])
    rep = report.sharding_report(nn.Linear(1, 1))
    assert (rep.num_groups, rep.reordered_groups, rep.orders, rep.padding_ratio) == (0, 0, (), 0.0)


def test_printing_a_report_gives_a_table(monkeypatch):
    """``print(vz.sharding_report(model))`` reads as a table of the report's own numbers."""
    specs = group_specs(layer_groups("qwen3-30b-a3b")["decoder_layer"], "16rows")
    plans = [plan(specs, 512), plan(specs, 256)]
    stats = SimpleNamespace(all_gather_bytes=3 * 2**20, reduce_scatter_bytes=2**20, all_gathers=3, reduce_scatters=1)
    monkeypatch.setattr(report, "groups_of", lambda module: [SimpleNamespace(plan=p, stats=stats) for p in plans])
    rep = report.sharding_report(nn.Linear(1, 1))
    lines = str(rep).splitlines()
    assert "ShardingReport(" not in str(rep) and repr(rep).startswith("ShardingReport(")
    table = {ln.split("  ")[1].strip(): ln.split("  ", 2)[2].strip() for ln in lines[1:]}
    assert list(table) == ["groups", "elements", "shard / rank", "layout order", "all-gathered", "reduce-scattered"]
    assert table["groups"] == f"2 groups, {rep.num_params:,d} parameters"
    assert table["elements"] == f"{rep.numel:,d} + {rep.padding:,d} padding ({100 * rep.padding_ratio:.3f}% of buffers)"
    assert table["shard / rank"] == f"{rep.shard_numel:,d} elements"
    assert table["layout order"] == "model: 1 group; granularity descending: 1 group (1 reordered to pad less)"
    assert table["all-gathered"] == "6.0 MiB (6,291,456 bytes) in 6 all-gathers"
    assert table["reduce-scattered"] == "2.0 MiB (2,097,152 bytes) in 2 reduce-scatters"
