"""``sharding_report``: totals and the layout order of each group (groups stood in for)."""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn

import vescale_zero.report as report
from vescale_zero.model_shapes import group_specs, layer_groups
from vescale_zero.planner import MODEL_ORDER, plan


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
