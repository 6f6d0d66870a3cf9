"""Smoke test of benchmarks/memory.py at its smallest setting: the fake-process-group tables
(one process) list every system with the floor and its excess, and each row adds up."""

from __future__ import annotations

import importlib
import os
import re

import pytest


@pytest.mark.slow  # the benchmark end to end: ~20 s each on 2 cores
@pytest.mark.parametrize("precision, systems", [("fp32", None), ("bf16", ("vescale", "fsdp2", "zero3"))])
def test_memory_benchmark_smoke(capsys, precision, systems):
    """bf16: [Note: inputs in the compute dtype] (fp32 inputs failed the whole run: "expected m1
    and m2 to have the same dtype")."""
    pytest.importorskip("deepspeed")
    bench = importlib.import_module("benchmarks.memory")  # the repository root is on sys.path (conftest / rootdir)
    systems = systems or bench.FAKE_SYSTEMS
    args = bench.parse_args(["--ranks", "--fake-ranks", "8", "--fake-layers", "1", "--fake-hidden", "64",
                             "--fake-ffn", "128", "--fake-heads", "4", "--fake-kv-heads", "2", "--fake-seq", "8",
                             "--fake-precision", precision, "--fake-systems", *systems])
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    bench.run_fake(args)
    out = capsys.readouterr().out
    tables = [t for t in out.split("\n\n") if "floor = " in t]
    assert len(tables) == (2 if "vescale_lin" in systems else 1), out  # per layer, and one group per nn.Linear
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
    assert set(rows) == set(systems), out  # every system: a row, or why it cannot run on a fake group
    measured = {name for name, line in rows.items() if "does not run" not in line}
    assert measured == set(systems) - {"ddp"}, out  # all but DDP run on PyTorch's fake process group


def _offload_rows(rank: int, world: int):
    """benchmarks/memory.py's measurement of vescale-zero with and without CPUOffloadPolicy, and of
    FSDP2 with it, on a tiny GPT (fp32, two steps, the second measured): each system's bytes at
    its device peak and at its host peak, by role; and the master-shard bytes it was built with."""
    import importlib

    from vescale_zero.testing import GPT, GPTConfig, SyntheticCorpus

    bench = importlib.import_module("benchmarks.memory")
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)
    batches = [corpus.batch(i, 2 * world, rank, world) for i in range(2)]
    return {system: bench.measure_rank(system, lambda: GPT(cfg), lambda m: list(m.blocks), "fp32", batches, 2,
                                       cfg.d_model)["where"]
            for system in ("vescale", "vescale_off", "fsdp2_off")}


@pytest.mark.slow  # ~20 s on 2 cores
def test_memory_offload_rows_place_shards_on_the_host():
    """benchmarks/memory.py [Note: offload rows]: with CPUOffloadPolicy the device-side bytes of
    vescale-zero hold no parameter, gradient or optimizer-state buffer (its master shards,
    gradient shards and AdamW state are host buffers, by data pointers) and the host-side bytes
    hold exactly them: the same master shard and AdamW state bytes as the run without offload
    holds on the device, a gradient shard as large as the master shard, nothing else. Without
    offload nothing is on the host. FSDP2's CPUOffloadPolicy rows split the same way."""
    from tests.distributed import run_on_ranks

    for rank, rows in enumerate(run_on_ranks(_offload_rows, 2, timeout=240)):
        plain, off = rows["vescale"], rows["vescale_off"]
        assert plain["host"]["peak"] == 0, (rank, plain)
        for system in ("vescale_off", "fsdp2_off"):
            device, host = rows[system]["device"], rows[system]["host"]
            assert device["params"] == device["grads"] == device["optim"] == 0, (rank, system, device)
            assert host["params"] > 0 and host["grads"] == host["params"], (rank, system, host)
            assert host["optim"] >= 2 * host["params"], (rank, system, host)  # AdamW's two moments, and its steps
            assert host["comm"] == host["act"] == 0, (rank, system, host)  # only the persistent shards
            assert host["peak"] == host["params"] + host["grads"] + host["optim"], (rank, system, host)
        assert off["host"]["params"] == plain["device"]["params"], (rank, off, plain)  # the same master shard
        assert off["host"]["optim"] == plain["device"]["optim"], (rank, off, plain)  # the same AdamW state
