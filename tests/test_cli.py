"""``vescale-zero plan``: the table, the plot, the HSDP suggestion and bad input."""

from __future__ import annotations

import json
import math

import pytest

from vescale_zero.primitives.planner import plan
from vescale_zero.tools.cli import HSDPTraffic, hsdp_traffic, main
from vescale_zero.tools.model_shapes import group_specs, layer_groups


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
    assert "layer" in out and "(model)" in out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"layer": [["w", "not a shape"]]}))
    with pytest.raises(ValueError, match="must be a list of"):
        main(["plan", "--shapes", str(bad)])


def test_the_table_names_the_order_of_each_plan(capsys):
    assert main(["plan", "--model", "qwen3-30b-a3b", "--granularity", "16rows", "--sizes", "256", "512"]) == 0
    lines = capsys.readouterr().out.splitlines()
    layer = [ln for ln in lines if ln.startswith("decoder_layer")]
    summary = [ln for ln in lines if ln.startswith("(model)")]
    # at 512 ranks the model's order pads 7.15%, 4.9% above the bound: another order reaches it
    p = plan(group_specs(layer_groups("qwen3-30b-a3b")["decoder_layer"], "16rows"), 512)
    assert p.order == "granularity descending"
    assert layer[0].endswith(" model") and layer[1].endswith(f" {p.order}")
    assert summary[0].endswith("0 of 3 reordered") and summary[1].endswith("1 of 3 reordered")


def _row(out: str, group: str, ranks: int) -> list:
    return next(ln.split() for ln in out.splitlines() if ln.startswith(group) and ln.split()[2] == str(ranks))


def test_the_model_row_is_the_whole_model(capsys):
    """The (model) row is every group times its instances (80 decoder layers of Llama-3-70B,
    whose parameters total the published 70.6B), per rank; the columns are explained."""
    assert main(["plan", "--model", "llama3-70b", "--sizes", "8", "--dtype-bytes", "2"]) == 0
    out = capsys.readouterr().out
    groups = layer_groups("llama3-70b")
    counts = {"embedding": 1, "decoder_layer": 80, "head": 1}
    numel = sum(counts[g] * math.prod(shape) for g, params in groups.items() for _, shape in params)
    assert 70.5e9 < numel < 70.7e9, numel
    plans = {g: plan(group_specs(params, "row"), 8) for g, params in groups.items()}
    shard = sum(counts[g] * p.shard_size for g, p in plans.items())
    padding = sum(counts[g] * p.padding for g, p in plans.items())
    assert shard * 8 == numel + padding
    model = _row(out, "(model)", 8)
    assert model[1] == "82" and model[3] == f"{shard:,d}", model
    assert float(model[6]) == pytest.approx(shard * 2 / 2**20, abs=0.05)
    layer = _row(out, "decoder_layer", 8)
    assert layer[1] == "80" and layer[3] == f"{plans['decoder_layer'].shard_size:,d}", layer
    header = next(ln for ln in out.splitlines() if ln.startswith("group"))
    assert header.split()[:4] == ["group", "count", "ranks", "shard"]
    for label in ("count ", "shard ", "padding %", "MiB/rank ", "order "):
        assert any(ln.startswith("  " + label) for ln in out.splitlines()), label


def test_own_model_description_with_layer_counts(tmp_path, capsys):
    shapes = tmp_path / "m.json"
    layer = [["w1", [96, 64]], ["w2", [64, 96]], ["norm", [64]]]
    shapes.write_text(json.dumps({"embed": [["e", [100, 64]]], "layer": {"count": 12, "params": layer}}))
    assert main(["plan", "--shapes", str(shapes), "--granularity", "element", "--sizes", "3"]) == 0
    out = capsys.readouterr().out
    per_layer = plan(group_specs([("w1", (96, 64)), ("w2", (64, 96)), ("norm", (64,))], "element"), 3).shard_size
    embed = plan(group_specs([("e", (100, 64))], "element"), 3).shard_size
    assert _row(out, "(model)", 3)[1:4] == ["13", "3", f"{12 * per_layer + embed:,d}"]
    shapes.write_text(json.dumps({"layer": {"count": 0, "params": layer}}))
    with pytest.raises(ValueError, match='"count": N >= 1'):
        main(["plan", "--shapes", str(shapes)])


