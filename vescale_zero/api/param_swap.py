"""Other parameter objects in a module's places for a while (full tensors to load into,
meta stand-ins to describe a save), and the originals put back afterwards.

[Note: replaced by identity] A parameter is found by identity in every module's
``_parameters``, not by name: a tied parameter is replaced under all its names by the same
object, and wrappers that drop their prefix from state-dict keys (Megatron's
``Float16Module``) do not matter.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Tuple

from torch import nn

__all__ = ["ParameterSlots", "put_parameters", "replace_parameters"]

ParameterSlots = List[Tuple[nn.Module, str, nn.Parameter]]
"""``(module, attribute, parameter)`` places and the objects to hold there."""


def replace_parameters(module: nn.Module,
                       replacement: Callable[[nn.Parameter], Optional[nn.Parameter]]) -> ParameterSlots:
    """Put ``replacement(p)`` in place of every parameter ``p`` under ``module`` for which it
    is not ``None`` (called once per parameter object: [Note: replaced by identity]); returns
    the places and the objects they held, for :func:`put_parameters`."""
    chosen: Dict[int, Optional[nn.Parameter]] = {}
    replaced: ParameterSlots = []
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is None:
                continue
            if id(param) not in chosen:
                chosen[id(param)] = replacement(param)
            new = chosen[id(param)]
            if new is not None:
                replaced.append((sub, name, param))
                sub._parameters[name] = new
    return replaced


def put_parameters(slots: Iterable[Tuple[nn.Module, str, nn.Parameter]]) -> None:
    """Put each parameter back into its place (what :func:`replace_parameters` returned)."""
    for sub, name, param in slots:
        sub._parameters[name] = param
