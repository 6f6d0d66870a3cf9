"""A model's own init on sharded parameters: FSDP2's meta-device recipe (issue 47).

    with torch.device("meta"): model = Net()
    fully_shard(block) ...; fully_shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(s); model.init_weights()     # or each module's reset_parameters()

At 2 and 3 gloo ranks, with element granularity (pieces cut inside rows; a rank may own nothing
of a small tensor) and row granularity, every initialiser ``docs/torch_api.md`` lists as bit for
bit (``nn.init`` uniform_, normal_, trunc_normal_ (both of its algorithms), kaiming / xavier
uniform and normal, zeros_, ones_, constant_, fill_, ``copy_`` of a full tensor, the
``reset_parameters()`` of nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm, nn.Conv1d) leaves:

  * the same full tensors on every rank;
  * the values the same seed gives the unsharded model initialised the same way: bit for bit
    (ragged_tensor [Note: random fills draw the whole tensor]);
  * the random generator where the unsharded model's init leaves it (the next draw is equal);
  * a model that trains (one step equals the unsharded model's).

Initialisers that need the whole tensor in other ways are refused with a message naming the way
(``orthogonal_``, an ``nn.Embedding`` with ``padding_idx``). Reductions the inits and users call
(``norm``, ``sum``, ``mean``, ``max``, ``amax``, ``all``, ``any``, ``equal``, ``allclose``) give the
whole tensor's value on every rank.
"""

from __future__ import annotations

import math
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist
from torch import nn

import vescale_zero as vz
from tests.distributed import run_cases_on_ranks
from tests.sweeps import sweep

SEED = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(13, 7)
        self.fc2 = nn.Linear(7, 13, bias=False)
        self.norm = nn.LayerNorm(13)
        self.conv = nn.Conv1d(13, 5, 3)
        self.scale = nn.Parameter(torch.empty(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x + self.fc2(torch.relu(self.fc1(x))))
        return h + self.conv(h.transpose(1, 2)).mean(dim=(1, 2))[:, None, None] * self.scale.sum()  # per sample


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 13)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.rms = nn.RMSNorm(13)
        self.head = nn.Linear(13, 11)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.rms(h))

    def init_weights(self, full_head: torch.Tensor) -> None:
        """Every documented initialiser, in a torchtitan-like order."""
        nn.init.normal_(self.embed.weight, std=1.0)
        for i, block in enumerate(self.blocks):
            nn.init.trunc_normal_(block.fc1.weight, std=0.02 / math.sqrt(2 * (i + 1)))   # rejection sampling
            nn.init.trunc_normal_(block.fc2.weight, std=1.0, a=-0.3, b=0.3)             # the narrow algorithm
            nn.init.uniform_(block.fc1.bias, -0.1, 0.1)
            nn.init.kaiming_uniform_(block.conv.weight, a=math.sqrt(5))
            nn.init.zeros_(block.conv.bias)
            nn.init.ones_(block.norm.weight)
            nn.init.constant_(block.norm.bias, 0.125)
            if i:
                block.scale.data.fill_(0.5)  # .data: this rank's piece (element-wise: exact)
            else:
                nn.init.normal_(block.scale, std=0.5)
        nn.init.kaiming_normal_(self.blocks[0].fc2.weight, mode="fan_out")
        nn.init.xavier_uniform_(self.blocks[1].fc1.weight, gain=2.0)
        self.rms.weight.fill_(1.5)
        self.head.weight.copy_(full_head)
        nn.init.uniform_(self.head.bias)


def _reset_all(model: nn.Module) -> None:
    """Each module's reset_parameters(), in module order (``scale`` by hand: it has none)."""
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
        if isinstance(module, Block):
            nn.init.normal_(module.scale)


def _sharded(granularity: str) -> Net:
    with torch.device("meta"):
        model = Net()
    for block in model.blocks:
        vz.fully_shard(block, granularity=granularity)
    vz.fully_shard(model, granularity=granularity)
    model.to_empty(device="cpu")
    return model


