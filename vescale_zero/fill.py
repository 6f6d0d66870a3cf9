"""Fill a ``fully_shard``-ed model built on meta from a per-parameter source, group by group.

::

    for each group still to initialise (module order):
        leave_meta(device)                    persistent shards only
        with open_group(owners) as fulls:     the source makes this group's full tensors
            copy this rank's range of each    into the master shard
                                              (the source frees them on exit)

[Note: filling group by group]
Another sharding scheme (DeepSpeed ZeRO-3's ``zero.Init``, a checkpoint reader) holds the
values; ``open_group`` turns one group's worth of them into full tensors for the duration of
one ``with`` block. At most one group's full tensors exist beside the shards at any moment,
so no rank ever holds the whole model. ``open_group`` is called on every rank in the same
order (module order), so a collective source stays matched across ranks.
"""

from __future__ import annotations

from typing import Callable, ContextManager, List, Sequence, Tuple, Union

import torch
from torch import nn

from .fully_shard import groups_of
from .param_group import ParamGroup

__all__ = ["fill_group_by_group", "Owner", "OpenGroup"]

Owner = Tuple[nn.Module, str]
"""A (module, attribute) that holds a managed parameter (its first owner names it)."""

OpenGroup = Callable[[List[Owner]], ContextManager[Sequence[torch.Tensor]]]
"""``open_group(owners)``: a context yielding the full tensor of each owner's parameter, in order."""


def fill_group_by_group(model: nn.Module, open_group: OpenGroup, device: Union[torch.device, str]) -> nn.Module:
    """Give every group of ``model`` built on meta its shards on ``device``, filled from
    ``open_group`` one group at a time (see [Note: filling group by group]). Collective when
    ``open_group`` is.

    Args:
        model: the root, sharded with ``fully_shard`` while its parameters were on meta.
        open_group: called once per group with the first owner of each managed parameter;
            yields one tensor per owner with that parameter's number of elements (any shape,
            dtype or device: copied into the shard's dtype and device).
        device: where the shards go; not meta.

    Returns:
        ``model``.

    Raises:
        ValueError: ``device`` is meta, or a source tensor has the wrong number of elements.
        RuntimeError: no group of ``model`` is waiting on meta.
    """
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError("fill_group_by_group needs a real device for the shards (e.g. 'cuda' or 'cpu'), got 'meta'")
    groups = [g for g in groups_of(model) if g.needs_init and g.device.type == "meta"]
    if not groups:
        raise RuntimeError("fill_group_by_group: no fully_shard group of this model is on the meta device; "
                           "apply fully_shard to a model whose parameters are on meta first")
    with torch.no_grad():
        for group in groups:
            group.leave_meta(device)
            _fill_one(group, open_group)
            group.needs_init = False
    return model


def _fill_one(group: ParamGroup, open_group: OpenGroup) -> None:
    """One group. Its own function so that nothing refers to this group's full tensors once
    it returns, before the next group's are made (a loop variable in the caller would)."""
    with open_group([m.owners[0] for m in group.managed]) as fulls:
        if len(fulls) != len(group.managed):
            raise ValueError(f"open_group gave {len(fulls)} tensors for {len(group.managed)} parameters")
        for i, (m, full) in enumerate(zip(group.managed, fulls)):
            if full.numel() != m.shape.numel():
                raise ValueError(f"the source of {m.fqn!r} has {full.numel()} elements, the parameter "
                                 f"{tuple(m.shape)} ({m.shape.numel()})")
            group.master.copy_local_from_full(i, full)
