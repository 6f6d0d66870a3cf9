"""Tolerances for comparing two runs that sum in another order, derived, never fitted.

[Note: comparing runs that sum in another order]
Two engines (ZeRO-3 and ragged, DDP and ragged, 2 ranks and 3) given the same weights and data
compute the same per-rank gradients a_r bit for bit, then reduce them in different orders
(buckets, one reduce-scatter per group, a ring or a tree). What is guaranteed:

* the first forward (identical inputs, identical ops): bit-exact losses;
* the reduced gradients: :func:`reduction_order_bound`, from fp32's unit roundoff and the number
  of summed terms;
* Adam trajectories: nothing bit-exact after the first step. Adam divides each element's step by
  that element's own gradient magnitude, so where a gradient is at rounding level (a near-zero
  component) another summation order changes its sign, and its step by up to lr.
  :func:`adam_divergence_bound` is what Adam's steps can move two runs apart, whatever the
  gradients; it is loose by design (it only rules out gross errors such as a lost update at many
  steps); the gradient bound above is the sharp check of the reduction itself.

Where both runs' inputs are identical bit for bit (sharded vs unsharded under one reduction, a
resumed run vs the uninterrupted one), compare exactly instead.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["FP32_UNIT_ROUNDOFF", "gamma", "reduction_order_bound", "adam_step_bound", "adam_divergence_bound",
           "local_reference", "assert_reduced_like", "grad_pieces", "full_grads"]

FP32_UNIT_ROUNDOFF = 2.0 ** -24


def gamma(k: int, u: float = FP32_UNIT_ROUNDOFF) -> float:
    """Higham's gamma_k = k u / (1 - k u): a sum of k + 1 terms in any order is within
    gamma_k * sum(|terms|) of the exact sum."""
    return k * u / (1 - k * u)


def reduction_order_bound(sum_abs_terms: torch.Tensor, world_size: int, terms_per_rank: int = 1) -> torch.Tensor:
    """Per element, how far two fp32 means of the same ``world_size * terms_per_rank`` terms,
    summed in any two orders, can be apart: each is within gamma_L * sum|t| / n of the exact
    mean (L - 1 additions, and one more rounding for the division by n, before or after the
    sum), so two of them within 2 * gamma_L * sum|t| / n. ``sum_abs_terms`` is sum over ranks of
    |a_r| (computed by the test from the same weights and data)."""
    terms = world_size * terms_per_rank
    return 2 * gamma(terms) * sum_abs_terms / world_size


def adam_step_bound(t: int, betas: Tuple[float, float] = (0.9, 0.999)) -> float:
    """The largest |m_hat_t| / sqrt(v_hat_t) of Adam at step t, for any gradients.

    m_t = (1 - b1) sum_k b1^k g_{t-k},  v_t = (1 - b2) sum_k b2^k g_{t-k}^2  (k < t). By Cauchy-Schwarz,
    |sum_k b1^k g| = |sum_k (b1^k / b2^(k/2)) (b2^(k/2) g)| <= sqrt(sum_k (b1^2/b2)^k) * sqrt(v_t / (1 - b2)),
    so with the bias corrections m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t):
        |m_hat| / sqrt(v_hat) <= (1 - b1) / (1 - b1^t) * sqrt(sum_{k<t} (b1^2/b2)^k) * sqrt((1 - b2^t) / (1 - b2)).
    It is 1 at t = 1 (m_hat / sqrt(v_hat) = sign(g)), 1.0014 at t = 2, 1.0036 at t = 3 for (0.9, 0.999),
    and grows to (1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2)) (7.3) for large t. eps only makes the step
    smaller; gradient clipping and loss scaling rescale g, which the bound does not depend on."""
    b1, b2 = betas
    ratio = sum((b1 * b1 / b2) ** k for k in range(t))
    return (1 - b1) / (1 - b1 ** t) * math.sqrt(ratio) * math.sqrt((1 - b2 ** t) / (1 - b2))


def adam_divergence_bound(lr: float, steps: int, betas: Tuple[float, float] = (0.9, 0.999)) -> float:
    """Per element, how far two AdamW runs from the same weights can be apart after ``steps``
    steps with learning rates at most ``lr``, whatever their gradients: each step moves an element by
    lr * m_hat / (sqrt(v_hat) + eps) (at most lr * adam_step_bound(t)) and decays it by a factor
    (1 - lr * wd) <= 1, which does not widen a difference; the two runs' steps may point opposite
    ways: 2 * lr * sum_t adam_step_bound(t)."""
    return 2 * lr * sum(adam_step_bound(t, betas) for t in range(1, steps + 1))


def grad_pieces(model: torch.nn.Module) -> Dict[str, tuple]:
    """Rank side, no collective: ``{name: (shape, start, end, this rank's piece of the reduced
    gradient)}`` of a sharded ``model``'s parameters that have one (tests.models.assemble's format)."""
    import vescale_zero as vz

    mine = {}
    for prefix, module in model.named_modules():
        if isinstance(module, vz.RaggedFSDPModule) and module.vescale_group is not None:
            group = module.vescale_group
            for i, managed in enumerate(group.managed):
                sp = group.sharded_params[i]
                if sp.grad is not None:
                    rng = sp.sharded_range
                    mine[f"{prefix}.{managed.fqn}" if prefix else managed.fqn] = (
                        tuple(rng.shape), rng.start, rng.end, sp.grad.to_local().detach().clone())
    return mine


def full_grads(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Rank side, in every rank: the reduced gradients of a sharded ``model``'s parameters that
    have one, assembled into full tensors from every rank's piece."""
    everyone: List[dict] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, grad_pieces(model))
    full: Dict[str, torch.Tensor] = {}
    for pieces in everyone:
        for name, (shape, start, end, g) in pieces.items():
            full.setdefault(name, torch.zeros(shape, dtype=g.dtype)).view(-1)[start:end] = g
    return full


