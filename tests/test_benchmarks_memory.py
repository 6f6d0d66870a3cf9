"""Smoke test of benchmarks/memory.py at its smallest setting: the fake-process-group tables
(one process) list every system with the floor and its excess, and each row adds up."""

from __future__ import annotations

import importlib
import os
import re

import pytest


def test_memory_benchmark_smoke(capsys):
    pytest.importorskip("deepspeed")
    bench = importlib.import_module("benchmarks.memory")  # the repository root is on sys.path (conftest / rootdir)
    args = bench.parse_args(["--ranks", "--fake-ranks", "8", "--fake-layers", "1", "--fake-hidden", "64",
                             "--fake-ffn", "128", "--fake-heads", "4", "--fake-kv-heads", "2", "--fake-seq", "8"])
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    bench.run_fake(args)
    out = capsys.readouterr().out
    tables = [t for t in out.split("\n\n") if "floor = " in t]
    assert len(tables) == 2, out  # per layer, and one group per nn.Linear (ZeRO-3's unit)
    rows = {}
    for table in tables:
        floor = re.search(r"floor = sharded ([\d.]+) \+ 2 groups full ([\d.]+) \+ act ([\d.]+) = ([\d.]+) MiB", table)
        assert floor, table
        sharded, gathered, act, total = map(float, floor.groups())
        assert abs(sharded + gathered + act - total) <= 0.02 and min(sharded, gathered, act) > 0, table
        header = next(line for line in table.splitlines() if line.startswith("system"))
        assert header.split() == ["system", "peak", "MiB", *bench.ROLES, "floor", "excess"], header
        for line in table.splitlines():
            name = line.split(" ", 1)[0]
            if name not in bench.FAKE_SYSTEMS:
                continue
            rows[name] = line
            if "does not run" in line:
                continue
            peak, *roles, row_floor, excess = map(float, line.split()[1:])
            assert abs(sum(roles) - peak) <= 0.01 * len(roles), line  # the split accounts for the whole peak
            assert row_floor == total and abs(peak - row_floor - excess) <= 0.02, line
            assert peak > 0 and roles[bench.ROLES.index("params")] > 0, line
    assert set(rows) == set(bench.FAKE_SYSTEMS), out  # every system: a row, or why it cannot run on a fake group
    measured = sum("does not run" not in line for line in rows.values())
    assert measured >= 5, out  # vescale, FSDP2 and ZeRO-3 (and the _lin rows) run on PyTorch's fake process group
