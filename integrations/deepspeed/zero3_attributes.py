"""ZeRO-3's per-parameter attributes, answered on ragged parameters for the libraries that read them.

[Note: ZeRO-3 attributes on ragged parameters]
"ragged" answers ``is_deepspeed_zero3_enabled()`` with True (accelerate_stage
[Note: the stage transformers compares]), so the libraries around the Trainer take their ZeRO-3
branches and some read ZeRO-3's attributes of a parameter. Every such read in trl 1.16.0,
peft 0.21.2, accelerate 1.15.0 and transformers 5.24.0 (``grep -rn "ds_status|ds_id|ds_numel|ds_shape|
ds_tensor|ZeroParamStatus|ds_grads_remaining"``), and what a ragged parameter answers::

    attribute  read by                                          a ragged parameter answers
    ds_status  trl.trainer.utils.maybe_gather_lm_head_ctx       NOT_AVAILABLE on the sharded object (TRL then
               (fused log-prob / entropy of SFT, GRPO, RLOO,    gathers it with zero.GatheredParameters, which
               DPO, KTO, distillation; forward and backward)    gathers ragged parameters), AVAILABLE on the
                                                                unsharded one (installed only while its group is
                                                                gathered: TRL uses it as it is)
    ds_shape   peft tuners (LoRA, IA3, VeRA, ... : the base     the full shape, as ``shape`` already says
               layer's shape), peft_model's state-dict shapes
    ds_numel   peft's trainable-parameter counts (read only     the full element count, as ``numel()`` says
               when numel() is 0)
    ds_id      nothing in these libraries; DeepSpeed's engine,  not set: it is DeepSpeed's mark of its own
               GatheredParameters and accessors dispatch on it  partitions (a ragged parameter with it would be
                                                                taken for one)
    ds_tensor, ds_grads_remaining, ds_active_sub_modules: read by no library above (TRL's
               generation path clears ``ds_active_sub_modules`` of what ``parameter_offload`` lists,
               which is nothing: module_hooks [Note: pausing the hooks for generation])

Each sharded / unsharded object keeps its role for the group's lifetime, so the answers are set
once, when the engine shards the model.
"""

from __future__ import annotations

from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from torch import nn

from vescale_zero.fully_shard import groups_of

__all__ = ["answer_zero3_attributes", "ANSWERED"]

ANSWERED = ("ds_status", "ds_shape", "ds_numel")
"""The ZeRO-3 attributes a ragged parameter carries (see the note above)."""


def answer_zero3_attributes(module: nn.Module) -> None:
    """Set ``ds_status``, ``ds_shape`` and ``ds_numel`` on both parameter objects of every group
    of ``module`` (see [Note: ZeRO-3 attributes on ragged parameters])."""
    for group in groups_of(module):
        for m, sharded, unsharded in zip(group.managed, group.sharded_params, group.unsharded_params):
            for param, status in ((sharded, ZeroParamStatus.NOT_AVAILABLE), (unsharded, ZeroParamStatus.AVAILABLE)):
                param.ds_status = status
                param.ds_shape = m.shape
                param.ds_numel = m.shape.numel()
