"""integrations/loss_scaling.py: the one fp16 unscale + overflow check every adapter calls
(DeepSpeed engine's fp16 step, Megatron optimizer's prepare_grads)."""

from __future__ import annotations

import torch

from tests.distributed import run_on_ranks
from tests.sync_spy import record_host_syncs
from vescale_zero.integrations.loss_scaling import unscale_and_find_inf

SCALE = 1024.0


def _unscale(rank, world_size):
    g = torch.Generator().manual_seed(rank)
    grads = [torch.randn(5, generator=g) * SCALE, (torch.randn(3, generator=g) * SCALE).half()]
    want = [t.float() / SCALE for t in grads]
    with record_host_syncs(torch.device("cpu")) as calls:
        clean = unscale_and_find_inf(grads, 1.0 / SCALE, torch.device("cpu"))
    got = [t.float() for t in grads]
    poisoned = [torch.ones(2), torch.ones(2)]
    if rank == world_size - 1:
        poisoned[1][0] = float("inf")  # one element, on one rank
    flagged = unscale_and_find_inf(poisoned, torch.tensor(0.5), torch.device("cpu"))
    empty = unscale_and_find_inf([], 1.0, torch.device("cpu"))  # a rank without gradients still joins
    return {"calls": calls, "clean": clean.item(), "flagged": flagged.item(), "empty": empty.item(),
            "exact": all(torch.equal(a, b) for a, b in zip(got, want))}


def test_unscale_and_find_inf_agrees_on_every_rank_without_host_reads():
    """Gradients are divided by a power-of-two scale exactly (fp32 and fp16); an inf on one
    element of one rank raises the flag on every rank; no flag without one; a rank with no
    gradients takes part; nothing is read on the host."""
    results = run_on_ranks(_unscale, 2)
    for rank, r in enumerate(results):
        assert r["exact"] and r["calls"] == [], (rank, r)
        assert r["clean"] == 0 and r["flagged"] > 0 and r["empty"] == 0, (rank, r)
