"""``RaggedFSDP``: Megatron-Core's data-parallel wrapper contract on ragged sharding.

A drop-in for ``megatron.core.distributed.DistributedDataParallel``: same constructor,
same methods (``_BaseDataParallel``), used by Megatron's schedules and
``finalize_model_grads`` unchanged. Groups (one flat buffer each)::

    GPTModel                                   mesh
    ├─ embedding ........................ ┐
    ├─ decoder.layers[i] ─────────────── one group per layer         dp x cp
    │   └─ mlp.experts (MoE) ─────────── one group per layer's experts   expert-dp
    ├─ decoder.final_layernorm .......... │  root group                 dp x cp
    └─ output_layer ..................... ┘

With ``num_distributed_optimizer_instances`` N > 1 (Megatron's HSDP) each mesh above is 2-D:
shard inside an instance, replicate across the N instances (hsdp.py [Note: Megatron HSDP mesh]).

Tensor parallelism is untouched: every rank shards *its* tensor-parallel slice over its
own data-parallel group, so a block (a row of the local slice with ``"row"``) never
spans two TP ranks, and the TP ranks of one layer share one plan (their local shapes
are equal), which keeps Megatron's sequence-parallel all-reduce of LayerNorm gradients
element-aligned on the sharded gradients.

[Note: gradients] After backward each sharded parameter has ``.grad`` and ``.main_grad``
(the same view into the group's sharded gradient buffer). Megatron's
``finalize_model_grads`` reads ``main_grad`` of the parameters the model holds at that
point -- the sharded ones -- so its TP (sequence-parallel) and pipeline (tied embedding)
all-reduces run on the shards. For the tied embedding across pipeline stages the word
embedding (first stage) and the output layer (last stage) are groups of their own, so
both stages shard that tensor with the same plan.

Gradients are scaled as Megatron's DDP scales them: times 1/(dp x cp size), then a SUM
reduce-scatter (or AVG with ``average_in_collective``); expert parameters
(``param.allreduce == False``) are reduced over the expert-data-parallel group, still
scaled by 1/(dp x cp size); with ``calculate_per_token_loss`` every group sums (Megatron
scales by 1/tokens later).

[Note: dist-checkpoints] Megatron's ``torch_dist`` checkpoints describe every tensor by its
*full* tensor-parallel-local shape (``ShardedTensor``), with data parallelism as replicas.
Saving, each rank writes its own shard, nothing is gathered: :meth:`RaggedFSDP.sharded_state_dict`
(and Megatron-LM's ``save_checkpoint`` under the switch) lets Megatron's own
``sharded_state_dict`` build the keys and metadata on meta stand-ins of the full parameters,
then describes this rank's ragged range of each tensor as a few boxes, views of its shard
(dist_checkpoint.py [Note: streamed dist-checkpoint save]); the optimizer writes Adam's state
on the same boxes. Loading, the module shows Megatron full parameters:
:meth:`RaggedFSDP.full_parameters` gathers each group once and installs plain full tensors in
place of the shards for its duration, Megatron's loader reshards any TP/PP/DP layout (boxes
written by any ranks, or Megatron's DDP's regular grid) into them, and
:meth:`RaggedFSDP.load_state_dict` keeps each rank's range. The optimizer finds its state's
full shapes through :meth:`sharded_param_of`.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

# host patch megatron.core.distributed.data_parallel_base._BaseDataParallel: checked against megatron-core 0.15.3-0.19.2
from megatron.core.distributed.data_parallel_base import _BaseDataParallel
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import nn

import vescale_zero as vz
from vescale_zero import full_state_dict, load_full_state_dict
from vescale_zero.hosts import (
    CHECKPOINT_DOMAIN,
    GranularityPolicy,
    ParamGroup,
    carry_job_timeout,
    collective_device,
    copy_parameter_attributes,
    groups_of,
    outside_compile,
    put_parameters,
    replace_parameters,
)

from .dist_checkpoint import SHARD_ONLY_ATTRIBUTES, STREAMING, checkpoint_parameters
from .hsdp import check_outer_dp_sharding, data_parallel_meshes, ddp_process_groups, shard_group
from .meta_init import check_all_or_nothing_on_meta, has_meta_tensors, materialize_megatron
from .optimizer_offload import OptimizerOffload, groups_to_offload

__all__ = ["RaggedFSDP", "RaggedFSDPOptions", "check_supported", "clash_message", "params_l2_norm"]


@dataclass(frozen=True)
class RaggedFSDPOptions:
    """Our knobs (``--vescale-*`` flags); everything else comes from Megatron's configs."""

    granularity: GranularityPolicy = None
    """Block policy: 'element' (default), 'row', '<N>rows', an int, or a per-name mapping."""
    reshard_after_forward: bool = True
    prefetch: bool = True
    fp8_all_gather_tile: Optional[int] = None
    """Gather parameters as float8 with one scale per tile x tile tile (e.g. 128)."""
    optimizer_aware: Any = None
    """``fully_shard``'s ``optimizer_aware`` (``--vescale-optimizer-aware``: ``Muon.optimizer_aware(...)``)."""
    optimizer_offload: Optional[OptimizerOffload] = None
    """Megatron's ``--optimizer-cpu-offload``: which groups keep their master shard, gradient shard
    and optimizer state in host memory (optimizer_offload.py); ``None``: none."""


