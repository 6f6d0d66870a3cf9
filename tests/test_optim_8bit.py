"""Block-wise 8-bit AdamW on ragged shards equals the unsharded optimizer bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import vescale_zero as vz
from tests.distributed import run_on_ranks
from tests.models import AwkwardLM, local_pieces, make_batches, rank_slice
from vescale_zero.optim import AdamW8bit
from vescale_zero.quantization import dequantize_blockwise, quantize_blockwise

BLOCK = 13  # divides most of AwkwardLM's tensors into several blocks; others stay whole


def _full_grads(model):
    """Every rank's sharded gradient pieces, assembled into full gradients on every rank."""
    mine = {}
    for prefix, module in model.named_modules():
        if isinstance(module, vz.RaggedFSDPModule) and module.vescale_group is not None:
            g = module.vescale_group
            for i in g.grad_indices:
                sp = g.sharded_params[i]
                name = f"{prefix}.{g.managed[i].fqn}" if prefix else g.managed[i].fqn
                rng = sp.sharded_range
                mine[name] = (rng.start, rng.end, rng.shape, sp.grad.to_local().clone())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    full = {}
    for pieces in everyone:
        for name, (s, e, shape, g) in pieces.items():
            full.setdefault(name, torch.zeros(math.prod(shape))).view(-1)[s:e] = g
    return {n: t.view(everyone[0][n][2]) for n, t in full.items()}


def _sharded_vs_unsharded(rank, world_size):
    reference = AwkwardLM(seed=0)
    ref_params = {n: p for n, p in reference.named_parameters() if p.requires_grad}
    ref_opt = AdamW8bit(ref_params.values(), lr=1e-2, weight_decay=0.1, block=BLOCK)
    model = AwkwardLM(seed=0)
    vz.fully_shard_layers(model, granularity=AdamW8bit.granularity(BLOCK))
    opt = AdamW8bit([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1, block=BLOCK)
    for batch in make_batches(4, 12):
        model(*rank_slice(batch, rank, world_size)).backward()
        grads = _full_grads(model)
        for name, p in ref_params.items():
            p.grad = grads[name].clone()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        for name, (_shape, s, e, values) in local_pieces(model).items():
            if name in ref_params:
                assert torch.equal(values, ref_params[name].detach().view(-1)[s:e]), (name, s, e)
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_sharded_8bit_adamw_equals_unsharded_bit_for_bit(world_size):
    assert all(run_on_ranks(_sharded_vs_unsharded, world_size))


def _split_blocks(rank, world_size):
    model = AwkwardLM(seed=0)
    vz.fully_shard_layers(model, granularity="element")  # ignores the optimizer's blocks
    opt = AdamW8bit([p for p in model.parameters() if p.requires_grad], block=BLOCK)
    model(*rank_slice(make_batches(1, 12)[0], rank, world_size)).backward()
    try:
        opt.step()
    except ValueError as e:
        return str(e)
    return None


def test_a_block_split_across_ranks_is_refused():
    messages = run_on_ranks(_split_blocks, 3)
    # every rank refuses alike (optim/layout.py), not only those whose own piece splits a block
    assert all(messages) and len(set(messages)) == 1, messages
    assert "would be split across ranks" in messages[0] and "AdamW8bit.granularity(13)" in messages[0]


def test_state_is_two_bytes_per_element_plus_scales():
    p = torch.nn.Parameter(torch.randn(1000, 64))
    opt = AdamW8bit([p], block=256)
    p.grad = torch.randn_like(p)
    opt.step()
    state = opt.state[p]
    nbytes = sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
    assert nbytes == 2 * p.numel() + 2 * 4 * math.ceil(p.numel() / 256)


def test_quantizer_round_trip_and_bad_dtypes():
    x = torch.randn(1000)
    codes, scales = quantize_blockwise(x, 64)
    err = (dequantize_blockwise(codes, scales, 64) - x).abs()
    assert torch.all(err <= scales.repeat_interleave(64)[:1000] / 2 + 1e-7)  # half a step per block
    with pytest.raises(TypeError, match="cast to float32"):
        quantize_blockwise(torch.arange(10), 4)
    with pytest.raises(ValueError, match="negative"):
        quantize_blockwise(-torch.ones(8), 4, signed=False)


def test_converges_like_fp32_adamw():
    """Stated margin: after 60 steps on the synthetic corpus, 8-bit AdamW's loss is within
    5% of fp32 AdamW's (single process, same model and data)."""
    from vescale_zero.testing import GPT, GPTConfig, SyntheticCorpus

    cfg = GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_layers=2, n_heads=4)
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)
    final = {}
    for name, make in (("fp32", lambda ps: torch.optim.AdamW(ps, lr=3e-3)),
                       ("8bit", lambda ps: AdamW8bit(ps, lr=3e-3, block=64))):
        model = GPT(cfg)
        opt = make(model.parameters())
        for step in range(60):
            loss = model(*corpus.global_batch(step, 16))
            loss.backward()
            opt.step()
            opt.zero_grad()
        final[name] = loss.item()
    assert final["8bit"] <= final["fp32"] * 1.05, final
