"""Gradient memory (gloo, CPU, 2 ranks, one spawn).

* Sharded gradients live from a group's first reduce-scatter until
  ``zero_grad(set_to_none=True)`` frees them (grad_shard
  [Note: gradient shards live with their .grad]), counted exactly by LiveBytes and checked by
  data pointers; ``set_to_none=False`` keeps them, zeroed; training is bit-identical either way,
  with and without gradient accumulation (no-sync micro-batches), and with clipping.
* A training step's peak live tensor bytes are at or under PyTorch FSDP2's on the same model,
  fp32 and bf16 mixed precision, both on torch's own reduce-scatter (the like-for-like setting
  on gloo: benchmarks/memory.py [Note: what the tracker cannot see]); with one group per layer,
  and with one group per ``nn.Linear`` inside each layer (nested groups: the backward prefetch
  follows runtime [Note: backward prefetch order], else the previous layer's last Linear is
  gathered a layer early).
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from torch import nn

import vescale_zero as vz
from tests.distributed import run_cases_on_ranks
from vescale_zero.collectives import set_reduce_scatter_impl
from vescale_zero.fully_shard import groups_of
from vescale_zero.testing import GPT, GPTConfig, SyntheticCorpus
from vescale_zero.testing.live_bytes import LiveBytes

CFG = GPTConfig(vocab_size=128, seq_len=16, d_model=64, n_layers=3, n_heads=2)
LOCAL_BATCH = 4


def _batches(rank, world_size, n):
    corpus = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
    return [corpus.batch(i, LOCAL_BATCH * world_size, rank, world_size) for i in range(n)]


def _policy(mp):
    return vz.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp else None


def _block_linears(model):
    """Every ``nn.Linear`` inside the blocks (the head is tied to the embedding, the root's)."""
    return [m for block in model.blocks for m in block.modules() if isinstance(m, nn.Linear)]


def _vescale_model(mp=False, per_linear=False):
    torch.manual_seed(0)
    model = GPT(CFG)
    for linear in _block_linears(model) if per_linear else []:
        vz.fully_shard(linear, mp_policy=_policy(mp))
    vz.fully_shard_layers(model, mp_policy=_policy(mp))
    return model


def _shards(model):
    return [g.grads.sharded.live for g in groups_of(model)]


def _frees_at_zero_grad(rank, world_size):
    model = _vescale_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    (x, y), (x2, y2) = _batches(rank, world_size, 2)
    assert all(s is None for s in _shards(model)), "no gradient shard before the first backward"
    model(x, y).backward()
    shards = _shards(model)
    assert all(s is not None for s in shards)
    for g, shard in zip(groups_of(model), shards):  # every .grad is a view into its group's shard
        for i in g.grad_indices:
            grad = g.sharded_params[i].grad.to_local()  # the DTensor gradient's local piece
            assert grad.untyped_storage().data_ptr() == shard.data_ptr()
            if grad.numel():  # an empty piece has no address of its own
                assert grad.data_ptr() == shard.data_ptr() + g.plan.local_slices(rank)[i][2] * shard.element_size()
    shard_bytes = sum(s.untyped_storage().nbytes() for s in shards)
    del shards, shard, grad
    tracker = LiveBytes()
    with tracker:
        before = tracker.live
        opt.zero_grad(set_to_none=True)
        freed = before - tracker.live
    assert freed == shard_bytes, f"zero_grad(set_to_none=True) freed {freed} B, the gradient shards are {shard_bytes} B"
    assert all(s is None for s in _shards(model))
    assert vz.clip_grad_norm_(model, 1.0).item() == 0.0  # no gradient anywhere: nothing to clip, no error
    seen = []  # forward runs without gradient shards
    hook = model.blocks[0].register_forward_pre_hook(lambda *_: seen.append(any(s is not None for s in _shards(model))))
    model(x2, y2).backward()
    hook.remove()
    assert seen == [False], seen
    ptrs = [s.data_ptr() for s in _shards(model)]
    opt.zero_grad(set_to_none=False)  # keeps the shards, zeroed; .grad still views them
    kept = _shards(model)
    assert [s.data_ptr() for s in kept] == ptrs and all(bool((s == 0).all()) for s in kept)
    assert all(p.grad is not None for p in model.parameters())
    return True


def _train(rank, world_size, set_to_none, accum, mp):
    model = _vescale_model(mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for x, y in _batches(rank, world_size, 3):
        for i in range(accum):
            model.set_requires_gradient_sync(i == accum - 1)
            loss = model(x.chunk(accum)[i], y.chunk(accum)[i]) / accum
            loss.backward()
        vz.clip_grad_norm_(model, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def _same_training(rank, world_size):
    """set_to_none True and False train bit-identically (accumulating or not, fp32 and bf16)."""
    out = {}
    for accum in (1, 2):
        for mp in (False, True):
            (l1, p1), (l2, p2) = (_train(rank, world_size, s, accum, mp) for s in (True, False))
            out[f"accum {accum} mp {mp}"] = l1 == l2 and all(torch.equal(a, b) for a, b in zip(p1, p2))
    return out


def _fsdp2_model(mp, per_linear=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = GPT(CFG)
    kw = {"mesh": init_device_mesh("cpu", (dist.get_world_size(),))}
    if mp:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in (_block_linears(model) if per_linear else []) + list(model.blocks):  # innermost first
        fully_shard(unit, **kw)
    fully_shard(model, **kw)
    return model


def _step_peak(model, rank, world_size):
    """Live tensor bytes at the peak of the third AdamW step (the first two warm up)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = _batches(rank, world_size, 3)
    for i, (x, y) in enumerate(batches):
        tracker = LiveBytes()
        if i == len(batches) - 1:
            gc.collect()
            tracker.__enter__()
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i == len(batches) - 1:
            tracker.__exit__(None, None, None)
    return tracker.peak


def _peak_vs_fsdp2(rank, world_size):
    previous = set_reduce_scatter_impl("native")
    try:
        out = {}
        for mp, per_linear in ((False, False), (True, False), (False, True)):
            ours = _step_peak(_vescale_model(mp, per_linear), rank, world_size)
            gc.collect()
            theirs = _step_peak(_fsdp2_model(mp, per_linear), rank, world_size)
            gc.collect()
            out[("bf16" if mp else "fp32") + (", group per Linear" if per_linear else "")] = (ours, theirs)
        return out
    finally:
        set_reduce_scatter_impl(previous)


def test_grad_shards_and_step_peak():
    results = run_cases_on_ranks({"frees": (_frees_at_zero_grad, ()), "same": (_same_training, ()),
                                  "peak": (_peak_vs_fsdp2, ())}, 2)
    assert results["frees"] == [True, True]
    for per_rank in results["same"]:
        assert all(per_rank.values()), per_rank
    for rank, per_rank in enumerate(results["peak"]):
        for precision, (ours, theirs) in per_rank.items():
            print(f"rank {rank} {precision}: step peak {ours} B, FSDP2 {theirs} B")
            assert ours <= theirs, f"rank {rank} {precision}: step peak {ours} B > FSDP2's {theirs} B"
