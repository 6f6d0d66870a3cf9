"""The whole model from a ragged engine, wherever DeepSpeed, accelerate or transformers save it.

A ragged-sharded module's ``state_dict()`` holds this rank's 1-D pieces of each parameter.
The save paths that expect the model get it gathered instead::

    caller                                         stage 3              stage "ragged"
    Trainer.save_model / checkpoint-N,             gathers (needs       accelerate.Accelerator.get_state_dict
      Accelerator.save_model                       stage3_gather_16bit  is wrapped (host_patches): the full
      -> Accelerator.get_state_dict(engine)        _weights_on_model    state dict, gathered group by group
                                                   _save)               by every rank, kept on rank 0
    engine._zero3_consolidated_16bit_state_dict,   gathers              the same (engine methods)
      engine.save_16bit_model
    engine.module_state_dict()                     placeholders         full, on every rank (collective)
    model.save_pretrained(dir) without state_dict  placeholders         ValueError naming the calls above
                                                                        (one rank alone cannot gather)

accelerate decides on ``deepspeed_config["zero_optimization"]["stage"] == 3``; for any
other stage it returns ``unwrap_model(model).state_dict()``, our pieces. The wrapper
recognises a ragged-sharded model by its parameter groups, whatever the config says.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from vescale_zero import full_state_dict
from vescale_zero.hosts import groups_of

__all__ = ["consolidated_state_dict", "wrap_get_state_dict", "wrap_save_pretrained", "is_ragged_sharded"]

def is_ragged_sharded(module: Any) -> bool:
    """Whether ``module`` has parameters sharded by vescale-zero (at it or below)."""
    return isinstance(module, nn.Module) and bool(groups_of(module))


def consolidated_state_dict(
    module: nn.Module, exclude_frozen_parameters: bool = False
) -> Optional[Dict[str, torch.Tensor]]:
    """The full state dict of ``module`` on rank 0 (CPU, parameters in their compute dtype:
    what a 16-bit save of ZeRO-3 holds), ``None`` on the other ranks.

    Collective: every rank must call it; one group's full buffer is alive at a time.
    """
    state = full_state_dict(module, rank0_only=True, cpu_offload=True, compute_dtype=True)
    if dist.get_rank() != 0:
        return None
    if exclude_frozen_parameters:
        for name, param in module.named_parameters(remove_duplicate=False):
            if not param.requires_grad:
                state.pop(name, None)
    return state


# host patch accelerate.Accelerator.get_state_dict: checked against accelerate 1.10.1-1.15.0
def wrap_get_state_dict(original):
    """``Accelerator.get_state_dict`` that gathers a ragged-sharded model (others go through untouched)."""

    @functools.wraps(original)
    def get_state_dict(self, model, unwrap=True):
        module = self.unwrap_model(model)
        if not is_ragged_sharded(module):
            return original(self, model, unwrap=unwrap)
        return consolidated_state_dict(module)

    return get_state_dict


# host patch transformers.modeling_utils.PreTrainedModel.save_pretrained: checked against transformers 4.57.6-5.24.0
def wrap_save_pretrained(original):
    """``PreTrainedModel.save_pretrained`` that refuses a ragged-sharded model without ``state_dict=``."""

    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_pretrained(self, *args, **kwargs):
        if signature.bind(self, *args, **kwargs).arguments.get("state_dict") is None and is_ragged_sharded(self):
            raise ValueError(
                f"{type(self).__name__}.save_pretrained() without state_dict=: the model is sharded by stage 'ragged', "
                "so its state_dict() holds this rank's 1-D pieces, not the model. Gather on every rank and save on "
                "rank 0: trainer.save_model(dir), or accelerator.save_model(engine, dir), or "
                "model.save_pretrained(dir, state_dict=accelerator.get_state_dict(engine), "
                "is_main_process=accelerator.is_main_process) called on every rank"
            )
        return original(self, *args, **kwargs)

    return save_pretrained
