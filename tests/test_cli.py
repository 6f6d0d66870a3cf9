"""``vescale-zero plan``: the table, the plot, the HSDP suggestion and bad input."""

from __future__ import annotations

import json

import pytest

from vescale_zero.cli import main
from vescale_zero.model_shapes import group_specs, layer_groups
from vescale_zero.planner import plan


def test_plan_table_plot_and_hsdp_suggestion(tmp_path, capsys):
    png = tmp_path / "pad.png"
    assert main(["plan", "--model", "llama3-70b", "--sizes", "8", "4096", "--plot", str(png), "--gpus", "4096"]) == 0
    out = capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the table reports the planner's own numbers
    p = plan(group_specs(layer_groups("llama3-70b")["decoder_layer"], "row"), 4096)
    assert f"{p.shard_size:,d}" in out and f"{100 * p.padding_ratio:.3f}" in out
    # the suggestion is the largest FSDP size whose padding is within 3%
    assert "suggestion: FSDP size 1024 x 4 replicas" in out


def test_own_model_description(tmp_path, capsys):
    shapes = tmp_path / "m.json"
    shapes.write_text(json.dumps({"layer": [["w1", [96, 64]], ["w2", [64, 96]], ["norm", [64]]]}))
    assert main(["plan", "--shapes", str(shapes), "--granularity", "element", "--sizes", "3", "5"]) == 0
    out = capsys.readouterr().out
    assert "layer" in out and "(all)" in out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"layer": [["w", "not a shape"]]}))
    with pytest.raises(ValueError, match="must be a list of"):
        main(["plan", "--shapes", str(bad)])


def test_the_table_names_the_order_of_each_plan(capsys):
    assert main(["plan", "--model", "qwen3-30b-a3b", "--granularity", "16rows", "--sizes", "256", "512"]) == 0
    lines = capsys.readouterr().out.splitlines()
    layer = [ln for ln in lines if ln.startswith("decoder_layer")]
    summary = [ln for ln in lines if ln.startswith("(all)")]
    # at 512 ranks the model's order pads 7.15%, 4.9% above the bound: another order reaches it
    p = plan(group_specs(layer_groups("qwen3-30b-a3b")["decoder_layer"], "16rows"), 512)
    assert p.order == "granularity descending"
    assert layer[0].endswith(" model") and layer[1].endswith(f" {p.order}")
    assert summary[0].endswith("0 of 3 reordered") and summary[1].endswith("1 of 3 reordered")
