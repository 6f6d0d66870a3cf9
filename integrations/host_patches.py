"""Every host attribute the adapters replace (monkey-patches of DeepSpeed, accelerate,
transformers and Megatron internals, and the torch functions ``vescale_zero.dtensor_interop``
routes; TRL and PEFT are read, not patched), the host version each was checked against, and the
signature of the host function it relies on: the one list (``HOST_PATCHES``).

[Note: host patches] A patch site says in one line, right above the assignment::

    # host patch deepspeed.initialize: checked against deepspeed 0.19.8

naming its entry here (under ``integrations/`` or ``vescale_zero/``); ``tests/test_host_patches.py``
checks that every site names an entry
with the same version, that every entry has a site, and -- in a fresh interpreter, where no
patch is applied yet -- that each installed host function still has the signature recorded
here (parameter names, kinds and defaults; annotations left out), failing with the function,
the expected and the found signature and the installed version. A host upgrade that changes
one of them needs the patch re-read against the new version, then its entry and site updated.
This module imports no host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

__all__ = ["HOST_PATCHES", "HOST_VERSIONS", "HostPatch"]

HOST_VERSIONS: Dict[str, str] = {
    "torch": "2.11.0-2.15.0",  # every release CI tests (setup.py): the signatures are checked on each
    "deepspeed": "0.19.8",
    "accelerate": "1.15.0",
    "transformers": "5.24.0",
    "megatron-core": "0.16.1",
    "Megatron-LM": "core_v0.16.1",  # not on the package index: read from its source at that tag
    "trl": "1.16.0",  # nothing patched: its reads of ZeRO-3 internals surveyed at this version (see below)
    "peft": "0.21.2",  # nothing patched: likewise
}
"""The host distributions (as pip names them) and the versions every patch was checked against.
TRL and PEFT are patched nowhere; every read they make of ZeRO-3's internals was surveyed at the
versions here and is answered for ragged parameters: integrations/deepspeed/zero3_attributes.py
[Note: ZeRO-3 attributes on ragged parameters], accelerate_stage.py
[Note: the stage accelerate compares], ``integrations/deepspeed/__init__.py``
[Note: a model built partitioned for ragged]."""


@dataclass(frozen=True)
class HostPatch:
    """One replaced host attribute.

    Attributes:
        patched: the dotted path of what is assigned (``module.attr`` or ``module.Class.attr``).
        host: its distribution, a key of :data:`HOST_VERSIONS`.
        signature_of: the dotted path of the host callable whose signature the patch relies on
            (the replaced function itself, or what the patched name holds).
        signature: that signature at the checked version, annotations left out; ``None``: not
            checkable on our machines (the host is not installable here), or not a callable
            (then only its existence is checked).
    """

    patched: str
    host: str
    signature_of: str
    signature: Optional[str]


_DS_INIT = ("(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None, "
            "distributed_port=29500, mpu=None, dist_init_required=None, collate_fn=None, config=None, "
            "mesh_param=None, config_params=None)")
_DS_ENGINE = ("(args, model, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None, mpu=None, "
              "dist_init_required=None, collate_fn=None, config=None, config_class=None, mesh_device=None, "
              "dont_change_device=False)")
_ZERO_INIT = ("(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None, "
              "pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None, "
              "zero_param_parallel_group=None, zero_quantized_weights=False, "
              "zero_quantized_nontrainable_weights=False, sequence_data_parallel_group=None, param_swapper=None, "
              "tensor_overrides=[<DeepSpeedTensorOverride.dtype: 1>, <DeepSpeedTensorOverride.device: 2>])")
_GATHERED = "(params, modifier_rank=None, fwd_module=None, enabled=True)"
_SAVE_PRETRAINED = ("(self, save_directory, is_main_process=True, state_dict=None, push_to_hub=False, "
                    "max_shard_size='50GB', variant=None, token=None, save_peft_format=True, "
                    "save_original_format=True, distributed_checkpoint=False, **kwargs)")
_MCORE_DDP = "(config, ddp_config, module, disable_bucketing=False, pg_collection=None)"
_MCORE_OPTIMIZER = ("(config, model_chunks, config_overrides=None, use_gloo_process_groups=True, pg_collection=None, "
                    "dump_param_to_param_group_map=None)")
_TRAINING = "megatron.training.training"
_DS_ACCESSORS = {  # deepspeed.utils.tensor_fragment: the accessors routed for ragged parameters
    "safe_get_full_grad": "(param)", "safe_set_full_grad": "(param, value)",
    "safe_get_full_fp32_param": "(param)", "safe_set_full_fp32_param": "(param, value)",
    "safe_get_full_optimizer_state": "(param, optim_state_key)",
    "safe_set_full_optimizer_state": "(param, value, optim_state_key)",
    "safe_get_local_grad": "(param)", "safe_set_local_grad": "(param, value)",
    "safe_get_local_fp32_param": "(param)", "safe_set_local_fp32_param": "(param, value)",
    "safe_get_local_optimizer_state": "(param, optim_state_key)",
    "safe_set_local_optimizer_state": "(param, value, optim_state_key)",
    "safe_update_full_grad_vectorized": "(param_list, update_func)",
}

_DTENSOR = "torch.distributed.tensor"
_FROM_LOCAL = "(local_tensor, device_mesh=None, placements=None, *, run_check=False, shape=None, stride=None, " \
              "grad_placements=None)"
_REDISTRIBUTE = "(self, device_mesh=None, placements=None, *, async_op=False, forward_dtype=None, backward_dtype=None)"
_DISTRIBUTE = "(tensor, device_mesh=None, placements=None, *, src_data_rank=0)"

HOST_PATCHES: Dict[str, HostPatch] = {p.patched: p for p in (
    # torch: vescale_zero/dtensor_interop.py ([Note: torch's DTensor functions meet RaggedShard])
    HostPatch(f"{_DTENSOR}.DTensor.from_local", "torch", f"{_DTENSOR}.DTensor.from_local", _FROM_LOCAL),
    HostPatch(f"{_DTENSOR}.DTensor.redistribute", "torch", f"{_DTENSOR}.DTensor.redistribute", _REDISTRIBUTE),
    HostPatch(f"{_DTENSOR}.distribute_tensor", "torch", f"{_DTENSOR}.distribute_tensor", _DISTRIBUTE),
    HostPatch(f"{_DTENSOR}._api.distribute_tensor", "torch", f"{_DTENSOR}._api.distribute_tensor", _DISTRIBUTE),
    HostPatch("torch.distributed._state_dict_utils.distribute_tensor", "torch",
              "torch.distributed._state_dict_utils.distribute_tensor", _DISTRIBUTE),
    HostPatch("torch.distributed._state_dict_utils._distribute_tensors", "torch",
              "torch.distributed._state_dict_utils._distribute_tensors", "(local_state_dict, keys, device, pg=None)"),
    # torch (2.11 only: its DTensor fast path skips a subclass's __torch_dispatch__): vescale_zero/torch_compat.py
    HostPatch("torch._library.simple_registry.GenericTorchDispatchRuleHolder.find", "torch",
              "torch._library.simple_registry.GenericTorchDispatchRuleHolder.find", "(self, torch_dispatch_class)"),
    # DeepSpeed: integrations/deepspeed/__init__.py, parser.py
    HostPatch("deepspeed.initialize", "deepspeed", "deepspeed.initialize", _DS_INIT),
    HostPatch("deepspeed.DeepSpeedEngine", "deepspeed", "deepspeed.DeepSpeedEngine", _DS_ENGINE),
    HostPatch("deepspeed.PipelineEngine", "deepspeed", "deepspeed.PipelineEngine",
              "(has_bool_tensors=False, *super_args, **super_kwargs)"),
    HostPatch("deepspeed.runtime.zero.config.get_zero_config", "deepspeed",
              "deepspeed.runtime.zero.config.get_zero_config", "(param_dict)"),
    HostPatch("deepspeed.runtime.config.get_zero_config", "deepspeed", "deepspeed.runtime.config.get_zero_config",
              "(param_dict)"),
    HostPatch("deepspeed.runtime.zero.partition_parameters.Init.__init__", "deepspeed",
              "deepspeed.runtime.zero.partition_parameters.Init.__init__", _ZERO_INIT),
    HostPatch("deepspeed.runtime.zero.partition_parameters.GatheredParameters", "deepspeed",
              "deepspeed.runtime.zero.partition_parameters.GatheredParameters", _GATHERED),
    HostPatch("deepspeed.zero.GatheredParameters", "deepspeed", "deepspeed.zero.GatheredParameters", _GATHERED),
    HostPatch("deepspeed.runtime.engine.DeepSpeedEngine._do_sanity_check", "deepspeed",
              "deepspeed.runtime.engine.DeepSpeedEngine._do_sanity_check", "(self)"),
    HostPatch("deepspeed.runtime.zero.partition_parameters.Init._convert_to_deepspeed_param", "deepspeed",
              "deepspeed.runtime.zero.partition_parameters.Init._convert_to_deepspeed_param", "(self, param)"),
    # DeepSpeed's accessors (their code routed in place) and zero_to_fp32's reader:
    # integrations/deepspeed/safe_accessors.py, zero_to_fp32.py
    *(HostPatch(f"deepspeed.utils.tensor_fragment.{name}", "deepspeed", f"deepspeed.utils.tensor_fragment.{name}",
                signature) for name, signature in _DS_ACCESSORS.items()),
    HostPatch("deepspeed.utils.zero_to_fp32._get_fp32_state_dict_from_zero_checkpoint", "deepspeed",
              "deepspeed.utils.zero_to_fp32._get_fp32_state_dict_from_zero_checkpoint",
              "(ds_checkpoint_dir, exclude_frozen_parameters)"),
    # accelerate and transformers: integrations/deepspeed/accelerate_stage.py, saving.py
    HostPatch("accelerate.utils.DeepSpeedPlugin.zero_stage", "accelerate",
              "accelerate.utils.DeepSpeedPlugin.zero_stage", None),  # a field set on plugin instances: no signature
    HostPatch("accelerate.utils.DeepSpeedPlugin.__post_init__", "accelerate",
              "accelerate.utils.DeepSpeedPlugin.__post_init__", "(self)"),
    HostPatch("accelerate.utils.deepspeed.HfDeepSpeedConfig.is_zero3", "accelerate",
              "accelerate.utils.deepspeed.HfDeepSpeedConfig.is_zero3", "(self)"),
    HostPatch("accelerate.Accelerator.get_state_dict", "accelerate", "accelerate.Accelerator.get_state_dict",
              "(self, model, unwrap=True)"),
    HostPatch("transformers.modeling_utils.PreTrainedModel.save_pretrained", "transformers",
              "transformers.modeling_utils.PreTrainedModel.save_pretrained", _SAVE_PRETRAINED),
    # megatron-core: integrations/megatron/dist_checkpoint.py, megatron_lm.py
    HostPatch("megatron.core.transformer.module.MegatronModule.sharded_state_dict", "megatron-core",
              "megatron.core.transformer.module.MegatronModule.sharded_state_dict",
              "(self, prefix='', sharded_offsets=(), metadata=None)"),
    HostPatch("megatron.core.utils.unwrap_model", "megatron-core", "megatron.core.utils.unwrap_model",
              "(model, module_instances=None)"),
    HostPatch(f"{_TRAINING}.DDP", "megatron-core", "megatron.core.distributed.DistributedDataParallel", _MCORE_DDP),
    HostPatch(f"{_TRAINING}.get_megatron_optimizer", "megatron-core", "megatron.core.optimizer.get_megatron_optimizer",
              _MCORE_OPTIMIZER),
    # Megatron-LM (megatron.training, not installable here): integrations/megatron/megatron_lm.py
    HostPatch(f"{_TRAINING}.get_megatron_muon_optimizer", "Megatron-LM", f"{_TRAINING}.get_megatron_muon_optimizer",
              None),
    HostPatch(f"{_TRAINING}.get_model", "Megatron-LM", f"{_TRAINING}.get_model", None),
    HostPatch(f"{_TRAINING}.to_empty_if_meta_device", "Megatron-LM", f"{_TRAINING}.to_empty_if_meta_device", None),
    HostPatch(f"{_TRAINING}.check_param_hashes_across_dp_replicas", "Megatron-LM",
              "megatron.core.utils.check_param_hashes_across_dp_replicas", "(model, cross_check=False)"),
    HostPatch(f"{_TRAINING}.calc_params_l2_norm", "Megatron-LM", f"{_TRAINING}.calc_params_l2_norm", None),
    HostPatch("megatron.training.checkpointing.save_checkpoint", "Megatron-LM",
              "megatron.training.checkpointing.save_checkpoint", None),
    HostPatch("megatron.training.checkpointing.load_checkpoint", "Megatron-LM",
              "megatron.training.checkpointing.load_checkpoint", None),
)}
