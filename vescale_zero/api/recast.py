"""``model.to(dtype)`` / ``.double()`` / ``.half()`` after ``fully_shard``: the group planned again
in the new dtype.

[Note: a group cast after fully_shard]
FSDP2 casts each sharded parameter in place (its local shard), keeping the parameter objects. A
group here is one flat buffer per role, planned for its dtype (tensor starts and shards aligned
in bytes), so a cast builds the group again in the new dtype from the same parameters, with the
same granularities and settings: the values are gathered (one all-gather per parameter: every
rank casts, as every rank calls ``model.to``) and cast, each rank keeps its new range, and the
old buffers are dropped. The sharded parameter objects keep their identity
(``torch.utils.swap_tensors``: an optimizer built before the cast holds the new parameters, as
with FSDP2; its state keeps the dtype it had). Gradients are dropped. A group built on the meta
device is planned again with nothing to gather. Refused: inside forward or backward, after the
root's first forward (the reduce-scatter order holds the group), and for tensor-parallel or
full-DTensor groups (cast before ``fully_shard``).
"""

from __future__ import annotations

import weakref
from typing import List

import torch
from torch import nn

from ..runtime.hooks import STATE_ATTR
from ..runtime.param_attributes import copy_parameter_attributes
from ..runtime.param_group import _SLOTS, GroupState, ParamGroup, _register_slot
from .fsdp_module import RECIPE_ATTR
from .fully_shard import build_group

__all__ = ["recast_group"]


def _refuse(module: nn.Module, dtype: torch.dtype, why: str) -> ValueError:
    return ValueError(f"cannot cast the sharded parameters of this {type(module).__name__} to {dtype} after "
                      f"fully_shard: {why}")


def _drop_weakrefs(param: torch.Tensor) -> None:
    """``swap_tensors`` refuses a tensor with weak references: the group's slot registry holds
    one (registered again after the swap)."""
    _SLOTS.pop(id(param), None)
    for ref in weakref.getweakrefs(param):
        if isinstance(ref.__callback__, weakref.finalize):
            ref.__callback__.detach()


def recast_group(module: nn.Module, dtype: torch.dtype) -> None:
    """For ``module``'s group (collective over its shard group): [Note: a group cast after fully_shard]."""
    state = getattr(module, STATE_ATTR)
    old: ParamGroup = state.group
    recipe = getattr(module, RECIPE_ATTR)
    if state.context is not None and (state.context.in_forward or state.context.in_backward):
        raise _refuse(module, dtype, "it runs inside forward or backward; cast between iterations")
    if state.context is not None:
        raise _refuse(module, dtype, "the model ran forward already (its groups are scheduled in that order); cast "
                                     "after fully_shard and before the first forward, or before fully_shard; to "
                                     "compute in another dtype, use fully_shard(..., mp_policy=MixedPrecisionPolicy("
                                     "param_dtype=...))")
    if any(m.tp is not None for m in old.managed):
        raise _refuse(module, dtype, "its tensor-parallel (DTensor) parameters are laid out by fully_shard; cast "
                                     "before fully_shard")
    if old._expose_full_grad is not None:
        raise _refuse(module, dtype, "its gradients are written into the group's buffer by the host; cast before "
                                     "fully_shard")
    if old.state is not GroupState.SHARDED:
        old.reshard()
    with torch.no_grad():
        values: List[torch.Tensor] = []
        for rp, m in zip(old.params, old.managed):
            if old.device.type == "meta":
                full = torch.empty(m.shape, dtype=dtype, device="meta")
            else:
                full = rp.sharded.full_tensor().to(device=old.device, dtype=dtype)
            values.append(copy_parameter_attributes(rp.sharded, nn.Parameter(full, requires_grad=m.requires_grad)))
    new = build_group(old.managed, values, old.process_group, recipe)
    new.needs_init = old.needs_init
    new.grads.keep_settings_of(old.grads)
    new.gather.comm = old.gather.comm
    new.unshard_in_backward = old.unshard_in_backward
    new.usage.policy = old.usage.policy
    new.max_reduce_scatters_in_flight = old.max_reduce_scatters_in_flight
    for i, (before, after) in enumerate(zip(old.params, new.params)):
        kept = before.sharded  # the object optimizers and users hold
        kept.grad = None
        _drop_weakrefs(kept)
        _drop_weakrefs(after.sharded)
        torch.utils.swap_tensors(kept, after.sharded)
        after.sharded = kept
        _register_slot(kept, new, i)
    state.group = new
    new.to_sharded_params()
