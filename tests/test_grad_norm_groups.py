"""The core global gradient norm over groups sharded on different process groups (MoE:
experts over the expert-data-parallel group, the rest over the data-parallel group):
vescale_zero/api/clip_grad.py [Note: several process groups]."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

import vescale_zero as vz
from tests.distributed import run_on_ranks
from tests.numerics import gamma

DIM, EP = 8, 2  # 4 ranks: experts 0 and 1, each sharded over 2 ranks; the dense layer over all 4


class MoEish(nn.Module):
    def __init__(self, expert_index: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense, self.head = nn.Linear(DIM, DIM), nn.Linear(DIM, 1)
        torch.manual_seed(100 + expert_index)  # each expert-parallel rank holds another expert
        self.expert = nn.Linear(DIM, 3 * DIM + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.expert(torch.tanh(self.dense(x)))[:, :DIM])).square().mean()


def _norms(rank, world_size):
    per_group = world_size // EP
    expert_groups = [dist.new_group(list(range(e * per_group, (e + 1) * per_group))) for e in range(EP)]
    mine = rank // per_group
    model = MoEish(mine)
    vz.fully_shard(model.dense)
    vz.fully_shard(model.expert, mesh=expert_groups[mine])
    vz.fully_shard(model)  # head: the root group, over the world
    model(torch.randn(4, DIM, generator=torch.Generator().manual_seed(rank))).backward()
    pieces = {}
    for prefix, module in model.named_modules():
        g = getattr(module, "vescale_group", None) if isinstance(module, vz.RaggedFSDPModule) else None
        if g is not None:
            for i in g.grad_indices:
                r = g.sharded_params[i].sharded_range
                name = f"{prefix}.{g.managed[i].fqn}" if prefix else g.managed[i].fqn
                pieces[name] = (r.start, r.end, math.prod(r.shape), g.sharded_params[i].grad.to_local().clone())
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (mine, pieces))
    full = {}  # the full gradients this rank's unsharded model holds: the dense ones, and its own expert's
    for expert, theirs in everyone:
        for name, (s, e, n, g) in theirs.items():
            if not name.startswith("expert.") or expert == mine:
                full.setdefault(name, torch.zeros(n, dtype=torch.float64))[s:e] = g.double()
    exact = torch.cat(list(full.values())).norm().item()  # fp64: exact to far below the fp32 bound
    return {"ours": vz.sharded_grad_norm(model).item(), "exact": exact,
            "elements": sum(t.numel() for t in full.values())}


def test_grad_norm_over_two_process_groups_equals_the_unsharded_norm():
    """4 ranks; the dense layer and head sharded over the world, each rank's expert over its
    expert-data-parallel pair. Each rank's norm is the norm of its unsharded model's
    gradients (dense + its own expert) within the fp32 bound: the N squares (one rounding
    each) summed in some order on a rank and across the 2 or 4 ranks of each group, then the
    groups' totals added: a sum of N positive terms with at most N + 2 * world additions and
    roundings, so within gamma(N + 2 * world + 1) relative of the exact sum of squares; the
    root halves that and adds one rounding (<= 2 u): within gamma(N + 2 * world + 3) of the
    exact norm (computed in fp64)."""
    results = run_on_ranks(_norms, 4)
    assert {round(r["exact"], 6) for r in results[:2]} != {round(r["exact"], 6) for r in results[2:]}  # 2 experts
    for rank, r in enumerate(results):
        bound = gamma(r["elements"] + 2 * 4 + 3) * r["exact"]
        assert abs(r["ours"] - r["exact"]) <= bound, (rank, r, bound)
