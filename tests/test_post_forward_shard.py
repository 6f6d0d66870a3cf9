"""``reshard_after_forward=<int>``: after forward each rank keeps ``1/n`` of a group's gathered
buffer and backward gathers it over ``n`` ranks only (runtime.post_forward
[Note: the post-forward shard]).

4 ranks, every block ``fully_shard(block, reshard_after_forward=2)``, 2 AdamW steps of the
awkward test model (3 blocks, tied embedding, frozen gates):

* a collective spy (tests/comm_spy.py) sees forward's all-gathers on the 4-rank shard group and
  backward's on this rank's 2-rank post-forward group ({0, 1} or {2, 3}) only, the
  reduce-scatters on the shard group;
* what is kept after forward is the group's 2-rank shard: ``m / n`` shards of the plan, and the
  full buffer freed;
* the numbers are those of ``reshard_after_forward=True`` bit for bit (backward computes with the
  weights forward gathered; nothing else changes), and those of FSDP2 with the same int and of
  the unsharded model: the first losses bit for bit, the first step's gradients within the bound
  of two summation orders of 4 terms, the weights within what 2 AdamW steps allow
  (tests/numerics.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import vescale_zero as vz
from tests.comm_spy import CommSpy
from tests.distributed import run_cases_on_ranks
from tests.models import AwkwardLM, make_batches, rank_slice
from tests.numerics import adam_divergence_bound, full_grads, reduction_order_bound
from vescale_zero.hosts import GroupState

WORLD, N, STEPS, LR, GLOBAL_BATCH = 4, 2, 2, 1e-2, 8
pytestmark = pytest.mark.slow  # 4 ranks on 2 cores: over 20 s


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, torch.distributed.tensor.DTensor) else value


def _train(rank: int, world_size: int, kind: str, value):
    """kind: "ours" / "fsdp2" with every block's ``reshard_after_forward=value``, or "reference"
    (unsharded, gradients averaged by one all-reduce)."""
    model = AwkwardLM(seed=0, n_blocks=3)
    if kind == "ours":
        for block in model.blocks:
            vz.fully_shard(block, reshard_after_forward=value)
        vz.fully_shard(model)
    elif kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=value)
        fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)
    spy, out = CommSpy(), {"losses": [], "grads": [], "kept": []}
    with spy.installed():
        for step, batch in enumerate(make_batches(STEPS, GLOBAL_BATCH)):
            x, y = rank_slice(batch, rank, world_size)
            with spy.window(step, "forward"):
                loss = model(x, y)
            if kind == "ours":
                out["kept"].append([(b.vescale_group.state.value, b.vescale_group.compute.is_allocated,
                                     None if b.vescale_group.post_forward is None
                                     else (b.vescale_group.post_forward.held, b.vescale_group.post_forward.length,
                                           b.vescale_group.plan.shard_size)) for b in model.blocks])
            with spy.window(step, "backward"):
                loss.backward()
            if kind == "reference":
                if not out["grads"]:
                    out["sum_abs"] = {}
                    for n, p in model.named_parameters():
                        if p.grad is not None:
                            out["sum_abs"][n] = p.grad.abs()
                            dist.all_reduce(out["sum_abs"][n])
                for p in model.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
                        p.grad /= world_size
            total = loss.detach().clone()
            dist.all_reduce(total)
            out["losses"].append(total.item() / world_size)
            out["grads"].append(full_grads(model) if kind == "ours" else
                                {n: _full(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None})
            opt.step()
            opt.zero_grad()
    out["params"] = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    out["gathers"] = [(c[5], tuple(dist.get_process_group_ranks(c[3]))) for c in spy.calls if c[0] == "all_gather"]
    out["reduce_scatters"] = sorted({tuple(dist.get_process_group_ranks(c[3])) for c in spy.calls
                                     if c[0] == "reduce_scatter"})
    out["rank"] = rank
    return out


@pytest.fixture(scope="module")
def runs():
    cases = {"ours int": (_train, ("ours", N)), "ours True": (_train, ("ours", True)),
             "fsdp2 int": (_train, ("fsdp2", N)), "reference": (_train, ("reference", None))}
    return run_cases_on_ranks(cases, WORLD, timeout=400)


def test_backward_gathers_inside_the_post_forward_group_only(runs):
    for mine in runs["ours int"]:
        rank = mine["rank"]
        block = tuple(range(rank // N * N, rank // N * N + N))
        forward = {ranks for when, ranks in mine["gathers"] if when == "forward"}
        backward = [ranks for when, ranks in mine["gathers"] if when == "backward"]
        assert forward == {tuple(range(WORLD))}, (rank, forward)
        # every block but the one kept gathered for backward's start ([Note: orders]) is gathered again
        assert backward and set(backward) == {block} and len(backward) == STEPS * 2, (rank, backward)
        assert mine["reduce_scatters"] == [tuple(range(WORLD))], mine["reduce_scatters"]
        for step in mine["kept"]:
            # blocks 0 and 1 hold their 2-rank shard (2 of the plan's 4 shards), no full buffer;
            # block 2, kept gathered for backward's start, holds its full buffer
            for state, full, (held, length, shard_size) in step[:2]:
                assert (state, full, held, length) == ("sharded post forward", False, True, 2 * shard_size), step
            assert step[2][0] == GroupState.UNSHARDED.value and step[2][1], step
    for mine in runs["ours True"]:
        assert {ranks for _, ranks in mine["gathers"]} == {tuple(range(WORLD))}


def test_numbers_equal_reshard_true_fsdp2_and_unsharded(runs):
    ours, exact = runs["ours int"][0], runs["ours True"][0]
    assert ours["losses"] == exact["losses"]
    for step in range(STEPS):
        assert ours["grads"][step].keys() == exact["grads"][step].keys()
        for name, grad in ours["grads"][step].items():
            assert torch.equal(grad, exact["grads"][step][name]), (step, name)
    for name, value in ours["params"].items():
        assert torch.equal(value, exact["params"][name]), name
    reference, fsdp2 = runs["reference"][0], runs["fsdp2 int"][0]
    for kind, other in (("ours", ours), ("fsdp2", fsdp2)):
        assert other["losses"][0] == reference["losses"][0], kind
        assert set(other["grads"][0]) == set(reference["sum_abs"]), (kind, sorted(other["grads"][0]))
        for name, grad in other["grads"][0].items():
            bound = reduction_order_bound(reference["sum_abs"][name], WORLD)
            excess = ((grad - reference["grads"][0][name]).abs() - bound).max().item()
            assert excess <= 0, f"{kind} {name}: gradient {excess:.3e} past the summation-order bound"
        for name, value in other["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=0,
                                       atol=adam_divergence_bound(LR, STEPS), msg=f"{kind} {name}")
