"""Deferred (meta-device) initialisation: build on ``meta``, ``fully_shard``, then materialise.

::

    with torch.device("meta"):
        model = build_model()                       # no storage anywhere
    fully_shard_layers(model)                       # planned and sharded, still on meta
    torch.manual_seed(0)
    vz.materialize(model, device="cuda")            # each module's reset_parameters()
    # or: vz.materialize(model, init_fn=model._init_weights)   (Hugging Face)

or FSDP2's recipe, which allocates the shards first::

    model.to_empty(device="cuda")                   # persistent shards only, uninitialised
    vz.load_full_state_dict(model, full_sd)         # or vz.materialize(model, init_fn=...)

[Note: deferred initialisation]
``materialize`` walks the modules in registration order (``model.named_modules()``). For a
module holding tensors still to initialise -- parameters of a group built on meta (or
allocated but not filled by ``to_empty``), or parameters / buffers left on meta -- it

  1. gives each of its managed parameters a full tensor of its own on the device, installed
     in the module as the parameter (the shape forward sees); meta buffers and unmanaged meta
     parameters get their permanent storage;
  2. runs ``init_fn(module)``, or ``module.reset_parameters()``;
  3. copies this rank's range of each full tensor into the group's shard and drops it.

Before that each group leaves the meta device (``ParamGroup.leave_meta``): its persistent
shards are allocated, its full buffers only for a moment, one at a time (they start freed).
So at most one module's full parameters, or one group's full buffer, exist beside the
shards: the peak is all shards plus one group's full buffer. Every rank
runs the same initialisation with the same RNG state, so the ranks agree on every value
without communicating (each keeps its own range).

Initialising module by module in registration order draws random numbers in the order an
eager construction does when each module initialises its own tensors in its constructor
(``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm`` ...): with the same seed the values are
bit-identical to the eager model's. A model whose constructor initialises in another order
(a whole-model pass after construction, as Hugging Face's ``post_init`` does) matches the eager
model with the same ``init_fn`` applied module by module in the same order.

A tied parameter (several owners) is initialised by its first owner; a later owner's
initialiser writes a scratch copy (it draws the same random numbers, then the copy is
dropped), as in an eager model tied after construction (``head.weight = embed.weight``).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Set, Tuple, Union

import torch
from torch import nn

from ..runtime.param_group import ParamGroup
from ..runtime.ragged_param import _new_param
from .fully_shard import BUFFER_NEEDS_INIT, RaggedFSDPModule, groups_of

__all__ = ["materialize"]

InitFn = Callable[[nn.Module], None]


def _default_device() -> torch.device:
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator()
    return torch.device("cpu")


def _class_name(module: nn.Module) -> str:
    """The module's own class name (not fully_shard's ``RaggedFSDP...`` subclass)."""
    cls = type(module)
    return cls.__bases__[-1].__name__ if isinstance(module, RaggedFSDPModule) else cls.__name__


def _owned(groups: List[ParamGroup]) -> Dict[Tuple[int, str], Tuple[ParamGroup, int]]:
    """(id(module), attribute) -> (group, index) for every owner of a parameter to initialise."""
    return {(id(module), attr): (group, i) for group in groups for i, m in enumerate(group.managed)
            for module, attr in m.owners}


def _pending(module: nn.Module, owned: Dict) -> Tuple[List[str], List[str]]:
    """Names of the module's own parameters and buffers that ``materialize`` must initialise:
    managed ones of groups that need it, meta ones, buffers ``to_empty`` emptied."""
    params = [a for a, p in module._parameters.items()
              if p is not None and ((id(module), a) in owned or p.device.type == "meta")]
    buffers = [a for a, b in module._buffers.items()
               if b is not None and (b.device.type == "meta" or hasattr(b, BUFFER_NEEDS_INIT))]
    return params, buffers


def materialize(model: nn.Module, init_fn: Optional[InitFn] = None,
                device: Union[torch.device, str, None] = None) -> nn.Module:
    """Allocate and initialise a model built on the meta device and sharded with ``fully_shard``.

    Module by module (see [Note: deferred initialisation]), so the full parameters of one
    module at a time exist beside the shards. Also initialises a model whose shards
    ``model.to_empty(device=...)`` allocated, with the buffers ``to_empty`` emptied: after
    ``load_full_state_dict`` that is the non-persistent buffers only (rotary tables).

    Args:
        model: the root; its groups built on meta (or to_empty-ed), or meta tensors outside
            any group.
        init_fn: called as ``init_fn(module)`` on every module holding tensors to initialise,
            in registration order (like ``model.apply``); it must initialise that module's own
            parameters and buffers (``recurse=False``), e.g. a Hugging Face model's
            ``_init_weights``. Default: ``module.reset_parameters()``.
        device: where the shards go (groups still on meta); default: where ``to_empty`` put
            the others, else the current accelerator, else the CPU.

    Returns:
        ``model``.

    Raises:
        RuntimeError: nothing is left to initialise (materialised or loaded already).
        ValueError: a module with tensors to initialise has no ``reset_parameters`` and no
            ``init_fn`` was given; or ``device`` is the meta device.
    """
    groups = [g for g in groups_of(model) if g.needs_init]
    owned = _owned(groups)
    todo = []
    for name, module in model.named_modules():
        params, buffers = _pending(module, owned)
        if params or buffers:
            todo.append((name, module, params, buffers))
    if not groups and not todo:
        raise RuntimeError(
            "materialize: nothing to initialise; every parameter and buffer of the model already has its values "
            "(it was materialised or loaded before, or never built on the meta device). Materialise a model once, "
            "after building it under torch.device('meta') and applying fully_shard"
        )
    if init_fn is None:
        missing = [f"{name or '<root>'!r} ({_class_name(m)}: {p + b})" for name, m, p, b in todo
                   if not callable(getattr(m, "reset_parameters", None))]
        if missing:
            raise ValueError(
                f"materialize: module(s) {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''} hold tensors "
                "to initialise but have no reset_parameters(); pass init_fn=fn, called as fn(module) on each module "
                "(e.g. a Hugging Face model's _init_weights), or load weights instead: model.to_empty(device=...) "
                "then vescale_zero.load_full_state_dict(model, full_sd)"
            )
    given = device
    placed = [g.device for g in groups if g.device.type != "meta"]  # by to_empty
    device = torch.device(device) if device is not None else (placed[0] if placed else _default_device())
    if device.type == "meta":
        raise ValueError("materialize needs a real device for the shards (e.g. 'cuda' or 'cpu'), got 'meta'")
    for group in groups:
        shards_on = group.device
        if given is not None and shards_on.type != "meta" and (
                shards_on.type != device.type or device.index not in (None, shards_on.index)):
            raise ValueError(f"materialize: device={device} but to_empty already put the shards on {shards_on}; "
                             "leave device unset (or pass the same one)")
    for group in groups:
        if group.device.type == "meta":
            group.leave_meta(device)
    init = init_fn if init_fn is not None else (lambda m: m.reset_parameters())
    moved: Dict[int, torch.Tensor] = {}  # id(meta tensor) -> its replacement (tied meta tensors stay tied)
    done: Set[Tuple[int, int]] = set()
    with torch.no_grad():
        for _, module, params, buffers in todo:
            _init_module(module, params, buffers, owned, moved, done, init, device)
    for group in groups:
        left = [m.fqn for i, m in enumerate(group.managed) if (id(group), i) not in done]
        if left:  # every managed parameter has an owner in the model: cannot happen
            raise RuntimeError(f"materialize: parameters {left} of a fully_shard group were not initialised")
        group.needs_init = False
    return model


def _init_module(module: nn.Module, params: List[str], buffers: List[str], owned: Dict,
                 moved: Dict[int, torch.Tensor], done: Set[Tuple[int, int]], init: InitFn,
                 device: torch.device) -> None:
    """Steps 1-3 of [Note: deferred initialisation] for one module."""
    keep: Dict[str, Tuple[ParamGroup, int]] = {}  # attribute -> managed parameter whose range it fills
    for attr in buffers:  # a meta buffer gets its storage; one to_empty allocated keeps it
        old = module._buffers[attr]
        if old.device.type == "meta":
            if id(old) not in moved:
                moved[id(old)] = torch.empty_like(old, device=device)
            module._buffers[attr] = moved[id(old)]
    for attr in params:
        hit = owned.get((id(module), attr))
        if hit is None:  # a meta parameter no group manages: it gets its storage here, for good
            old = module._parameters[attr]
            if id(old) not in moved:
                moved[id(old)] = _new_param(torch.empty_like(old, device=device), old)
            module._parameters[attr] = moved[id(old)]
            continue
        group, i = hit
        unsharded = group.params[i].unsharded
        full = torch.empty(group.managed[i].shape, dtype=group.orig_dtype, device=group.device)
        module._parameters[attr] = _new_param(full, unsharded)
        if (id(group), i) not in done:  # the first owner's values are kept; a later one's are scratch
            keep[attr] = (group, i)
    try:
        init(module)
        for attr in buffers:
            if hasattr(module._buffers[attr], BUFFER_NEEDS_INIT):
                delattr(module._buffers[attr], BUFFER_NEEDS_INIT)
        for attr, (group, i) in keep.items():
            group.master.copy_local_from_full(i, module._parameters[attr])
            done.add((id(group), i))
    finally:  # the module holds its sharded parameters again, also when the initialiser raised
        for attr in params:
            hit = owned.get((id(module), attr))
            if hit is not None:
                module._parameters[attr] = hit[0].params[hit[1]].sharded