def local_reference(model: torch.nn.Module, micro_batches: Sequence[tuple], group=None) -> Dict[str, object]:
    """Rank side, in every rank of ``group``: what an unsharded ``model`` holding the sharded run's
    weights computes on this rank's ``micro_batches`` (each loss divided by their number, as the
    training loops do): ``losses`` (each micro-batch's), ``mean`` (over ranks, of the local
    gradients a_r = the sum of the micro-batches' gradients) and ``sum_abs`` (sum over ranks and
    micro-batches of |a_rk|: the terms a reduced gradient sums, for :func:`reduction_order_bound`).
    The same weights, data and ops as the sharded run's local forward and backward: its losses
    are bit-identical, its reduced gradients a mean of the same terms in another order."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    local = {n: torch.zeros_like(p) for n, p in params.items()}
    sum_abs = {n: torch.zeros_like(p) for n, p in params.items()}
    losses: List[float] = []
    for x, y in micro_batches:
        loss = model(x, y) / len(micro_batches)
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        for (n, _), g in zip(params.items(), grads):
            if g is not None:
                local[n] += g  # 0 + g1 == g1 exactly; then g1 + g2, as .grad accumulates
                sum_abs[n] += g.abs()
        losses.append(loss.item())
    for n in params:
        dist.all_reduce(local[n], group=group)
        dist.all_reduce(sum_abs[n], group=group)
        local[n] /= dist.get_world_size(group)
    return {"losses": losses, "mean": local, "sum_abs": sum_abs}


def assert_reduced_like(grads: Dict[str, torch.Tensor], reference: Dict[str, object], world_size: int,
                        terms_per_rank: int = 1, case: str = "") -> None:
    """Parent side: every reduced gradient in ``grads`` (full tensors) is within
    :func:`reduction_order_bound` of the :func:`local_reference` mean of the same terms (two
    means of the same world_size * terms_per_rank terms in two summation orders)."""
    mean, sum_abs = reference["mean"], reference["sum_abs"]
    assert set(grads) == set(mean), (case, sorted(grads), sorted(mean))
    for name, value in grads.items():
        bound = reduction_order_bound(sum_abs[name], world_size, terms_per_rank)
        excess = ((value - mean[name]).abs() - bound).max().item()
        assert excess <= 0, f"{case} {name}: gradient {excess:.3e} past the summation-order bound".lstrip()
