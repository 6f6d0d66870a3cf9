"""Full parameters for a moment, outside forward: ``gathered_parameters(params, modifier_rank)``.

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
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .full_views import gather_group_full
from .param_group import GroupState, ParamGroup, slot_of
from .runtime import in_backward_pass
from .tensor_parallel import refuse_tensor_parallel

__all__ = ["gathered_parameters", "is_sharded_param"]


def is_sharded_param(param: object) -> bool:
    """Whether ``param`` is the sharded parameter of a live ``fully_shard`` group."""
    return isinstance(param, torch.Tensor) and slot_of(param) is not None


def _by_group(params: Iterable[torch.Tensor]) -> List[Tuple[ParamGroup, List[Tuple[int, torch.Tensor]]]]:
    """The sharded ones of ``params``, grouped by group in order of first appearance."""
    order: Dict[int, Tuple[ParamGroup, List[Tuple[int, torch.Tensor]]]] = {}
    seen = set()
    for p in params:
        slot = slot_of(p) if isinstance(p, torch.Tensor) else None
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
