"""``"<N>rows"`` where N does not divide a tensor's row count: the blocks used are named,
in a warning from ``resolve_granularities`` (``fully_shard``) and a note from ``plan``."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from vescale_zero.primitives.granularity import resolve_granularities
from vescale_zero.tools.cli import main

PARAMS = [("w8", torch.empty(8, 4)), ("w9", torch.empty(9, 4)), ("w2", torch.empty(2, 4)), ("b7", torch.empty(7))]


def test_rows_preset_warns_naming_each_tensor_that_gets_fewer_rows():
    with pytest.warns(UserWarning) as record:
        got = resolve_granularities(PARAMS, "3rows")
    assert got == [2 * 4, 3 * 4, 2 * 4, 1]  # 8 rows: 2; 9: 3; 2 rows (< 3): the whole tensor; 7: 1
    (message,) = [str(w.message) for w in record]
    assert message.startswith("granularity '3rows' is at most 3 rows per block")
    assert "2 of 4 tensors get fewer (w8 [8, 4]: 2 rows, b7 [7]: 1 row)" in message, message
    assert "w9" not in message and "w2" not in message


@pytest.mark.parametrize("policy", ["3rows", {"w8": "2rows", "b7": "element"}, "row", None])
def test_no_warning_when_every_block_is_what_was_asked(policy):
    params = [p for p in PARAMS if p[0] != "b7"] if policy == "3rows" else PARAMS
    params = [p for p in params if p[0] != "w8"] if policy == "3rows" else params
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_granularities(params, policy)


def test_plan_says_which_tensors_get_fewer_rows(tmp_path, capsys):
    shapes = tmp_path / "m.json"
    shapes.write_text(json.dumps({"layer": [["w8", [8, 4]], ["w9", [9, 4]]]}))
    assert main(["plan", "--shapes", str(shapes), "--granularity", "3rows", "--sizes", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("3rows blocks, 2-byte elements")
    assert lines[1].startswith("note: granularity '3rows' is at most 3 rows per block"), lines[1]
    assert "1 of 2 tensors get fewer (layer.w8 [8, 4]: 2 rows)" in lines[1], lines[1]
    assert main(["plan", "--shapes", str(shapes), "--granularity", "row", "--sizes", "2"]) == 0
    assert not any(ln.startswith("note:") for ln in capsys.readouterr().out.splitlines())
