"""``fully_shard(optimizer_aware=...)``: plan each group against what its optimizer moves.

A matrix optimizer (:class:`vescale_zero.optim.Muon`) computes on whole matrices; a matrix cut by
a rank boundary travels to one rank and back every step, a matrix whole on one rank does not.
With ``optimizer_aware`` the planner weighs the two ways to lay a group out -- today's piecewise
plan, or matrices kept whole on one rank at the price of padding in every gather and
reduce-scatter -- by the bytes each rank receives per step
(planner [Note: placing units against padding]), and ``vz.sharding_report`` shows the choice::

    vz.fully_shard_layers(model, optimizer_aware=True)        # Muon's whole matrices
    vz.fully_shard_layers(model, optimizer_aware=Muon.optimizer_aware(micro_batches=4))
    opt = Muon(model.parameters(), lr=0.02)                    # a matrix whole on one rank moves nothing
    print(vz.sharding_report(model))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..primitives.planner import (
    PIECEWISE,
    PLACED,
    OptimizerUnits,
    PlacementChoice,
    StepTraffic,
    TensorSpec,
    optimizer_aware_plan,
)

__all__ = ["OptimizerAware", "whole_matrices", "resolve_optimizer_aware", "choose_placement"]

UnitPolicy = Callable[[str, torch.Tensor], Optional[OptimizerUnits]]


def whole_matrices(name: str, param: torch.Tensor) -> Optional[OptimizerUnits]:
    """Muon's units: every parameter of 2+ dimensions that requires grad is one matrix of
    ``shape[0]`` rows (Muon's view of it), costing ``m*n*min(m, n)``; 1-D parameters are none."""
    if param.dim() < 2 or not param.requires_grad:
        return None
    rows, cols = param.shape[0], math.prod(param.shape[1:])
    return OptimizerUnits(rows * cols, float(rows * cols * min(rows, cols)))


@dataclass(frozen=True)
class OptimizerAware:
    """``fully_shard``'s ``optimizer_aware`` argument (``True`` is ``OptimizerAware()``: Muon's).

    Args:
        units: ``(name, parameter) -> OptimizerUnits | None``: the runs of elements the optimizer
            computes on whole (default :func:`whole_matrices`); names as in ``granularity``.
        micro_batches: forward/backward passes per optimizer step (gradient accumulation): each
            gathers the group again, while the optimizer moves once per step.
        itemsize, moves: bytes per element the optimizer moves (fp32 momentum: 4) and how often
            per step (to the root and back: 2).
        force: ``"piecewise"`` or ``"placed"`` to take that plan whatever it costs (benchmarks,
            tests); ``None``: the cheaper one (planner [Note: placing units against padding]).
    """

    units: UnitPolicy = whole_matrices
    micro_batches: int = 1
    itemsize: int = 4
    moves: int = 2
    force: Optional[str] = None

    def __post_init__(self) -> None:
        if self.micro_batches < 1:
            raise ValueError(f"OptimizerAware: micro_batches must be >= 1, got {self.micro_batches}")
        if self.force not in (None, PIECEWISE, PLACED):
            raise ValueError(f"OptimizerAware: force must be None, {PIECEWISE!r} or {PLACED!r}, got {self.force!r}")


def resolve_optimizer_aware(value: Union[bool, OptimizerAware, None]) -> Optional[OptimizerAware]:
    """``fully_shard``'s argument as an :class:`OptimizerAware` (``None`` when off)."""
    if value is None or value is False:
        return None
    if value is True:
        return OptimizerAware()
    if not isinstance(value, OptimizerAware):
        raise TypeError(f"optimizer_aware must be a bool or an OptimizerAware (e.g. Muon.optimizer_aware()), got "
                        f"{type(value).__name__}")
    return value


def choose_placement(
    held: Sequence[Tuple[str, torch.Tensor]],
    granularities: Sequence[int],
    policy: OptimizerAware,
    process_group: dist.ProcessGroup,
    replicate_group: Optional[dist.ProcessGroup],
    align: int,
    *,
    mp_policy: Optional[MixedPrecisionPolicy],
    fp8: bool,
    reshard_after_forward: Optional[bool],
) -> PlacementChoice:
    """The plan of one ``fully_shard`` group under ``policy``: ``held`` are the tensors the group
    holds (TP-local ones beside tensor parallelism), ``granularities`` what the user's policy
    gave them, the rest ``fully_shard``'s arguments. Per step: 2 gathers per micro-batch
    (forward and backward) unless ``reshard_after_forward`` is ``False``, in ``param_dtype``
    (1 byte with an FP8 gather); one reduce-scatter in ``reduce_dtype`` (accumulation without
    sync), all-reduced across HSDP's replicas."""
    master = held[0][1].dtype
    compute = mp_policy.param_dtype if mp_policy is not None and mp_policy.param_dtype else master
    reduce = mp_policy.reduce_dtype if mp_policy is not None and mp_policy.reduce_dtype else compute
    units: List[Optional[OptimizerUnits]] = [policy.units(n, p) for n, p in held]
    specs = [TensorSpec(p.numel(), g, n) for (n, p), g in zip(held, granularities)]
    traffic = StepTraffic(gather_itemsize=1 if fp8 else _itemsize(compute), reduce_itemsize=_itemsize(reduce),
                          gathers=(1 if reshard_after_forward is False else 2) * policy.micro_batches,
                          replicas=dist.get_world_size(replicate_group) if replicate_group is not None else 1,
                          unit_itemsize=policy.itemsize, unit_moves=policy.moves)
    return optimizer_aware_plan(specs, units, dist.get_world_size(process_group), traffic, align, force=policy.force)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