def _full(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, vz.RaggedDTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def _step(model: nn.Module, rank: int, world: int, sharded: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, 11, (3 * world, 4), generator=g)
    if sharded:
        tokens = tokens.chunk(world)[rank]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(tokens).square().mean()
    loss.backward()
    opt.step()
    return loss.detach()


def init_case(rank: int, world: int, granularity: str, how: str) -> Dict[str, Any]:
    full_head = torch.arange(13 * 11, dtype=torch.float32).view(11, 13) / 100
    torch.manual_seed(0)
    ref = Net()  # the unsharded model, initialised the same way from the same seed
    model = _sharded(granularity)
    for m in (ref, model):
        torch.manual_seed(SEED)
        with torch.no_grad():
            m.init_weights(full_head) if how == "init_weights" else _reset_all(m)
        if m is ref:
            ref_next = torch.rand(4)
    out: Dict[str, Any] = {"next draw": torch.equal(torch.rand(4), ref_next)}
    got, want = _full(model), {n: p.detach().clone() for n, p in ref.named_parameters()}
    out["vs unsharded"] = {n: (got[n] - want[n]).abs().max().item() for n in want}
    everyone = [None] * world
    dist.all_gather_object(everyone, got)
    out["same on every rank"] = all(all(torch.equal(o[n], got[n]) for n in got) for o in everyone)
    out["reductions"] = _reductions(model, ref)
    _step(model, rank, world, True)
    _step(ref, rank, world, False)
    after, ref_after = _full(model), {n: p.detach() for n, p in ref.named_parameters()}
    out["after a step"] = max((after[n] - ref_after[n]).abs().max().item() for n in after)
    return out


def _reductions(model: Net, ref: Net) -> Dict[str, Any]:
    p, q = model.blocks[0].fc1.weight, ref.blocks[0].fc1.weight.detach()
    e, f = model.embed.weight, ref.embed.weight.detach()
    return {
        "norm": (p.norm().item(), q.norm().item()),
        "vector_norm 3": (torch.linalg.vector_norm(e, 3).item(), torch.linalg.vector_norm(f, 3).item()),
        "sum": (p.sum().item(), q.sum().item()),
        "mean": (e.mean().item(), f.mean().item()),
        "max": (e.max().item(), f.max().item()),
        "min": (e.min().item(), f.min().item()),
        "amax |.|": (e.abs().amax().item(), f.abs().amax().item()),
        "all": (bool((e > -10).all()), bool((f > -10).all())),
        "any": (bool((e > 2.5).any()), bool((f > 2.5).any())),
        "equal": (torch.equal(e, f), True),
        "allclose": (torch.allclose(p, q + 1e-9), torch.allclose(q, q + 1e-9)),
        "not allclose": (torch.allclose(p, q + 1), False),
    }


def refusals_case(rank: int, world: int) -> Dict[str, Any]:
    def outcome(fn):
        try:
            fn()
            return ("ok",)
        except Exception as e:  # noqa: BLE001 - the error is the result
            return ("error", type(e).__name__, str(e))

    model = _sharded("row")
    out = {"orthogonal_": outcome(lambda: nn.init.orthogonal_(model.blocks[0].fc1.weight))}
    with torch.device("meta"):
        emb = nn.Sequential(nn.Embedding(8, 4, padding_idx=0))
    vz.fully_shard(emb)
    emb.to_empty(device="cpu")
    out["padding_idx"] = outcome(lambda: emb[0].reset_parameters())
    out["norm over a dim"] = outcome(lambda: torch.linalg.vector_norm(model.head.weight, dim=1))
    return out


@pytest.fixture(scope="module", params=sweep([2, 3], quick=3), ids=lambda n: f"{n}ranks")
def results(request):
    cases = {f"{g} {how}": (init_case, (g, how)) for g in ("element", "row") for how in ("init_weights", "reset")}
    cases["refusals"] = (refusals_case, ())
    out = run_cases_on_ranks(cases, request.param, timeout=600)
    out["world"] = request.param
    return out


def test_the_models_own_init_equals_the_unsharded_model_on_every_rank(results):
    for name, per_rank in results.items():
        if name in ("world", "refusals"):
            continue
        for r in per_rank:
            assert max(r["vs unsharded"].values()) == 0.0, (name, r["vs unsharded"])
            assert r["same on every rank"], name
            assert r["next draw"], f"{name}: the generator is not where the unsharded init leaves it"


def test_reductions_on_sharded_parameters_are_the_whole_tensors(results):
    for name, per_rank in results.items():
        if name in ("world", "refusals"):
            continue
        for r in per_rank:
            for what, (got, want) in r["reductions"].items():
                if isinstance(want, bool):
                    assert got == want, (name, what, got, want)
                else:  # the same values summed in another grouping: a few ulps of |sum|
                    assert abs(got - want) <= 1e-6 * max(1.0, abs(want)), (name, what, got, want)


def test_a_model_initialised_sharded_trains(results):
    for name, per_rank in results.items():
        if name in ("world", "refusals"):
            continue
        for r in per_rank:
            # one SGD step (lr 0.1) on the mean of the ranks' means vs the whole batch's: 1e-6 (as
            # tests/test_torch_utilities.py)
            assert math.isfinite(r["after a step"]) and r["after a step"] <= 1e-6, (name, r["after a step"])


def test_inits_that_need_the_whole_tensor_are_refused_naming_the_way(results):
    for r in results["refusals"]:
        for what in ("orthogonal_", "padding_idx", "norm over a dim"):
            outcome = r[what]
            assert outcome[:2] == ("error", "NotImplementedError"), (what, outcome)
            assert "full_tensor()" in outcome[2] and "gathered_parameters" in outcome[2], (what, outcome)

