"""Activation recompute in every form users turn on gives the gradients of the run without it.

The awkward test model (primes everywhere, a frozen parameter in each block, a tied
embedding) trains 2 steps per variant at 2 and 3 ranks; every variant's gradients after
each backward and parameters after each step must equal the variant without recompute
bit for bit (the recompute runs the same operations), and that run equals the unsharded
reference (tests/test_fully_shard.py proves it; here checked again by the derived bounds of
tests/numerics.py).

Forms (runtime [Note: recompute]):
  around/reentrant       torch.utils.checkpoint(block, h, use_reentrant=True): the first
                         forward runs under no_grad, the recompute inside backward
  around/non-reentrant   torch.utils.checkpoint(block, h, use_reentrant=False)
  inside/reentrant       the block's ``forward`` checkpointed inside its ``__call__`` (how
  inside/non-reentrant   Hugging Face's gradient_checkpointing_enable does it): the hooks stay
                         outside, so pre-backward must install the full parameters
  chunk/reentrant        one reentrant checkpoint around both blocks (Megatron's
                         ``recompute_method="uniform"``): two groups recomputed in one nested
                         backward
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import vescale_zero as vz
from tests.distributed import run_on_ranks
from tests.models import AwkwardLM, assemble, local_pieces, make_batches, rank_slice, train_reference, train_steps
from tests.numerics import adam_divergence_bound, assert_reduced_like, local_reference

STEPS, GLOBAL_BATCH = 2, 12
VARIANTS = ["none", "around/reentrant", "around/non-reentrant", "inside/reentrant", "inside/non-reentrant",
            "chunk/reentrant"]


class RecomputeLM(AwkwardLM):
    """AwkwardLM whose blocks run under one of the recompute forms of the module docstring."""

    def __init__(self, variant: str) -> None:
        super().__init__(seed=0)
        self.variant = variant
        where, _, kind = variant.partition("/")
        self.where, self.reentrant = where, kind == "reentrant"
        if where == "inside":
            for block in self.blocks:
                plain = block.forward
                block.forward = functools.partial(checkpoint, plain, use_reentrant=self.reentrant)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos
        if self.where == "around":
            for block in self.blocks:
                h = checkpoint(block, h, use_reentrant=self.reentrant)
        elif self.where == "chunk":
            h = checkpoint(lambda x: self.blocks[1](self.blocks[0](x)), h, use_reentrant=self.reentrant)
        else:
            for block in self.blocks:
                h = block(h)
        logits = self.head(self.norm(h))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _grad_pieces(model) -> dict:
    out = {}
    for name, (shape, start, end, _) in local_pieces(model).items():
        out[name] = (shape, start, end, None)
    for prefix, module in model.named_modules():
        if isinstance(module, vz.RaggedFSDPModule) and module.vescale_group is not None:
            group = module.vescale_group
            for i, m in enumerate(group.managed):
                name = f"{prefix}.{m.fqn}" if prefix else m.fqn
                grad = group.sharded_params[i].grad
                grad = None if grad is None else grad.to_local()
                shape, start, end, _ = out[name]
                out[name] = (shape, start, end, grad.detach().clone() if grad is not None else torch.zeros(end - start))
    return out


def _train_variants(rank, world_size):
    results = {}
    for variant in VARIANTS:
        model = RecomputeLM(variant)
        for block in model.blocks:
            vz.fully_shard(block, granularity="row")
        vz.fully_shard(model, granularity="row")
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
        grads = []
        batches = [rank_slice(b, rank, world_size) for b in make_batches(STEPS, GLOBAL_BATCH)]
        losses = train_steps(model, opt, batches,
                             after_backward=lambda model=model, grads=grads: grads.append(_grad_pieces(model)))
        results[variant] = {"losses": losses, "grads": grads, "params": local_pieces(model)}
    # the unsharded model on this rank's first batch (tests/numerics.py): its loss averaged over
    # the ranks by the same all-reduce as train_steps', its gradients' mean and magnitudes
    reference = local_reference(AwkwardLM(seed=0), [batches[0]])
    first_loss = torch.tensor(reference["losses"][0])
    torch.distributed.all_reduce(first_loss, op=torch.distributed.ReduceOp.AVG)
    results["reference"] = dict(reference, first_loss=first_loss.item())
    return results


@pytest.fixture(scope="module")
def reference():
    return train_reference(AwkwardLM(seed=0), make_batches(STEPS, GLOBAL_BATCH), lr=1e-2)


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_recompute_form_equals_the_run_without(world_size, reference):
    per_rank = run_on_ranks(_train_variants, world_size)
    runs = {}
    for variant in VARIANTS:
        mine = [r[variant] for r in per_rank]
        runs[variant] = {
            "losses": mine[0]["losses"],
            "grads": [assemble([m["grads"][step] for m in mine]) for step in range(STEPS)],
            "params": assemble([m["params"] for m in mine]),
        }
    base = runs["none"]
    # The run without recompute against the unsharded model, by what the math guarantees
    # (tests/numerics.py [Note: comparing runs that sum in another order]): the first loss bit for
    # bit (the same weights, data and ops on each rank, then the same all-reduce); the first
    # step's reduced gradients within the bound of two summation orders of the per-rank
    # gradients; the trained weights within what STEPS AdamW steps can move two runs apart.
    local = per_rank[0]["reference"]
    assert base["losses"][0] == local["first_loss"], (base["losses"], local["first_loss"])
    trained = {name: grad for name, grad in base["grads"][0].items() if "gate" not in name}  # gates: frozen
    assert_reduced_like(trained, local, world_size)
    for name, value in base["params"].items():
        torch.testing.assert_close(value, reference["params"][name], rtol=0, atol=adam_divergence_bound(1e-2, STEPS))
    for variant in VARIANTS[1:]:
        run = runs[variant]
        assert run["losses"] == base["losses"], variant
        for step in range(STEPS):
            for name, grad in base["grads"][step].items():
                assert torch.equal(run["grads"][step][name], grad), (variant, step, name)
                if "gate" not in name:  # the frozen gates have none; everything else must have trained
                    assert grad.abs().sum() > 0, (variant, step, name)
        for name, value in base["params"].items():
            assert torch.equal(run["params"][name], value), (variant, name)
