"""What sharding costs and moves: padding per group, the layout orders and bytes through collectives,
and each optimizer-aware group's choice (``fully_shard(optimizer_aware=...)``) with its bytes."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Dict, Tuple

from torch import nn

from ..primitives.planner import MODEL_ORDER, PlacementChoice
from .fsdp_module import RaggedFSDPModule
from .fully_shard import groups_of

__all__ = ["ShardingReport", "GroupPlacement", "sharding_report", "reset_comm_stats"]


@dataclass(frozen=True)
class GroupPlacement:
    """One optimizer-aware group's choice (planner [Note: placing units against padding]): its
    module's name (``""``: the root), the plan chosen, its padding, the optimizer's matrices
    (units) whole on one rank of those it has, and the bytes one rank receives per step
    (planner [Note: bytes per rank per step]) by kind under the chosen plan, and in all under the
    piecewise one; ``unit_cost_max_over_mean``: the Newton-Schulz work of the busiest rank over
    the mean (1.0: balanced), a split matrix counted on its largest piece's rank."""

    module: str
    choice: str
    padding: int
    whole_tensors: int
    tensors: int
    all_gather_bytes: int
    reduce_scatter_bytes: int
    replica_bytes: int
    optimizer_bytes: float
    piecewise_total_bytes: float
    unit_cost_max_over_mean: float

    @property
    def total_bytes(self) -> float:
        return self.all_gather_bytes + self.reduce_scatter_bytes + self.replica_bytes + self.optimizer_bytes

    @staticmethod
    def of(module: str, choice: PlacementChoice) -> "GroupPlacement":
        step, cost = choice.step_bytes, choice.unit_cost
        mean = sum(cost) / len(cost) if cost else 0.0
        return GroupPlacement(module, choice.choice, choice.plan.padding, sum(w is True for w in choice.whole),
                              sum(w is not None for w in choice.whole), step.all_gather, step.reduce_scatter,
                              step.replicas, step.optimizer, choice.piecewise_bytes.total,
                              max(cost) / mean if mean else 1.0)


@dataclass(frozen=True)
class ShardingReport:
    """Totals over every group under a module, on this rank.

    ``orders`` counts the groups laid out in each order (``ShardPlan.order``), the model's
    first, e.g. ``(("model", 60), ("granularity descending", 1))``; ``reordered_groups`` is how
    many groups the planner laid out in another order than the model's, because that order
    padded less (see ``planner.plan``'s ``search_orders``).

    ``bytes_all_gathered`` / ``bytes_reduce_scattered`` count the full buffer of each
    collective (``world_size * shard_size`` elements), cumulative since the last
    :func:`reset_comm_stats`. ``placements``: one :class:`GroupPlacement` per group sharded with
    ``optimizer_aware``, in module order (bytes per rank per step, from the plan).
    """

    num_groups: int
    num_params: int
    numel: int
    padding: int
    padding_ratio: float
    shard_numel: int
    reordered_groups: int
    orders: Tuple[Tuple[str, int], ...]
    bytes_all_gathered: int
    bytes_reduce_scattered: int
    all_gathers: int
    reduce_scatters: int
    placements: Tuple[GroupPlacement, ...] = ()

    def as_dict(self) -> Dict[str, object]:
        return asdict(self)

    def __str__(self) -> str:
        """A table for people (``print(vz.sharding_report(model))``); ``repr`` keeps the fields."""
        def plural(n: int, word: str) -> str:
            return f"{n:,d} {word}{'' if n == 1 else 's'}"

        orders = "; ".join(f"{name}: {plural(n, 'group')}" for name, n in self.orders) or "-"
        rows = [
            ("groups", f"{plural(self.num_groups, 'group')}, {plural(self.num_params, 'parameter')}"),
            ("elements", f"{self.numel:,d} + {self.padding:,d} padding ({100 * self.padding_ratio:.3f}% of buffers)"),
            ("shard / rank", f"{self.shard_numel:,d} elements"),
            ("layout order", f"{orders} ({self.reordered_groups:,d} reordered to pad less)"),
            ("all-gathered", f"{_mib(self.bytes_all_gathered)} in {plural(self.all_gathers, 'all-gather')}"),
            ("reduce-scattered",
             f"{_mib(self.bytes_reduce_scattered)} in {plural(self.reduce_scatters, 'reduce-scatter')}"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = ["sharding report (this rank; traffic since the last reset_comm_stats)"]
        lines += [f"  {k:<{width}s}  {v}" for k, v in rows]
        if self.placements:
            lines.append("optimizer-aware groups (bytes each rank receives per step, from the plan)")
            lines.append(f"  {'group':<24s} {'plan':<30s} {'whole':>7s} {'padding':>12s} {'gather':>10s} "
                         f"{'reduce':>10s} {'optimizer':>10s} {'total':>10s} {'piecewise':>10s} {'NS max/mean':>11s}")
            for p in self.placements:
                whole = f"{p.whole_tensors}/{p.tensors}"
                lines.append(f"  {p.module or '(root)':<24.24s} {p.choice:<30.30s} {whole:>7s} "
                             f"{p.padding:>12,d} {_mb(p.all_gather_bytes):>10s} "
                             f"{_mb(p.reduce_scatter_bytes + p.replica_bytes):>10s} {_mb(p.optimizer_bytes):>10s} "
                             f"{_mb(p.total_bytes):>10s} {_mb(p.piecewise_total_bytes):>10s} "
                             f"{p.unit_cost_max_over_mean:>11.2f}")
        return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB ({n:,d} bytes)"


def _mb(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _module_names(module: nn.Module) -> Dict[int, str]:
    """id(group) -> the name of the module it belongs to."""
    return {id(m.vescale_group): name for name, m in module.named_modules()
            if isinstance(m, RaggedFSDPModule) and m.vescale_group is not None}


def sharding_report(module: nn.Module) -> ShardingReport:
    groups = groups_of(module)
    numel = sum(s.numel for g in groups for s in g.plan.specs)
    padding = sum(g.plan.padding for g in groups)
    total = numel + padding
    orders = Counter(g.plan.order for g in groups)
    names = _module_names(module)
    return ShardingReport(
        num_groups=len(groups),
        num_params=sum(len(g.plan.specs) for g in groups),
        numel=numel,
        padding=padding,
        padding_ratio=padding / total if total else 0.0,
        shard_numel=sum(g.plan.shard_size for g in groups),
        reordered_groups=len(groups) - orders[MODEL_ORDER],
        orders=tuple(sorted(orders.items(), key=lambda kv: (kv[0] != MODEL_ORDER, -kv[1], kv[0]))),
        bytes_all_gathered=sum(g.stats.all_gather_bytes for g in groups),
        bytes_reduce_scattered=sum(g.stats.reduce_scatter_bytes for g in groups),
        all_gathers=sum(g.stats.all_gathers for g in groups),
        reduce_scatters=sum(g.stats.reduce_scatters for g in groups),
        placements=tuple(GroupPlacement.of(names.get(id(g), f"group {i}"), choice)
                         for i, (g, choice) in enumerate((g, getattr(g, "placement", None)) for g in groups)
                         if choice is not None),
    )


def reset_comm_stats(module: nn.Module) -> None:
    for g in groups_of(module):
        g.stats.reset()
