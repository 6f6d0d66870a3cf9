"""Every change vescale-zero makes to a host's code, in one registry, applied by :func:`install`
and undone by :func:`uninstall`.

The hosts are torch, DeepSpeed, accelerate, transformers, megatron-core, Megatron-LM and torchtitan
(TRL and PEFT are read, not patched). ``HOST_PATCHES`` lists, for every replaced host attribute, every
private host method our subclasses override and every private host name we import: what it is,
the host version it was checked against (``HOST_VERSIONS``) and the signature relied on.

[Note: host patches]
One registry, one owner. Nothing else in the package or the adapters assigns to a host module or
class (``tests/test_host_patches.py`` parses the tree and fails on any such assignment, and on
any private method of a host class overridden without an entry here); a replacement's code lives
with its adapter, named by ``by``. An entry's ``kind`` says how it reaches the host:

==========  ======================================================================================
kind        what :func:`install` does with ``by`` (``"module:name"``, imported when installed)
==========  ======================================================================================
replace     puts ``by`` in place of the attribute
wrap        puts ``by(original)`` in place (``None``: left alone, the host's own stays)
everywhere  as ``wrap``, in every loaded module that holds the original under that name
            (megatron-core's ``unwrap_model``, imported by name into many modules)
route       the host function's code is replaced in place by a forwarder to ``by(original)``: the
            function object stays, so a reference bound before the install is routed too
            (DeepSpeed's ``safe_get_*`` accessors); the original body runs as a copy
scoped      nothing: the adapter puts ``by`` there for the length of a ``with`` (:func:`scoped`)
setting     nothing: the adapter sets a host's setting through :func:`assign`
instance    nothing: the code at ``by`` sets the attribute on host *instances* (no class changes),
            its marker right above the assignment
override    nothing: ``by`` (a class of ours) overrides the host's private method in a subclass
import      nothing: the private host name is imported by ``by``'s module
==========  ======================================================================================

``install(host)`` applies every ``replace`` / ``wrap`` / ``everywhere`` / ``route`` entry of a
patch set (a host's name: ``"torch"``, ``"deepspeed"``, ``"accelerate"``, ``"transformers"``,
``"megatron"``, ``"torchtitan"``; or a part of one applied at another time: ``"torch.optim"`` on the first
``fully_shard``, ``"deepspeed.zero_to_fp32"`` in a checkpoint's own converter script) and keeps
the originals (one bookkeeping for every patch: :func:`installed`); it is idempotent, and an
owner replaced since (a module loaded again) is patched anew. ``uninstall(host)`` puts every
original back, the very objects. Who installs what, and when:

    import vescale_zero                              install("torch")
    the first fully_shard                            install("torch.optim")
    import vescale_zero.integrations.deepspeed       install("deepspeed"), install("deepspeed.zero_to_fp32"),
                                                     install("accelerate")
    a ragged DeepSpeed engine is built               install("accelerate"), install("transformers")
                                                     (what was not loaded before)
    use_vescale_fsdp_in_megatron_lm()                install("megatron")
    vescale_zero.integrations.torchtitan.install()   install("torchtitan")

An entry the host does not have is an error, unless ``optional`` (accelerate and transformers
are optional hosts; Megatron-LM's names differ between its versions); ``loaded_only`` names a
module that must already be imported (a heavy one we never import ourselves); ``when`` names a
predicate (``"module:function"``) that must hold (torch 2.11's dispatch rule lookup).
``tests/test_host_patches.py`` checks, in a fresh interpreter, that every installed host
function still has the signature recorded here (parameter names, kinds and defaults;
annotations left out), and that :func:`uninstall` restores every original. A host upgrade that
changes one of them needs the patch re-read against the new version, then its entry updated.

[Note: host releases]
Each host is supported over a range of releases: ``HOST_VERSIONS`` names the oldest and the newest
that CI installs (``FIRST-LAST``), and every minor release between them, any patch release of
each, is supported (setup.py's extras state the same ranges; tests/test_host_releases.py checks
it). An adapter checks the installed release before it imports the host's internals
(:func:`check_release`): another release fails the import in one line naming the range and the
release found. Where the releases differ, each adapter asks one module of its own (as
``vescale_zero/torch_compat.py`` for torch): integrations/deepspeed/deepspeed_compat.py,
integrations/megatron/megatron_compat.py. A signature that differs between releases is recorded
in each form (``HostPatch.signature``), and CI checks the registry in a venv of each release
(.ci/run).

Each entry's ``by`` carries, at its definition, the line ``# host patch KEY: checked against HOST
VERSION`` (the test checks that every entry has one and that they agree). This module imports no
host and none of ours at import time.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import re
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

__all__ = ["HOST_PATCHES", "HOST_VERSIONS", "HostPatch", "KINDS", "install", "uninstall", "installed", "scoped",
           "assign", "supported_releases", "check_release"]

HOST_VERSIONS: Dict[str, str] = {
    "torch": "2.11.0-2.15.0",  # every release CI tests (setup.py): the signatures are checked on each
    "deepspeed": "0.16.9-0.19.8",  # the newest patch of each minor release: CI installs each
    "accelerate": "1.10.1-1.15.0",
    "transformers": "4.57.6-5.24.0",
    "megatron-core": "0.15.3-0.19.2",
    "Megatron-LM": "0.15.3-0.19.2",  # megatron/training of these megatron-core releases (in its wheel from 0.17)
    "trl": "1.10.0-1.16.0",  # nothing patched: its reads of ZeRO-3 internals surveyed at these versions (see below)
    "peft": "0.18.1-0.21.2",  # nothing patched: likewise
    "torchtitan": "0.3.0",  # CI: its own venv (.venv-titan)
}
"""The host distributions (as pip names them) and the releases every patch was checked against:
the oldest and the newest CI installs (``FIRST-LAST``; what is between, as far as CI installs it:
.ci/run). A signature that differs between them is recorded with each form (``signature``).
TRL and PEFT are patched nowhere; every read they make of ZeRO-3's internals was surveyed at the
versions here and is answered for ragged parameters: integrations/deepspeed/zero3_attributes.py
[Note: ZeRO-3 attributes on ragged parameters], accelerate_stage.py
[Note: the stage accelerate compares], ``integrations/deepspeed/__init__.py``
[Note: a model built partitioned for ragged]."""


def _minor(version: str) -> Tuple[int, int]:
    digits = [int(re.match(r"\d*", part).group() or 0) for part in version.split(".")[:2]]
    return (digits + [0, 0])[0], (digits + [0, 0])[1]


def supported_releases(distribution: str) -> Tuple[str, str]:
    """``(first, last)`` minor releases of ``distribution`` that vescale-zero supports, e.g.
    ``("0.16", "0.19")``: from the oldest to the newest minor release of ``HOST_VERSIONS``,
    every patch release of each (setup.py's extras state the same ranges)."""
    first, _, last = HOST_VERSIONS[distribution].partition("-")
    return tuple(".".join(map(str, _minor(v))) for v in (first, last or first))


def check_release(distribution: str) -> str:
    """The installed version of ``distribution``; an ``ImportError`` of one line naming the
    supported releases and the installed one when it is outside them ([Note: host releases])."""
    from importlib import metadata

    try:
        found = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        raise ImportError(f"{distribution} is not installed: install a release from "
                          f"{' to '.join(supported_releases(distribution))}") from None
    first, last = supported_releases(distribution)
    if not _minor(first) <= _minor(found) <= _minor(last):
        above = ".".join(map(str, (_minor(last)[0], _minor(last)[1] + 1)))
        raise ImportError(f"vescale-zero supports {distribution} {first}.x to {last}.x, this environment has "
                          f"{distribution} {found}: install one of those releases "
                          f"(pip install '{distribution}>={first},<{above}')")
    return found


KINDS = ("replace", "wrap", "everywhere", "route", "scoped", "setting", "instance", "override", "import")
INSTALLED_KINDS = ("replace", "wrap", "everywhere", "route")


@dataclass(frozen=True)
class HostPatch:
    """One change to a host's code.

    Attributes:
        patched: the dotted path of the host attribute (``module.attr`` or ``module.Class.attr``).
        host: its distribution, a key of :data:`HOST_VERSIONS`.
        signature_of: the dotted path of the host callable whose signature the patch relies on
            (the replaced function itself, or what the patched name holds).
        signature: that signature at the checked versions, annotations left out (where they differ,
            each one, separated by `` | ``: the patch handles all of them); ``None``: not
            checkable on our machines (the host is not installable here), not a callable (then
            only its existence is checked), or checked by ``by`` itself when installed.
        by: ``"module:name"`` of ours: what is put there, or what puts it (see ``kind``).
        kind: one of :data:`KINDS` ([Note: host patches]).
        patch_set: what :func:`install` is given to apply it (default: a host's own name).
        optional: a missing owner or attribute skips the entry (else it is an error).
        loaded_only: a module that must already be imported for the entry to be installed.
        when: ``"module:function"``, a predicate that must hold for the entry to be installed.
    """

    patched: str
    host: str
    signature_of: str
    signature: Optional[str]
    by: str = ""
    kind: str = "replace"
    patch_set: str = ""
    optional: bool = False
    loaded_only: Optional[str] = None
    when: Optional[str] = None

    @property
    def installed_by(self) -> str:
        """The patch set :func:`install` applies it with."""
        return self.patch_set or _DEFAULT_SETS.get(self.host, self.host)


_DEFAULT_SETS = {"megatron-core": "megatron", "Megatron-LM": "megatron"}


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
              "tensor_overrides=[<DeepSpeedTensorOverride.dtype: 1>, <DeepSpeedTensorOverride.device: 2>])"
              # the second: 0.16
              " | (self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None, "
              "pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None, "
              "zero_param_parallel_group=None, zero_quantized_weights=False, "
              "zero_quantized_nontrainable_weights=False, sequence_data_parallel_group=None, param_swapper=None)")