_OTHER_SHARDING = {
    "use_megatron_fsdp": "Megatron-FSDP is another sharded data-parallel wrapper",
    "use_custom_fsdp": "Megatron-FSDP is another sharded data-parallel wrapper",
    "use_torch_fsdp2": "PyTorch FSDP2 is another sharded data-parallel wrapper",
}


def clash_message(field: str) -> str:
    """The one message for ``--use-vescale-fsdp`` beside another sharding flag (``field``: its
    argparse / ``DistributedDataParallelConfig`` name, e.g. ``"use_megatron_fsdp"``)."""
    flag = "--" + field.replace("_", "-")
    return (f"--use-vescale-fsdp cannot be combined with {flag} ({field}=True): {_OTHER_SHARDING[field]}; "
            f"drop one of the two: drop {flag} to shard with vescale-zero, or --use-vescale-fsdp to keep it")


def check_supported(config: TransformerConfig, ddp_config: DistributedDataParallelConfig) -> None:
    """Refuse Megatron settings that would fight ragged sharding, naming the fix."""
    # use_distributed_optimizer is accepted: RaggedFSDP already shards the optimizer state (what it asks)
    for field in ("use_megatron_fsdp", "use_custom_fsdp"):
        if getattr(ddp_config, field, False):
            raise ValueError(clash_message(field))
    instances = getattr(ddp_config, "num_distributed_optimizer_instances", 1)
    if not isinstance(instances, int) or instances < 1:
        raise ValueError(f"num_distributed_optimizer_instances must be a positive integer, got {instances!r}")
    check_outer_dp_sharding(ddp_config)  # HSDP: hsdp.py
    if getattr(config, "cuda_graph_impl", "none") not in ("none", None) or getattr(config, "enable_cuda_graph", False):
        raise ValueError("--use-vescale-fsdp does not support CUDA graphs yet; "
                         "drop --cuda-graph-impl / --enable-cuda-graph")


def _expose_main_grad(param: nn.Parameter, view: torch.Tensor) -> None:
    """[Note: gradient-accumulation fusion] With ``config.gradient_accumulation_fusion``
    (Megatron-LM's default) megatron-core's linear layers add each weight gradient into
    ``weight.main_grad`` in their backward (``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32``
    / ``_fp16`` by its dtype) and hand autograd a dummy, marking ``grad_added_to_main_grad``
    (zeros instead, and still added, for a weight with ``zero_out_wgrad``: the tied embedding).
    Megatron's DDP points ``main_grad`` into its gradient buffer; here the full (unsharded)
    parameter gets the full-size view of its group's gradient buffer (reduce dtype: fp32 under
    --accumulate-allreduce-grads-in-fp32 or fp32 training), which is zeroed at the group's first
    backward of the step and reduce-scattered as usual
    (vescale_zero.runtime.grad_reduce [Note: gradients written into full during backward]); dummies are
    dropped, as DDP's hook drops them."""
    param.main_grad = view
    if not hasattr(param, "grad_added_to_main_grad"):
        param.grad_added_to_main_grad = False


