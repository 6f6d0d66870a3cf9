"""Which modules of a model are its layers: the default groups of ``fully_shard_layers``.

[Note: finding the layers]
A model's layers are the modules it repeats. Most models hold them in an ``nn.ModuleList``
(Hugging Face, Megatron, torchtitan), and the classes held there are the layers. Others hold
them in an ``nn.Sequential`` (``nn.Sequential(embed, block, block, ..., head)``), a
``nn.ModuleDict`` or plain attributes: there the layers are the classes of modules that
repeat among the children of one module (siblings of one class, with parameters), keeping
the outermost such classes only: the ``nn.Linear`` pair of each block's MLP repeats too, but
lies inside a repeated block::

    nn.Sequential                     children by class
      Embedding                       1
      Block  -- Linear, Linear        3  <- repeated; its Linears (2 per Block) lie inside it
      Block  -- Linear, Linear
      Block  -- Linear, Linear
      LayerNorm, Linear               1, 1

A model with no repeated module would be one group, gathered whole by every forward (ZeRO-3
fetches module by module): that is warned about, naming the way to choose the groups.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Dict, List

from torch import nn

__all__ = ["find_layer_classes"]


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _repeated_among_siblings(model: nn.Module) -> Dict[str, List[str]]:
    """Class name -> qualified names of its instances, for classes that occur at least twice among
    the children of one module and hold parameters."""
    found: Dict[str, List[str]] = defaultdict(list)
    for prefix, parent in model.named_modules():
        by_class: Dict[type, List[str]] = defaultdict(list)
        for name, child in parent.named_children():
            if _has_params(child):
                by_class[type(child)].append(f"{prefix}.{name}" if prefix else name)
        for cls, names in by_class.items():
            if len(names) >= 2:
                found[cls.__name__].extend(names)
    return found


def _outermost(candidates: Dict[str, List[str]]) -> List[str]:
    """The candidate classes with at least one instance not inside another candidate's instance."""
    owner = {name: cls for cls, names in candidates.items() for name in names}

    def inside_another(name: str, cls: str) -> bool:
        parts = name.split(".")
        return any(owner.get(".".join(parts[:i]), cls) != cls for i in range(1, len(parts)))

    return sorted(cls for cls, names in candidates.items() if any(not inside_another(n, cls) for n in names))


def find_layer_classes(model: nn.Module) -> List[str]:
    """Class names of ``model``'s layers ([Note: finding the layers]); empty (with a warning) if
    it repeats no module."""
    in_lists = {type(m).__name__ for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst}
    if in_lists:
        return sorted(in_lists)
    layers = _outermost(_repeated_among_siblings(model))
    if not layers and sum(1 for m in model.modules() if _has_params(m) and not list(m.children())) > 1:
        warnings.warn(
            f"{type(model).__name__} repeats no module (no nn.ModuleList, no module class occurring twice among "
            "siblings), so fully_shard_layers makes the whole model one group, gathered whole by every forward. "
            "Name the modules that should each be a group: fully_shard_layers(model, layer_classes=['MyBlock']) "
            "(DeepSpeed: \"zero_optimization\": {\"stage\": \"ragged\", \"sharded_modules\": [\"MyBlock\"]}).",
            stacklevel=3,
        )
    return layers