_GATHERED = "(params, modifier_rank=None, fwd_module=None, enabled=True)"
_SAVE_PRETRAINED = ("(self, save_directory, is_main_process=True, state_dict=None, push_to_hub=False, "
                    "max_shard_size='50GB', variant=None, token=None, save_peft_format=True, "
                    "save_original_format=True, distributed_checkpoint=False, **kwargs)"
                    # the second: 4.57 (a function default is shown without its address)
                    " | (self, save_directory, is_main_process=True, state_dict=None, save_function=<function save>, "
                    "push_to_hub=False, max_shard_size='5GB', safe_serialization=True, variant=None, token=None, "
                    "save_peft_format=True, **kwargs)")
_MCORE_DDP = ("(config, ddp_config, module, disable_bucketing=False, pg_collection=None)"  # the second: 0.18 on
              " | (config, ddp_config, module, disable_bucketing=False, pg_collection=None, full_param_layout=None)")
_MCORE_OPTIMIZER = ("(config, model_chunks, config_overrides=None, use_gloo_process_groups=True, pg_collection=None, "
                    "dump_param_to_param_group_map=None)"
                    " | (config, model_chunks, no_weight_decay_cond=None, scale_lr_cond=None, lr_mult=1.0, "  # 0.15
                    "use_gloo_process_groups=True, default_skip_embedding_weight_decay=False, pg_collection=None)")
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
_FROM_LOCAL = ("(local_tensor, device_mesh=None, placements=None, *, run_check=False, shape=None, stride=None)"  # 2.11
               " | (local_tensor, device_mesh=None, placements=None, *, run_check=False, shape=None, stride=None, "
               "grad_placements=None)")  # torch 2.12 and later
