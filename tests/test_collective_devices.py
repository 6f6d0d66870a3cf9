"""Defect 4: every tensor our code hands to a collective is on a device its group serves.

On GPUs a tensor made without a device lands on the CPU, which NCCL refuses; here
:mod:`tests.device_guard` makes such a tensor land on ``meta`` and refuses it in any
collective, so the bug fails on CPU/gloo too.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import vescale_zero as vz
from tests.device_guard import WrongDevice, strict_collectives
from tests.distributed import run_on_ranks
from tests.models import AwkwardLM, make_batches, rank_slice
from vescale_zero import checkpoint
from vescale_zero.api.fully_shard import groups_of
from vescale_zero.primitives import comm_device

GLOBAL_BATCH = 12
GPT_CFG = dict(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)


def _outcome(fn):
    """``("ok", value, collectives seen)`` or ``(error type, message, collectives seen)``;
    every check runs under :func:`strict_collectives`."""
    with strict_collectives() as calls:
        try:
            return "ok", fn(), list(calls)
        except Exception as e:  # noqa: BLE001 - reported to the test
            return type(e).__name__, str(e), list(calls)


def _awkward(rank, world_size):
    model = AwkwardLM(seed=0)
    for block in model.blocks:
        vz.fully_shard(block)
    vz.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = rank_slice(make_batches(1, GLOBAL_BATCH)[0], rank, world_size)
    model(x, y).backward()
    opt.step()
    return model, opt, (x, y)


def _local_sq(model) -> float:
    grads = [g.sharded_params[i].grad for g in groups_of(model) for i in g.grad_indices]
    grads = [None if g is None else g.to_local() for g in grads]
    return sum(float(g.double().pow(2).sum()) for g in grads if g is not None)


def _optimizer_steps(name, rank, world_size):
    from vescale_zero.optim import AdamW8bit, Muon, Shampoo
    from vescale_zero.testing import GPT, GPTConfig, SyntheticCorpus

    torch.manual_seed(0)
    model = GPT(GPTConfig(**GPT_CFG))
    granularity = {"adamw8bit": AdamW8bit.granularity(16), "shampoo": Shampoo.granularity(16)}.get(name, "row")
    vz.fully_shard_layers(model, granularity=granularity)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = {"adamw8bit": lambda: AdamW8bit(params, lr=1e-2, block=16),
           "shampoo": lambda: Shampoo(params, lr=1e-2, block=16, update_freq=1),
           "muon": lambda: Muon(params, lr=0.02, adamw_lr=1e-3)}[name]()
    corpus = SyntheticCorpus(GPT_CFG["vocab_size"], GPT_CFG["seq_len"])
    model(*corpus.batch(0, 8, rank, world_size)).backward()
    return _outcome(opt.step)  # the first step: plans, state and every collective of a step


def _strict(rank, world_size, path):
    original = dist.all_reduce
    # the guard itself: a tensor made without a device inside it is refused
    out = {"guard": _outcome(lambda: dist.all_reduce(torch.tensor([1.0])))}
    model, opt, batch = _awkward(rank, world_size)
    out["save"] = _outcome(lambda: checkpoint.save(path, model, opt))
    out["load"] = _outcome(lambda: checkpoint.load(path, model, opt))
    # a refusal on one rank: every rank raises CheckpointError (none trains on alone)
    out["load refused by rank 1"] = _outcome(lambda: checkpoint.load(path if rank == 0 else path + ".missing", model))
    # a rank holding no gradient (an expert without tokens, a branch not taken)
    model(*batch).backward()
    if rank == 1:
        opt.zero_grad(set_to_none=True)
    out["rank 0's sum of squares"] = _local_sq(model)
    out["clip, rank 1 without gradients"] = _outcome(lambda: float(vz.clip_grad_norm_(model, 1e9)))
    opt.zero_grad(set_to_none=True)
    out["clip, no gradients anywhere"] = _outcome(lambda: float(vz.clip_grad_norm_(model, 1.0)))
    for name in ("muon", "shampoo", "adamw8bit"):
        out[name] = _optimizer_steps(name, rank, world_size)
    out["guard removed"] = dist.all_reduce is original
    return out


def test_collectives_get_tensors_on_the_groups_device(tmp_path):
    """Checkpoint save and load (also refused on one rank), gradient clipping with ranks
    that hold no gradient, Muon / Shampoo / 8-bit AdamW steps: every collective gets
    tensors on the model's device, none made on an implicit default device."""
    results = run_on_ranks(_strict, 2, str(tmp_path / "ckpt"))
    problems = []
    for rank, out in enumerate(results):
        status, message, calls = out["guard"]
        assert status == WrongDevice.__name__ and "meta" in message and calls == ["all_reduce"], out["guard"]
        assert out["guard removed"]
        _check(problems, rank, out, "save", "broadcast", ("all_gather", "all_gather_single"))  # torch 2.15: the latter
        _check(problems, rank, out, "load", "all_reduce")
        status, message, calls = out["load refused by rank 1"]
        refused = status == "CheckpointError" and ("another rank refused" in message) == (rank == 0)
        if not refused or "all_reduce" not in calls:
            problems.append((rank, "load refused by rank 1", status, message))
        expected = math.sqrt(results[0]["rank 0's sum of squares"])
        norm = _check(problems, rank, out, "clip, rank 1 without gradients", "all_reduce")
        if norm is not None and norm != pytest.approx(expected, rel=1e-5):
            problems.append((rank, "clip, rank 1 without gradients", norm, expected))
        norm = _check(problems, rank, out, "clip, no gradients anywhere", "all_reduce")
        if norm is not None and norm != 0.0:
            problems.append((rank, "clip, no gradients anywhere", norm, 0.0))
        _check(problems, rank, out, "muon", "all_to_all_single")  # ranges come from the placement: no gather
        _check(problems, rank, out, "shampoo")
        _check(problems, rank, out, "adamw8bit")
    assert not problems, "\n".join(map(str, problems))