def _grad_in_main_grad(param: nn.Parameter) -> bool:
    """The ``.grad`` is the fused kernel's dummy (megatron-core DDP's rule for adding it)."""
    return bool(getattr(param, "grad_added_to_main_grad", False)) and not getattr(param, "zero_out_wgrad", False)


def _is_expert(param: nn.Parameter) -> bool:
    return not getattr(param, "allreduce", True)


def _expert_modules(layer: nn.Module) -> List[nn.Module]:
    """The largest sub-modules of ``layer`` whose parameters are all expert parameters."""
    found: List[nn.Module] = []

    def visit(module: nn.Module) -> None:
        params = list(module.parameters())
        if params and all(_is_expert(p) for p in params):
            found.append(module)
            return
        for child in module.children():
            visit(child)

    for child in layer.children():
        visit(child)
    return found


class RaggedFSDP(_BaseDataParallel):
    """Megatron's data-parallel wrapper, sharding parameters, gradients and optimizer state
    with RaggedShard over the data-parallel (x context-parallel) group.

    Args:
        config: the model's ``TransformerConfig``.
        ddp_config: Megatron's ``DistributedDataParallelConfig`` (``grad_reduce_in_fp32``
            picks the reduce dtype under bf16/fp16; ``average_in_collective`` is implied).
        module: the model chunk (``GPTModel``, possibly inside ``Float16Module``).
        disable_bucketing: accepted for signature compatibility (every group is one bucket).
        pg_collection: Megatron's process groups; default: ``parallel_state``'s.
        options: :class:`RaggedFSDPOptions`.
    """

    def __init__(
        self,
        config: TransformerConfig,
        ddp_config: DistributedDataParallelConfig,
        module: nn.Module,
        disable_bucketing: bool = False,
        pg_collection: Optional[ProcessGroupCollection] = None,
        options: Optional[RaggedFSDPOptions] = None,
    ) -> None:
        super().__init__(config=config, module=module)
        check_supported(config, ddp_config)
        self.ddp_config = ddp_config
        self.options = options or RaggedFSDPOptions()
        groups = ddp_process_groups(pg_collection, config, ddp_config)
        # every group used here stops waiting on a stuck peer after the job's timeout: [Note: the job's timeout]
        carry_job_timeout(*(g for g in groups.values() if isinstance(g, dist.ProcessGroup)))
        self.dp_cp_group = groups["dp_cp_group"]
        self.expt_dp_group = groups["expt_dp_group"]
        self.tp_group = groups["tp_group"]
        self.pp_group = groups["pp_group"]
        check_all_or_nothing_on_meta(module)
        # HSDP with --num-distributed-optimizer-instances N (hsdp.py): meshes, else the groups.
        self.dense_mesh, self.expert_mesh = data_parallel_meshes(
            groups, ddp_config.num_distributed_optimizer_instances, _device_type(module, self.dp_cp_group))
        self._shard(module)
        # [Note: when gradients are reduced] As Megatron's DDP: with overlap_grad_reduce the
        # last micro-batch's backward reduce-scatters (earlier ones run under no_sync, which
        # Megatron-LM then sets); without it (Megatron-LM's default, and no no_sync_func then)
        # every backward only accumulates, in the reduce dtype, and finish_grad_sync
        # (finalize_model_grads) reduce-scatters once per group per step. The price: the
        # whole model's full gradients are held until then (as megatron-core DDP's main_grad
        # buffer holds them), even with one micro-batch; --overlap-grad-reduce bounds that
        # to one group's in the last backward.
        self._sync_in_backward = bool(ddp_config.overlap_grad_reduce)
        module.set_requires_gradient_sync(self._sync_in_backward)
        if has_meta_tensors(module):  # --init-model-with-meta-device: see meta_init.py
            materialize_megatron(module, config)
        self._groups: List[ParamGroup] = groups_of(module)
        self._installed: Optional[List[tuple]] = None
        self._sharded_of: Dict[int, tuple] = {}  # id(full) -> (weakref to full, sharded param)
        dense, expert = _checkpoint_domains(groups)
        for group in self._groups:
            for i in group.grad_indices:
                group.sharded_params[i].main_grad = group.sharded_grad.persistent_view(i)
            for sp in group.sharded_params:
                setattr(sp, CHECKPOINT_DOMAIN, expert if _is_expert(sp) else dense)
            if getattr(config, "gradient_accumulation_fusion", False):  # [Note: gradient-accumulation fusion]
                group.set_grads_written_into_full(_expose_main_grad, _grad_in_main_grad)

    # ---- construction ----------------------------------------------------------------
    def _mixed_precision(self, module: nn.Module) -> Optional[vz.MixedPrecisionPolicy]:
        """bf16/fp16 parameters (Float16Module) get fp32 master shards and bf16/fp16 compute."""
        dtypes = {p.dtype for p in module.parameters()}
        low = dtypes & {torch.bfloat16, torch.float16}
        if not low:
            return None
        if len(low) > 1:
            raise ValueError(f"RaggedFSDP: the model mixes bf16 and fp16 parameters ({sorted(map(str, dtypes))})")
        compute = low.pop()
        with torch.no_grad():
            for p in module.parameters():
                if p.dtype == compute:
                    p.data = p.data.float()  # master shards are fp32, as Megatron's main params
        reduce = torch.float32 if self.ddp_config.grad_reduce_in_fp32 else compute
        return vz.MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce, cast_forward_inputs=False)

    def _shard(self, module: nn.Module) -> None:
        opts = self.options
        common: Dict[str, Any] = dict(
            granularity=opts.granularity,
            reshard_after_forward=opts.reshard_after_forward,
            mp_policy=self._mixed_precision(module),
            fp8_all_gather_tile=opts.fp8_all_gather_tile,
            optimizer_aware=opts.optimizer_aware,
        )
        # Megatron's gradient scaling (DistributedDataParallel): per-token loss sums; else
        # scale by 1/(dp x cp) before a SUM, or average in the collective if asked to.
        per_token = bool(getattr(self.config, "calculate_per_token_loss", False))
        dp_cp = float(self.dp_cp_group.size())
        dense_factor = 1.0 if per_token else None if self.ddp_config.average_in_collective else dp_cp
        expert_factor = 1.0 if per_token else dp_cp

        # Every group's (module, mesh, divide factor), inner modules first as fully_shard wants.
        layer_calls: List[tuple] = []
        for layer in [m for m in module.modules() if isinstance(m, TransformerLayer)]:
            layer_calls += [(experts, self.expert_mesh, expert_factor) for experts in _expert_modules(layer)]
            layer_calls.append((layer, self.dense_mesh, dense_factor))
        # A word embedding tied across pipeline stages is its own group on both stages, so
        # both shard it alike (see [Note: gradients]).
        model = _unwrap(module)
        output_layer = None
        tail_calls: List[tuple] = []
        if getattr(model, "share_embeddings_and_output_weights", False) and not (
            getattr(model, "pre_process", True) and getattr(model, "post_process", True)
        ):
            if model.pre_process:
                tail_calls.append((model.embedding.word_embeddings, self.dense_mesh, dense_factor))
            elif model.post_process and model.output_layer.weight is not None:
                output_layer = model.output_layer
                tail_calls.append((output_layer, self.dense_mesh, dense_factor))
        tail_calls.append((module, self.dense_mesh, dense_factor))
        offloaded = self._offloaded(module, [sub for sub, _, _ in layer_calls + tail_calls])

        def shard(sub: nn.Module, group, factor: Optional[float]) -> None:
            policy = opts.optimizer_offload.policy() if id(sub) in offloaded else None
            # the root keeps FSDP2's default (gathered for backward); reshard_after_forward is the layers'
            kwargs = dict(common, reshard_after_forward=None) if sub is module else common
            vz.fully_shard(sub, mesh=group, offload_policy=policy, **kwargs)
            if factor is not None:
                sub.set_gradient_divide_factor(factor, recurse=False)

        for call in layer_calls:
            shard(*call)
        stray = [n for n, p in module.named_parameters() if _is_expert(p) and not hasattr(p, "_vescale_fsdp_group_of")]
        if stray:
            raise ValueError(
                f"RaggedFSDP: expert parameters outside a TransformerLayer are not supported: {stray[:4]}"
            )
        for call in tail_calls:
            shard(*call)
        if output_layer is not None:
            # GPTModel reads ``output_layer.weight`` (to pass it as the output weight)
            # before the output layer runs: gather it when the root's forward starts.
            module.register_forward_pre_hook(outside_compile(lambda *_: output_layer.unshard()))
        module.set_prefetch(opts.prefetch)
        module.set_unused_grads("zero")  # as Megatron's DDP: main_grad of a parameter no rank used is zero

    def _offloaded(self, module: nn.Module, subs: List[nn.Module]) -> set:
        """``id``s of the modules in ``subs`` (one group each, inner ones first, as they are
        sharded) whose groups live in host memory: optimizer_offload.py [Note: offload fraction],
        over the groups in module order (each group's parameters: its module's, less those of
        the groups sharded before it)."""
        offload = self.options.optimizer_offload
        if offload is None:
            return set()
        claimed: set = set()
        numels: Dict[int, int] = {}
        for sub in subs:
            own = [p for p in sub.parameters() if id(p) not in claimed]
            claimed.update(id(p) for p in own)
            numels[id(sub)] = sum(p.numel() for p in own)
        in_module_order = [id(m) for m in module.modules() if id(m) in numels]
        chosen = groups_to_offload([numels[i] for i in in_module_order], offload.fraction)
        return {i for i, take in zip(in_module_order, chosen) if take}

    # ---- the _BaseDataParallel contract ---------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate full gradients locally; the next one outside reduces
        (with ``overlap_grad_reduce``; without it :meth:`finish_grad_sync` reduces)."""
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(self._sync_in_backward)

    def start_grad_sync(self, *unused: Any) -> None:
        """Nothing to start: with ``overlap_grad_reduce`` backward issues each group's
        reduce-scatter itself once the group's gradients are complete, in one order on every rank
        (vescale_zero.runtime.scheduler [Note: one order of reduce-scatters]); without it
        :meth:`finish_grad_sync` does."""

    def finish_grad_sync(self, force_all_reduce: Optional[bool] = False) -> None:
        """Wait for every outstanding reduce-scatter (without ``overlap_grad_reduce``: issue them,
        see [Note: when gradients are reduced]); sharded ``.grad``/``.main_grad`` are set."""
        if not self._sync_in_backward:
            self.module.reduce_accumulated_grads()
        for group in self._groups:
            group.finish_grad_sync()
        if getattr(self.ddp_config, "check_for_nan_in_grad", False):
            self._check_grads_finite()

    def _check_grads_finite(self) -> None:
        """``--check-for-nan-in-loss-and-grad`` (``ddp_config.check_for_nan_in_grad``): Megatron's
        DDP checks each rank's local gradients before its collective; here the reduce-scatter
        carries a NaN / Inf of any rank's local gradients into the shard that owns the element,
        so the squared norms of this rank's shards, summed over the data-parallel group, are
        checked (every rank raises together) through Megatron's rerun state machine, as DDP's
        check. One small all-reduce and one host sync per step, only with the flag."""
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        squares = [group.sharded_grad.local.float().square().sum() for group in self._groups]
        if not squares:
            return
        total = torch.stack(squares).sum()
        dist.all_reduce(total, group=self.dp_cp_group)
        get_rerun_state_machine().validate_result(
            result=total,
            rejection_func=lambda t: not bool(torch.isfinite(t)),
            message="found NaN or Inf in the gradients (RaggedFSDP: squared norm of the reduce-scattered gradient "
            "shards over the data-parallel group, so some rank's local gradients had one): the loss or the "
            "gradients diverged; lower the learning rate or check the data, or pass "
            "--no-check-for-nan-in-loss-and-grad to skip this check",
            tolerance=0.001,
            fatal=True,
        )

    def scale_gradients(self, scaling_factor: float) -> None:
        for group in self._groups:
            group.sharded_grad.local.mul_(scaling_factor)

    def zero_grad_buffer(self) -> None:
        for group in self._groups:
            group.zero_grad()
            for p in group.unsharded_params:  # as megatron-core DDP's zero_grad_buffer
                if hasattr(p, "grad_added_to_main_grad"):
                    p.grad_added_to_main_grad = False

    def broadcast_params(self) -> None:
        """A no-op: each element of a sharded model lives on exactly one data-parallel rank,
        so there are no replicas to bring in line."""

    def start_param_sync(self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """Parameters are gathered by each group's forward hook; nothing to start here."""

    def enable_forward_pre_hook(self) -> None:
        """A no-op (Megatron-LM calls it under --use-distributed-optimizer --overlap-param-gather):
        each group's forward hook gathers its parameters, prefetching the next, always."""

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """A no-op: the hooks that gather the parameters stay (the forward needs them), and the
        parameters a forward sees are always the shards' latest values (nothing to sync)."""

    def prepare_state_dict(self) -> None:
        """Gather the full state dict now, on every rank (collective), so that a later
        :meth:`state_dict` on the saving ranks -- Megatron-LM's torch checkpoints call it on
        data-parallel rank 0 only -- needs no communication. :meth:`release_state_dict` drops it.

        Streamed: one group's full buffer on the device at a time, each group copied to the
        CPU on the ranks that save (data-parallel rank 0, or expert-data-parallel rank 0: the
        rule differs between Megatron-LM versions) and dropped on the others, which keep
        nothing."""
        groups = [g for g in (self.dp_cp_group, self.expt_dp_group) if g is not None]
        saving = not groups or any(dist.get_rank(g) == 0 for g in groups)
        self._prepared = full_state_dict(self.module, cpu_offload=True, keep=saving)
        self._prepared_here = saving

    def release_state_dict(self) -> None:
        self._prepared = None

    @contextmanager
    def torch_format_save(self) -> Iterator[None]:
        """Collective. For Megatron-LM's ``--ckpt-format torch`` save: :meth:`prepare_state_dict`,
        and for the duration the wrapped model (what Megatron's ``unwrap_model`` gives, whose
        ``state_dict_for_save_checkpoint`` Megatron-LM's ``generate_state_dict`` calls on the saving
        ranks) answers that call with the full state dict prepared here, not its shards.

        [Note: torch-format saves see the inner model] Megatron-LM's ``save_checkpoint`` unwraps
        every wrapper before asking for the model's state, so :meth:`state_dict_for_save_checkpoint`
        of this wrapper is never reached there; an instance attribute on the inner model shadows
        its class's method while the save runs, and goes when it ends."""
        self.prepare_state_dict()
        inner = _unwrap(self.module)

        def full(prefix: str = "", keep_vars: bool = False) -> Dict[str, Any]:
            return self.state_dict(prefix=prefix, keep_vars=keep_vars)

        inner.state_dict_for_save_checkpoint = full
        try:
            yield
        finally:
            inner.__dict__.pop("state_dict_for_save_checkpoint", None)
            self.release_state_dict()

    def state_dict(self, prefix: str = "", keep_vars: bool = False, destination: Any = None) -> Dict[str, Any]:
        """The *full* (unsharded) state dict, as Megatron's DDP would give; interchangeable
        with DDP checkpoints. Collective over the data-parallel groups unless
        :meth:`prepare_state_dict` ran first (then on the CPU)."""
        full = getattr(self, "_prepared", None)
        if full is not None and not self._prepared_here:
            raise RuntimeError(
                "RaggedFSDP.state_dict() on a rank that is neither data-parallel nor expert-data-parallel rank 0, "
                "after prepare_state_dict(): that rank kept nothing. Call state_dict() on every rank without "
                "prepare_state_dict() (collective), or only on those ranks after it")
        if full is None:
            full = full_state_dict(self.module)
        out = destination if destination is not None else {}
        for key, value in full.items():
            out[prefix + key] = value
        return out

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> Dict[str, Any]:
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True) -> None:
        """Load a full state dict (from DDP, Megatron's torch or torch_dist checkpoints or
        :meth:`state_dict`); the shards go back in first if :meth:`full_parameters` is on."""
        self._restore_shards()
        load_full_state_dict(self.module, state_dict, strict=strict)

    # ---- Megatron dist-checkpoints (see [Note: dist-checkpoints]) ----------------------
    @contextmanager
    def full_parameters(self) -> Iterator[None]:
        """Collective. For the duration, the module holds plain full (TP-local) tensors,
        gathered, instead of its shards: what Megatron's ``torch_dist`` load fills (a save
        needs none: :meth:`sharded_state_dict`). Training must not run inside.

        The gather is :func:`~vescale_zero.api.state_dict.full_state_dict` (one all-gather per
        group, in turn), but every group's full tensors stay installed for the duration:
        Megatron's ``sharded_state_dict`` and ``dist_checkpointing.save`` take the whole
        model at once, so inside, each rank holds its full TP-local parameters -- what
        megatron-core's DDP holds all the time."""
        if self._installed is not None:  # nested: already full
            yield
            return
        if getattr(self, STREAMING, False):
            raise RuntimeError("RaggedFSDP.full_parameters() inside checkpoint_parameters() (a streamed save): the "
                               "module holds meta stand-ins there; use one or the other")
        full = full_state_dict(self.module)
        self._sharded_of = {}
        sharded_keys = {id(sp) for g in self._groups for sp in g.sharded_params}
        # By identity, not by name (param_swap [Note: replaced by identity])
        full_of = {id(v): full[k] for k, v in self.module.state_dict(keep_vars=True).items()
                   if id(v) in sharded_keys and k in full}

        def plain_full(param: nn.Parameter) -> Optional[nn.Parameter]:  # once per object: tied, one tensor
            if id(param) not in sharded_keys:
                return None
            plain = nn.Parameter(full_of[id(param)], requires_grad=param.requires_grad)
            copy_parameter_attributes(param, plain, skip=SHARD_ONLY_ATTRIBUTES)
            self._sharded_of[id(plain)] = (weakref.ref(plain), param)
            return plain

        self._installed = replace_parameters(self.module, plain_full)
        try:
            yield
        finally:
            self._restore_shards()

    def _restore_shards(self) -> None:
        put_parameters(self._installed or ())
        self._installed = None

    @contextmanager
    def shards_in_place(self) -> Iterator[None]:
        """Inside :meth:`full_parameters`, put the shards back for a while (the optimizer
        reads its state by the sharded parameters); outside it, a no-op."""
        swapped = self._installed
        if swapped is None:
            yield
            return
        fulls = [(sub, name, sub._parameters[name]) for sub, name, _ in swapped]
        self._restore_shards()
        try:
            yield
        finally:
            put_parameters(fulls)
            self._installed = swapped

    def sharded_param_of(self, tensor: torch.Tensor) -> Optional[nn.Parameter]:
        """The sharded parameter whose full tensor :meth:`full_parameters` installed as
        ``tensor`` (alive as long as a sharded state dict refers to it), else ``None``."""
        ref, param = self._sharded_of.get(id(tensor), (None, None))
        return param if ref is not None and ref() is tensor else None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None,
                           is_loading: bool = False) -> Any:
        """Megatron's ``sharded_state_dict`` of the wrapped module, with Megatron's keys and
        metadata (as Megatron-LM builds it: ``unwrap_model(model).sharded_state_dict()``).

        To save (default): this rank's boxes of its shards, views, no gather (dist_checkpoint.py
        [Note: streamed dist-checkpoint save]); ``dist_checkpointing.save`` writes each rank's
        own pieces. With ``is_loading``: full (TP-local) tensors, gathered, for
        ``dist_checkpointing.load`` (Megatron reshards any layout into them) and then
        :meth:`load_state_dict`, as megatron-core DDP loads."""
        context = self.full_parameters() if is_loading else checkpoint_parameters(self)
        with context:
            return self.module.sharded_state_dict(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)

    # ---- Megatron DDP's buffer lists ---------------------------------------------------
    @property
    def buffers(self) -> "_NoDDPBuffers":  # type: ignore[override]
        """[Note: Megatron DDP's buffer lists] megatron-core's DDP holds its parameters and
        gradients in ``_ParamAndGradBuffer`` objects, listed in the instance attributes
        ``buffers`` and ``expert_parallel_buffers`` (shadowing ``nn.Module.buffers``), and
        Megatron-LM reads them on every chunk that is a ``DDP``: from 0.18 on, ``train()``
        sums the two lists to deregister their NCCL memory pools when a job stops early
        (``--exit-interval``, ``--exit-duration-in-mins``, a signal). ``RaggedFSDP`` has no such
        buffers: both are empty lists here, and ``buffers`` stays callable as ``nn.Module``'s."""
        return _NoDDPBuffers(self)

    @property
    def expert_parallel_buffers(self) -> List[Any]:
        """Empty: see [Note: Megatron DDP's buffer lists]."""
        return []

    # ---- ours ------------------------------------------------------------------------
    @property
    def vescale_groups(self) -> List[ParamGroup]:
        """The parameter groups, in module order."""
        return list(self._groups)