_REDISTRIBUTE = "(self, device_mesh=None, placements=None, *, async_op=False, forward_dtype=None, backward_dtype=None)"
_DISTRIBUTE = "(tensor, device_mesh=None, placements=None, *, src_data_rank=0)"

_DS = "vescale_zero.integrations.deepspeed"
_TITAN = "vescale_zero.integrations.torchtitan"
_TORCH_FULLY_SHARD = ("(module, *, mesh=None, reshard_after_forward=None, shard_placement_fn=None, "
                      "mp_policy=MixedPrecisionPolicy(param_dtype=None, reduce_dtype=None, output_dtype=None, "
                      "cast_forward_inputs=True), offload_policy=OffloadPolicy(), ignored_params=None, "
                      "dp_mesh_dims=None)")
_MEG = "vescale_zero.integrations.megatron"
_TORCH_OPTIM = ("adam", "adamw", "sgd", "adagrad", "adamax", "adadelta", "asgd", "nadam", "radam", "rmsprop", "rprop")
_DS_ENGINE_OVERRIDES = {  # DeepSpeedEngine's private methods RaggedEngineMixin overrides (engine.py)
    "_configure_distributed_model": "(self, model)",
    "_configure_basic_optimizer": "(self, model_parameters)",
    "_configure_optimizer": "(self, client_optimizer, model_parameters)",
    "_is_supported_optimizer": "(self, optimizer_name)",
    "_broadcast_model": "(self)",
    "_backward_prologue": "(self) | (self, loss, scale_wrt_gas=True)",  # the second: 0.16 and 0.17
    "_take_model_step": "(self, lr_kwargs) | (self, lr_kwargs, block_eigenvalue={})",  # the second: up to 0.19.0
    "_zero3_consolidated_16bit_state_dict": "(self, exclude_frozen_parameters=False)",
    "_consolidated_16bit_state_dict": "(self, exclude_frozen_parameters=False)",
}
_ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"
_INIT = "deepspeed.runtime.zero.partition_parameters.Init"
_FRAGMENT = "deepspeed.utils.tensor_fragment"


