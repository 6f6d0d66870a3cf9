"""The ``"zero_optimization": {"stage": "ragged", ...}`` section of a DeepSpeed config.

Our options, and the ZeRO-3 keys a user's existing config already has::

    key                                 with "ragged"
    granularity, sharded_modules,       our options (see RaggedOptions)
    reshard_after_forward, prefetch,
    reduce_dtype, fp8_all_gather_tile,
    shard_group_size
    overlap_comm                        mapped: prefetch the next group (async gathers)
    stage3_prefetch_bucket_size: 0      mapped: prefetch false, as ZeRO-3 prefetches nothing
    enable_sanity_checks,               honoured by deepspeed.zero.Init, which reads them alone
    memory_efficient_linear,            (ZERO_INIT_KEYS)
    override_module_apply
    reduce_scatter                      honoured: false reduces each group's gradients by one
                                        all-reduce, every rank keeping its range, as ZeRO-3
                                        does (see vescale_zero/runtime/grad_reduce.py)
    mics_shard_size                     mapped: shard_group_size (MiCS, which DeepSpeed
                                        0.19.8 removed; see [Note: shard groups])
    reduce_bucket_size, ... (NOTED)     accepted with a one-line warning: we run one
                                        collective per group, there is nothing to tune
    offload_optimizer, offload_param    mapped: master shards, gradients and optimizer state in
    (device cpu; cpu_offload*)          host memory (see .offload [Note: offload under ragged])
    offload_optimizer (device nvme)     mapped: optimizer state in files under nvme_path,
                                        stepped group by group (see nvme_offload_of)
    zero_quantized_weights              mapped: weights gathered as FP8 tiles (fp8_all_gather_tile
                                        128), [Note: ZeRO++ quantized communication under ragged]
    zero_hpz_partition_size             mapped: reshard_after_forward (ZeRO++ hpZ: after forward
                                        the weights stay sharded within groups of that size;
                                        backward gathers inside them)
    zero_quantized_gradients,           rejected: not implemented; the error names the key and
    zero_quantized_nontrainable_weights, the fix
    zenflow
    anything else                       an error naming it and listing the valid keys

[Note: shard groups]
``shard_group_size: N`` shards every parameter within groups of N consecutive data-parallel
ranks and replicates across the groups (HSDP: ``fully_shard`` on a ``(world / N, N)``
``("replicate", "shard")`` mesh): all-gathers and reduce-scatters stay inside a group (a
node, say), and one all-reduce per group of the shard crosses them. MiCS configs
(``mics_shard_size``, stage 3) migrate by changing the stage: the key means the same here
(``-1``, MiCS's "off", and ``None`` mean unset). ZeRO++'s ``zero_hpz_partition_size: N`` (a
secondary weight copy partitioned within groups of N ranks, which backward gathers from) is
the layers' ``reshard_after_forward=N``: after forward each rank keeps ``1/N`` of a layer's
gathered weights and backward gathers them inside its group of N
(vescale_zero.runtime.post_forward [Note: the post-forward shard]); N must divide the shard
group's size. Whether N divides the data-parallel world is checked when the engine is built.

[Note: ZeRO++ quantized communication under ragged]
ZeRO++'s qwZ (``zero_quantized_weights``) gathers the weights quantized (int8, one scale per
group of elements) and computes with them dequantized, the master staying exact. Ragged's
quantized gather is block-wise FP8 (``fp8_all_gather_tile``, vescale_zero/runtime/fp8_gather.py):
each rank quantizes whole tiles of its own shard, one scale per tile, and the gathered weights
equal quantize / dequantize of the unsharded tensor tile by tile. So qwZ maps to it, with tiles of
``QWZ_TILE`` (matrices only: norms and biases travel unquantized, as FP8 recipes keep them): the
same meaning, a quantized weight gather, in another format (e4m3 keeps 3 mantissa bits on every
element of a tile, int8 keeps 1/127 of a group's largest value). qgZ (``zero_quantized_gradients``)
exchanges int4 gradients all-to-all before reducing them; ragged has no quantized reduce-scatter,
so it is refused, as is ``zero_quantized_nontrainable_weights`` (frozen weights stored
quantized, where ragged keeps every weight exact).

[Note: validated as DeepSpeed validates]
Every value is parsed by DeepSpeed's own pydantic models, so a ragged config accepts and
means what a ZeRO-3 config does: the ZeRO-3 keys we do not use are validated by
``DeepSpeedZeroConfig`` (``reduce_bucket_size: -5`` is refused, ``overlap_comm: "false"`` is
False), and the ``bf16`` / ``fp16`` sections by DeepSpeed's precision models
(:func:`parse_precision`), which drop ``"auto"`` values (Hugging Face's placeholders: the
default, i.e. disabled) and read ``"false"`` as False.

Top-level keys that concern the data-parallel layer (:func:`apply_top_level_keys`)::

    communication_data_type             mapped: reduce_dtype (gradients reduced in it)
    data_types.grad_accum_dtype         accepted when it is the reduce dtype (we accumulate
                                        gradients in the reduce dtype); else refused
    bf16.bf16_master_weights_and_grads, refused: our master shards are fp32
    bf16.bf16_optimizer_states
    gradient_allreduce_op: "sum"        refused, as ZeRO-3 refuses it (we average)
"""

