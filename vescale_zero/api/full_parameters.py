"""A module's full parameters for a while, outside forward and backward: one concept, three doors.

::

    gather_group_full(group, local)        one all-gather of a group's shard-shaped tensor into a flat
                                           buffer, each managed tensor whole as a view into it: the one
                                           gather behind the two below and ``full_state_dict`` (and so
                                           ``RaggedFSDP.full_parameters``, which installs the views as
                                           parameters: :mod:`vescale_zero.api.param_swap`)
    gathered_parameters(params, rank)      read (and on one rank write) whole parameters in a block
    fill_group_by_group(model, open, dev)  a model built on meta filled from a per-parameter source

## gathered_parameters

Full parameters for a moment, outside forward: ``gathered_parameters(params, modifier_rank)``.

The ``deepspeed.zero.GatheredParameters`` contract, for sharded parameters of ``fully_shard``::

    with gathered_parameters([block.fc.weight, block.fc.bias], modifier_rank=0):
        block.fc.weight.data.shape     # the full tensor: each parameter object stands for a full copy
        if rank == 0:
            block.fc.weight.zero_()    # load, tie, re-initialise ...
    # exit: rank 0's full tensors are broadcast; every rank keeps its range in its shard

[Note: gathered parameters]
On entry each group holding one of ``params`` is all-gathered once (master dtype, a buffer
of this call) and each requested *sharded parameter object* stands for its full view
(ragged_tensor [Note: gathered mode]: ``.data`` is the full tensor, ops on the object run on
it), so code holding the object, or reading it from its module, sees the whole tensor. On exit
with ``modifier_rank`` that rank's full buffer of each such group is broadcast and every
rank copies its ranges of the requested parameters into its master shard; then every
object views its shard again. With ``modifier_rank=None`` the gather is read-only: changes
are discarded. The optimizer's parameters are these objects, so its later steps start from
the written values. Called in the same order with the same parameters on every rank of
each group (collective); an exception inside the block skips the write-back.

## fill_group_by_group

Fill a ``fully_shard``-ed model built on meta from a per-parameter source, group by group.

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

import contextlib
from typing import (
    Callable,
    ContextManager,
    Dict,
    Iterable,
    Iterator,
    List,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import torch
import torch.distributed as dist
from torch import nn

from ..primitives.collectives import all_gather
from ..primitives.tensor_parallel import refuse_tensor_parallel
from ..runtime.hooks import in_backward_pass
from ..runtime.param_group import GroupState, ParamGroup, slot_of
from .fully_shard import groups_of
from .stale_params import full_param_slot

__all__ = ["GroupFull", "gather_group_full", "gathered_parameters", "is_sharded_param", "fill_group_by_group",
           "Owner", "OpenGroup"]


# ---- one group's full tensors ------------------------------------------------------------


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


# ---- gathered_parameters ------------------------------------------------------------------


def is_sharded_param(param: object) -> bool:
    """Whether ``param`` is the sharded parameter of a live ``fully_shard`` group."""
    return isinstance(param, torch.Tensor) and slot_of(param) is not None


def _by_group(params: Iterable[torch.Tensor]) -> List[Tuple[ParamGroup, List[Tuple[int, torch.Tensor]]]]:
    """The sharded ones of ``params``, grouped by group in order of first appearance; a group's
    full parameter (shown by its module between a forward and its backward) stands for its
    sharded one, which the module shows again once the group is resharded."""
    order: Dict[int, Tuple[ParamGroup, List[Tuple[int, torch.Tensor]]]] = {}
    seen = set()
    for p in params:
        slot = slot_of(p) if isinstance(p, torch.Tensor) else None
        if slot is None and isinstance(p, torch.Tensor):
            slot = full_param_slot(p)
            if slot is not None:
                p = slot[0].params[slot[1]].sharded
        if slot is None or id(p) in seen:
            continue
        seen.add(id(p))
        group, index = slot
        order.setdefault(id(group), (group, []))[1].append((index, p))
    return list(order.values())


@contextlib.contextmanager
def gathered_parameters(params: Union[torch.Tensor, Iterable[torch.Tensor]],
                        modifier_rank: Optional[int] = None) -> Iterator[None]:
    """Make ``params`` (sharded parameters; anything else is ignored) full inside the block;
    write ``modifier_rank``'s changes back into every rank's shard on exit (see
    [Note: gathered parameters]). ``modifier_rank`` is a rank of the groups' process group."""
    groups = _by_group([params] if isinstance(params, torch.Tensor) else params)
    refuse_tensor_parallel([g for g, _ in groups], "gathered_parameters (DeepSpeed's GatheredParameters)",
                           "read whole tensors with p.full_tensor(), write them with p.copy_(whole)")
    for group, items in groups:
        if modifier_rank is not None and not 0 <= modifier_rank < group.world_size:
            name = group.managed[items[0][0]].fqn
            raise ValueError(f"modifier_rank={modifier_rank} is not a rank of the group of {name!r} (ranks "
                             f"0..{group.world_size - 1} of its process group); pass one of them, or None")
        if group.state is not GroupState.SHARDED and in_backward_pass():
            raise RuntimeError("gathered_parameters / GatheredParameters over sharded parameters runs outside "
                               "backward (their group is gathered for backward now); call it before or after")
    saved: List[torch.Tensor] = []
    flats: List[torch.Tensor] = []
    try:
        with torch.no_grad():
            for group, items in groups:
                if group.state is not GroupState.SHARDED:
                    group.reshard()  # gathered for a backward to come: it gathers the written shards again
                full = gather_group_full(group, group.master.local)
                flats.append(full.flat)
                for index, param in items:
                    saved.append(param)
                    param.enter_gathered(full.views[index])
        yield
        if modifier_rank is not None:
            with torch.no_grad():
                for (group, items), flat in zip(groups, flats):
                    dist.broadcast(flat, src=dist.get_global_rank(group.process_group, modifier_rank),
                                   group=group.process_group)
                    for index, _ in items:
                        group.master.copy_local_from_full(
                            index, flat.narrow(0, group.plan.offsets[index], group.plan.specs[index].numel))
    finally:
        for param in saved:
            param.leave_gathered()


# ---- fill_group_by_group -------------------------------------------------------------------


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
