"""An optimizer that holds parameter objects ``fully_shard`` does not step.

[Note: an optimizer over replaced parameters]
``fully_shard`` replaces each parameter by a sharded one, and between a forward and its
backward a module may show its group's full parameters instead (FSDP2's registration with
``reshard_after_forward=False`` and the root's default: runtime
[Note: nothing stays gathered after forward]). An optimizer built from ``model.parameters()``
before ``fully_shard``, or between a forward and its backward, holds objects no gradient ever
reaches (the group reduces into the sharded parameters' ``.grad``): its steps would change
nothing, silently (so would FSDP2's). The first ``step()`` of every ``torch.optim`` optimizer
(torch's global step pre-hook, registered on the first ``fully_shard``) checks its parameters
once (again when it gains parameters) and refuses such objects, naming the way: build the
optimizer from ``model.parameters()`` after ``fully_shard`` and outside forward and backward.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..primitives.ragged_tensor import RaggedDTensor
from ..runtime.param_group import _SLOTS, ParamGroup

__all__ = ["CLAIMED_ATTR", "SHARDED_AS_ATTR", "watch_optimizers", "full_param_slot"]

CLAIMED_ATTR = "_vescale_fsdp_group_of"
"""Set on every parameter object a group manages: the module's original, sharded and full objects."""

SHARDED_AS_ATTR = "_vescale_sharded_as"
"""On a module's original parameter: the sharded parameter that replaced it (hosts remap optimizers
built earlier with it)."""

_CHECKED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()
_HANDLE: Any = None


def _check(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    if _CHECKED.get(optimizer) == count:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if hasattr(p, SHARDED_AS_ATTR) or full_param_slot(p) is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__}.step(): it holds a parameter of shape {tuple(p.shape)} that a "
                    f"fully_shard group of {getattr(p, CLAIMED_ATTR)} replaced (the module's original, or its full "
                    "parameter shown between a forward and its backward), which no gradient reaches: its steps would "
                    "change nothing. Build the optimizer from model.parameters() after fully_shard and outside forward "
                    "and backward (after backward, or after model.reshard())")
    _CHECKED[optimizer] = count


def full_param_slot(param: torch.Tensor) -> Optional[Tuple[ParamGroup, int]]:
    """``(group, index)`` of a group's full parameter (the object a module shows between a
    forward and its backward), else ``None``; searched among the live groups."""
    if not hasattr(param, CLAIMED_ATTR) or isinstance(param, RaggedDTensor):
        return None
    groups = {id(g): g for g in (entry[1]() for entry in list(_SLOTS.values())) if g is not None}
    for group in groups.values():
        for index, rp in enumerate(group.params):
            if rp.unsharded is param:
                return group, index
    return None


def watch_optimizers() -> None:
    """Register the check of [Note: an optimizer over replaced parameters] (once per process)."""
    global _HANDLE
    if _HANDLE is None:
        _HANDLE = register_optimizer_step_pre_hook(_check)
