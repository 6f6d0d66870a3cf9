"""Parameters that get no gradient on some ranks: the order of collectives never depends on it.

An MoE model routes each token to one expert by its id (``token % EXPERTS``); rank 0's data
reaches every expert and every other rank's avoids one, so each MoE block has an expert
without tokens on some ranks only; one parameter (in the first block) is used on no rank.
If a rank issued its reduce-scatters in another order than its peers, the collectives would
pair up wrongly: silently averaging the wrong gradients where the sizes agree (on NCCL as
on gloo), a crash or a hang where they do not. A spy checks the sequence of reduce-scatters
on every rank directly (runtime [Note: one order of reduce-scatters]), and the result is
compared with ``DistributedDataParallel(find_unused_parameters=True)``. Every launch has a
hard timeout: a hang fails the test.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import vescale_zero as vz
from tests.distributed import run_on_ranks
from tests.models import assemble, local_pieces, record_reduce_scatters, train_steps
from tests.numerics import adam_divergence_bound, assert_reduced_like, full_grads, local_reference
from vescale_zero.fully_shard import groups_of

VOCAB, DIM, EXPERTS, SEQ, STEPS, PER_RANK = 30, 12, 3, 4, 3, 4


class MoEBlock(nn.Module):
    def __init__(self, with_unused: bool) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(EXPERTS))
        if with_unused:
            self.unused = nn.Parameter(torch.randn(DIM))  # no rank ever uses it

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        probs = self.router(h).softmax(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            mask = route == e
            if mask.any():  # an expert with no token on this rank is not run at all
                out[mask] = expert(h[mask]) * probs[mask][:, e : e + 1]
        return h + out


class MoELM(nn.Module):
    def __init__(self, recompute: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(MoEBlock(with_unused=i == 0) for i in range(2))
        self.head = nn.Linear(DIM, VOCAB)
        self.recompute = recompute

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h, route = self.embed(tokens), tokens % EXPERTS
        for block in self.blocks:
            h = checkpoint(block, h, route, use_reentrant=True) if self.recompute else block(h, route)
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), targets.reshape(-1))


def _batches(rank: int, world_size: int):
    """Rank 0 routes to every expert; rank r > 0 never to expert r % EXPERTS. So some ranks
    complete every group's gradients and others do not, and the ranks differ in which."""
    g = torch.Generator().manual_seed(100 + rank)
    allowed = torch.tensor([t for t in range(VOCAB) if rank == 0 or t % EXPERTS != rank % EXPERTS])
    out = []
    for _ in range(STEPS):
        x = allowed[torch.randint(0, len(allowed), (PER_RANK, SEQ), generator=g)]
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def _train(rank, world_size, variant):
    """``variant``: "ddp", "vescale" or "vescale+recompute" (reentrant, around each block)."""
    model = MoELM(recompute=variant == "vescale+recompute")
    grads = []  # the reduced gradients of each step (full tensors)
    if variant == "ddp":
        model = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = train_steps(model, opt, _batches(rank, world_size), after_backward=lambda: grads.append(
            {n: p.grad.clone() for n, p in model.module.named_parameters() if p.grad is not None}))
        return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.module.named_parameters()},
                "grads": grads, "reference": local_reference(MoELM(), _batches(rank, world_size)[:1])}
    for block in model.blocks:
        vz.fully_shard(block)
    vz.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with record_reduce_scatters(groups_of(model)) as sequence:  # groups: root, blocks[0], blocks[1]
        losses = train_steps(model, opt, _batches(rank, world_size), after_backward=lambda: grads.append(
            full_grads(model)) if not grads else None)
    return {"losses": losses, "pieces": local_pieces(model), "sequence": sequence, "grads": grads}


def _all_variants(rank, world_size):
    return {v: _train(rank, world_size, v) for v in ("ddp", "vescale", "vescale+recompute")}


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_dependent_unused_experts_match_ddp(world_size):
    results = run_on_ranks(_all_variants, world_size, timeout=180)
    ddp = results[0]["ddp"]
    for variant in ("vescale", "vescale+recompute"):
        runs = [r[variant] for r in results]
        sequences = [r["sequence"] for r in runs]
        assert all(s == sequences[0] for s in sequences), f"{variant}: ranks issued reduce-scatters in different orders"
        assert sequences[0] == [2, 1, 0] * STEPS, sequences[0]  # blocks[1], blocks[0], root
        # Against DDP, what the math guarantees (tests/numerics.py
        # [Note: comparing runs that sum in another order]): the first loss bit for bit (the same
        # weights and data on each rank, then the same all-reduce); the first step's reduced
        # gradients within the bound of two summation orders of the same per-rank gradients (an
        # unused expert's are 0 on its ranks; collectives paired up wrongly would average another
        # parameter's); the weights within what STEPS AdamW steps can move two runs apart.
        assert runs[0]["losses"][0] == ddp["losses"][0], (variant, runs[0]["losses"], ddp["losses"])
        grads, ddp_grads = runs[0]["grads"][0], ddp["grads"][0]
        assert_reduced_like(grads, dict(ddp["reference"], mean=ddp_grads), world_size, case=variant)
        params = assemble([r["pieces"] for r in runs])
        assert set(params) == set(ddp["params"])
        for name, value in params.items():
            torch.testing.assert_close(value, ddp["params"][name], rtol=0, atol=adam_divergence_bound(1e-2, STEPS),
                                       msg=lambda m, name=name, variant=variant: f"{variant} {name}: {m}")
        unused = [n for n in params if n.endswith("unused")]
        assert unused and all(torch.equal(params[n], ddp["params"][n]) for n in unused)