from __future__ import annotations

import difflib
import warnings
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

import torch
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .deepspeed_compat import (
    DtypeEnum,
    bf16_section,
    fp16_section,
    get_communication_data_type,
    gradient_allreduce_op,
    super_offload,
)
from .offload import OFFLOAD_KEYS, OffloadOptions, read_offload, warn_ignored

__all__ = ["RaggedOptions", "ACCEPTED", "NvmeOptimizerOffload", "nvme_offload_of", "parse_ragged_section",
           "parse_precision", "apply_top_level_keys", "RAGGED_STAGE"]

RAGGED_STAGE = "ragged"

_NOTED = {  # meaningful for ZeRO-3's bucketed, per-parameter machinery; not for one buffer per group
    "reduce_bucket_size", "allgather_bucket_size", "allgather_partitions", "use_multi_rank_bucket_allreduce",
    "stage3_prefetch_bucket_size", "prefetch_bucket_size", "stage3_param_persistence_threshold",
    "param_persistence_threshold", "stage3_model_persistence_threshold", "model_persistence_threshold",
    "stage3_max_live_parameters", "max_live_parameters", "stage3_max_reuse_distance", "max_reuse_distance",
    "stage3_module_granularity_threshold", "module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params",
    "use_all_reduce_for_fetch_params", "stage3_allgather_sequential", "allgather_sequential", "sub_group_size",
    "round_robin_gradients", "elastic_checkpoint", "ignore_unused_parameters",
    "load_from_fp32_weights", "compute_grad_norm", "parameter_alignment", "log_trace_cache_warnings",
    "legacy_stage1", "pipeline_loading_checkpoint",
    "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "contiguous_gradients", "leaf_module",
    "save_muon_momentum_buffer_in_memory", "mics_hierarchical_params_gather",
}


_REJECTED = ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients", "zenflow")
"""ZeRO keys that are known here: refused with a reason when set (see :func:`_rejection`)."""


QWZ_TILE = 128
"""The FP8 tile side ``zero_quantized_weights`` gathers with (the usual FP8 recipes' tile)."""

_QUANTIZED_REFUSED = {
    "zero_quantized_gradients": (
        "zero_quantized_gradients (ZeRO++ qgZ: int4 gradients exchanged all-to-all) is not implemented with stage "
        "'ragged', which reduce-scatters gradients in reduce_dtype; remove it (reduce_dtype 'bf16' halves the bytes)"),
    "zero_quantized_nontrainable_weights": (
        "zero_quantized_nontrainable_weights (frozen weights stored quantized) is not implemented with stage "
        "'ragged', which keeps every weight exact; remove it (zero_quantized_weights gathers weights as FP8 tiles)"),
}


def _rejection(key: str, value: Any) -> Optional[str]:
    """Why ``key: value`` cannot be used with ragged sharding (``None`` if it can)."""
    if key == "zero_quantized_weights":
        return None  # read after the loop: [Note: ZeRO++ quantized communication under ragged]
    if key in _QUANTIZED_REFUSED and value:
        return _QUANTIZED_REFUSED[key]
    if key == "zenflow" and value:
        return "zenflow is not implemented with stage 'ragged'; remove it"
    if key in _REJECTED:
        return None
    return "unknown"


_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


