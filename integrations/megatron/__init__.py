"""Megatron-Core adapter: ``RaggedFSDP`` (the data-parallel wrapper), ``RaggedOptimizer``
(Megatron's optimizer protocol on the shards), ``--use-vescale-fsdp`` and the switch that
makes Megatron-LM's builders use them.

    from vescale_zero.integrations.megatron import RaggedFSDP, get_vescale_optimizer
    model = RaggedFSDP(config, ddp_config, gpt_model)          # instead of DDP(...)
    optimizer = get_vescale_optimizer(optimizer_config, [model])

In Megatron-LM: ``use_vescale_fsdp_in_megatron_lm()`` before ``pretrain(...,
extra_args_provider=add_vescale_fsdp_args)``, then pass ``--use-vescale-fsdp``.

Megatron ``torch_dist`` checkpoints (see data_parallel.py [Note: dist-checkpoints])::

    model_sd = model.sharded_state_dict()                      # this rank's boxes of its shards
    state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd)}
    dist_checkpointing.save(state, path)                       # each rank writes its own, no gather

    model_sd = model.sharded_state_dict(is_loading=True)       # full TP-local tensors
    state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True)}
    loaded = dist_checkpointing.load(state, path)              # Megatron reshards any layout
    model.load_state_dict(loaded["model"]); optimizer.load_state_dict(loaded["optimizer"])
"""
# ruff: noqa: E402 - the release check comes before the adapter's imports

from vescale_zero import host_patches

# Before any module of the adapter imports megatron-core's internals: a release outside the supported
# range fails here, in one line naming both ([Note: one door to Megatron's releases]).
host_patches.check_release("megatron-core")

from .arguments import (
    add_vescale_fsdp_args,
    validate_vescale_args,
    vescale_optimizer_block,
    vescale_optimizer_name,
    vescale_options_from_args,
)
from .checkpoint_conversion import from_megatron
from .data_parallel import RaggedFSDP, RaggedFSDPOptions, check_supported, clash_message, params_l2_norm
from .megatron_lm import use_vescale_fsdp_in_megatron_lm
from .optimizer import SUPPORTED_OPTIMIZERS, RaggedOptimizer, check_dist_checkpoint_optimizer, get_vescale_optimizer
from .optimizer_offload import OptimizerOffload, optimizer_offload

# The names these classes had before one brand for public classes (Ragged*, as RaggedFSDPModule and
# RaggedDeepSpeedEngine): kept, so users' code keeps working.
VeScaleFSDP = RaggedFSDP
VeScaleFSDPOptions = RaggedFSDPOptions
VeScaleOptimizer = RaggedOptimizer

__all__ = [
    "RaggedFSDP",
    "RaggedFSDPOptions",
    "RaggedOptimizer",
    "get_vescale_optimizer",
    "add_vescale_fsdp_args",
    "validate_vescale_args",
    "vescale_options_from_args",
    "vescale_optimizer_name",
    "vescale_optimizer_block",
    "check_supported",
    "clash_message",
    "params_l2_norm",
    "use_vescale_fsdp_in_megatron_lm",
    "SUPPORTED_OPTIMIZERS",
    "check_dist_checkpoint_optimizer",
    "OptimizerOffload",
    "optimizer_offload",
    "from_megatron",
    "VeScaleFSDP",
    "VeScaleFSDPOptions",
    "VeScaleOptimizer",
]