def _idle_everywhere(rank, world_size, policy):
    """Experts that no rank routes to: every rank still reduces every group, in the same
    order; the untouched experts then follow the unused-gradient policy."""
    model = MoELM()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    for block in model.blocks:
        vz.fully_shard(block)
    vz.fully_shard(model)
    model.set_unused_grads(policy)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.full((2, SEQ), 3 * (rank + 1))  # tokens % 3 == 0: experts 1 and 2 get none anywhere
    grads_none = []
    for _ in range(2):
        model(x, x).backward()
        grads_none.append(sorted(n for n, p in model.named_parameters() if p.requires_grad and p.grad is None))
        opt.step()
        opt.zero_grad()
    return local_pieces(model), initial, grads_none


@pytest.mark.parametrize("policy", ["none", "zero"])
def test_parameters_unused_on_every_rank(policy):
    """"none" (DDP / FSDP2): no gradient, so AdamW leaves them exactly as they were.
    "zero" (ZeRO-3 / Megatron DDP): a zero gradient, so AdamW only decays them."""
    results = run_on_ranks(_idle_everywhere, 2, policy, timeout=120)
    params, initial = assemble([r[0] for r in results]), results[0][1]
    idle = [f"blocks.{b}.experts.{e}.{k}" for b in range(2) for e in (1, 2) for k in ("weight", "bias")]
    idle += ["blocks.0.unused"]
    for _, _, grads_none in results:
        if policy == "none":
            assert set(grads_none[0]) == set(idle) and grads_none[0] == grads_none[1], grads_none
        else:
            assert grads_none == [[], []]
    decay = 1.0 if policy == "none" else (1 - 1e-2 * 1e-2) ** 2  # AdamW: weight decay 0.01 at lr 1e-2, 2 steps
    for name in idle:
        torch.testing.assert_close(params[name], initial[name] * decay, rtol=1e-6, atol=0, msg=name)
    for b in range(2):
        assert not torch.equal(params[f"blocks.{b}.experts.0.weight"], initial[f"blocks.{b}.experts.0.weight"])


def _pipeline_schedule(rank, world_size, interleaved):
    """Two micro-batches per step, each backward synced (gradients add up in the shards):
    ``interleaved`` runs both forwards before the backwards, as pipeline schedules do."""
    model = MoELM()
    model.embed.weight.requires_grad_(False)  # blocks[0] gets no input gradient: no input trigger
    for block in model.blocks:
        vz.fully_shard(block)
    vz.fully_shard(model)
    groups = groups_of(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    parts = []
    with record_reduce_scatters(groups) as sequence:
        for x, y in _batches(rank, world_size):
            micro = [(x[:2], y[:2]), (x[2:], y[2:])]
            if interleaved:
                losses = [model(a, b) / 2 for a, b in micro]
                second = model._vescale_fsdp_state.context.forward_id  # the id of the second forward
                losses[0].backward()
                # the first backward is over; the second forward's groups still take part in its own
                parts.append([g.part_in(second).value for g in groups])
                losses[1].backward()
            else:
                for a, b in micro:
                    (model(a, b) / 2).backward()
            opt.step()
            opt.zero_grad()
    return local_pieces(model), sequence, parts


def _both_schedules(rank, world_size):
    return [_pipeline_schedule(rank, world_size, interleaved) for interleaved in (False, True)]


def test_pipeline_schedule_with_idle_experts_equals_sequential_micro_batches():
    """The next micro-batch's forward runs before this one's backward: which groups take
    part in each backward is judged by the forward it differentiates (runtime
    [Note: one order of reduce-scatters]), so every rank issues the same collectives in the same
    order."""
    results = run_on_ranks(_both_schedules, 3, timeout=180)
    for variant in (0, 1):
        sequences = [r[variant][1] for r in results]
        assert all(s == sequences[0] for s in sequences), f"variant {variant}: ranks differ: {sequences}"
    for r in results:
        assert r[1][2] == [["takes part"] * 3] * len(r[1][2]), r[1][2]
    sequential = assemble([r[0][0] for r in results])
    interleaved = assemble([r[1][0] for r in results])
    for name, value in sequential.items():
        assert torch.equal(interleaved[name], value), name