class _NoDDPBuffers(list):
    """An empty list of megatron-core DDP's param-and-grad buffers that, called, is
    ``nn.Module.buffers`` of ``module`` (see [Note: Megatron DDP's buffer lists])."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._module = module

    def __call__(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return nn.Module.buffers(self._module, recurse)


def params_l2_norm(model_chunks: Sequence[RaggedFSDP]) -> float:
    """The L2 norm of the whole model's parameters (Megatron-LM's ``--log-params-norm``), from
    ``RaggedFSDP`` chunks' shards: as Megatron-LM's ``calc_params_l2_norm`` counts them (one
    tensor-parallel copy of each, shared parameters once, expert parameters beside dense ones),
    with each rank's squared shard norms summed over the group that shards them (dense: the
    data-parallel x context-parallel "shard" group; experts: the expert-data-parallel one), then
    over model parallelism as Megatron-LM does. Megatron-LM's own function cannot get this from
    our shards: it sums DTensor shards over one data-parallel group only, and asserts every
    parameter shares it (expert parameters are sharded over another). Collective on every rank."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    chunks = list(model_chunks)
    if not chunks or not all(isinstance(c, RaggedFSDP) for c in chunks):
        raise TypeError("params_l2_norm needs RaggedFSDP model chunks")
    dense: List[torch.Tensor] = []
    expert: List[torch.Tensor] = []
    for chunk in chunks:
        for param in chunk.parameters():
            if not param_is_not_tensor_parallel_duplicate(param):
                continue
            local = param.to_local() if hasattr(param, "to_local") else param
            if _is_expert(param):
                expert.append(local.detach())
            elif param_is_not_shared(param):
                dense.append(local.detach())
    first = chunks[0]
    device = collective_device(shard_group(first.dense_mesh), next(first.parameters()).device)

    def squares(tensors: List[torch.Tensor]) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=device)
        for t in tensors:
            total += t.float().square().sum().to(device)
        return total

    dense_sq, expert_sq = squares(dense), squares(expert)
    dist.all_reduce(dense_sq, group=shard_group(first.dense_mesh))
    if first.expert_mesh is not None:
        dist.all_reduce(expert_sq, group=shard_group(first.expert_mesh))
    dist.all_reduce(dense_sq, group=parallel_state.get_model_parallel_group())
    expert_mp = parallel_state.get_expert_tensor_model_pipeline_parallel_group(check_initialized=False)
    if expert_mp is not None:
        dist.all_reduce(expert_sq, group=expert_mp)
    return (dense_sq + expert_sq).item() ** 0.5


