"""``RaggedDeepSpeedEngine``: DeepSpeed's engine with its data-parallel layer replaced.

DeepSpeed builds the engine at stage 0 (no ZeRO, no fp16/bf16 wrappers of its own); this
subclass then

* shards the module with :func:`vescale_zero.fully_shard_layers` over DeepSpeed's
  data-parallel group (with ``shard_group_size``: on its 2-D replicate x shard mesh, HSDP),
  right after DeepSpeed placed and broadcast it;
* builds the optimizer on the sharded parameters (remapping ``model_parameters`` or a
  client optimizer that was built on the original ones);
* lets the runtime's hooks reduce-scatter gradients at the accumulation boundary (every
  backward when the caller owns it: ``"managed_gradient_accumulation": false``), so
  DeepSpeed's all-reduce is a no-op, for ``engine.backward(loss)``, ``loss.backward()`` and
  ``engine.scale(loss).backward()`` alike; clips by the global norm over ragged shards and
  reports it as ZeRO-3 does;
* with ``offload_optimizer`` to the CPU, keeps every group's master shard, gradient shard and
  optimizer state in host memory, stepped there by the optimizer DeepSpeed picks at ZeRO-3 with
  offload (:mod:`.offload` [Note: offload under ragged]);
* keeps bf16 / fp16 itself: bf16 or fp16 compute and gathers, fp32 reduce and master
  shards (fp32 also for a model already cast to bf16 / fp16, as ZeRO-3); fp16 with
  DeepSpeed's loss scaler as ZeRO-3 configures it (dynamic or static), where an overflow
  on any shard skips the step on every rank.

Everything else (forward, ``train_batch_size`` arithmetic, gradient accumulation
counters, LR schedulers, logging) is DeepSpeed's own.
"""

from __future__ import annotations

import inspect
import math
import os
from typing import Any, Container, List, Optional, Union

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler, LossScalerBase
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from deepspeed.utils import groups
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import vescale_zero as vz
from vescale_zero import checkpoint, host_patches, local_piece
from vescale_zero.hosts import HSDP_DIM_NAMES, GroupState, StateOffloader, collective_device, groups_of
from vescale_zero.integrations.loss_scaling import unscale_and_find_inf
from vescale_zero.optim import AdamW8bit, Muon, Shampoo
from vescale_zero.torch_compat import queue_backward_callback

from .accelerate_stage import present_ragged_stage_to_accelerate
from .checkpoint_conversion import is_deepspeed_checkpoint
from .config import RaggedOptions
from .deepspeed_compat import (
    BACKWARD_HOOKS,
    fp16_section,
    is_functorch_transforming,
    managed_gradient_accumulation,
    refine_include_states,
)
from .module_hooks import RaggedModuleHooks
from .nvme_offload import offload_optimizer_to_nvme
from .offload import OptimizerOnDevice, offload_policy
from .optimizer_state import as_the_optimizer_keeps_it
from .recovery_scripts import write_recovery_scripts, write_universal_notice
from .safe_accessors import attach_optimizer
from .saving import consolidated_state_dict
from .zero3_attributes import answer_zero3_attributes
from .zero_init import fill_from_zero3, zero3_to_meta

__all__ = ["RaggedEngineMixin", "RaggedDeepSpeedEngine", "RaggedPipelineEngine", "RaggedPrecision"]


_SHARDED_BY_ENGINE = "_vescale_deepspeed_sharding"
"""Set on a model a ragged engine sharded: the options it sharded with
([Note: a model an engine sharded, given to another])."""

STRUCTURED_OPTIMIZERS = {"adamw8bit": AdamW8bit, "shampoo": Shampoo, "muon": Muon}
"""Config ``optimizer.type`` values (lower case) served by vescale-zero's own optimizers."""


class RaggedPrecision:
    """The user's ``bf16`` / ``fp16`` sections, which DeepSpeed itself does not see: the compute
    dtype, and the fp16 section as DeepSpeed parsed it (its loss scaling)."""

    def __init__(self, dtype: Optional[torch.dtype], fp16: Any = None) -> None:
        self.dtype = dtype
        self.fp16 = fp16 if fp16 is not None else fp16_section()