class NvmeOptimizerOffload(BaseModel):
    """``offload_optimizer: {"device": "nvme", ...}`` as stage 'ragged' uses it (:func:`nvme_offload_of`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nvme_path: str
    read_ahead: bool = False
    pin_memory: bool = True


def nvme_offload_of(zero3: DeepSpeedZeroConfig) -> Optional[NvmeOptimizerOffload]:
    """The section's ``offload_optimizer`` with device ``nvme`` (``None`` for any other device),
    parsed by DeepSpeed's own model: the optimizer state goes to files under ``nvme_path``
    (vescale_zero.optim.state_files), one fully_shard group's state in memory at a time.
    ``pipeline_read`` / ``pipeline_write`` read the next group's state while one steps (two
    staging buffers); ``buffer_count`` (DeepSpeed's pool of swap buffers), ``fast_init`` and
    ``cpuadam_cores_perc`` have nothing to set here; ``super_offload`` is refused (a partial
    offload, ``ratio`` < 1, by ``.offload.read_offload``, for either device)."""
    offload = zero3.offload_optimizer
    if offload is None or offload.device != "nvme":
        return None
    if offload.nvme_path is None:
        raise ValueError("zero_optimization.offload_optimizer: device 'nvme' needs nvme_path, an existing writable "
                         "directory (on a fast local disk) for the optimizer state files")
    if super_offload(offload):
        raise ValueError("zero_optimization.offload_optimizer: super_offload is not implemented with stage 'ragged', "
                         "which offloads all of the optimizer state; remove it")
    return NvmeOptimizerOffload(nvme_path=str(offload.nvme_path), read_ahead=offload.pipeline,
                                pin_memory=offload.pin_memory)


class RaggedOptions(BaseModel):
    """Our keys in the ragged section (all optional)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    granularity: Union[None, int, str, Dict[str, Union[int, str]]] = None
    """Block size policy: 'element', 'row', '<N>rows', an int, or {parameter name: int | preset}."""
    sharded_modules: Optional[List[str]] = None
    """Class names of the modules that form one group each (e.g. ["GPTBlock"]); default: the
    model's layers (vescale_zero.api.layer_discovery [Note: finding the layers])."""
    reshard_after_forward: Union[bool, int] = True
    """Or the number of ranks to reshard to after forward (the layers'; zero_hpz_partition_size)."""
    prefetch: bool = True
    reduce_dtype: Optional[Literal["fp32", "float32", "bf16", "bfloat16", "fp16", "float16"]] = None
    fp8_all_gather_tile: Optional[int] = Field(default=None, gt=0)
    """Gather parameters as float8 with one scale per tile x tile tile (e.g. 128)."""
    optimizer_aware: bool = False
    """With ``"optimizer": {"type": "Muon"}``: keep matrices whole on one rank where that moves fewer
    bytes per step (``fully_shard(optimizer_aware=...)``; the plan per group: ``vz.sharding_report``)."""
    shard_group_size: Optional[int] = Field(default=None, gt=0)
    """Shard within groups of this many data-parallel ranks, replicate across them (HSDP;
    see [Note: shard groups]); default: shard over the whole data-parallel group."""
    reduce_scatter: bool = True
    """Not ours: ZeRO-3's key as DeepSpeed reads it; false reduces gradients by an all-reduce,
    each rank keeping its range."""
    zero_init: Dict[str, Any] = Field(default_factory=dict)
    """Not ours: the ZeRO-3 keys only ``deepspeed.zero.Init`` reads (:data:`ZERO_INIT_KEYS`), as
    DeepSpeed read them; they reach it through the parsed config (.parser)."""
    offload: Optional[OffloadOptions] = None
    """Not a key of the section: read from offload_optimizer / offload_param (.offload)."""
    optimizer_nvme: Optional[NvmeOptimizerOffload] = None
    """From ``offload_optimizer`` with device ``nvme`` (not a key of its own: :func:`nvme_offload_of`)."""

    @property
    def reduce_torch_dtype(self) -> Optional[torch.dtype]:
        return _DTYPES[self.reduce_dtype] if self.reduce_dtype else None


_PREFETCH_BUCKET = {"stage3_prefetch_bucket_size", "prefetch_bucket_size"}
"""0 turns ZeRO-3's prefetch off: mapped to prefetch false (any other size has no effect here)."""

ZERO_INIT_KEYS = ("enable_sanity_checks", "memory_efficient_linear", "override_module_apply")
"""ZeRO-3 keys that only ``deepspeed.zero.Init`` (and its ``GatheredParameters``) read: they keep
their meaning under ragged, where ``zero.Init`` partitions as for ZeRO-3 (zero_init
[Note: zero.Init under ragged])."""

_READ_BY_DEEPSPEED = {"offload", "optimizer_nvme", "reduce_scatter", "zero_init"}
"""Fields of :class:`RaggedOptions` that are ZeRO-3's keys (or made from them), read by DeepSpeed's model."""


def _unknown_key(key: str, ours: set) -> str:
    """The error for an unknown key: the closest valid key first, then ours (the ZeRO-3 tuning
    keys, accepted and ignored, are too many to list)."""
    known = (ours | {"stage", "overlap_comm", "reduce_scatter", "mics_shard_size", "zero_hpz_partition_size"} | _NOTED
             | set(_REJECTED) | set(OFFLOAD_KEYS) | set(ZERO_INIT_KEYS))
    close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
    if not close:  # a prefix or a different separator ("granular", "sharded-modules")
        folded = str(key).lower().replace("-", "_")
        close = [k for k in sorted(known) if k.startswith(folded) or k == folded][:1]
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return (f"zero_optimization: unknown key {key!r} for stage 'ragged'.{hint} Our keys: "
            f"{', '.join(sorted(ours))}; also accepted: stage, overlap_comm, reduce_scatter and ZeRO-3's tuning keys "
            "(reduce_bucket_size, stage3_prefetch_bucket_size, ...; no effect with one collective per group)")


def _merge_mics_shard_size(section: Dict[str, Any], options: Dict[str, Any]) -> None:
    """``mics_shard_size`` as ``shard_group_size`` (see [Note: shard groups]); refused if both
    are set and differ."""
    mics = section.get("mics_shard_size")
    if mics in (None, -1):
        return
    ours = options.get("shard_group_size")
    if ours is not None and ours != mics:
        raise ValueError(
            f"zero_optimization: shard_group_size {ours} and mics_shard_size {mics} disagree; they are the same "
            "setting under stage 'ragged' (shard within groups of that size): keep one"
        )
    if not isinstance(mics, int) or isinstance(mics, bool) or mics < 1:
        raise ValueError(f"zero_optimization: mics_shard_size {mics!r} is not a group size: use a positive integer "
                         "(or -1 for no shard groups), or set shard_group_size instead")
    options["shard_group_size"] = mics


def _merge_hpz_partition_size(section: Dict[str, Any], options: Dict[str, Any]) -> None:
    """``zero_hpz_partition_size`` as ``reshard_after_forward`` (see [Note: shard groups]); 0, 1
    and unset mean no hpZ; refused if reshard_after_forward says otherwise (False, another int)."""
    hpz = section.get("zero_hpz_partition_size")
    if hpz in (None, 0, 1):
        return
    if not isinstance(hpz, int) or isinstance(hpz, bool) or hpz < 0:
        raise ValueError(f"zero_optimization: zero_hpz_partition_size {hpz!r} is not a group size: use a positive "
                         "integer that divides the data-parallel (or shard group) size, or 1 for no hpZ")
    ours = options.get("reshard_after_forward", True)
    if ours is not True and ours != hpz:
        raise ValueError(
            f"zero_optimization: reshard_after_forward {ours!r} and zero_hpz_partition_size {hpz} disagree; hpZ is "
            f"reshard_after_forward: {hpz} under stage 'ragged' (reshard to {hpz} ranks after forward): keep one")
    options["reshard_after_forward"] = hpz


_NOT_IN_DEEPSPEED = {"stage", "mics_shard_size", "mics_hierarchical_params_gather"}  # MiCS left DeepSpeed 0.19.8


def _problems(error: ValidationError, prefix: str) -> str:
    return "; ".join(f"{prefix}{'.'.join(map(str, err['loc']))} {err.get('input')!r}: {err['msg']}"
                     for err in error.errors())


def _as_deepspeed_reads_it(section: Dict[str, Any], ours: set) -> DeepSpeedZeroConfig:
    """The section's ZeRO-3 keys parsed by DeepSpeed's own ZeRO model, as at stage 3
    ([Note: validated as DeepSpeed validates]); a value it refuses is refused here."""
    zero3 = {k: v for k, v in section.items() if k not in ours and k not in _NOT_IN_DEEPSPEED}
    try:
        return DeepSpeedZeroConfig(stage=3, **zero3)
    except ValidationError as e:
        raise ValueError(
            f"zero_optimization (stage 'ragged'): {_problems(e, '')}. DeepSpeed refuses this value at stage 3 as "
            "well; give a valid value, or remove the key (ZeRO-3's tuning keys have no effect with stage 'ragged')"
        ) from None


def parse_ragged_section(section: Dict[str, Any]) -> Tuple[RaggedOptions, List[str]]:
    """Validate a ragged ``zero_optimization`` section: ``(options, warnings issued)``."""
    ours = set(RaggedOptions.model_fields) - _READ_BY_DEEPSPEED
    options: Dict[str, Any] = {}
    noted: List[str] = []
    for key, value in section.items():
        if key == "stage":
            continue
        if key in ours:
            options[key] = value
        elif key in ("mics_shard_size", "zero_hpz_partition_size"):
            pass  # after the loop: they may meet shard_group_size, reshard_after_forward
        elif key in ("overlap_comm", "reduce_scatter") or key in OFFLOAD_KEYS or key in ZERO_INIT_KEYS:
            pass  # after the loop: as DeepSpeed reads them ("false" is False; cpu_offload: true)
        elif key in _NOTED and not (key in _PREFETCH_BUCKET and value == 0):
            noted.append(key)
        elif key in _NOTED:
            pass  # 0: ZeRO-3 prefetches nothing; read after the loop
        else:
            why = _rejection(key, value)
            if why == "unknown":
                raise ValueError(_unknown_key(key, ours))
            if why is not None:
                raise ValueError(f"zero_optimization: {why}")
    _merge_mics_shard_size(section, options)
    _merge_hpz_partition_size(section, options)
    zero3 = _as_deepspeed_reads_it(section, ours)
    options["optimizer_nvme"] = nvme_offload_of(zero3)
    if _PREFETCH_BUCKET & set(section) and zero3.prefetch_bucket_size == 0:  # ZeRO-3 prefetches nothing
        options.setdefault("prefetch", False)
    if "overlap_comm" in section and "overlap_comm" in zero3.model_fields_set:  # not "auto"
        options.setdefault("prefetch", zero3.overlap_comm)
    options["reduce_scatter"] = zero3.reduce_scatter
    options["zero_init"] = {k: getattr(zero3, k) for k in ZERO_INIT_KEYS if k in zero3.model_fields_set}
    options["offload"], ignored = read_offload(zero3)
    if zero3.zero_quantized_weights:  # [Note: ZeRO++ quantized communication under ragged]
        options.setdefault("fp8_all_gather_tile", QWZ_TILE)
        warnings.warn(f"zero_optimization.zero_quantized_weights: weights are gathered as float8 (e4m3) tiles of "
                      f"{options['fp8_all_gather_tile']} x {options['fp8_all_gather_tile']}, one scale per tile "
                      "(fp8_all_gather_tile), where ZeRO++ gathers int8 groups", UserWarning, stacklevel=3)
    for key in noted:
        msg = f"zero_optimization.{key} has no effect with stage 'ragged' (one collective per group); ignored"
        warnings.warn(msg, UserWarning, stacklevel=3)
    warn_ignored(ignored)
    try:
        return RaggedOptions(**options), [f"zero_optimization.{k}" for k in noted + ignored]
    except ValidationError as e:
        raise ValueError(_our_problems(e)) from None


ACCEPTED = {
    "granularity": "'element', 'row', '<N>rows', a positive int (elements per block), or {parameter name: one of "
                   "those}",
    "sharded_modules": "a list of module class names, e.g. [\"LlamaDecoderLayer\"]",
    "reshard_after_forward": "true, false, or the number of ranks to reshard to after forward (a divisor of the "
                             "shard group's size, as zero_hpz_partition_size)",
    "prefetch": "true or false",
    "reduce_dtype": "fp32, bf16 or fp16 (or float32, bfloat16, float16)",
    "fp8_all_gather_tile": "a positive int (the tile side, e.g. 128), or null",
    "shard_group_size": "a positive int that divides the data-parallel world size, or null",
    "optimizer_aware": "true or false (true with the optimizer Muon)",
}
"""What each of our keys accepts, for the one-line error naming a refused value."""


def _our_problems(error: ValidationError) -> str:
    """[Note: one line per refused key] Values of our keys that :class:`RaggedOptions` refuses:
    one line (several keys joined by "; "), each naming the key, the value given and what the
    key accepts -- never pydantic's multi-line report (whose reasons, one per branch of a union,
    say less than the list of what is accepted)."""
    refused = {}
    for err in error.errors():
        key = str(err["loc"][0]) if err["loc"] else "?"
        refused.setdefault(key, err.get("input"))
    return "; ".join(f"zero_optimization.{key} {value!r} is not accepted: {key} takes "
                     f"{ACCEPTED.get(key, 'see RaggedOptions')}" for key, value in refused.items())


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def parse_precision(config: Dict[str, Any]) -> Tuple[Optional[torch.dtype], Any]:
    """``(compute dtype or None, the fp16 section)`` of a whole config, read by DeepSpeed's own
    models ([Note: validated as DeepSpeed validates]: ``"auto"`` is the default, ``"false"``
    False, a value DeepSpeed refuses is refused). Our master shards are fp32, so ZeRO's bf16 /
    fp16 master weights are refused."""
    sections = {}
    for name, read in (("bf16", bf16_section), ("fp16", fp16_section)):  # [Note: one door to DeepSpeed's releases]
        given = {k: v for k, v in config.items() if k in ("bf16", "bfloat16", "fp16") and v is not None}
        try:
            sections[name] = read(given)
        except ValidationError as e:
            raise ValueError(
                f"{_problems(e, name + '.')}. DeepSpeed refuses this value with any stage: give a valid value "
                "(\"enabled\": true or false)") from None
    bf16, fp16 = sections["bf16"], sections["fp16"]
    if bf16.enabled and fp16.enabled:
        raise ValueError("bf16 and fp16 are both enabled; enable one")
    # before 0.18 DeepSpeed has no 16-bit masters in these sections [Note: one door to DeepSpeed's releases]
    low = [f"bf16.{k}" for k in ("bf16_master_weights_and_grads", "bf16_optimizer_states") if getattr(bf16, k, False)]
    low += ["fp16.fp16_master_weights_and_grads"] if getattr(fp16, "fp16_master_weights_and_grads", False) else []
    if low:
        raise ValueError(
            f"{', '.join(low)}: 16-bit master weights, gradients or optimizer states are not implemented with stage "
            "'ragged', which keeps fp32 master shards and optimizer states; remove them (to reduce gradients in "
            "16 bits, set zero_optimization.reduce_dtype), or use stage 3")
    dtype = torch.bfloat16 if bf16.enabled else torch.float16 if fp16.enabled else None
    return dtype, fp16


def apply_top_level_keys(config: Dict[str, Any], options: RaggedOptions) -> RaggedOptions:
    """``options`` with the whole config's data-parallel keys applied (see the table in the
    module docstring): ``communication_data_type`` becomes ``reduce_dtype``;
    ``grad_accum_dtype`` other than the reduce dtype and ``gradient_allreduce_op: "sum"`` are
    refused."""
    if gradient_allreduce_op(config) == "sum":  # DeepSpeed's reading (and refusal of unknown ops)
        raise ValueError(
            "gradient_allreduce_op \"sum\" is not supported with stage 'ragged' (DeepSpeed refuses it with ZeRO "
            "stage 3 as well): gradients are averaged over the data-parallel ranks. Remove the key (or set \"mean\"); "
            "to train on summed gradients, multiply the loss by the data-parallel world size")
    comm = get_communication_data_type(config)  # DeepSpeed's reading: None or a torch dtype
    if comm is not None:
        if options.reduce_dtype is not None and options.reduce_torch_dtype != comm:
            raise ValueError(
                f"communication_data_type {config['communication_data_type']!r} and zero_optimization.reduce_dtype "
                f"{options.reduce_dtype!r} disagree; with stage 'ragged' both set the dtype gradients are reduced "
                "in: keep one")
        options = options.model_copy(update={"reduce_dtype": _DTYPE_NAMES[comm]})
    accum = (config.get("data_types") or {}).get("grad_accum_dtype")
    if accum is not None:
        try:
            want = DtypeEnum(accum).value
        except ValueError:
            raise ValueError(f"data_types.grad_accum_dtype {accum!r} is not a dtype: use fp32, bf16 or fp16") from None
        reduce = options.reduce_torch_dtype or torch.float32
        if want != reduce:
            raise ValueError(
                f"data_types.grad_accum_dtype {accum!r}: stage 'ragged' accumulates gradients in the dtype it "
                f"reduces them in ({_DTYPE_NAMES[reduce]} here); remove grad_accum_dtype, or set "
                f"zero_optimization.reduce_dtype: {_DTYPE_NAMES.get(want, accum)!r} to accumulate and reduce in it")
    return options