def _same(patched: str, host: str, signature: Optional[str], by: str, kind: str = "replace", **more: Any) -> HostPatch:
    """An entry whose signature is the patched callable's own."""
    return HostPatch(patched, host, patched, signature, by, kind, **more)


HOST_PATCHES: Dict[str, HostPatch] = {p.patched: p for p in (
    # ---- torch, at `import vescale_zero` ----------------------------------------------------------------------
    # DTensor functions meet RaggedShard: vescale_zero/primitives/dtensor_interop.py
    # ([Note: torch's DTensor functions meet RaggedShard])
    _same(f"{_DTENSOR}.DTensor.from_local", "torch", _FROM_LOCAL,
          "vescale_zero.primitives.dtensor_interop:routed_from_local", "wrap"),
    _same(f"{_DTENSOR}.DTensor.redistribute", "torch", _REDISTRIBUTE,
          "vescale_zero.primitives.dtensor_interop:routed_redistribute", "wrap"),
    _same(f"{_DTENSOR}.distribute_tensor", "torch", _DISTRIBUTE,
          "vescale_zero.primitives.dtensor_interop:routed_distribute_tensor", "wrap"),
    _same(f"{_DTENSOR}._api.distribute_tensor", "torch", _DISTRIBUTE,
          "vescale_zero.primitives.dtensor_interop:routed_distribute_tensor", "wrap"),
    _same("torch.distributed._state_dict_utils.distribute_tensor", "torch", _DISTRIBUTE,
          "vescale_zero.primitives.dtensor_interop:routed_distribute_tensor", "wrap"),
    _same("torch.distributed._state_dict_utils._distribute_tensors", "torch",
          "(local_state_dict, keys, device, pg=None)",
          "vescale_zero.primitives.dtensor_interop:routed_distribute_tensors", "wrap"),
    # torch 2.11 only (its DTensor fast path skips a subclass's __torch_dispatch__): vescale_zero/torch_compat.py
    _same("torch._library.simple_registry.GenericTorchDispatchRuleHolder.find", "torch",
          "(self, torch_dispatch_class)", "vescale_zero.torch_compat:rule_lookups_answered", "wrap",
          when="vescale_zero.torch_compat:dispatch_rule_lookup_needed"),
    # the private members of FSDP2's FSDPModule that RaggedFSDPModule overrides: vescale_zero/api/fsdp_module.py
    *(_same(f"torch.distributed.fsdp.FSDPModule.{name}", "torch", signature,
            "vescale_zero.api.fsdp_module:RaggedFSDPModule", "override")
      for name, signature in (("_get_fsdp_state", "(self)"), ("_set_unshard_async_op", "(self, async_op)"),
                              ("_apply", "(self, *args, **kwargs) | (self, fn, recurse=True)"),  # 2.15: named
                              ("_orig_cls_mro_index", None))),
    # on the CUDA sanitizer's event handler (an instance), for the GPU check: vescale_zero/torch_compat.py
    _same("torch.cuda._sanitizer.EventHandler._handle_kernel_launch", "torch",
          "(self, stream, read_only, read_write, outputs, operator, tensor_aliases)",
          "vescale_zero.torch_compat:collect_sanitizer_reports", "instance"),
    # ---- torch.optim, on the first fully_shard: vescale_zero/api/local_optim_steps.py --------------------------
    # ([Note: torch's optimizers step the local pieces]). The signature relied on (its leading positional
    # parameters are the tensor lists, ``params`` first) is checked by the wrap itself, which leaves a
    # functional that does not have it alone: torch's releases may differ here, so none is recorded.
    *(_same(f"torch.optim.{name}.{name}", "torch", None, "vescale_zero.api.local_optim_steps:local_steps_of",
            "wrap", patch_set="torch.optim") for name in _TORCH_OPTIM),
    # ---- DeepSpeed, at `import vescale_zero.integrations.deepspeed` ----------------------------------------------
    # its initialize and parser: integrations/deepspeed/__init__.py, parser.py
    _same("deepspeed.initialize", "deepspeed", _DS_INIT, f"{_DS}:initialize"),
    _same("deepspeed.runtime.zero.config.get_zero_config", "deepspeed", "(param_dict)",
          f"{_DS}.parser:get_zero_config"),
    _same("deepspeed.runtime.config.get_zero_config", "deepspeed", "(param_dict)", f"{_DS}.parser:get_zero_config"),
    _same(f"{_INIT}.__init__", "deepspeed", _ZERO_INIT, f"{_DS}.parser:ragged_zero_init"),
    _same("deepspeed.runtime.zero.partition_parameters.GatheredParameters", "deepspeed", _GATHERED,
          f"{_DS}.zero_init:GatheredParameters"),
    _same("deepspeed.zero.GatheredParameters", "deepspeed", _GATHERED, f"{_DS}.zero_init:GatheredParameters"),
    _same(f"{_ENGINE}._do_sanity_check", "deepspeed", "(self)", f"{_DS}.parser:engine_sanity_check"),
    # the engine class deepspeed.initialize builds, for one call: integrations/deepspeed/__init__.py
    _same("deepspeed.DeepSpeedEngine", "deepspeed", _DS_ENGINE, f"{_DS}:initialize", "scoped"),
    _same("deepspeed.PipelineEngine", "deepspeed", "(has_bool_tensors=False, *super_args, **super_kwargs)",
          f"{_DS}:initialize", "scoped"),
    # on each zero.Init instance under a ragged config: integrations/deepspeed/zero_init.py
    _same(f"{_INIT}._convert_to_deepspeed_param", "deepspeed", "(self, param)",
          f"{_DS}.zero_init:mark_ragged_partitions", "instance"),
    # the private methods of DeepSpeed's engine the ragged engines override: integrations/deepspeed/engine.py
    *(_same(f"{_ENGINE}.{name}", "deepspeed", signature, f"{_DS}.engine:RaggedEngineMixin", "override")
      for name, signature in _DS_ENGINE_OVERRIDES.items()),
    # DeepSpeed's accessors, their code routed in place: integrations/deepspeed/safe_accessors.py
    *(_same(f"{_FRAGMENT}.{name}", "deepspeed", signature, f"{_DS}.safe_accessors:routed_accessor", "route")
      for name, signature in _DS_ACCESSORS.items()),
    # zero_to_fp32's reading step (also in a checkpoint's own zero_to_fp32.py): integrations/deepspeed/zero_to_fp32.py
    _same("deepspeed.utils.zero_to_fp32._get_fp32_state_dict_from_zero_checkpoint", "deepspeed",
          "(ds_checkpoint_dir, exclude_frozen_parameters)", f"{_DS}.zero_to_fp32:ragged_reader", "wrap",
          patch_set="deepspeed.zero_to_fp32"),
    _same("deepspeed.utils.zero_to_fp32.debug", "deepspeed", None, f"{_DS}.zero_to_fp32:main", "setting"),
    # the CPU communication op's JIT build, switched off by the GPU check's CPU dry mode: vescale_zero/tools/gpu_check
    _same("deepspeed.ops.__compatible_ops__", "deepspeed", None,
          "vescale_zero.tools.gpu_check.hosts:deepspeed_torch_adam",
          "setting"),
    # ---- accelerate and transformers: integrations/deepspeed/accelerate_stage.py, saving.py --------------------
    _same("accelerate.utils.DeepSpeedPlugin.__post_init__", "accelerate", "(self)",
          f"{_DS}.accelerate_stage:plugin_reads_3", "wrap", optional=True),
    _same("accelerate.utils.deepspeed.HfDeepSpeedConfig.is_zero3", "accelerate", "(self)",
          f"{_DS}.accelerate_stage:ragged_is_zero3", "wrap", optional=True),
    _same("accelerate.utils.DeepSpeedPlugin.zero_stage", "accelerate", None,  # a field of plugin instances
          f"{_DS}.accelerate_stage:present_ragged_stage_to_accelerate", "instance"),
    _same("accelerate.Accelerator.get_state_dict", "accelerate", "(self, model, unwrap=True)",
          f"{_DS}.saving:wrap_get_state_dict", "wrap", optional=True, loaded_only="accelerate.accelerator"),
    _same("transformers.modeling_utils.PreTrainedModel.save_pretrained", "transformers", _SAVE_PRETRAINED,
          f"{_DS}.saving:wrap_save_pretrained", "wrap", optional=True, loaded_only="transformers.modeling_utils"),
    # ---- torchtitan, at vescale_zero.integrations.torchtitan.install(): integrations/torchtitan/ ------------------
    # torch's fully_shard as torchtitan.distributed.fsdp imported it (apply_fsdp_to_decoder and the encoders')
    _same("torchtitan.distributed.fsdp.fully_shard", "torchtitan", _TORCH_FULLY_SHARD, f"{_TITAN}:fully_shard",
          when=f"{_TITAN}:torchtitan_installed"),
    # ---- megatron-core: integrations/megatron/ -----------------------------------------------------------------
    _same("megatron.core.utils.unwrap_model", "megatron-core", "(model, module_instances=None)",
          f"{_MEG}.megatron_lm:unwrap_vescale", "everywhere"),
    _same("megatron.core.transformer.module.MegatronModule.sharded_state_dict", "megatron-core",
          "(self, prefix='', sharded_offsets=(), metadata=None)", f"{_MEG}.dist_checkpoint:checkpoint_parameters",
          "instance"),
    _same("megatron.core.distributed.data_parallel_base._BaseDataParallel", "megatron-core", "(config, module)",
          f"{_MEG}.data_parallel:RaggedFSDP", "import"),
    _same("megatron.core.optimizer._get_param_groups", "megatron-core",
          "(model_chunks, config, config_overrides)"  # 0.16 and later; 0.15:
          " | (model_chunks, no_weight_decay_cond, scale_lr_cond, lr_mult, lr, min_lr, decoupled_lr, decoupled_min_lr, "
          "default_skip_embedding_weight_decay=False)", f"{_MEG}.megatron_compat:param_groups", "import"),
    _same("megatron.core.tensor_parallel.layers._initialize_affine_weight_cpu", "megatron-core",
          "(weight, output_size, input_size, per_partition_size, partition_dim, init_method, stride=1, "
          "return_master_weight=False, *, params_dtype=torch.float32, rank=None, world_size=None, "
          "skip_set_tensor_parallel_attributes=False)", f"{_MEG}.meta_init:_parallel_weight", "import"),
    # ---- Megatron-LM (megatron.training, not installable here), at use_vescale_fsdp_in_megatron_lm():
    # integrations/megatron/megatron_lm.py. Its module-level names, some of which its versions lack.
    HostPatch(f"{_TRAINING}.DDP", "megatron-core", "megatron.core.distributed.DistributedDataParallel", _MCORE_DDP,
              f"{_MEG}.megatron_lm:data_parallel_switch", "wrap"),
    HostPatch(f"{_TRAINING}.get_megatron_optimizer", "megatron-core", "megatron.core.optimizer.get_megatron_optimizer",
              _MCORE_OPTIMIZER, f"{_MEG}.megatron_lm:optimizer_switch", "wrap"),
    HostPatch(f"{_TRAINING}.check_param_hashes_across_dp_replicas", "Megatron-LM",
              "megatron.core.utils.check_param_hashes_across_dp_replicas", "(model, cross_check=False)",
              f"{_MEG}.megatron_lm:hashes_of_full_parameters", "wrap", optional=True),
    *(_same(f"{_TRAINING}.{name}", "Megatron-LM", None, f"{_MEG}.megatron_lm:{by}", "wrap", optional=True)
      for name, by in (("get_megatron_muon_optimizer", "muon_optimizer_switch"), ("get_model", "checked_get_model"),
                       ("to_empty_if_meta_device", "kept_on_meta"), ("calc_params_l2_norm", "params_norm_of_shards"),
                       ("save_checkpoint", "checkpoint_saver"), ("load_checkpoint", "checkpoint_loader"))),
    _same("megatron.training.checkpointing.save_checkpoint", "Megatron-LM", None,
          f"{_MEG}.megatron_lm:checkpoint_saver", "wrap", optional=True),
    _same("megatron.training.checkpointing.load_checkpoint", "Megatron-LM", None,
          f"{_MEG}.megatron_lm:checkpoint_loader", "wrap", optional=True),
)}


