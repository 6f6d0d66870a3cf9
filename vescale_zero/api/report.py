"""What sharding costs and moves: padding per group, the layout orders and bytes through collectives."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Dict, Tuple

from torch import nn

from ..primitives.planner import MODEL_ORDER
from .fully_shard import groups_of

__all__ = ["ShardingReport", "sharding_report", "reset_comm_stats"]


@dataclass(frozen=True)
class ShardingReport:
    """Totals over every group under a module, on this rank.

    ``orders`` counts the groups laid out in each order (``ShardPlan.order``), the model's
    first, e.g. ``(("model", 60), ("granularity descending", 1))``; ``reordered_groups`` is how
    many groups the planner laid out in another order than the model's, because that order
    padded less (see ``planner.plan``'s ``search_orders``).

    ``bytes_all_gathered`` / ``bytes_reduce_scattered`` count the full buffer of each
    collective (``world_size * shard_size`` elements), cumulative since the last
    :func:`reset_comm_stats`.
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
        return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB ({n:,d} bytes)"


def sharding_report(module: nn.Module) -> ShardingReport:
    groups = groups_of(module)
    numel = sum(s.numel for g in groups for s in g.plan.specs)
    padding = sum(g.plan.padding for g in groups)
    total = numel + padding
    orders = Counter(g.plan.order for g in groups)
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
    )


def reset_comm_stats(module: nn.Module) -> None:
    for g in groups_of(module):
        g.stats.reset()
