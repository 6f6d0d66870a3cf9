"""The weights a model computes with always follow its master shards, whoever writes them.

Under mixed precision (and FP8 gathers) the gathered compute weights are made from the
fp32 master shards (param_gather [Note: every gather re-reads the master]). Writers that
bypass the version counter -- ``AdamW(fused=True)``, a ``.data`` write, ``load_state_dict``
into a model whose root is still gathered after a forward -- must be seen by the next
forward, as they are without sharding.
"""

from __future__ import annotations

import copy

import torch

import vescale_zero as vz
from tests.distributed import run_on_ranks
from tests.models import AwkwardLM, assemble, local_pieces, make_batches, rank_slice, train_steps
from tests.numerics import adam_divergence_bound
from vescale_zero.fully_shard import groups_of

STEPS, GLOBAL_BATCH = 6, 12
BF16 = vz.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _sharded(mp=BF16, fp8_tile=None, seed=0):
    model = AwkwardLM(seed=seed)
    for block in model.blocks:
        vz.fully_shard(block, mp_policy=mp, fp8_all_gather_tile=fp8_tile)
    vz.fully_shard(model, mp_policy=mp, fp8_all_gather_tile=fp8_tile)
    return model


def _train(rank, world_size, kernel, fp8_tile):
    model = _sharded(fp8_tile=fp8_tile)
    kw = {"fused": True} if kernel == "fused" else {"foreach": True}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, **kw)
    batches = [rank_slice(b, rank, world_size) for b in make_batches(STEPS + 1, GLOBAL_BATCH)]
    losses = train_steps(model, opt, batches[:STEPS])
    # the trained model's next forward vs a fresh model given its master shards (never gathered
    # before): the same master, the same cast and ops, so the same loss bit for bit -- unless the
    # trained model computes with stale weights
    fresh = _sharded(fp8_tile=fp8_tile, seed=1)
    with torch.no_grad():
        for mine, theirs in zip(fresh.parameters(), model.parameters(), strict=True):
            vz.local_piece(mine).copy_(vz.local_piece(theirs))
    follows = (model(*batches[STEPS]).item(), fresh(*batches[STEPS]).item())
    return losses, local_pieces(model), follows


def _fused_and_foreach(rank, world_size):
    return {(kernel, tile): _train(rank, world_size, kernel, tile)
            for kernel in ("fused", "foreach") for tile in (None, 4)}


def test_fused_adamw_trains_like_foreach():
    """fused and foreach AdamW differ only in rounding (the same formula, other kernels); what
    must hold whatever the kernel: the compute weights follow the master shards the kernel wrote
    (a stale compute weight differs by the whole update: 46% in loss after 8 steps before).

    * after STEPS steps, each run's next forward equals, bit for bit, that of a fresh model given
      its master shards (the sharp check: the same inputs, the same ops);
    * the first loss bit for bit between the kernels (the same weights, nothing stepped yet);
    * fused vs foreach weights within what STEPS AdamW steps can move two runs apart (their
      roundings differ from the first step on, and Adam's normalised step turns that into up
      to lr per step where a gradient is near zero: tests/numerics.py)."""
    results = run_on_ranks(_fused_and_foreach, 2)
    for tile in (None, 4):
        for kernel in ("fused", "foreach"):
            for rank, r in enumerate(results):
                trained, fresh = r[(kernel, tile)][2]
                assert trained == fresh, (kernel, tile, rank, trained, fresh)
        (fused_losses, _, _), (foreach_losses, _, _) = results[0][("fused", tile)], results[0][("foreach", tile)]
        assert fused_losses[0] == foreach_losses[0], (tile, fused_losses, foreach_losses)
        fused = assemble([r[("fused", tile)][1] for r in results])
        foreach = assemble([r[("foreach", tile)][1] for r in results])
        for name in fused:
            torch.testing.assert_close(fused[name], foreach[name], rtol=0, atol=adam_divergence_bound(1e-2, STEPS),
                                       msg=lambda m, n=name: f"{n}: {m}")


def _writes_bypassing_the_version_counter(rank, world_size):
    """Three writers the version counter does not see; after each, the next forward must
    compute exactly what a model built with the written weights computes (in bf16)."""
    x, y = rank_slice(make_batches(1, GLOBAL_BATCH)[0], rank, world_size)
    source = _sharded(seed=7)  # never run: holds seed 7's shards
    expected = _sharded(seed=7)(x, y).item()
    out = {}

    # 1. a .data write into every sharded parameter (EMA swap-in, hand-rolled optimizers),
    #    after a forward and backward that gathered (and cast) the old weights
    model = _sharded()
    model(x, y).backward()
    for mine, theirs in zip(model.parameters(), source.parameters()):
        mine.data.copy_(theirs.data)
    out["data write"] = model(x, y).item()

    # 2. torch's load_state_dict after a forward without backward (the root stays gathered)
    model = _sharded()
    with torch.no_grad():
        model(x, y)
    shapes = {k: tuple(v.shape) for k, v in source.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == shapes, "state_dict must see the shards"
    model.load_state_dict(copy.deepcopy(source.state_dict()))
    out["load_state_dict"] = model(x, y).item()

    # 3. load_full_state_dict after a forward with grad enabled and no backward
    model = _sharded()
    model(x, y)
    vz.load_full_state_dict(model, vz.full_state_dict(source))
    out["load_full_state_dict"] = model(x, y).item()
    return expected, out


def test_writes_that_bypass_the_version_counter_reach_the_next_forward():
    for expected, out in run_on_ranks(_writes_bypassing_the_version_counter, 2):
        for writer, loss in out.items():
            assert loss == expected, (writer, loss, expected)


def _fp8_buffers_live_only_while_gathering(rank, world_size):
    model = _sharded(fp8_tile=4)
    groups = groups_of(model)
    x, y = rank_slice(make_batches(1, GLOBAL_BATCH)[0], rank, world_size)
    seen = []
    for group in groups:
        real = group.gather.finish

        def finish(group=group, real=real):
            if group.gather._bytes is not None:  # a gather in flight (release() also calls finish)
                seen.append(group.gather._bytes.numel() == group.plan.world_size * group.gather.layout.slot_bytes)
            real()
            assert group.gather._bytes is None

        group.gather.finish = finish
    model(x, y).backward()
    idle = [g.gather._bytes for g in groups]
    return seen, idle


def test_fp8_gather_buffers_are_freed_after_each_gather():
    for seen, idle in run_on_ranks(_fp8_buffers_live_only_while_gathering, 2):
        # each gather had its byte buffer: m slots (fp8_gather [Note: one collective per group]);
        # none is kept between gathers
        assert seen and all(seen), seen
        assert idle == [None] * 3