# ---- install / uninstall: the one bookkeeping of what is in place ---------------------------------------------

_MISSING = object()


@dataclass
class _Installed:
    """What :func:`install` changed for one entry, to undo it."""

    patch: HostPatch
    owner: Any  # the module or class holding the attribute (for ``everywhere``: the first one)
    undo: List[Callable[[], None]]


_INSTALLED: Dict[str, _Installed] = {}


def _object(path: str) -> Any:
    """``module:name`` -> the object (its module imported)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _owner(patch: HostPatch) -> Tuple[Any, str]:
    """``(the module or class holding the patched attribute, its name)``; ``(None, name)`` where the
    host or the owner is missing (or not loaded, for ``loaded_only``)."""
    path, _, attr = patch.patched.rpartition(".")
    if patch.loaded_only is not None and patch.loaded_only not in sys.modules:
        return None, attr
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            owner = sys.modules.get(name) or importlib.import_module(name)
            break
        except ImportError:
            continue
    else:
        return None, attr
    for part in parts[i:]:
        owner = getattr(owner, part, None)
        if owner is None:
            return None, attr
    return owner, attr


def _raw(owner: Any, attr: str) -> Any:
    """The attribute as the owner holds it (a class's ``staticmethod`` object, not its function)."""
    if isinstance(owner, type):
        return owner.__dict__.get(attr, _MISSING)
    return getattr(owner, attr, _MISSING)


def _put(owner: Any, attr: str, raw: Any) -> Callable[[], None]:
    """Set ``owner.attr``; returns what puts the original back."""
    before = _raw(owner, attr)
    setattr(owner, attr, raw)

    def undo() -> None:
        if before is _MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, before)
    return undo