class RaggedEngineMixin:
    """The overrides, for ``DeepSpeedEngine`` and ``PipelineEngine`` alike. Set
    ``ragged_options`` / ``ragged_precision`` on a subclass before construction."""

    ragged_options: RaggedOptions = RaggedOptions()
    ragged_precision: RaggedPrecision = RaggedPrecision(None)

    # ---- construction ------------------------------------------------------------------
    # host patch deepspeed.runtime.engine.DeepSpeedEngine._configure_distributed_model: checked against deepspeed 0.16.9-0.19.8  # noqa: E501
    def _configure_distributed_model(self, model: torch.nn.Module) -> None:
        super()._configure_distributed_model(model)
        opts, precision = self.ragged_options, self.ragged_precision
        compute = precision.dtype if precision.dtype is not None else self._zero3_built_dtype()
        mp = None
        if compute is not None:
            reduce_dtype = opts.reduce_torch_dtype or torch.float32
            mp = vz.MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce_dtype)
        elif opts.reduce_torch_dtype is not None:
            mp = vz.MixedPrecisionPolicy(reduce_dtype=opts.reduce_torch_dtype)
        granularity = opts.granularity
        if granularity is None and hasattr(self._structured_optimizer(), "granularity"):
            # the optimizer's blocks must stay whole on one rank: shard by them
            granularity = self._structured_optimizer().granularity(self._optimizer_block())
        aware = None
        if opts.optimizer_aware:  # Muon's matrices whole where that moves fewer bytes
            if self._structured_optimizer() is not Muon:
                raise ValueError(f"zero_optimization.optimizer_aware plans for Muon's matrices, but the optimizer is "
                                 f"{self.optimizer_name()!r}: set \"optimizer\": {{\"type\": \"Muon\"}}, or drop "
                                 "optimizer_aware")
            aware = Muon.optimizer_aware(micro_batches=self.gradient_accumulation_steps())
        # built under deepspeed.zero.Init (ragged's or stage 3's): [Note: zero.Init under ragged]
        zero3 = zero3_to_meta(self.module, torch.float32 if compute is not None else None)
        if isinstance(self.module, vz.RaggedFSDPModule):
            self._check_presharded(mp, granularity)
        else:
            if precision.dtype is not None:
                self._fp32_masters()
            vz.fully_shard_layers(
                self.module, opts.sharded_modules, mesh=self._ragged_mesh(),
                reshard_after_forward=opts.reshard_after_forward, mp_policy=mp, granularity=granularity,
                fp8_all_gather_tile=opts.fp8_all_gather_tile, offload_policy=offload_policy(opts.offload),
                optimizer_aware=aware,
            )
            setattr(self.module, _SHARDED_BY_ENGINE, self._sharding_options(granularity))
        if zero3:
            fill_from_zero3(self.module, zero3, self.device)
        answer_zero3_attributes(self.module)  # TRL / PEFT read them: [Note: ZeRO-3 attributes on ragged parameters]
        self.module.set_prefetch(opts.prefetch)
        # "reduce_scatter": false: grad_reduce [Note: all-reduce instead of reduce-scatter]
        for group in groups_of(self.module):
            group.grads.reduce_by_all_reduce = not opts.reduce_scatter
        self.module.set_unused_grads("zero")  # as ZeRO-3: a parameter no rank used still gets stepped
        host_patches.install("accelerate")  # accelerate's / transformers' saves get the full model (see .saving),
        host_patches.install("transformers")  # where they are loaded by now
        present_ragged_stage_to_accelerate()  # accelerate compares zero_stage with ints (see .accelerate_stage)
        self._ragged_scaler = self._make_loss_scaler() if precision.dtype == torch.float16 else None
        if self._is_pipeline():
            # [Note: pipelines] PipelineEngine runs backward per micro-batch outside
            # engine.backward and marks the accumulation boundary only when it reduces, so
            # every micro-batch's gradients are reduce-scattered and accumulate in the
            # shards (a sum of averages: the same numbers as one reduction at the end).
            if self.module.get_tied_weights_and_groups():
                raise ValueError("stage 'ragged' with weights tied across pipeline stages is not supported yet")
            if precision.dtype is not None:
                raise ValueError(
                    "stage 'ragged' with pipeline parallelism runs in fp32 only for now; disable bf16/fp16")

    def _zero3_built_dtype(self) -> Optional[torch.dtype]:
        """The 16-bit dtype stage 3's ``zero.Init`` built the model in, when the config enables neither
        bf16 nor fp16 (``zero.Init()`` without a config builds fp16, or bf16 where fp16 is not
        supported): ZeRO-3 then computes in that dtype beside fp32 master partitions, and so does
        ragged ([Note: zero.Init under ragged]). ``None`` for any other model."""
        built = {p.dtype for p in self.module.parameters() if hasattr(p, "ds_id")}
        return built.pop() if len(built) == 1 and built <= {torch.bfloat16, torch.float16} else None

    def _fp32_masters(self) -> None:
        """A model already in bf16 / fp16 (``model.to(torch.bfloat16)``) with bf16 / fp16 enabled:
        its parameters become the fp32 master weights (their 16-bit values exactly), as ZeRO-3
        keeps fp32 partitions of a 16-bit model; the compute copy is 16-bit by the policy.
        Without this the 16-bit parameters would be the masters, and Adam's updates below their
        resolution would vanish. Buffers keep their dtype."""
        for param in self.module.parameters():
            if param.dtype in (torch.bfloat16, torch.float16):
                param.data = param.data.float()

    def _ragged_mesh(self) -> Union[dist.ProcessGroup, DeviceMesh]:
        """What the layers are sharded over: DeepSpeed's data-parallel group, or with
        ``shard_group_size`` a 2-D ``(replicas, shard)`` mesh of it (config [Note: shard groups])."""
        dp = groups._get_data_parallel_group()
        size, dp_size = self.ragged_options.shard_group_size, dist.get_world_size(dp)
        if size is None or size == dp_size:
            return dp
        if dp_size % size:
            divisors = [d for d in range(1, dp_size + 1) if dp_size % d == 0]
            raise ValueError(
                f"zero_optimization.shard_group_size {size} does not divide the data-parallel world size {dp_size}: "
                f"shard groups must tile it; choose one of {divisors}")
        if dp_size != dist.get_world_size():
            raise ValueError(
                f"zero_optimization.shard_group_size with pipeline or model parallelism (data-parallel size {dp_size} "
                f"of {dist.get_world_size()} ranks) is not supported yet; remove shard_group_size, or train with data "
                "parallelism only")
        return init_device_mesh(get_accelerator().device_name(), (dp_size // size, size),
                                mesh_dim_names=HSDP_DIM_NAMES[0])

    def _sharding_options(self, granularity: Any) -> dict:
        """The options this engine shards with ([Note: a model an engine sharded, given to another])."""
        opts = self.ragged_options
        return {"granularity": granularity, "sharded_modules": opts.sharded_modules,
                "reshard_after_forward": opts.reshard_after_forward, "reduce_dtype": opts.reduce_torch_dtype,
                "fp8_all_gather_tile": opts.fp8_all_gather_tile, "shard_group_size": opts.shard_group_size,
                "offload": opts.offload, "bf16/fp16": self.ragged_precision.dtype}

    def _check_sharded_by_an_engine(self, granularity: Any) -> None:
        """[Note: a model an engine sharded, given to another] ``deepspeed.initialize`` on the model
        of an earlier engine (DeepSpeed's own tests build a second engine on the same model to load
        a checkpoint and save it again) re-wraps it, as ZeRO-3 re-wraps its partitioned model: the
        model stays sharded as the first engine sharded it, so the config must ask for the same
        sharding (the same keys, bf16 / fp16 included); a difference is refused, naming it."""
        before, now = getattr(self.module, _SHARDED_BY_ENGINE), self._sharding_options(granularity)
        differ = [f"{k}: {before[k]!r} -> {now[k]!r}" for k in now if before.get(k) != now[k]]
        if differ:
            raise ValueError(
                f"deepspeed.initialize was given the model of an earlier stage 'ragged' engine, sharded with other "
                f"options than this config's ({'; '.join(differ)}): use the first engine's sharding options (its "
                "zero_optimization section and bf16 / fp16), or pass a model that is not sharded yet")

    def _check_presharded(self, mp: Optional[vz.MixedPrecisionPolicy], granularity: Any) -> None:
        """[Note: a model sharded before deepspeed.initialize] A model the user sharded with
        ``fully_shard`` (e.g. built on meta and ``vescale_zero.materialize``-d) is taken as it
        is: its groups must shard over DeepSpeed's data-parallel group, and the config may not
        ask for sharding options that only apply when sharding (they would be ignored)."""
        dp_ranks = dist.get_process_group_ranks(groups._get_data_parallel_group())
        size = self.ragged_options.shard_group_size or len(dp_ranks)
        at = dp_ranks.index(dist.get_rank()) // size * size
        want, what = dp_ranks[at : at + size], "DeepSpeed's data-parallel group is"
        if size != len(dp_ranks):
            what = f"this rank's shard group (shard_group_size {size}) is"
        for group in groups_of(self.module):
            ranks = dist.get_process_group_ranks(group.process_group)
            if ranks != want:
                raise ValueError(
                    f"the model was sharded with fully_shard over ranks {ranks}, {what} "
                    f"{want}: shard with mesh=<the data-parallel group> (or its HSDP mesh), or "
                    "pass the unsharded model and let deepspeed.initialize shard it")
        if hasattr(self.module, _SHARDED_BY_ENGINE):
            self._check_sharded_by_an_engine(granularity)
            return
        opts, default = self.ragged_options, RaggedOptions()
        offloaded = {group.offload is not None for group in groups_of(self.module)}
        if offloaded and offloaded != {opts.offload is not None}:
            sharded = "with offload_policy=CPUOffloadPolicy(...)" if True in offloaded else "without offload_policy"
            config = "sets offload_optimizer" if opts.offload is not None else "has no offload_optimizer"
            raise ValueError(
                f"the model was sharded with vescale_zero.fully_shard {sharded} and the config {config}: make them "
                "agree (\"offload_optimizer\": {\"device\": \"cpu\"} with CPUOffloadPolicy on every fully_shard "
                "call, or neither), or pass the unsharded model to deepspeed.initialize")
        set_here = [k for k in ("granularity", "sharded_modules", "reshard_after_forward", "reduce_dtype",
                                "fp8_all_gather_tile", "optimizer_aware") if getattr(opts, k) != getattr(default, k)]
        if mp is not None:
            set_here.append("bf16/fp16")
        if set_here:
            raise ValueError(
                f"the model was already sharded with vescale_zero.fully_shard, so the config's {set_here} cannot "
                "apply (they are sharding-time options): pass them to fully_shard (mp_policy=, granularity=, ...) "
                "and remove them from the config, or pass the unsharded model to deepspeed.initialize")
        if granularity is not None and self.ragged_options.granularity is None:
            raise ValueError(
                f"optimizer {self.optimizer_name()!r} needs blocks kept whole on one rank, but the model was "
                "already sharded with fully_shard: shard it with granularity=<the optimizer's block>, or pass the "
                "unsharded model to deepspeed.initialize")

    # host patch deepspeed.runtime.engine.DeepSpeedEngine._broadcast_model: checked against deepspeed 0.16.9-0.19.8
    def _broadcast_model(self) -> None:
        """Rank 0's parameters to every rank, as DeepSpeed does -- except a model sharded
        before ``deepspeed.initialize``, whose sharded parameters differ per rank by design."""
        if not groups_of(self.module):
            super()._broadcast_model()

    def _is_pipeline(self) -> bool:
        return isinstance(self, PipelineEngine)

    def _make_loss_scaler(self) -> LossScalerBase:
        """DeepSpeed's own loss scaler, made as ZeRO-3 makes it: ``loss_scale`` 0 gives the
        dynamic scaler (which stops the run on an overflow at ``min_loss_scale``), any other
        value a static scale (an overflow skips the step, the scale stays)."""
        cfg = self.ragged_precision.fp16
        return CreateLossScaler(dtype=torch.float16, static_loss_scale=cfg.loss_scale,
                                dynamic_scaling=cfg.loss_scale == 0, dynamic_loss_args=cfg.dynamic_loss_scale_args())

    # ---- structure-aware config optimizers ("optimizer": {"type": "AdamW8bit"}) ----------
    def _structured_optimizer(self) -> Optional[type]:
        name = (self.optimizer_name() or "").lower()
        return STRUCTURED_OPTIMIZERS.get(name)

    def _optimizer_block(self) -> int:
        default = inspect.signature(self._structured_optimizer()).parameters["block"].default
        return int((self.optimizer_params() or {}).get("block", default))

    # host patch deepspeed.runtime.engine.DeepSpeedEngine._is_supported_optimizer: checked against deepspeed 0.16.9-0.19.8  # noqa: E501
    def _is_supported_optimizer(self, optimizer_name: str) -> bool:
        name = (optimizer_name or "").lower()
        return name in STRUCTURED_OPTIMIZERS or super()._is_supported_optimizer(optimizer_name)

    # host patch deepspeed.runtime.engine.DeepSpeedEngine._configure_basic_optimizer: checked against deepspeed 0.16.9-0.19.8  # noqa: E501
    def _configure_basic_optimizer(self, model_parameters: Any):
        cls = self._structured_optimizer()
        if cls is None:
            return super()._configure_basic_optimizer(model_parameters)
        params = dict(self.optimizer_params() or {})
        if cls is Muon and self.ragged_options.shard_group_size is None:
            # moves its matrices within DeepSpeed's data-parallel group (else: within the shard group)
            params.setdefault("process_group", groups._get_data_parallel_group())
        return cls(model_parameters, **params)

    # host patch deepspeed.runtime.engine.DeepSpeedEngine._configure_optimizer: checked against deepspeed 0.16.9-0.19.8
    def _configure_optimizer(self, client_optimizer: Any, model_parameters: Any) -> None:
        if isinstance(client_optimizer, torch.optim.Optimizer):
            if any(client_optimizer.state.values()):
                raise ValueError("the client optimizer already has state; build it before its first step")
            for group in client_optimizer.param_groups:
                group["params"] = [vz.sharded_counterpart(p) for p in group["params"]]
        params = [
            {**item, "params": [vz.sharded_counterpart(p) for p in item["params"]]} if isinstance(item, dict)
            else vz.sharded_counterpart(item)
            for item in model_parameters
        ]
        super()._configure_optimizer(client_optimizer, params)
        attach_optimizer(self.basic_optimizer)  # deepspeed.utils.safe_*_optimizer_state read its state
        offload = self.ragged_options.offload
        if offload is not None and not offload.optimizer and self.basic_optimizer is not None:
            if self._structured_optimizer() is not None:
                raise ValueError(
                    f"zero_optimization.offload_param alone with optimizer {self.optimizer_name()!r} is not supported "
                    "with stage 'ragged' (it steps whole matrices across ranks); add \"offload_optimizer\": "
                    "{\"device\": \"cpu\"} (it then steps in host memory), or remove offload_param")
            OptimizerOnDevice(self.basic_optimizer)  # offload [Note: the optimizer steps on the device]
        self.optimizer_state_files = offload_optimizer_to_nvme(self.basic_optimizer, self.module, self.ragged_options)
        if self.optimizer is not None and not hasattr(self.optimizer, "parameter_offload"):
            # ZeRO-3's handle on the module hooks: module_hooks [Note: pausing the hooks for generation]
            self.optimizer.parameter_offload = RaggedModuleHooks(self.module)

    # ---- backward / step -------------------------------------------------------------
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._state_offloader = StateOffloader()  # before DeepSpeed's __init__, which may run a forward
        super().__init__(*args, **kwargs)
        if not self._is_pipeline():
            self._support_torch_style_backward = True  # [Note: backward without engine.backward]

    def _sync_gradients_in_this_backward(self) -> None:
        """[Note: when the ragged engine reduces gradients] Managed accumulation (DeepSpeed's
        default): only the boundary micro-batch's backward reduce-scatters; the ones before it accumulate
        locally, and their sum is reduced once. With ``"managed_gradient_accumulation": false``
        the caller owns the boundary: it is ``step()``, and no backward knows whether it is the
        last before it (``is_gradient_accumulation_boundary()`` is true only inside ``step()``),
        so every backward reduce-scatters and the shards accumulate the reduced gradients, as
        ZeRO-3 reduces every backward in that mode."""
        if not self._is_pipeline():
            sync = not managed_gradient_accumulation(self) or self.is_gradient_accumulation_boundary()
            self.module.set_requires_gradient_sync(sync)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        self._sync_gradients_in_this_backward()
        if self._ragged_scaler is not None:
            loss = loss * self._ragged_scaler.loss_scale
        return super().backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``engine.scale(loss).backward()``: the loss times the fp16 loss scale (unchanged in
        fp32 / bf16), as ZeRO-3's optimizer scales it."""
        scaled = super().scale(loss)  # DeepSpeed's checks; marks the next direct backward as scaled
        return scaled * self._ragged_scaler.loss_scale if self._ragged_scaler is not None else scaled

    # host patch deepspeed.runtime.engine.DeepSpeedEngine._backward_prologue: checked against deepspeed 0.16.9-0.19.8
    def _backward_prologue(self, *before_018: Any, **before_018_kw: Any) -> Any:
        """[Note: backward without engine.backward] DeepSpeed 0.18 and later run
        this from hooks it puts on the forward's outputs, for ``engine.backward(loss)`` and for a
        direct ``loss.backward()`` / ``engine.scale(loss).backward()`` alike; its per-tensor hook
        divides a direct backward's output gradients by the accumulation steps, as
        ``engine.backward`` divides the loss. At stage 0 it refuses direct calls (stage 0 reduces
        only from ``engine.backward``), but ragged's runtime hooks reduce-scatter in any backward,
        so the engine opts in (``_support_torch_style_backward``) and does here what
        ``engine.backward`` does before its ``loss.backward()``: choose whether this backward
        reduces, and refuse an unscaled fp16 loss (its gradients would be divided by a scale
        they never had). The epilogue, which ``engine.backward`` calls after its backward, runs
        at the end of a direct backward's graph, as ZeRO-3 runs it from its post-backward hook."""
        # before 0.18: called by engine.backward with (loss, scale_wrt_gas) ([Note: one door to DeepSpeed's releases])
        if not BACKWARD_HOOKS:
            return super()._backward_prologue(*before_018, **before_018_kw)
        direct = not (self._running_engine_backward or self._is_pipeline() or is_functorch_transforming())
        if direct:
            if self._ragged_scaler is not None and not self._manual_backward_expected:
                raise RuntimeError(
                    "fp16 with stage 'ragged' scales the loss before backward, but loss.backward() was called on an "
                    "unscaled loss: call engine.backward(loss), or engine.scale(loss).backward()")
            self._manual_backward_expected = False
            self._sync_gradients_in_this_backward()
        super()._backward_prologue()
        if direct:
            queue_backward_callback(self._backward_epilogue)

    def allreduce_gradients(self, bucket_size: int = 0) -> None:
        """Gradients were reduce-scattered into the shards by the runtime's hooks."""

    def clip_fp32_gradients(self) -> None:
        """Clip by the norm :meth:`_take_model_step` took for this step (no second all-reduce)."""
        vz.clip_grads_with_norm_(self.module, self.gradient_clipping(), self._global_grad_norm)

    # host patch deepspeed.runtime.engine.DeepSpeedEngine._take_model_step: checked against deepspeed 0.16.9-0.19.8
    def _take_model_step(self, lr_kwargs: Any) -> None:
        """[Note: the reported gradient norm] ``get_global_grad_norm()`` after every step is
        what ZeRO-3 reports: the global norm of the (unscaled) gradients the step used, also
        without clipping (ZeRO-3 computes it every step; DeepSpeed at stage 0 only when it
        clips), and ``inf`` on a skipped step.

        [Note: a step with non-finite gradients is skipped] As ZeRO-3 in every precision: when
        that norm is not finite (a NaN / Inf gradient on any rank: the norm is all-reduced, so
        every rank decides alike, with no collective of its own), or in fp16 the loss scaler
        found an overflow, the step is skipped -- weights and optimizer state untouched, the
        gradients dropped, the LR scheduler not stepped, ``skipped_steps`` counted,
        ``was_step_applied()`` False; fp16's loss scale is updated either way."""
        scaler = self._ragged_scaler
        skip = scaler is not None and self._unscale_and_check_overflow(scaler.loss_scale)
        if not skip:
            norm = vz.sharded_grad_norm(self.module)
            skip = not math.isfinite(norm.item())  # a host read, as ZeRO-3's: skipping is a host decision
        if scaler is not None:
            scaler.update_scale(skip)
        if skip:
            self._skip_step()
            return
        self._global_grad_norm = norm  # clip_fp32_gradients clips by it (when gradient_clipping > 0)
        super()._take_model_step(lr_kwargs)

    def _skip_step(self) -> None:
        """Count a skipped step as DeepSpeed's engine counts one
        (see [Note: a step with non-finite gradients is skipped]); every rank takes this path together."""
        self._global_grad_norm = float("inf")
        self.zero_grad()
        self._step_applied = False
        self.skipped_steps += 1
        self.global_steps += 1
        if managed_gradient_accumulation(self):
            self.global_samples += self.train_batch_size()
        else:  # a caller-owned step counts the micro-batches it accumulated, as DeepSpeed's
            per_micro_batch = self.train_batch_size() // self.gradient_accumulation_steps()
            self.global_samples += per_micro_batch * self._unmanaged_backward_count
            self._unmanaged_backward_count = 0

    def _unscale_and_check_overflow(self, scale: float) -> bool:
        groups = groups_of(self.module)
        device = collective_device(None, groups[0].device if groups else None)  # the all-reduce's: the model's
        live = [g.sharded_grad.live for g in groups if g.sharded_grad.live is not None]  # None: no gradient yet
        flag = unscale_and_find_inf(live, 1.0 / scale, device)  # overflow on any shard of any rank
        # The step's one host read: skipping is a host decision, as in DeepSpeed's own fp16
        # optimizers (one overflow flag per step); the scale is a Python float, no read.
        return bool(flag.item())

    # ---- offload_states / reload_states (RL loops around generation) --------------------
    def offload_states(self, include: Optional[Container[OffloadStateTypeEnum]] = None,
                       device: OffloadDeviceEnum = OffloadDeviceEnum.cpu, pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """DeepSpeed's ``engine.offload_states`` (0.19.8's signature and defaults): move the
        states named in ``include`` (default all) to host memory, as ZeRO-3 does.

        [Note: offload_states under ragged] What each of DeepSpeed's state kinds is here (moved
        in place: vescale_zero.runtime.state_offload [Note: offloading states in place])::

            OffloadStateTypeEnum     ZeRO-3's                          ragged's
            hp_params                fp32 partitions                   every group's master shard
            lp_params                16-bit partitions                 nothing kept between steps: the
                                                                       16-bit copy exists gathered only
                                                                       (every group is resharded first,
                                                                       as ZeRO-3 empties its cache)
            lp_grads                 gradient partitions               every group's gradient shard
            contiguous_grad_buffer   reduce buckets                    the reduce-scatter input, if held
                                                                       (gradients accumulated unsynced)
            optim_states             Adam's state                      the optimizer's state tensors

        As DeepSpeed, ``offload_optimizer`` (the masters, gradients and optimizer state already in
        host memory) leaves hp_params and optim_states out; ``device`` "none" does nothing and
        "nvme" is refused. Unlike ZeRO-3 any optimizer's state moves (ZeRO-3: FusedAdam only).
        A forward before :meth:`reload_states` is refused."""
        include = refine_include_states(self, include)
        if device == OffloadDeviceEnum.none:
            return
        if device == OffloadDeviceEnum.nvme:
            raise ValueError("NVMe offload is not supported for offloading states (as at stage 3); use device cpu")
        for group in groups_of(self.module):
            if group.state is not GroupState.SHARDED:
                group.reshard()
        for kind in include:
            self._state_offloader.offload(OffloadStateTypeEnum(kind).value, self._states_of(OffloadStateTypeEnum(kind)),
                                          pin_memory=pin_memory, non_blocking=non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """DeepSpeed's ``engine.reload_states``: every offloaded state back on the device, the same
        tensors holding the same bytes ([Note: offload_states under ragged])."""
        self._state_offloader.reload(non_blocking=non_blocking)

    def _states_of(self, kind: OffloadStateTypeEnum) -> List[torch.Tensor]:
        """The tensors of ``kind`` that live on the compute device ([Note: offload_states under ragged])."""
        return [t for group in groups_of(self.module) for t in self._group_states(group, kind)
                if t is not None and local_piece(t).device == group.device]

    def _group_states(self, group: Any, kind: OffloadStateTypeEnum) -> List[Optional[torch.Tensor]]:
        if kind == OffloadStateTypeEnum.hp_params:
            return [group.master.local]
        if kind == OffloadStateTypeEnum.lp_grads:
            return [group.sharded_grad.live] + [group.sharded_params[i].grad for i in group.grad_indices]
        if kind == OffloadStateTypeEnum.contiguous_grad_buffer:
            return [group.grads.full.full]
        if kind == OffloadStateTypeEnum.optim_states and self.basic_optimizer is not None:
            state = self.basic_optimizer.state
            return [v for p in group.sharded_params for v in state.get(p, {}).values() if torch.is_tensor(v)]
        return []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        offloaded = self._state_offloader.offloaded
        if offloaded:
            raise RuntimeError(f"the engine's states {offloaded} are offloaded (engine.offload_states()): call "
                               "engine.reload_states() before the next forward")
        return super().forward(*args, **kwargs)

    # ---- checkpoints -----------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Each rank writes its own shards under ``save_dir/tag``; rank 0 writes ``zero_to_fp32.py``
        (see :mod:`.recovery_scripts`); ``latest`` moves last. With
        ``exclude_frozen_parameters`` the parameters that do not require grad are not written, and
        loading keeps the model's own values of them, as ZeRO-3 does."""
        tag = str(tag if tag is not None else f"global_step{self.global_steps}")
        extra = {
            "client_state": client_state or {},
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "loss_scaler": vars(self._ragged_scaler).copy() if self._ragged_scaler is not None else None,
            "counters": {k: getattr(self, k)
                         for k in ("global_steps", "global_samples", "skipped_steps", "micro_steps")},
        }
        os.makedirs(save_dir, exist_ok=True)
        checkpoint.save(os.path.join(save_dir, tag), self.module, self.optimizer, extra,
                        exclude_frozen=exclude_frozen_parameters)
        if dist.get_rank() == 0:
            write_recovery_scripts(save_dir)
            write_universal_notice(os.path.join(save_dir, tag))  # [Note: ds_to_universal on a ragged checkpoint]
        if save_latest and dist.get_rank() == 0:
            checkpoint.write_latest(save_dir, tag)
        dist.barrier()
        return True

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None):
        """Load shards written by :meth:`save_checkpoint` (any world size), or migrate a
        DeepSpeed checkpoint (ZeRO 0-3, or universal); ``(path, client_state)``.

        [Note: load_universal under ragged] ``"checkpoint": {"load_universal": true}`` makes
        DeepSpeed's engine read the tag from ``latest_universal`` and load the universal
        checkpoint there (``ds_to_universal``'s output, which loads at any world size). Here too:
        the tag comes from ``latest_universal``, and a universal checkpoint is migrated like any
        DeepSpeed checkpoint ([Note: migration]). Every checkpoint loads at any world size under
        ragged, so whatever the tag names (ours, ZeRO, universal) is loaded."""
        if tag is None:
            tag = self._latest_universal(load_dir) if self.load_universal_checkpoint() else checkpoint.read_latest(
                load_dir)
        tag = str(tag)
        path = os.path.join(load_dir, tag)
        if is_deepspeed_checkpoint(path):
            return self._migrate_deepspeed_checkpoint(load_dir, tag, load_module_strict, load_optimizer_states,
                                                      load_lr_scheduler_states, load_module_only)
        with_optimizer = load_optimizer_states and not load_module_only
        extra = checkpoint.load(path, self.module, self.optimizer if with_optimizer else None,
                                keep_frozen_left_out=not load_module_strict)  # saved exclude_frozen_parameters
        if with_optimizer:
            as_the_optimizer_keeps_it(self.optimizer)  # [Note: optimizer state after a load]
        if not load_module_only:
            if load_lr_scheduler_states and self.lr_scheduler is not None and extra["lr_scheduler"] is not None:
                self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
            if self._ragged_scaler is not None and extra["loss_scaler"] is not None:
                vars(self._ragged_scaler).update(extra["loss_scaler"])
            for key, value in extra["counters"].items():
                setattr(self, key, value)
        return path, extra["client_state"]

    @staticmethod
    def _latest_universal(load_dir: str) -> str:
        file = os.path.join(load_dir, "latest_universal")
        tag = open(file).read().strip() if os.path.isfile(file) else ""
        if not tag:
            raise ValueError(
                f"checkpoint.load_universal is set, but {file} is missing or empty: write the universal checkpoint's "
                "directory name into it (ds_to_universal does not), or pass tag=, or remove load_universal to load "
                "the tag in 'latest' (stage 'ragged' loads any checkpoint at any world size)")
        return tag

    def _migrate_deepspeed_checkpoint(self, load_dir: str, tag: str, strict: bool, load_optimizer_states: bool,
                                      load_lr_scheduler_states: bool, load_module_only: bool):
        """[Note: migration] A checkpoint of DeepSpeed's own engine (stage 0-3, any world
        size) is converted once, by rank 0, next to it as ``<tag>_vescale`` (weights only:
        ``<tag>_vescale_weights``) with :func:`vescale_zero.checkpoint.from_deepspeed` --
        the code ``vescale-zero convert --from deepspeed`` runs -- and then loaded like our
        own checkpoints: each rank reads its ranges; counters, LR scheduler and client
        state come along."""
        weights_only = load_module_only or not load_optimizer_states
        target = os.path.join(load_dir, f"{tag}_vescale" + ("_weights" if weights_only else ""))
        error = None
        if dist.get_rank() == 0 and not os.path.exists(os.path.join(target, "metadata.json")):
            try:
                checkpoint.from_deepspeed(load_dir, tag, target, weights_only=weights_only)
            except Exception as e:  # noqa: BLE001 - reported on every rank below
                error = str(e) if isinstance(e, checkpoint.CheckpointError) else f"{type(e).__name__}: {e}"
        flag = [error]
        dist.broadcast_object_list(flag, src=0)
        if flag[0] is not None:
            where = os.path.join(load_dir, tag)
            message = flag[0] if flag[0].startswith(where) else f"{where}: {flag[0]}"  # the path once
            raise ValueError(message.replace(  # the CLI's flag, said as load_checkpoint takes it
                "convert with --weights-only", "load the weights alone with load_optimizer_states=False"))
        extra = checkpoint.load(target, self.module, None if weights_only else self.optimizer)
        if not weights_only:
            as_the_optimizer_keeps_it(self.optimizer)  # [Note: optimizer state after a load]
        engine = extra["deepspeed"]
        if not load_module_only:
            if load_lr_scheduler_states and self.lr_scheduler is not None and engine.get("lr_scheduler") is not None:
                self.lr_scheduler.load_state_dict(engine["lr_scheduler"])
            for key in ("global_steps", "global_samples", "skipped_steps"):
                if engine.get(key) is not None:
                    setattr(self, key, engine[key])
        return os.path.join(load_dir, tag), extra["client_state"]

    # ---- the whole model (16-bit saves, Hugging Face / accelerate; see .saving) --------
    def _refuse_pipeline_consolidation(self, what: str) -> None:
        if self._is_pipeline():
            raise ValueError(
                f"{what}: stage 'ragged' with pipeline parallelism cannot consolidate the model on one rank (each "
                "stage holds its own layers); save with engine.save_checkpoint(dir) and join it offline with "
                "`vescale-zero consolidate`"
            )

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Always: a ragged model is gathered group by group whenever the whole model is saved."""
        return True

    # host patch deepspeed.runtime.engine.DeepSpeedEngine._zero3_consolidated_16bit_state_dict: checked against deepspeed 0.16.9-0.19.8  # noqa: E501
    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> Optional[dict]:
        """The full state dict on rank 0 (CPU, compute dtype), ``None`` elsewhere, as ZeRO-3's.
        Collective: every rank must call it."""
        self._refuse_pipeline_consolidation("the consolidated state dict")
        return consolidated_state_dict(self.module, exclude_frozen_parameters)

    # host patch deepspeed.runtime.engine.DeepSpeedEngine._consolidated_16bit_state_dict: checked against deepspeed 0.16.9-0.19.8  # noqa: E501
    _consolidated_16bit_state_dict = _zero3_consolidated_16bit_state_dict

    def module_state_dict(self, destination: Optional[dict] = None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict:
        """The module's full (unsharded) state dict on every rank: CPU, master dtype. Collective:
        every rank must call it (``keep_vars`` has no meaning for gathered tensors)."""
        self._refuse_pipeline_consolidation("module_state_dict()")
        state = vz.full_state_dict(self.module, cpu_offload=True)
        if exclude_frozen_parameters:
            for name, param in self.module.named_parameters(remove_duplicate=False):
                if not param.requires_grad:
                    state.pop(name, None)
        out = destination if destination is not None else {}
        out.update({prefix + key: value for key, value in state.items()})
        return out

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Rank 0 writes the full model (compute dtype, ``torch.save``) to ``save_dir/save_filename``.
        Collective: every rank must call it."""
        state = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if dist.get_rank() == 0:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(state, os.path.join(save_dir, save_filename))
        dist.barrier()
        return True

    @property
    def loss_scale(self) -> float:
        return self._ragged_scaler.loss_scale if self._ragged_scaler is not None else 1.0


class RaggedDeepSpeedEngine(RaggedEngineMixin, DeepSpeedEngine):
    """DeepSpeed's engine with ragged sharding (see module docstring)."""


class RaggedPipelineEngine(RaggedEngineMixin, PipelineEngine):
    """DeepSpeed's pipeline engine, ragged-sharded inside each stage's data-parallel group."""
