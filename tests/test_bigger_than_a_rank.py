"""A model bigger than one rank trains: meta init + ``fully_shard`` + ``vz.materialize`` under a cap.

Each of 4 ranks runs under a hard cap on its live tensor bytes
(:class:`tests.live_bytes.LiveBytes` with a budget: every storage alive in the
process, ``resize_`` followed; exact, unlike a CPU process's RSS):

* while the model is built and initialised: 3/4 of the unsharded model's fp32 parameters --
  materialising the whole model on a rank cannot fit;
* while it trains (AdamW): 60% of the unsharded model + its AdamW state -- training it
  unsharded on one rank cannot fit.

Under the cap the GPT is built on ``meta``, ``fully_shard``-ed layer by layer and materialised,
then trains 3 steps; its losses equal, bit for bit (fp32), those of the same model trained at 4
ranks without the cap from eager initialisation (the eager reference is made equal to meta
init as in tests/test_meta_init.py). The same caps stop the eager construction on a rank and
the unsharded model's AdamW step: the caps are tight enough to matter.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vescale_zero as vz
from tests.distributed import run_on_ranks
from tests.live_bytes import LiveBytes, OverBudget
from tests.models import SEQ, VOCAB
from tests.test_meta_init import INIT_SEED, gpt_init
from vescale_zero.testing.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=64, n_layers=12, n_heads=2)  # ~2.4 MB of fp32 parameters
WORLD, STEPS, ROWS = 4, 3, 4
INIT_CAP, TRAIN_CAP = 0.75, 0.6  # of the unsharded parameters / of the parameters + AdamW state


def _eager() -> nn.Module:
    """The unsharded model with the values ``materialize(init_fn=gpt_init)`` gives under INIT_SEED:
    initialised module by module as built, then tied (see tests/test_meta_init.py)."""
    model = GPT(CFG)
    model.head.weight = nn.Parameter(torch.empty_like(model.embed.weight))
    torch.manual_seed(INIT_SEED)
    with torch.no_grad():
        for m in model.modules():
            if any(True for _ in m.parameters(recurse=False)):
                gpt_init(m)
    model.head.weight = model.embed.weight
    return model


def _train(model: nn.Module, rank: int, steps: int = STEPS):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        n = ROWS // WORLD
        xs = x[rank * n:(rank + 1) * n]
        loss = model(xs, torch.roll(xs, -1, dims=1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _rank(rank: int, world_size: int):
    with torch.device("meta"):
        param_bytes = sum(p.numel() * p.element_size() for p in GPT(CFG).parameters())
    init_cap = int(INIT_CAP * param_bytes)
    train_cap = int(TRAIN_CAP * 3 * param_bytes)  # parameters + exp_avg + exp_avg_sq
    cap = LiveBytes(budget=init_cap)
    with cap:
        with torch.device("meta"):
            model = GPT(CFG)
        vz.fully_shard_layers(model)
        torch.manual_seed(INIT_SEED)
        vz.materialize(model, init_fn=gpt_init, device="cpu")
        init_peak = cap.peak
        cap.budget = train_cap
        losses = _train(model, rank)
    train_peak = cap.peak
    del model

    # the caps matter: the whole model on one rank does not fit them
    with pytest.raises(OverBudget):
        with LiveBytes(budget=init_cap):
            _eager()
    with pytest.raises(OverBudget):
        with LiveBytes(budget=train_cap):
            _train(_eager(), rank, steps=1)

    # the reference: the same model, eagerly initialised, sharded the same way, no cap
    reference = _eager()
    vz.fully_shard_layers(reference)
    want = _train(reference, rank)
    assert losses == want, f"rank {rank}: losses under the cap {losses} vs eager, uncapped {want}"
    return {"init_peak": init_peak, "init_cap": init_cap, "train_peak": train_peak, "train_cap": train_cap}


@pytest.mark.slow  # ~30 s on 2 cores
def test_bigger_than_a_rank():
    """4 ranks: meta build + fully_shard + materialize + 3 AdamW steps within per-rank caps below
    the unsharded model (init) and below the model + AdamW state (training); fp32 losses
    bit-exact against the eager, uncapped run."""
    for peaks in run_on_ranks(_rank, WORLD):
        assert peaks["init_peak"] <= peaks["init_cap"] and peaks["train_peak"] <= peaks["train_cap"], peaks