def _forwarder(*args: Any, **kwargs: Any) -> Any:
    return _ROUTE_TARGET(*args, **kwargs)  # noqa: F821 - the name is renamed per routed function (_route)


def _route(function: types.FunctionType, by: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None]:
    """Replace ``function``'s code by a forwarder to ``by(a copy of the original)`` (the function
    object stays, so references bound before are routed too); returns the undo."""
    copy = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__,
                              function.__closure__)
    routed = by(copy)
    target = f"_vescale_zero_routed_{function.__name__}"
    code, had_signature = function.__code__, "__signature__" in function.__dict__
    function.__globals__[target] = routed  # the forwarder's one global, looked up in the host's module
    function.__code__ = _forwarder.__code__.replace(co_names=(target,), co_name=function.__name__,
                                                    co_qualname=function.__qualname__)
    function.__signature__ = inspect.signature(copy)  # inspect / help() still show the host's parameters

    def undo() -> None:
        function.__code__ = code
        function.__globals__.pop(target, None)
        if not had_signature:
            del function.__signature__
    return undo


def _install_one(patch: HostPatch) -> bool:
    record = _INSTALLED.get(patch.patched)
    owner, attr = _owner(patch)
    if record is not None and (owner is None or record.owner is owner):
        return False  # in place (or its owner is gone: nothing to patch again)
    _INSTALLED.pop(patch.patched, None)  # an owner loaded anew: patched anew
    if patch.when is not None and not _object(patch.when)():
        return False
    original = _MISSING if owner is None else getattr(owner, attr, _MISSING)
    if original is _MISSING:
        if patch.optional:
            return False
        raise RuntimeError(f"host patch {patch.patched}: the host has no such attribute (checked against "
                           f"{patch.host} {HOST_VERSIONS[patch.host]}); install that version, or re-read the patch")
    by = _object(patch.by)
    if patch.kind == "replace":
        undo = [_put(owner, attr, by)]
    elif patch.kind == "wrap":
        new = by(original)
        if new is None:
            return False
        undo = [_put(owner, attr, new)]
    elif patch.kind == "everywhere":
        new = by(original)
        undo = [_put(module, attr, new) for module in list(sys.modules.values())
                if module is not None and getattr(module, attr, None) is original]
    elif patch.kind == "route":
        undo = [_route(original, by)]
    else:
        raise ValueError(f"host patch {patch.patched}: a {patch.kind!r} entry is not installed")
    _INSTALLED[patch.patched] = _Installed(patch, owner, undo)
    return True