@pytest.mark.parametrize("value, hint", [("100", "did you mean '100rows'"), ("3rowz", "valid presets")])
def test_a_bad_granularity_is_a_usage_error(capsys, value, hint):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "llama3-8b", "--granularity", value, "--sizes", "8"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--granularity {value!r}" in err and hint in err and "Traceback" not in err, err


def _hsdp_rows(out: str) -> dict:
    """{shard: [replicas, padding, MiB/rank, all-gather, reduce-scatter, all-reduce MiB]} of --gpus's table."""
    lines = out.split("HSDP shapes for", 1)[1].splitlines()[2:]
    return {int(ln.split()[0]): [float(v) for v in ln.split()[1:7]] for ln in lines if ln.split()[0].isdigit()}


def test_hsdp_shapes_are_meshes_fully_shard_takes_with_their_traffic(capsys):
    """Every shape printed is a (replicas, shard) mesh of the GPUs (shard >= 2); its bytes per rank
    and step are those of ring collectives on the planner's shard of the whole model: 2 all-gathers
    (forward, backward) and a reduce-scatter of (shard - 1) shards, an all-reduce of 2 (R - 1) / R."""
    gpus = 24
    assert main(["plan", "--model", "llama3-70b", "--sizes", "8", "--gpus", str(gpus), "--dtype-bytes", "2",
                 "--reduce-dtype-bytes", "4"]) == 0
    out = capsys.readouterr().out
    rows = _hsdp_rows(out)
    assert sorted(rows) == [2, 3, 4, 6, 8, 12, 24]
    counts = {"embedding": 1, "decoder_layer": 80, "head": 1}
    mib = 2**20
    for shard, (replicas, _pad, per_rank, gather, scatter, reduce) in rows.items():
        assert replicas * shard == gpus
        numel = sum(counts[g] * plan(group_specs(p, "row"), shard).shard_size
                    for g, p in layer_groups("llama3-70b").items())
        # one rank's view: it sends its shard to each of the others, twice (gathers), and the
        # others' pieces of its shard once (reduce-scatter); across R replicas a ring all-reduce
        # sends R - 1 chunks of 1/R of the shard to reduce and as many to share the sums.
        assert per_rank == pytest.approx(numel * 2 / mib, abs=0.05)
        assert gather == pytest.approx(2 * (shard - 1) * numel * 2 / mib, abs=0.05), shard
        assert scatter == pytest.approx((shard - 1) * numel * 4 / mib, abs=0.05), shard
        assert reduce == pytest.approx((replicas - 1) / replicas * 2 * numel * 4 / mib, abs=0.05), shard
    assert rows[24][5] == 0.0 and rows[2][5] > rows[4][5] > rows[8][5]  # fewer replicas, less between groups
    assert "mesh=init_device_mesh(device_type, (1, 24), mesh_dim_names=(\"replicate\", \"shard\"))" in out


def test_hsdp_traffic_by_hand():
    # 1000 elements per rank, 4 ranks per shard group, 3 replicas, bf16 gathers, fp32 reductions:
    # 2 gathers x 3 shards x 1000 x 2 B; 3 x 1000 x 4 B; 2 x 2/3 x 1000 x 4 B (floored).
    assert hsdp_traffic(1000, 4, 3, 2, 4) == HSDPTraffic(12000, 12000, 5333)
    assert hsdp_traffic(1000, 1, 8, 2, 4) == HSDPTraffic(0, 0, 7000)  # shard 1: DDP's all-reduce
    assert hsdp_traffic(1000, 8, 1, 2, 4).all_reduce == 0


def test_hsdp_needs_two_gpus(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "llama3-8b", "--gpus", "1"])
    assert e.value.code == 2 and "--gpus 1: HSDP needs at least 2 GPUs" in capsys.readouterr().err
