"""The whole model from a ragged engine, wherever DeepSpeed, accelerate or transformers save it.

A ragged-sharded module's ``state_dict()`` holds this rank's 1-D pieces of each parameter.
The save paths that expect the model get it gathered instead::

    caller                                         stage 3              stage "ragged"
    Trainer.save_model / checkpoint-N,             gathers (needs       accelerate.Accelerator.get_state_dict
      Accelerator.save_model                       stage3_gather_16bit  is wrapped by install(): the full
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
import sys
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from vescale_zero import full_state_dict
from vescale_zero.hosts import groups_of

__all__ = ["consolidated_state_dict", "install_save_hooks", "is_ragged_sharded"]

_MARK = "__vescale_ragged_save__"


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


def _wrap_get_state_dict(original):
    @functools.wraps(original)
    def get_state_dict(self, model, unwrap=True):
        module = self.unwrap_model(model)
        if not is_ragged_sharded(module):
            return original(self, model, unwrap=unwrap)
        return consolidated_state_dict(module)

    setattr(get_state_dict, _MARK, True)
    return get_state_dict


def _wrap_save_pretrained(original):
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

    setattr(save_pretrained, _MARK, True)
    return save_pretrained


def install_save_hooks() -> None:
    """Wrap accelerate's ``Accelerator.get_state_dict`` and transformers'
    ``PreTrainedModel.save_pretrained`` if those libraries are loaded (idempotent; models
    that are not ragged-sharded go through untouched). The engine calls it when it is built:
    accelerate has built it by then if it is in use."""
    accelerator = sys.modules.get("accelerate.accelerator")
    if accelerator is not None and not getattr(accelerator.Accelerator.get_state_dict, _MARK, False):
        # host patch accelerate.Accelerator.get_state_dict: checked against accelerate 1.15.0
        accelerator.Accelerator.get_state_dict = _wrap_get_state_dict(accelerator.Accelerator.get_state_dict)
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is not None and not getattr(modeling.PreTrainedModel.save_pretrained, _MARK, False):
        # host patch transformers.modeling_utils.PreTrainedModel.save_pretrained: checked against transformers 5.24.0
        modeling.PreTrainedModel.save_pretrained = _wrap_save_pretrained(modeling.PreTrainedModel.save_pretrained)
