"""Copying a parameter's attributes onto the parameter object that stands for it.

Frameworks tag parameters with Python attributes (Megatron's ``tensor_model_parallel``,
``allreduce``, ``shared``; DeepSpeed's ``ds_*``; ours ``sharded_range``). Every object that
replaces a parameter in a module -- the sharded and unsharded objects of ``fully_shard``, the
Megatron adapter's full tensors and meta stand-ins, the meta parameters replacing ZeRO-3
partitions -- carries its tags, less those that describe the replaced object only.
"""

from __future__ import annotations

from typing import Collection

import torch

__all__ = ["copy_parameter_attributes"]


def copy_parameter_attributes(source: torch.Tensor, target: torch.Tensor,
                              skip: Collection[str] = ()) -> torch.Tensor:
    """Set every instance attribute of ``source`` except ``skip`` on ``target`` (the same
    objects, not copies); returns ``target``."""
    for key, value in vars(source).items():
        if key not in skip:
            setattr(target, key, value)
    return target
