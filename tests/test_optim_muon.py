"""Distributed Muon on ragged shards equals single-process Muon (same gradients), with the
Newton-Schulz work spread over the ranks."""

from __future__ import annotations

import pytest
import torch

import vescale_zero as vz
from tests.distributed import run_on_ranks
from tests.models import local_pieces
from tests.sweeps import sweep
from tests.test_optim_8bit import _full_grads
from vescale_zero.optim import Muon
from vescale_zero.optim.muon import assign_roots, newton_schulz
from vescale_zero.testing import GPT, GPTConfig, SyntheticCorpus

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)


def _sharded_vs_unsharded(rank, world_size):
    reference = GPT(CFG)
    model = GPT(CFG)
    model.load_state_dict(reference.state_dict())
    ref_params = {n: p for n, p in reference.named_parameters() if p.requires_grad}
    ref_opt = Muon(ref_params.values(), lr=0.02, weight_decay=0.1, adamw_lr=1e-3)
    vz.fully_shard_layers(model)  # element granularity: matrices are cut anywhere; Muon joins them on a root
    opt = Muon([p for p in model.parameters() if p.requires_grad], lr=0.02, weight_decay=0.1, adamw_lr=1e-3)
    corpus = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
    worst = 0.0
    for step in range(3):
        model(*corpus.batch(step, 12, rank, world_size)).backward()
        grads = _full_grads(model)
        for name, p in ref_params.items():
            p.grad = grads[name].clone()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        for name, (_shape, s, e, values) in local_pieces(model).items():
            if name in ref_params and e > s:
                ref = ref_params[name].detach().view(-1)[s:e]
                worst = max(worst, ((values - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item())
    return {"worst": worst, "stats": opt.last_step_stats}


@pytest.mark.parametrize("world_size", sweep([1, 2, 3, 4], quick=3))
def test_sharded_muon_equals_unsharded(world_size):
    """<= 1e-6 relative (fp32): the root orthogonalises the same matrix the single process
    does; only the order of float adds inside the matmuls could differ, and does not here."""
    results = run_on_ranks(_sharded_vs_unsharded, world_size)
    assert max(r["worst"] for r in results) <= 1e-6, [r["worst"] for r in results]
    load = results[0]["stats"]["ns_cost"]
    assert len(load) == world_size and all(x > 0 for x in load), load  # every rank orthogonalises something


def test_roots_are_balanced():
    costs = [m * n * min(m, n) for m, n in [(512, 128), (128, 512), (256, 256), (64, 64), (1024, 32), (96, 96)] * 3]
    roots = assign_roots(costs, 4)
    load = [sum(c for c, r in zip(costs, roots) if r == rank) for rank in range(4)]
    assert max(load) <= sum(costs) / 4 + max(costs), load  # the greedy (LPT) bound
    assert sorted(set(roots)) == [0, 1, 2, 3]


def test_newton_schulz_orthogonalises_and_bad_input():
    g = torch.randn(24, 40)
    o = newton_schulz(g, 5)
    s = torch.linalg.svdvals(o)
    assert s.max() < 1.3 and s.min() > 0.5, s  # quintic NS: singular values near 1, not exactly
    with pytest.raises(ValueError, match="ns_steps"):
        Muon([torch.nn.Parameter(torch.ones(2, 2))], ns_steps=0)
    v = torch.nn.Parameter(torch.ones(4))
    opt = Muon([{"params": [v], "use_muon": True}])
    v.grad = torch.ones(4)
    with pytest.raises(ValueError, match="matrices only"):
        opt.step()
