"""Sharded checkpoints: resharding across world sizes, and refusing partial or corrupt ones."""

from __future__ import annotations

import os

import pytest
import torch

import vescale_zero as vz
from vescale_zero import checkpoint
from tests.distributed import run_on_ranks
from tests.models import AwkwardLM, assemble, local_pieces, make_batches, rank_slice

GLOBAL_BATCH = 12


def _steps(model, opt, batches, rank, world_size):
    for batch in batches:
        x, y = rank_slice(batch, rank, world_size)
        model(x, y).backward()
        vz.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()


def _build(seed, granularity):
    model = AwkwardLM(seed=seed)
    for block in model.blocks:
        vz.fully_shard(block, granularity=granularity)
    vz.fully_shard(model, granularity=granularity)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _phase(rank, world_size, path, phase, granularity):
    batches = make_batches(6, GLOBAL_BATCH)
    model, opt = _build(0 if phase != "resume" else 5, granularity)
    if phase == "first":
        _steps(model, opt, batches[:3], rank, world_size)
        checkpoint.save(path, model, opt, extra={"step": 3})
    elif phase == "resume":
        assert checkpoint.load(path, model, opt) == {"step": 3}
        _steps(model, opt, batches[3:], rank, world_size)
    else:
        _steps(model, opt, batches, rank, world_size)
    return local_pieces(model)


@pytest.mark.parametrize("save_ranks,load_ranks,granularities", [(2, 3, ("row", "element")), (3, 1, ("element", "3rows")), (1, 4, ("row", "row"))])
def test_reshard_on_load_then_continue(tmp_path, save_ranks, load_ranks, granularities):
    path = str(tmp_path / "ckpt")
    run_on_ranks(_phase, save_ranks, path, "first", granularities[0])
    resumed = assemble(run_on_ranks(_phase, load_ranks, path, "resume", granularities[1]))
    straight = assemble(run_on_ranks(_phase, load_ranks, path, "full", granularities[1]))
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=1e-6, atol=1e-7)


def _load_only(rank, world_size, path):
    model, opt = _build(0, "row")
    checkpoint.load(path, model, opt)


def test_partial_or_corrupt_checkpoints_are_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    run_on_ranks(_phase, 2, path, "first", "row")
    rank1 = os.path.join(path, "rank00001.pt")
    good = open(rank1, "rb").read()

    def refused(*fragments):
        with pytest.raises(AssertionError) as e:
            run_on_ranks(_load_only, 2, path)
        for f in fragments:
            assert f in str(e.value), (f, str(e.value)[-2000:])

    with open(rank1, "wb") as f:
        f.write(good[: len(good) // 2])  # truncated
    refused("CheckpointError", "rank00001.pt", "sha256")
    with open(rank1, "wb") as f:
        f.write(good[:-1] + bytes([good[-1] ^ 1]))  # one flipped bit
    refused("rank00001.pt", "corrupt")
    os.remove(rank1)
    refused("rank00001.pt", "missing")
    with open(rank1, "wb") as f:
        f.write(good)
    os.remove(os.path.join(path, "metadata.json"))  # as if the writer died before publishing
    refused("metadata.json", "partial checkpoint")


def _adamw8bit_phase(rank, world_size, path, phase):
    from vescale_zero.optim import AdamW8bit

    batches = make_batches(4, GLOBAL_BATCH)
    model = AwkwardLM(seed=0 if phase != "resume" else 5)
    vz.fully_shard_layers(model, granularity=AdamW8bit.granularity(13))
    opt = AdamW8bit([p for p in model.parameters() if p.requires_grad], lr=1e-2, block=13)
    if phase == "resume":
        try:
            checkpoint.load(path, model, opt)
        except checkpoint.CheckpointError as e:
            return str(e)
        batches = batches[2:]
    elif phase == "first":
        batches = batches[:2]
    _steps(model, opt, batches, rank, world_size)
    if phase == "first":
        checkpoint.save(path, model, opt)
    return local_pieces(model)


def test_per_block_optimizer_state_resumes_or_is_refused(tmp_path):
    """AdamW8bit's per-block scales belong to a rank's piece: same layout resumes exactly,
    another world size is refused with a clear message (never rank 0's scales everywhere)."""
    path = str(tmp_path / "ckpt")
    run_on_ranks(_adamw8bit_phase, 2, path, "first")
    resumed = assemble(run_on_ranks(_adamw8bit_phase, 2, path, "resume"))
    straight = assemble(run_on_ranks(_adamw8bit_phase, 2, path, "full"))
    for name in straight:
        assert torch.equal(resumed[name], straight[name]), name
    messages = run_on_ranks(_adamw8bit_phase, 3, path, "resume")
    assert all(isinstance(m, str) for m in messages), "every rank must refuse, not only some"
    assert any("stored per piece" in m for m in messages), messages


def test_consolidate_gives_the_unsharded_state_dict(tmp_path):
    """``vescale-zero consolidate`` joins the pieces of 3 ranks into the state dict of the
    unsharded model: it loads strictly into a plain AwkwardLM, with the trained values."""
    from vescale_zero.cli import main

    path, out = str(tmp_path / "ckpt"), str(tmp_path / "full.pt")
    trained = assemble(run_on_ranks(_phase, 3, path, "first", "row"))
    assert main(["consolidate", path, out, "--optimizer"]) == 0
    state = torch.load(out, weights_only=True)
    plain = AwkwardLM(seed=5)
    plain.load_state_dict({k: v for k, v in state.items() if "::" not in k}, strict=True)
    for name, value in trained.items():
        assert torch.equal(state[name], value), name
    assert {k.split("::")[1] for k in state if "::" in k} == {"exp_avg", "exp_avg_sq"}
    assert state["blocks.0.fc1.weight::exp_avg"].shape == state["blocks.0.fc1.weight"].shape


def _killed_while_saving(rank, world_size, directory):
    from vescale_zero.checkpoint import sharded

    model, opt = _build(0, "row")
    _steps(model, opt, make_batches(1, GLOBAL_BATCH), rank, world_size)
    checkpoint.save(os.path.join(directory, "step1"), model, opt)
    if rank == 0:
        checkpoint.write_latest(directory, "step1")
    _steps(model, opt, make_batches(2, GLOBAL_BATCH)[1:], rank, world_size)
    if rank == 1:  # dies after writing its file, before the checkpoint is published
        sharded._sha256 = lambda _path: os._exit(3)
    checkpoint.save(os.path.join(directory, "step2"), model, opt)
    if rank == 0:
        checkpoint.write_latest(directory, "step2")


def test_a_writer_killed_mid_save_leaves_the_last_checkpoint(tmp_path):
    directory = str(tmp_path)
    with pytest.raises(AssertionError, match="exit code 3|exited without a result"):
        run_on_ranks(_killed_while_saving, 2, directory, timeout=120)
    assert checkpoint.read_latest(directory) == "step1"
    assert not os.path.exists(os.path.join(directory, "step2"))
    assert any(name.startswith("step2.tmp-") for name in os.listdir(directory))  # what the crash left
    run_on_ranks(_load_only, 2, os.path.join(directory, "step1"))  # loads, checksums and all