def _device_type(module: nn.Module, group: Any) -> str:
    """The device type of the data-parallel meshes: the parameters', or (on the meta device)
    the one the group's backend serves."""
    devices = {p.device.type for p in module.parameters()} - {"meta"}
    return devices.pop() if len(devices) == 1 else collective_device(group).type


def _rank_in(group: Any) -> int:
    if isinstance(group, list):  # heterogeneous pipeline layouts give a list of groups
        group = group[0]
    return group.rank() if group is not None else 0


def _checkpoint_domains(groups: Dict[str, Any]) -> tuple:
    """Names of the model-parallel slices a rank holds (see vescale_zero.checkpoint.format
    [Note: domains]): dense tensors differ by TP and PP rank, experts also by EP rank."""
    from megatron.core import parallel_state

    tp, pp, ep = _rank_in(groups.get("tp_group")), _rank_in(groups.get("pp_group")), _rank_in(groups.get("ep_group"))
    etp = parallel_state.get_expert_tensor_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0
    return f"tp{tp}-pp{pp}", f"etp{etp}-ep{ep}-pp{pp}"


def _unwrap(module: nn.Module) -> nn.Module:
    """The model inside Megatron's wrappers (``Float16Module`` and the like)."""
    while hasattr(module, "module") and isinstance(module.module, nn.Module) and not hasattr(module, "pre_process"):
        module = module.module
    return module
