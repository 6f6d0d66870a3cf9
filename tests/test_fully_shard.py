"""fully_shard trains exactly like the unsharded model, at world sizes 1-4 (gloo, CPU).

Every rank returns its local pieces of each parameter with their flat ranges; the
parent re-assembles full tensors (checking that the pieces cover every element exactly
once) and compares them with a single-process run on the same global batch.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

import vescale_zero as vz
from tests.distributed import run_on_ranks
from tests.models import AwkwardLM, make_batches, rank_slice, train_reference

STEPS, GLOBAL_BATCH = 4, 12  # 12 samples split evenly over 1, 2, 3 and 4 ranks


def _shard(model, granularity, mp_policy=None, reshard_after_forward=True):
    for block in model.blocks:
        vz.fully_shard(block, granularity=granularity, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    vz.fully_shard(model, granularity=granularity, mp_policy=mp_policy)
    return model


def _local_pieces(model) -> Dict[str, tuple]:
    """{full name: (shape, start, end, local values)} for every managed parameter."""
    out = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, vz.RaggedFSDPModule) or module.vescale_group is None:
            continue
        group = module.vescale_group
        for i, m in enumerate(group.managed):
            start, end = group.master.local_range(i)
            name = f"{prefix}.{m.fqn}" if prefix else m.fqn
            out[name] = (tuple(m.shape), start, end, group.sharded_params[i].detach().clone())
    return out


def _assemble(per_rank: List[Dict[str, tuple]]) -> Dict[str, torch.Tensor]:
    full = {}
    for name, (shape, *_rest) in per_rank[0].items():
        numel = int(torch.Size(shape).numel())
        flat = torch.zeros(numel, dtype=per_rank[0][name][3].dtype)
        hits = torch.zeros(numel, dtype=torch.int32)
        for pieces in per_rank:
            _, start, end, values = pieces[name]
            flat[start:end] = values
            hits[start:end] += 1
        assert torch.all(hits == 1), f"{name}: ranks do not cover every element exactly once: {hits.tolist()}"
        full[name] = flat.view(shape)
    return full


def _train(rank, world_size, granularity, clip, accum, mp, reshard_after_forward):
    mp_policy = vz.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp else None
    model = _shard(AwkwardLM(seed=0), granularity, mp_policy, reshard_after_forward)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    losses = []
    for batch in make_batches(STEPS, GLOBAL_BATCH):
        local = rank_slice(batch, rank, world_size)
        total = torch.zeros(())
        for i in range(accum):
            model.set_requires_gradient_sync(i == accum - 1)
            x, y = (t.chunk(accum)[i] for t in local)
            loss = model(x, y) / accum
            loss.backward()
            total += loss.detach().float()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        if clip is not None:
            vz.clip_grad_norm_(model, clip)
        opt.step()
        opt.zero_grad()
        losses.append(total.item())
    return {"losses": losses, "pieces": _local_pieces(model)}


def run_sharded(world_size, granularity=None, clip=None, accum=1, mp=False, reshard_after_forward=True):
    results = run_on_ranks(_train, world_size, granularity, clip, accum, mp, reshard_after_forward)
    for r in results[1:]:
        assert r["losses"] == results[0]["losses"], "ranks disagree on the loss"
    return results[0]["losses"], _assemble([r["pieces"] for r in results])


def _assert_close(params, ref, rtol, atol=0.0):
    assert set(params) == set(ref), (sorted(params), sorted(ref))
    for name, value in params.items():
        torch.testing.assert_close(value, ref[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def reference_clip():
    return train_reference(AwkwardLM(seed=0), make_batches(STEPS, GLOBAL_BATCH), lr=1e-2, clip=1.0, accum=1)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fp32_matches_unsharded(world_size, reference_clip):
    losses, params = run_sharded(world_size, granularity="row", clip=1.0)
    assert losses == pytest.approx(reference_clip["losses"], rel=1e-6)
    _assert_close(params, reference_clip["params"], rtol=1e-6, atol=1e-7)