def _check(problems, rank, out, key, *collectives):
    """The value of check ``key`` if it passed having called ``collectives`` (so the guard
    saw them: the check is not vacuous); else ``None``, and the problem noted. A tuple among
    ``collectives``: one of its names (what torch's object collectives call differs by release)."""
    status, value, calls = out[key]
    if status != "ok":
        problems.append((rank, key, status, value))
    problems.extend((rank, key, f"{c} not called", calls) for c in collectives
                    if not set(c if isinstance(c, tuple) else (c,)) & set(calls))
    return value if status == "ok" else None


# ---- the device choice, for backends we cannot run here --------------------------------


@pytest.fixture
def fake_accelerator(monkeypatch):
    """A machine whose current accelerator device is cuda:3, and a settable backend."""
    backend = {"name": "nccl"}
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend["name"])
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 3)
    return backend


def test_collective_device_follows_the_backend(fake_accelerator):
    pick = comm_device.collective_device
    cpu, cuda1, cuda3 = torch.device("cpu"), torch.device("cuda", 1), torch.device("cuda", 3)
    # NCCL: never the CPU; the parameters' device, else the current one
    assert pick(None, cpu) == cuda3 and pick(None) == cuda3 and pick(None, cuda1) == cuda1
    fake_accelerator["name"] = "gloo"
    assert pick(None) == cpu and pick(None, cpu) == cpu
    fake_accelerator["name"] = "cuda:nccl,cpu:gloo"
    assert pick(None, cpu) == cpu and pick(None, cuda1) == cuda1
    assert comm_device.backend_device_types(None) == ("cuda", "cpu")
    fake_accelerator["name"] = "xccl"  # an XPU backend on a CUDA machine: nothing fits
    with pytest.raises(RuntimeError, match="xccl"):
        pick(None, cpu)


def test_current_device_switches_only_accelerator_devices(fake_accelerator, monkeypatch):
    seen = []
    monkeypatch.setattr(torch.accelerator, "device_index", lambda index: seen.append(index))
    comm_device.current_device(torch.device("cuda", 2))
    comm_device.current_device(torch.device("cpu"))
    comm_device.current_device(None)
    assert seen == [2, None, None]