def install(host: str) -> List[str]:
    """Apply every entry of patch set ``host`` that is not in place yet ([Note: host patches]);
    returns the entries installed by this call."""
    entries = [p for p in HOST_PATCHES.values() if p.installed_by == host and p.kind in INSTALLED_KINDS]
    if not entries:
        raise ValueError(f"no host patches to install for {host!r}: choose one of "
                         f"{sorted({p.installed_by for p in HOST_PATCHES.values() if p.kind in INSTALLED_KINDS})}")
    return [p.patched for p in entries if _install_one(p)]


def uninstall(host: str) -> List[str]:
    """Put back the originals of every installed entry of patch set ``host``, in reverse order
    of installation; returns the entries undone."""
    done = [key for key, record in _INSTALLED.items() if record.patch.installed_by == host]
    for key in reversed(done):
        for undo in reversed(_INSTALLED.pop(key).undo):
            undo()
    return done


def installed(host: Optional[str] = None) -> List[str]:
    """The entries in place (of patch set ``host``, or of all), in the order they were installed."""
    return [key for key, record in _INSTALLED.items() if host is None or record.patch.installed_by == host]


def _declared(patched: str, kind: str) -> HostPatch:
    patch = HOST_PATCHES.get(patched)
    if patch is None or patch.kind != kind:
        raise KeyError(f"{patched} is not a {kind!r} entry of HOST_PATCHES: declare it there first")
    return patch


@contextlib.contextmanager
def scoped(patched: str, value: Any) -> Iterator[None]:
    """``patched`` (a ``scoped`` entry) holds ``value`` inside the ``with`` block, its own outside."""
    patch = _declared(patched, "scoped")
    owner, attr = _owner(patch)
    undo = _put(owner, attr, value)
    try:
        yield
    finally:
        undo()


def assign(patched: str, value: Any, key: Any = _MISSING) -> None:
    """Set a host's setting (a ``setting`` entry): ``patched = value``, or ``patched[key] = value``."""
    patch = _declared(patched, "setting")
    owner, attr = _owner(patch)
    if key is _MISSING:
        setattr(owner, attr, value)
    else:
        getattr(owner, attr)[key] = value
