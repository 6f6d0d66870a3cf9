"""Blocked Shampoo on ragged shards equals unsharded Shampoo bit for bit (same gradients)."""

from __future__ import annotations

import pytest
import torch

import vescale_zero as vz
from tests.distributed import run_on_ranks
from tests.models import local_pieces
from tests.sweeps import sweep
from tests.test_optim_8bit import _full_grads
from vescale_zero.optim import Shampoo
from vescale_zero.testing import GPT, GPTConfig, SyntheticCorpus

BLOCK = 16  # divides the GPT's row counts: bands of 16 rows, several 16x16 blocks per matrix
CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)


def _sharded_vs_unsharded(rank, world_size):
    reference = GPT(CFG)
    model = GPT(CFG)
    model.load_state_dict(reference.state_dict())
    ref_params = {n: p for n, p in reference.named_parameters() if p.requires_grad}
    ref_opt = Shampoo(ref_params.values(), lr=1e-2, weight_decay=0.1, block=BLOCK, update_freq=2)
    vz.fully_shard_layers(model, granularity=Shampoo.granularity(BLOCK))
    opt = Shampoo([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1, block=BLOCK,
                  update_freq=2)
    corpus = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
    shampoo_params = 0
    for step in range(4):
        model(*corpus.batch(step, 12, rank, world_size)).backward()
        grads = _full_grads(model)
        for name, p in ref_params.items():
            p.grad = grads[name].clone()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        for name, (shape, s, e, values) in local_pieces(model).items():
            if name in ref_params:
                assert torch.equal(values, ref_params[name].detach().view(-1)[s:e]), (step, name, s, e)
                shampoo_params += len(shape) >= 2 and e > s
    return shampoo_params


@pytest.mark.parametrize("world_size", sweep([1, 2, 3, 4], quick=3))
def test_sharded_shampoo_equals_unsharded_bit_for_bit(world_size):
    counts = run_on_ranks(_sharded_vs_unsharded, world_size)
    assert sum(counts) > 0, "no matrix was preconditioned"


def _split(rank, world_size):
    model = GPT(CFG)
    vz.fully_shard_layers(model, granularity="element")
    opt = Shampoo([p for p in model.parameters() if p.requires_grad], block=BLOCK)
    model(*SyntheticCorpus(CFG.vocab_size, CFG.seq_len).batch(0, 12, rank, world_size)).backward()
    try:
        opt.step()
    except ValueError as e:
        return str(e)
    return None


def test_bad_input_is_refused_with_the_fix():
    messages = run_on_ranks(_split, 3)
    assert all(messages) and len(set(messages)) == 1, messages  # every rank alike (optim/state_layout.py)
    assert "would be split across ranks" in messages[0] and f"Shampoo.granularity({BLOCK})" in messages[0]
    with pytest.raises(ValueError, match="update_freq"):
        Shampoo([torch.nn.Parameter(torch.ones(2, 2))], update_freq=0)
    vector = torch.nn.Parameter(torch.ones(4))
    opt = Shampoo([{"params": [vector], "use_shampoo": True}])
    vector.grad = torch.ones(4)
    with pytest.raises(ValueError, match="matrices only"):
        opt.step()


def test_preconditioners_saved_as_per_block_dicts_are_read():
    """State written before [Note: preconditioner state] (a list of per-block dicts of
    ``L``/``R``/``Li``/``Ri``, each its own size) is converted at the next step: the run goes on
    as if uninterrupted, bit for bit. A 20 x 12 matrix with blocks of 8 has partial blocks at
    its last rows and columns, which sit in the corner of their slots."""
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(20, 12)), torch.nn.Parameter(torch.randn(12))]
    copies = [torch.nn.Parameter(w.detach().clone()) for w in weights]
    straight, resumed = Shampoo(weights, lr=1e-2, block=8), Shampoo(copies, lr=1e-2, block=8)
    grads = [[torch.randn_like(w) for w in weights] for _ in range(3)]
    for step, gs in enumerate(grads):
        for opt, ps in ((straight, weights), (resumed, copies)):
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            opt.step()
        if step == 0:  # rewrite the resumed run's state in the old format
            state = resumed.state[copies[0]]
            sides = {"L": [8, 8, 8, 8, 4, 4], "Li": [8, 8, 8, 8, 4, 4], "R": [8, 4] * 3, "Ri": [8, 4] * 3}
            state["blocks"] = [{k: state[k][i, : sides[k][i], : sides[k][i]].clone() for k in sides}
                               for i in range(6)]
            for k in sides:
                del state[k]
    for a, b in zip(weights, copies):
        assert torch.equal(a, b)
    assert torch.equal(straight.state[weights[0]]["L"], resumed.state[copies[0]]["L"])
