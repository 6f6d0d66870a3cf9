"""No host sync in the step path: from the start of forward to the end of ``optimizer.step()``
nothing reads a device value on the host (``tests.sync_spy``), so on a GPU the host keeps
running ahead of the device (issue 28, item 4).

Where a host value is part of the contract it is counted instead: a rank on which some
parameter got no gradient must learn whether any rank used it (``.grad = None`` or not:
unused_grads [Note: usage flags without a host read]); Megatron's optimizer API returns the grad
norm as a float and decides the fp16 skip on the host, once each per step, as megatron-core's
own ``MixedPrecisionOptimizer`` does.
"""

from __future__ import annotations

import re
from typing import Dict, List

import pytest
import torch
from torch import nn

import vescale_zero as vz
from tests.distributed import run_cases_on_ranks, run_on_ranks
from tests.sync_spy import host_step_counters, record_host_syncs
from vescale_zero.optim import AdamW8bit, Shampoo

DIM, BLOCK, STEPS = 8, 4, 2


class Tiny(nn.Module):
    """Two layers; ``extra`` runs on the ranks listed in ``extra_on`` only (it belongs to the
    root's group, which every rank runs: a ``fully_shard`` module must run on every rank)."""

    def __init__(self, extra_on: tuple = ()) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin1, self.lin2, self.extra = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM), nn.Linear(DIM, DIM)
        self.extra_on = extra_on

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        h = self.lin2(torch.relu(self.lin1(x)))
        if rank in self.extra_on:
            h = self.extra(h)
        return h.square().mean()


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "adamw-foreach":
        return torch.optim.AdamW(params, lr=1e-2, foreach=True)
    if name == "adamw-fused":
        return torch.optim.AdamW(params, lr=1e-2, fused=True)
    if name == "adamw8bit":
        return AdamW8bit(params, lr=1e-2, block=BLOCK)
    return Shampoo(params, lr=1e-2, block=BLOCK)


def _granularity(name: str):
    return {"adamw8bit": AdamW8bit.granularity(BLOCK), "shampoo": Shampoo.granularity(BLOCK)}.get(name)


def _sharded(extra_on: tuple, granularity=None) -> Tiny:
    model = Tiny(extra_on)
    for lin in (model.lin1, model.lin2):
        vz.fully_shard(lin, granularity=granularity)
    return vz.fully_shard(model, granularity=granularity)


def _steps(model: Tiny, opt: torch.optim.Optimizer, rank: int, steps: int) -> None:
    for step in range(steps):
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x, rank).backward()
        opt.step()
        opt.zero_grad()


def _syncs_in_steps(rank: int, world_size: int, optimizer: str, extra_on: tuple) -> Dict[str, object]:
    """Host syncs over ``STEPS`` training steps after a first one (the optimizer's state is
    made lazily by its first step), and which sharded parameters ended with a gradient."""
    model = _sharded(extra_on, _granularity(optimizer))
    opt = _optimizer(optimizer, model.parameters())
    _steps(model, opt, rank, 1)
    device = next(model.parameters()).device
    with record_host_syncs(device, host=host_step_counters(opt)) as calls:
        _steps(model, opt, rank, STEPS)
    x = torch.randn(4, DIM)
    model(x, rank).backward()
    with_grad = sorted(n for n, p in model.named_parameters() if p.grad is not None)
    return {"calls": calls, "with_grad": with_grad}


ALL_USED = ("adamw-foreach", "adamw-fused", "adamw8bit", "shampoo")


@pytest.mark.parametrize("world_size", [2, 3])
def test_no_host_sync_from_forward_to_optimizer_step(world_size):
    everyone = tuple(range(world_size))
    cases = {name: (_syncs_in_steps, (name, everyone)) for name in ALL_USED}
    # default set_unused_grads("none"): ``extra`` runs on rank 0 only, so it is used somewhere
    cases["unused-on-some-ranks"] = (_syncs_in_steps, ("adamw-foreach", (0,)))
    results = run_cases_on_ranks(cases, world_size, timeout=300)
    for name in ALL_USED:
        for rank, res in enumerate(results[name]):
            assert res["calls"] == [], f"{name}, rank {rank}: host syncs in the step path: {res['calls']}"
    unused = results["unused-on-some-ranks"]
    assert unused[0]["calls"] == [], f"rank 0 used every parameter, yet synced: {unused[0]['calls']}"
    for rank, res in enumerate(unused[1:], start=1):
        # a rank without ``extra``'s gradient reads the usage flags back: one read per step
        assert len(res["calls"]) == STEPS and all(c.startswith("tolist at unused_grads.py") for c in res["calls"]), (
            rank, res["calls"])
    for res in unused:  # used on rank 0, so every rank's shard keeps its gradient
        assert {"extra.weight", "extra.bias"} <= set(res["with_grad"]), res["with_grad"]


# ---- Megatron's optimizer protocol under fp16 ------------------------------------------------


def _megatron_fp16(rank: int, world_size: int) -> List[List[str]]:
    pytest.importorskip("megatron.core")
    from tests.megatron_shim import install_cuda_shim

    install_cuda_shim()
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig

    from integrations.megatron.optimizer import RaggedOptimizer

    parallel_state.initialize_model_parallel(1, 1)
    try:
        model = _sharded(tuple(range(world_size)))
        config = OptimizerConfig(optimizer="adam", lr=1e-2, fp16=True, initial_loss_scale=2.0 ** 8,
                                 min_loss_scale=1.0, loss_scale_window=1000, hysteresis=2, clip_grad=1.0)
        opt = RaggedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True), config, [model])
        per_step = []
        for step in range(STEPS + 1):
            x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(step + rank))
            with record_host_syncs(torch.device("cpu"), host=host_step_counters(opt.optimizer)) as calls:
                opt.scale_loss(model(x, rank)).backward()
                ok, norm, _ = opt.step()
                opt.zero_grad()
            assert ok and isinstance(norm, float)
            per_step.append(calls)
        return per_step[1:]  # the first step makes the optimizer's state
    finally:
        parallel_state.destroy_model_parallel()


def test_megatron_fp16_step_syncs_only_where_megatron_core_does():
    """megatron-core's MixedPrecisionOptimizer reads ``found_inf`` once (the skip decision)
    and the grad norm once (returned as a float, decides clipping) per step; so may we, and
    nothing more: no read of the loss scale, no per-parameter finiteness check."""
    pytest.importorskip("megatron.core")
    for rank, per_step in enumerate(run_on_ranks(_megatron_fp16, 2, timeout=300)):
        for calls in per_step:
            where = sorted(re.sub(r":\d+ ", " ", c) for c in calls)  # without line numbers
            assert where == ["item at optimizer.py get_grad_norm", "item at optimizer.py prepare_grads"], (rank, calls)
