"""The README's main job (examples/train_gpt.py) on a small GPT, in one spawn of 2 ranks and in
the quick subset, so that every torch of the CI matrix runs the core path: ``fully_shard`` per
block and on the root, AdamW steps with ``vz.clip_grad_norm_`` against the unsharded model, then
a ``vescale_zero.checkpoint`` and a ``torch.distributed.checkpoint`` round trip into a fresh model
(another seed), each of which goes on training bit for bit like the uninterrupted run.

Tolerances (tests/numerics.py [Note: comparing runs that sum in another order]): the first
step's local losses are the unsharded model's on the rank's slice, bit for bit (same weights,
data and ops); its reduced gradients within the summation-order bound; the trained weights
within ``adam_divergence_bound``. A loaded model holds the saved bits and then steps from the
same state through the same code as the uninterrupted run: compared exactly.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import vescale_zero as vz
from tests.distributed import run_on_ranks
from tests.models import assemble, local_pieces, train_reference
from tests.numerics import adam_divergence_bound, assert_reduced_like, full_grads, local_reference
from vescale_zero import checkpoint
from vescale_zero.testing import GPT, GPTConfig, SyntheticCorpus

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2)
STEPS, GLOBAL_BATCH, LR, CLIP, WORLD = 3, 4, 3e-3, 1.0, 2


def _corpus() -> SyntheticCorpus:
    return SyntheticCorpus(CFG.vocab_size, CFG.seq_len)


def _sharded(seed: int = 0):
    """The main job's model and optimizer (examples/train_gpt.py)."""
    model = GPT(dataclasses.replace(CFG, seed=seed))
    for block in model.blocks:
        vz.fully_shard(block, granularity="row")
    vz.fully_shard(model, granularity="row")
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def _step(model, opt, step: int, rank: int, world: int) -> float:
    x, y = _corpus().batch(step, GLOBAL_BATCH, rank, world)
    loss = model(x, y)
    loss.backward()
    vz.clip_grad_norm_(model, CLIP)
    opt.step()
    opt.zero_grad()
    return loss.item()


def _main_job(rank: int, world: int, root: str) -> dict:
    model, opt = _sharded()
    x, y = _corpus().batch(0, GLOBAL_BATCH, rank, world)
    reference = local_reference(GPT(CFG), [(x, y)])  # the unsharded model on this rank's slice
    loss = model(x, y)
    loss.backward()
    first = {"loss": loss.item(), "grads": full_grads(model), "reference": reference}
    vz.clip_grad_norm_(model, CLIP)
    opt.step()
    opt.zero_grad()
    for step in range(1, STEPS):
        _step(model, opt, step, rank, world)
    trained = local_pieces(model)

    vz_path, dcp_path = os.path.join(root, "vz"), os.path.join(root, "dcp")
    checkpoint.save(vz_path, model, opt)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=dcp_path)
    _step(model, opt, STEPS, rank, world)
    out = {"first": first, "trained": trained, "next": local_pieces(model)}

    fresh, fresh_opt = _sharded(seed=1)
    checkpoint.load(vz_path, fresh, fresh_opt)
    out["vz loaded"] = local_pieces(fresh)
    _step(fresh, fresh_opt, STEPS, rank, world)
    out["vz next"] = local_pieces(fresh)

    fresh, fresh_opt = _sharded(seed=1)
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=dcp_path)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out["dcp loaded"] = local_pieces(fresh)
    _step(fresh, fresh_opt, STEPS, rank, world)
    out["dcp next"] = local_pieces(fresh)
    return out


def _assert_equal(got: dict, want: dict, case: str) -> None:
    assert set(got) == set(want), (case, sorted(set(got) ^ set(want)))
    for name, value in got.items():
        assert torch.equal(value, want[name]), f"{case} {name}: max diff {(value - want[name]).abs().max().item()}"


def test_main_job_trains_like_unsharded_and_resumes_exactly_from_both_checkpoints(tmp_path):
    results = run_on_ranks(_main_job, WORLD, str(tmp_path))
    for r in results:  # the first local forward is the unsharded model's, bit for bit
        assert [r["first"]["loss"]] == r["first"]["reference"]["losses"], r["first"]
    assert_reduced_like(results[0]["first"]["grads"], results[0]["first"]["reference"], WORLD, case="first step")
    batches = [_corpus().global_batch(step, GLOBAL_BATCH) for step in range(STEPS)]
    want = train_reference(GPT(CFG), batches, lr=LR, clip=CLIP)["params"]
    trained = assemble([r["trained"] for r in results])
    assert set(trained) == set(want), sorted(set(trained) ^ set(want))
    for name, value in trained.items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=adam_divergence_bound(LR, STEPS),
                                   msg=lambda m, n=name: f"{n}: {m}")

    whole = {key: assemble([r[key] for r in results]) for key in ("trained", "next", "vz loaded", "vz next",
                                                                  "dcp loaded", "dcp next")}
    assert any(not torch.equal(whole["next"][n], whole["trained"][n]) for n in whole["next"])  # a step moved them
    for kind in ("vz", "dcp"):
        _assert_equal(whole[f"{kind} loaded"], whole["trained"], f"{kind} load")
        _assert_equal(whole[f"{kind} next"], whole["next"], f"{kind} load, then a step")
