"""A group's full parameters for a while: one all-gather of a shard-shaped tensor into a flat
buffer, each managed tensor whole as a view into it. The one gather behind
``gathered_parameters`` (each sharded object stands for its view), ``full_state_dict``
(and so ``VeScaleFSDP.full_parameters``, which installs the views as parameters:
:mod:`vescale_zero.param_swap`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, List, NamedTuple, Optional

import torch

from .collectives import all_gather

if TYPE_CHECKING:
    from .param_group import ParamGroup

__all__ = ["GroupFull", "gather_group_full"]


class GroupFull(NamedTuple):
    flat: torch.Tensor
    """The whole group, flat (the plan's global layout)."""
    views: List[torch.Tensor]
    """Each managed tensor, whole, in the group's order: views into ``flat``."""


def gather_group_full(group: "ParamGroup", local: torch.Tensor, scratch: Optional[torch.Tensor] = None) -> GroupFull:
    """All-gather ``local`` (laid out as the group's shard: its master, or a tensor shaped like
    it) into a new flat buffer, or into the front of ``scratch``. Collective over the group."""
    if scratch is not None:
        flat = scratch.narrow(0, 0, group.plan.global_size)
    else:
        flat = torch.empty(group.plan.global_size, dtype=local.dtype, device=group.device)
    all_gather(flat, local, group.process_group)
    views = [flat.narrow(0, off, spec.numel).view(group.managed[i].shape)
             for i, (spec, off) in enumerate(zip(group.plan.specs, group.plan.offsets))]
    return GroupFull(flat, views)
