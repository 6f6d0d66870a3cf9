"""DeepSpeed's ZeRO++ hpZ (``"zero_hpz_partition_size": 2``) with ``"stage": "ragged"`` at 4 ranks:
the layers' ``reshard_after_forward=2`` (runtime.post_forward [Note: the post-forward shard]).

* a collective spy sees forward's all-gathers on the 4 data-parallel ranks and backward's on this
  rank's hpZ group ({0, 1} or {2, 3}) only;
* the numbers are those of ragged without hpZ bit for bit, and those of ZeRO-3 with the same hpZ
  key (DeepSpeed's stage 3 runs hpZ on CPU): the first loss bit for bit, the first step's reduced
  gradients within the bound of two summation orders, the weights within what AdamW's steps allow
  (tests/numerics.py).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("deepspeed")

from tests.comm_spy import CommSpy  # noqa: E402
from tests.distributed import run_cases_on_ranks  # noqa: E402
from tests.models import AwkwardLM, assemble, make_batches, rank_slice  # noqa: E402
from tests.numerics import adam_divergence_bound, local_reference, reduction_order_bound  # noqa: E402
from tests.test_deepspeed import ACCUM, _deepspeed, _full_params, _train_steps, ds_config  # noqa: E402

WORLD, HPZ, STEPS, BATCH = 4, 2, 3, 16


def _run(rank, world_size, stage, hpz):
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed = _deepspeed()
    import torch.distributed as dist

    cfg = ds_config(stage, world_size, train_batch_size=BATCH,
                    train_micro_batch_size_per_gpu=BATCH // (world_size * ACCUM))
    if hpz:
        cfg["zero_optimization"]["zero_hpz_partition_size"] = hpz
    engine, *_ = deepspeed.initialize(model=AwkwardLM(seed=0), config=cfg)
    spy = CommSpy()
    forward, backward = engine.forward, engine.backward

    def spied_forward(*args, **kwargs):
        with spy.window(None, "forward"):
            return forward(*args, **kwargs)

    def spied_backward(*args, **kwargs):
        with spy.window(None, "backward"):
            return backward(*args, **kwargs)

    engine.forward, engine.backward = spied_forward, spied_backward  # engine(x) calls engine.forward
    batches = make_batches(STEPS, BATCH)
    with spy.installed():
        losses, grads = _train_steps(engine, batches, rank, world_size, grads_of=stage)
    out = {"losses": losses, "grads": grads, "params": _full_params(engine, stage)}
    out["gathers"] = sorted({(c[5], tuple(dist.get_process_group_ranks(c[3]))) for c in spy.calls
                             if c[0] == "all_gather"})
    if stage == 3:  # the terms the first step's reduced gradients sum (unsharded): tests/numerics.py
        x, y = rank_slice(batches[0], rank, world_size)
        out["local_sums"] = local_reference(AwkwardLM(seed=0), list(zip(x.chunk(ACCUM), y.chunk(ACCUM))))["sum_abs"]
    return out


@pytest.mark.slow
def test_hpz_gathers_backward_inside_its_group_and_trains_as_stage3_hpz():
    runs = run_cases_on_ranks({"ragged hpz": (_run, ("ragged", HPZ)), "ragged": (_run, ("ragged", None)),
                               "stage 3 hpz": (_run, (3, HPZ))}, WORLD, timeout=600)
    ours, plain, zero3 = runs["ragged hpz"], runs["ragged"], runs["stage 3 hpz"]
    for rank in range(WORLD):
        block = tuple(range(rank // HPZ * HPZ, rank // HPZ * HPZ + HPZ))
        assert ours[rank]["gathers"] == [("backward", block), ("forward", tuple(range(WORLD)))], ours[rank]["gathers"]
        assert plain[rank]["gathers"] == [("backward", tuple(range(WORLD))), ("forward", tuple(range(WORLD)))]
    # hpZ changes where backward gathers from, not the numbers
    assert ours[0]["losses"] == plain[0]["losses"]
    params, plain_params = assemble([r["params"] for r in ours]), assemble([r["params"] for r in plain])
    assert all(torch.equal(value, plain_params[name]) for name, value in params.items())
    # ZeRO-3 with hpZ: tests/numerics.py [Note: comparing runs that sum in another order]
    ref = zero3[0]
    assert ours[0]["losses"][0] == ref["losses"][0], (ours[0]["losses"], ref["losses"])
    grads = ours[0]["grads"]
    assert grads.keys() <= ref["grads"].keys() and len(grads) >= 10, sorted(grads)
    for name, value in grads.items():
        excess = (value - ref["grads"][name]).abs() - reduction_order_bound(ref["local_sums"][name], WORLD, ACCUM)
        assert excess.max() <= 0, f"{name}: gradient {excess.max().item():.3e} past the summation-order bound"
    assert set(params) == set(ref["params"])
    for name, value in params.items():
        torch.testing.assert_close(value, ref["params"][name], rtol=0, atol=adam_divergence_bound(1e-2, STEPS),
                                   msg=lambda m, name=name: f"{name}: {m}")
