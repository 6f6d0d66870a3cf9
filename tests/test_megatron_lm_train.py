"""Megatron-LM jobs migrate by ``--use-vescale-fsdp`` alone (issue 27).

Megatron-LM (``megatron.training``) is not on the package index, so a test-only stand-in
module plays ``megatron.training.training`` in each rank: its module-level names and the
calls that touch them, written here from Megatron-LM tag ``core_v0.16.1``
(megatron/training/training.py, utils.py, checkpointing.py, arguments.py, gpt_builders.py); each
helper says which lines it mirrors. No Megatron code is copied; the stand-ins only make the same calls.
One spawn of 2 ranks runs every case (tests/distributed.py run_cases_on_ranks).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
from typing import Any, Dict, List

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is a test dependency (pip install -e '.[test]')")

from tests.distributed import run_cases_on_ranks  # noqa: E402
from tests.numerics import gamma  # noqa: E402
from tests.sync_spy import record_host_syncs  # noqa: E402
from tests.test_megatron import SMALL, _megatron_job  # noqa: E402

ARGV = SMALL + ["--global-batch-size", "4"]


class _MegatronFSDPStandIn:
    """Megatron-LM's ``megatron_FSDP`` name (megatron-core's Megatron-FSDP adapter, which
    does not run on CPU): only its identity matters to the calls mirrored here."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


def _stand_in(args) -> types.ModuleType:
    """``megatron.training.training`` for this process, with the names the switch patches."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.utils import check_param_hashes_across_dp_replicas, unwrap_model

    training = types.ModuleType("megatron.training.training")
    training.DDP = DistributedDataParallel
    training.megatron_FSDP = _MegatronFSDPStandIn
    training.torch_FSDP = _MegatronFSDPStandIn
    training.get_megatron_optimizer = get_megatron_optimizer
    training.unwrap_model = unwrap_model

    def get_megatron_muon_optimizer(config, model_chunks, **kwargs):
        """Megatron's own Muon builder: it collects parameters from the chunks; on sharded
        chunks it finds none (the reported ``optimizer got an empty parameter list``)."""
        params = [p for chunk in model_chunks for p in chunk.parameters() if p.dim() == 2
                  and not hasattr(p, "_vescale_fsdp_group_of")]
        return torch.optim.SGD(params, lr=config.lr)

    training.get_megatron_muon_optimizer = get_megatron_muon_optimizer

    def get_model(model_provider, config):
        """core_v0.16.1 training.py get_model, lines 1161-1341: the model built under
        torch.device('meta') with --init-model-with-meta-device (1218-1222), tensor-parallel
        defaults (1230-1233), .cuda() unless meta (1253-1258), Float16Module under bf16/fp16
        (1261-1263), to_empty_if_meta_device unless FSDP2 / Megatron-FSDP (1266-1267), then the
        wrapper class by flag (1276-1284) called with config, ddp_config (1289-1322: the
        DistributedDataParallelConfig fields read from args, then the flags renamed into it, the
        bucket size) and module (1328-1337)."""
        from megatron.core import tensor_parallel
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.transformer.module import Float16Module

        if args.init_model_with_meta_device:
            with torch.device("meta"):
                model = [model_provider()]
        else:
            model = [model_provider()]
        for chunk in model:
            for param in chunk.parameters():
                tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        num_parameters = sum(p.nelement() for chunk in model for p in chunk.parameters())
        if not (args.use_torch_fsdp2 and args.use_cpu_initialization) and not args.init_model_with_meta_device:
            for chunk in model:
                chunk.cuda(torch.cuda.current_device())
        if args.fp16 or args.bf16:
            model = [Float16Module(config, chunk) for chunk in model]
        if args.init_model_with_meta_device and not args.use_torch_fsdp2 and not args.use_megatron_fsdp:
            # device "cuda" there; the suite's CUDA shim names the CPU as the current device
            model = [training.to_empty_if_meta_device(chunk, device=torch.device(torch.cuda.current_device()))
                     for chunk in model]
        if args.use_torch_fsdp2:
            dp = training.torch_FSDP
        elif args.use_megatron_fsdp:
            dp = training.megatron_FSDP
        else:
            dp = training.DDP
        fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(DistributedDataParallelConfig)
                  if hasattr(args, f.name)}
        fields["grad_reduce_in_fp32"] = args.accumulate_allreduce_grads_in_fp32
        fields["check_for_nan_in_grad"] = args.check_for_nan_in_loss_and_grad
        fields["check_for_large_grads"] = args.check_for_large_grads
        if args.ddp_num_buckets is not None:
            fields["bucket_size"] = num_parameters // args.ddp_num_buckets
        else:
            fields["bucket_size"] = args.ddp_bucket_size
        fields["pad_buckets_for_high_nccl_busbw"] = args.ddp_pad_buckets_for_high_nccl_busbw
        fields["reduce_scatter_with_fp32_accumulation"] = args.ddp_reduce_scatter_with_fp32_accumulation
        fields["average_in_collective"] = args.ddp_average_in_collective
        known = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}  # 0.15 lacks some
        ddp_config = DistributedDataParallelConfig(**{k: v for k, v in fields.items() if k in known})
        if ddp_config.bucket_size is None:
            ddp_config.bucket_size = max(40000000, 1000000 * torch.distributed.get_world_size())
        if not ddp_config.overlap_grad_reduce:
            ddp_config.bucket_size = None
        return [dp(config=config, ddp_config=ddp_config, module=chunk,
                   disable_bucketing=(i > 0) or args.overlap_param_gather_with_optimizer_step,
                   **_full_param_layout(dp, training, chunk, ddp_config))
                for i, chunk in enumerate(model)]

    training.get_model = get_model
    training.to_empty_if_meta_device = _to_empty_if_meta_device
    # core_v0.16.1 training.py line 88: imported by name from megatron.core.utils
    training.check_param_hashes_across_dp_replicas = check_param_hashes_across_dp_replicas
    training.calc_params_l2_norm = lambda model, force_create_fp32_copy=False: _calc_params_l2_norm(
        args, model, force_create_fp32_copy)
    checkpointing = types.ModuleType("megatron.training.checkpointing")
    checkpointing.get_checkpoint_name = lambda root, iteration, release=False: _checkpoint_name(root, iteration)
    checkpointing.get_distributed_optimizer_checkpoint_name = _distrib_optim_name
    checkpointing.save_checkpoint = lambda *a, **k: _save_checkpoint(args, *a, **k)
    checkpointing.load_checkpoint = lambda *a, **k: _load_checkpoint(args, *a, **k)
    # core_v0.16.1 training.py lines 104-105: imported by name from checkpointing
    training.save_checkpoint, training.load_checkpoint = checkpointing.save_checkpoint, checkpointing.load_checkpoint
    package = types.ModuleType("megatron.training")
    package.training, package.checkpointing = training, checkpointing
    sys.modules.update({"megatron.training": package, "megatron.training.training": training,
                        "megatron.training.checkpointing": checkpointing})
    return training


def _full_param_layout(dp, training, chunk, ddp_config) -> Dict[str, Any]:
    """megatron-core 0.18 and later, training.py wrap_model_chunks_with_ddp (0.19.2: lines
    1570-1700): with the distributed optimizer, the layout of DDP's buffers is computed by
    ``DistributedOptimizer.compute_full_param_layout`` over the chunk's trainable parameters,
    the bucket size and the data-parallel size, and passed as ``full_param_layout`` to the class
    ``get_model`` wraps with when it is Megatron-LM's ``DDP`` (the name, switched or not).
    Earlier releases: nothing."""
    from megatron.core import parallel_state
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    compute = getattr(DistributedOptimizer, "compute_full_param_layout", None)
    if compute is None or not ddp_config.use_distributed_optimizer or dp is not training.DDP:
        return {}
    params = [p for p in chunk.parameters() if p.requires_grad]
    return {"full_param_layout": compute(
        params, ddp_config.bucket_size, parallel_state.get_data_parallel_world_size(with_context_parallel=True),
        ddp_config, expert_data_parallel_world_size=parallel_state.get_expert_data_parallel_world_size())}


def _checkpoint_name(root: str, iteration: int) -> str:
    """core_v0.16.1 checkpointing.py get_checkpoint_name, lines 162-201, at TP rank 0 without
    pipeline or expert parallelism (the cases here)."""
    return os.path.join(root, f"iter_{iteration:07d}", "mp_rank_00", "model_optim_rng.pt")


def _distrib_optim_name(model_checkpoint_name: str) -> str:
    """core_v0.16.1 checkpointing.py get_distributed_optimizer_checkpoint_name, lines 221-223."""
    return os.path.join(os.path.dirname(model_checkpoint_name), "distrib_optim.pt")


def _save_checkpoint(args, iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                     **unused):
    """core_v0.16.1 checkpointing.py save_checkpoint with --ckpt-format torch (a LEGACY
    checkpoint), lines 471-760: unwrap_model(model) (504); on expert-data-parallel rank 0 only
    (581-583) generate_state_dict (877-952: args, version, iteration, each chunk's
    ``state_dict_for_save_checkpoint()``, the optimizer's ``state_dict()``) and torch.save
    (691-694); a barrier (701); rank 0 writes the tracker file (703-724); before that, on every
    rank, under --use-distributed-optimizer ``optimizer.save_parameter_state(distrib_optim.pt)``
    (552-563). RNG, rerun state and the scheduler are left out (none here)."""
    from megatron.core import parallel_state as mpu
    from megatron.training.training import unwrap_model

    model = unwrap_model(model)
    if args.use_distributed_optimizer and not args.no_save_optim and optimizer is not None:
        name = _distrib_optim_name(_checkpoint_name(args.save, iteration))
        os.makedirs(os.path.dirname(name), exist_ok=True)
        optimizer.save_parameter_state(name)
    if mpu.get_expert_data_parallel_rank() == 0:
        state_dict = {"args": None, "checkpoint_version": 3.0, "iteration": iteration}
        for i, chunk in enumerate(model):
            state_dict["model" if len(model) == 1 else f"model{i}"] = chunk.state_dict_for_save_checkpoint()
        if not args.no_save_optim and optimizer is not None:
            state_dict["optimizer"] = optimizer.state_dict()
        state_dict["num_floating_point_operations_so_far"] = num_floating_point_operations_so_far
        name = _checkpoint_name(args.save, iteration)
        os.makedirs(os.path.dirname(name), exist_ok=True)
        torch.save(state_dict, name)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(args.save, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))


def _load_checkpoint(args, ddp_model, optimizer, opt_param_scheduler, load_arg="load", strict=True, **unused):
    """core_v0.16.1 checkpointing.py load_checkpoint of a torch (LEGACY) checkpoint, lines
    1479-1800: _load_base_checkpoint (1160-1270: the tracker file's iteration, this rank's
    get_checkpoint_name, torch.load to the CPU), the iteration, then
    ``ddp_model[0].load_state_dict(state_dict['model'], strict)`` on the *wrapped* chunk
    (1757-1767) and ``optimizer.load_state_dict(state_dict['optimizer'])`` (1793-1794), then
    under --use-distributed-optimizer ``optimizer.load_parameter_state(distrib_optim.pt)``
    named from the tracker file (1798-1811)."""
    load_dir = getattr(args, load_arg)
    with open(os.path.join(load_dir, "latest_checkpointed_iteration.txt")) as f:
        iteration = int(f.read().strip())
    state_dict = torch.load(_checkpoint_name(load_dir, iteration), map_location="cpu", weights_only=False)
    ddp_model[0].load_state_dict(state_dict["model"], strict=strict)
    if not args.no_load_optim and optimizer is not None:
        optimizer.load_state_dict(state_dict["optimizer"])
        if args.use_distributed_optimizer:
            optimizer.load_parameter_state(_distrib_optim_name(_checkpoint_name(load_dir, iteration)),
                                           update_legacy_format=args.ckpt_convert_update_legacy_dist_opt_format)
    return state_dict["iteration"], state_dict.get("num_floating_point_operations_so_far", 0)


def _to_empty_if_meta_device(module: torch.nn.Module, *, device: torch.device, recurse: bool = True):
    """core_v0.16.1 megatron/training/utils.py to_empty_if_meta_device, lines 766-791 (imported
    by name into training.py, line 178): meta tensors become uninitialised ones on ``device``
    (``empty_like``), any other moves there."""
    return module._apply(lambda t: torch.empty_like(t, device=device) if t.device.type == "meta" else t.to(device),
                         recurse=recurse)


def _lm_args(pg, argv: List[str]):
    """Megatron-LM's parsed arguments: the example's parser plus the flags read here, at
    Megatron-LM's defaults (--check-for-nan-in-loss-and-grad is on by default)."""
    args = pg.build_parser().parse_args(argv)
    args.use_torch_fsdp2 = False
    args.overlap_grad_reduce = False
    args.align_grad_reduce = True
    args.check_for_nan_in_loss_and_grad = True
    args.gradient_accumulation_fusion = False
    args.use_cpu_initialization = True
    args.check_for_large_grads = False
    args.ddp_num_buckets = args.ddp_bucket_size = None
    args.ddp_pad_buckets_for_high_nccl_busbw = False
    args.ddp_reduce_scatter_with_fp32_accumulation = False
    args.ddp_average_in_collective = False
    args.overlap_param_gather_with_optimizer_step = False
    args.overlap_param_gather = args.use_precision_aware_optimizer = False
    args.ckpt_convert_update_legacy_dist_opt_format = False
    if args.bf16:  # core_v0.16.1 arguments.py lines 714-723: bf16 reduces and accumulates in fp32 by default
        args.accumulate_allreduce_grads_in_fp32 = True
    args.ckpt_format, args.no_save_optim, args.no_load_optim, args.finetune = "torch", False, False, False
    args.save = args.load = None
    return args


def _switched(pg, args) -> types.ModuleType:
    from vescale_zero.integrations.megatron import use_vescale_fsdp_in_megatron_lm

    training = _stand_in(args)
    use_vescale_fsdp_in_megatron_lm(get_args=lambda: args)
    return training


def _model_provider(pg, args, config) -> torch.nn.Module:
    """core_v0.16.1 gpt_builders.py gpt_builder (lines 28-114, the local-spec GPTModel at 95): the bare
    GPTModel; get_model places, casts and wraps it."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=args.num_experts,
                                                                      moe_grouped_gemm=False),
        vocab_size=args.vocab_size, max_sequence_length=args.max_position_embeddings or args.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)


def _get_model(training, pg, args, config) -> List[torch.nn.Module]:
    """core_v0.16.1 training.py setup_model_and_optimizer -> get_model(model_provider, ...)."""
    return training.get_model(lambda: _model_provider(pg, args, config), config)


def _train_setup_calls(training, args, model, config) -> None:
    """core_v0.16.1 training.py train(), line 2549 on: the wrapper's no_sync / start_grad_sync
    become the schedule's hooks when the first chunk is a megatron_FSDP or DDP."""
    if isinstance(model[0], (training.megatron_FSDP, training.DDP)) and args.overlap_grad_reduce:
        config.no_sync_func = model[0].no_sync if len(model) == 1 else [m.no_sync for m in model]
        if args.align_grad_reduce:
            config.grad_sync_func = model[0].start_grad_sync


def _one_step(pg, args, chunk, config, num_microbatches: int = 1) -> None:
    """Megatron's schedule over this rank's micro-batches, then finalize_model_grads (no optimizer)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config.finalize_model_grads_func = finalize_model_grads
    chunk.zero_grad_buffer()
    get_forward_backward_func()(
        forward_step_func=pg.forward_step, data_iterator=iter(pg.batches(args, 0, num_microbatches)),
        model=[chunk], num_microbatches=num_microbatches, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, forward_only=False)


# ---- A: training.DDP stays a class ---------------------------------------------------
def _isinstance_ddp(rank: int, world_size: int) -> Dict[str, Any]:
    from megatron.core.distributed import DistributedDataParallel

    from tests.test_megatron import _ddp_grads, _our_grads
    from vescale_zero.integrations.megatron import RaggedFSDP

    out: Dict[str, Any] = {}
    grads = {}
    argv = ARGV + ["--global-batch-size", "8"]  # two micro-batches per rank: no_sync is used
    with _megatron_job(argv) as (pg, _):
        for flag in (False, True):
            args = _lm_args(pg, argv + (["--use-vescale-fsdp"] if flag else []))
            args.overlap_grad_reduce = True
            training = _switched(pg, args)
            pg.seed(args)
            config = pg.transformer_config(args)
            model = _get_model(training, pg, args, config)
            _train_setup_calls(training, args, model, config)
            _one_step(pg, args, model[0], config, num_microbatches=2)
            grads[flag] = _our_grads(model[0]) if flag else _ddp_grads(model[0])
            out[flag] = {
                "class": isinstance(training.DDP, type),
                "wrapper": type(model[0]) is (RaggedFSDP if flag else DistributedDataParallel),
                "isinstance": isinstance(model[0], training.DDP),
                "no_sync": config.no_sync_func == model[0].no_sync,
                "issubclass": issubclass(type(model[0]), training.DDP),
            }
    # Both scale each rank's summed micro-batch gradients by 1/2 and add the two ranks'
    # (a sum of two terms is the same in either order): equal bit for bit.
    out["grads equal"] = sorted(grads[True]) == sorted(grads[False]) and all(
        torch.equal(grads[True][k], grads[False][k]) for k in grads[False])
    return out


# ---- 1: --init-model-with-meta-device ------------------------------------------------
def _full_weights(chunk) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in chunk.state_dict().items() if torch.is_tensor(v)}


def _meta_init(rank: int, world_size: int) -> Dict[str, Any]:
    """Megatron-LM's get_model with --init-model-with-meta-device under the switch, beside
    megatron-core DDP built eagerly (Megatron's DDP cannot take a meta model): the same
    initial weights (Megatron's meta-init contract) and the same 2 AdamW steps."""
    from tests.megatron_shim import MegatronFP32Step

    argv = ARGV + ["--global-batch-size", "8", "--clip-grad", "0", "--train-iters", "2"]
    out: Dict[str, Any] = {}
    with _megatron_job(argv) as (pg, _):
        for name, extra in (("ddp", []), ("vescale", ["--use-vescale-fsdp", "--init-model-with-meta-device"])):
            args = _lm_args(pg, argv + extra)
            training = _switched(pg, args)
            pg.seed(args)
            config = pg.transformer_config(args)
            model = _get_model(training, pg, args, config)
            init = _full_weights(model[0])
            opt_config = pg.optimizer_config(args)
            optimizer = (MegatronFP32Step(model[0], opt_config) if name == "ddp"
                         else training.get_megatron_optimizer(opt_config, model))
            losses = pg.train_loop(args, model[0], optimizer, config)["losses"]
            out[name] = (init, losses, _full_weights(model[0]))
    (ref_init, ref_losses, ref_end), (init, losses, end) = out["ddp"], out["vescale"]
    return {"keys": sorted(ref_init) == sorted(init),
            "init differ": sorted(k for k in ref_init if not torch.equal(ref_init[k], init[k])),
            "init max": max(v.abs().max().item() for v in init.values()),
            "losses": (ref_losses, losses),
            "end differ": sorted(k for k in ref_end if not torch.equal(ref_end[k], end[k]))}


# ---- 2: --ckpt-format torch ---------------------------------------------------------
def _torch_checkpoint(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    """Megatron-LM's save_checkpoint / load_checkpoint (--ckpt-format torch) under the switch:
    2 steps, saved, loaded into a fresh job, a third step; beside megatron-core DDP's 3 steps
    uninterrupted and its own file."""
    from tests.megatron_shim import MegatronFP32Step

    argv = ARGV + ["--global-batch-size", "8", "--clip-grad", "0", "--train-iters", "3"]
    out: Dict[str, Any] = {}
    with _megatron_job(argv) as (pg, _):
        def job(flag: bool, save: str = None, load: str = None, first: int = 0, last: int = 3):
            args = _lm_args(pg, argv + (["--use-vescale-fsdp"] if flag else []))
            args.save, args.load, args.train_iters = save, load, last
            training = _switched(pg, args)
            pg.seed(args)
            config = pg.transformer_config(args)
            model = _get_model(training, pg, args, config)
            opt_config = pg.optimizer_config(args)
            optimizer = (training.get_megatron_optimizer(opt_config, model) if flag
                         else MegatronFP32Step(model[0], opt_config))
            if load is not None:
                out["loaded iteration"] = training.load_checkpoint(model, optimizer, None)[0]
            losses = pg.train_loop(args, model[0], optimizer, config, first_step=first)["losses"]
            if save is not None:
                training.save_checkpoint(last, model, optimizer if flag else None, None, 0)  # DDP's: its model
            return losses, _full_weights(model[0])

        ddp_losses, ddp_end = job(False)
        job(False, save=os.path.join(root, "ddp"), last=2)
        first_losses, at_save = job(True, save=os.path.join(root, "ours"), last=2)
        resumed_losses, end = job(True, load=os.path.join(root, "ours"), first=2)
    ours = torch.load(_checkpoint_name(os.path.join(root, "ours"), 2), weights_only=False)["model"]
    ddps = torch.load(_checkpoint_name(os.path.join(root, "ddp"), 2), weights_only=False)["model"]
    tensors = {k: v for k, v in ours.items() if torch.is_tensor(v)}
    return {"keys": sorted(ours) == sorted(ddps),
            "shapes": sorted(k for k, v in ddps.items() if torch.is_tensor(v)
                             and (k not in tensors or tensors[k].shape != v.shape)),
            "saved differ": sorted(k for k in at_save if not torch.equal(tensors.get(k, torch.empty(0)), at_save[k])),
            "loaded iteration": out.get("loaded iteration"),
            "losses": (ddp_losses, first_losses + resumed_losses),
            "end differ": sorted(k for k in ddp_end if not torch.equal(ddp_end[k], end[k]))}


# ---- C and --use-distributed-optimizer ------------------------------------------------
def _forward_pre_hooks(training, model, enable: bool, param_sync: bool = True, optimizer=None) -> None:
    """core_v0.16.1 training.py enable_forward_pre_hook / disable_forward_pre_hook, lines 2147-2156;
    from megatron-core 0.19 disabling with a sync first stages the optimizer's main parameters
    into DDP's buffers (0.19.2 training.py lines 3014-3019: ``prepare_model_params_for_param_sync``)."""
    if not enable and param_sync and hasattr(optimizer, "prepare_model_params_for_param_sync"):
        optimizer.prepare_model_params_for_param_sync()
    for chunk in model:
        assert isinstance(chunk, training.DDP)
        chunk.enable_forward_pre_hook() if enable else chunk.disable_forward_pre_hook(param_sync=param_sync)


def _train_with_dist_opt(training, pg, args, model, optimizer, config, first: int, last: int) -> List[float]:
    """core_v0.16.1 training.py train() under --use-distributed-optimizer --overlap-param-gather
    (should_disable_forward_pre_hook, line 3496): the schedule's hooks (2549-2564, param_sync_func
    at 2561), the forward pre-hooks disabled without a sync and param_sync_func withheld for the
    first iteration (2657-2662), given back after it (2815-2827), disabled with a sync at the end
    (3006-3007); each iteration is the example's (pg.train_loop)."""
    _train_setup_calls(training, args, model, config)
    param_sync_func = model[0].start_param_sync if args.overlap_param_gather else None
    hooks = not args.use_megatron_fsdp and args.use_distributed_optimizer and args.overlap_param_gather
    if hooks:
        _forward_pre_hooks(training, model, False, param_sync=False)
    losses = []
    for step in range(first, last):
        args.train_iters = step + 1
        losses += pg.train_loop(args, model[0], optimizer, config, first_step=step)["losses"]
        if step == first and hooks:
            _forward_pre_hooks(training, model, True)
            config.param_sync_func = param_sync_func
    if hooks:
        _forward_pre_hooks(training, model, False, optimizer=optimizer)
    return losses


DIST_OPT_ARGV = ARGV + ["--global-batch-size", "8", "--clip-grad", "0", "--train-iters", "3",
                        "--use-distributed-optimizer"]


def _distributed_optimizer(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    """megatron-core DDP + distributed optimizer with --use-distributed-optimizer
    --overlap-grad-reduce --overlap-param-gather through Megatron-LM's get_model, train() and
    torch-format save_checkpoint (distrib_optim.pt beside the model file) at step 2; the switch
    with the same flags: 3 steps; DDP's checkpoint resumed under the switch for the third step,
    with the flag and without it; ours saved at 2 and resumed likewise."""
    import warnings

    from tests.megatron_shim import megatron_optimizer_on_cpu
    from tests.test_megatron import _as_megatron_scheduler_sets

    out: Dict[str, Any] = {}
    said: List[str] = []
    with _megatron_job(DIST_OPT_ARGV) as (pg, _):
        def job(flag: bool, save: str = None, load: str = None, first: int = 0, last: int = 3,
                distributed: bool = True, bucket_size: int = None, extra: List[str] = ()):
            args = _lm_args(pg, DIST_OPT_ARGV + list(extra) + (["--use-vescale-fsdp"] if flag else []))
            args.use_distributed_optimizer, args.ddp_bucket_size = distributed, bucket_size
            args.overlap_grad_reduce = True
            args.overlap_param_gather = distributed  # Megatron-LM asserts it needs the distributed optimizer
            args.save, args.load = save, load
            training = _switched(pg, args)
            pg.seed(args)
            config = pg.transformer_config(args)
            with megatron_optimizer_on_cpu(), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model = _get_model(training, pg, args, config)
                said.extend(str(w.message) for w in caught if "has no effect" in str(w.message))
                optimizer = training.get_megatron_optimizer(pg.optimizer_config(args), model)
                if not flag:  # what Megatron-LM's OptimizerParamScheduler sets (ours sets it when built)
                    _as_megatron_scheduler_sets(optimizer, pg.optimizer_config(args))
                loaded = training.load_checkpoint(model, optimizer, None)[0] if load is not None else None
                losses = _train_with_dist_opt(training, pg, args, model, optimizer, config, first, last)
                if save is not None:
                    training.save_checkpoint(last, model, optimizer, None, 0)
            return losses, _full_weights(model[0]), loaded

        def run(name: str, *a, **k) -> None:
            try:
                out[name] = job(*a, **k)
            except Exception as e:  # noqa: BLE001 - reported by the test
                out[name] = f"{type(e).__name__}: {e}"

        ddp_dir, ours_dir = os.path.join(root, "ddp"), os.path.join(root, "ours")
        run("ddp", False)
        run("ddp saved", False, save=ddp_dir, last=2)
        run("ours", True)
        run("ours from ddp", True, load=ddp_dir, first=2)
        run("ours from ddp, no flag", True, load=ddp_dir, first=2, distributed=False)
        run("ours saved", True, save=ours_dir, last=2)
        run("ours from ours", True, load=ours_dir, first=2)
        # DDP's buffer cut into buckets: the file drops the padding at each cut. Of >= 2000 elements,
        # each cut follows a matrix (a multiple of 64 elements: no padding there), so the layouts
        # coincide; of 1 element, cuts follow 32-element LayerNorm vectors too (padding dropped)
        # bf16: the fp32 masters come from distrib_optim.pt ("param"), the model file holds bf16 weights
        run("bf16 ddp", False, extra=["--bf16"])
        run("bf16 ddp saved", False, save=os.path.join(root, "bf16"), last=2, extra=["--bf16"])
        run("bf16 ours from ddp", True, load=os.path.join(root, "bf16"), first=2, extra=["--bf16"])
        for size in (2000, 1):
            run(f"ddp buckets {size} saved", False, save=os.path.join(root, f"b{size}"), last=2, bucket_size=size)
            run(f"ours from ddp buckets {size}", True, load=os.path.join(root, f"b{size}"), first=2)
    res: Dict[str, Any] = {"warnings": said,
                           "ddp saved file": os.path.isfile(_distrib_optim_name(_checkpoint_name(ddp_dir, 2)))}
    for name, value in out.items():
        if name in ("ddp", "bf16 ddp"):
            continue
        if isinstance(value, str):
            res[name] = value
            continue
        losses, end, loaded = value
        bf16 = name.startswith("bf16")
        ddp_losses, ddp_end, _ = out["bf16 ddp" if bf16 else "ddp"]
        first = ddp_losses[2:] if loaded is not None else ddp_losses[:len(losses)]
        ref = ddp_end if len(losses) + (loaded or 0) == 3 else out["bf16 ddp saved" if bf16 else "ddp saved"][1]
        res[name] = {"loaded": loaded, "losses equal": losses == first,
                     # bf16: DDP's state dict holds the bf16 model weights, ours the fp32 masters: rounded alike
                     "end differ": sorted(k for k in ref if not torch.equal(ref[k], end[k].to(ref[k].dtype)))}
    return res


# ---- F: --check-weight-hash-across-dp-replicas-interval --------------------------------
def _hashes(rank: int, world_size: int) -> Dict[str, Any]:
    """Megatron-LM's check_param_hashes_across_dp_replicas (cross_check=True, as train() calls
    it at lines 2665-2668 and 2264-2272) on a freshly built model, then with one weight element
    changed on rank 1 only (DDP: its copy; ours: its shard), at dp2 and under HSDP (2 instances
    of 1 rank: replicated shards)."""
    out: Dict[str, Any] = {}
    for variant, extra in (("dp2", []), ("hsdp", ["--num-distributed-optimizer-instances", "2"])):
        with _megatron_job(ARGV + extra) as (pg, _):
            for name, argv in (("ddp", ARGV + extra), ("vescale", ARGV + extra + ["--use-vescale-fsdp"])):
                args = _lm_args(pg, argv)
                if name == "ddp":
                    args.num_distributed_optimizer_instances = 1
                training = _switched(pg, args)
                pg.seed(args)
                model = _get_model(training, pg, args, pg.transformer_config(args))
                for state in ("correct", "corrupted"):
                    if state == "corrupted" and rank == 1:
                        weight = model[0].module.decoder.layers[0].mlp.linear_fc1.weight
                        with torch.no_grad():
                            local = weight if name == "ddp" else weight.to_local()
                            local.view(-1)[0] += 1.0
                    try:
                        out[(variant, name, state)] = training.check_param_hashes_across_dp_replicas(
                            model, cross_check=True)
                    except Exception as e:  # noqa: BLE001 - reported by the test
                        out[(variant, name, state)] = f"{type(e).__name__}: {e}"
    return out


# ---- 5: gradient reduction with and without --overlap-grad-reduce ---------------------
def _grad_reduce(rank: int, world_size: int) -> Dict[str, Any]:
    """bf16, 4 micro-batches per rank: Megatron-LM's get_model and train() setup (no_sync_func
    only under --overlap-grad-reduce), one step of Megatron's schedule and finalize_model_grads,
    under the switch and under megatron-core DDP with the same flags; then both again with
    --gradient-accumulation-fusion (Megatron-LM's default; the test-only CPU kernel)."""
    import contextlib

    from tests.comm_spy import CommSpy
    from tests.megatron_shim import fused_wgrad_on_cpu
    from tests.test_megatron import _ddp_grads, _our_grads

    argv = ARGV + ["--global-batch-size", "16", "--bf16"]  # 4 micro-batches of 2 per rank at dp 2
    out: Dict[str, Any] = {}
    with _megatron_job(argv) as (pg, _):
        for fusion in (False, True):
            for overlap in (False, True):
                grads = {}
                for flag in (False, True):
                    args = _lm_args(pg, argv + (["--use-vescale-fsdp"] if flag else []))
                    args.overlap_grad_reduce, args.gradient_accumulation_fusion = overlap, fusion
                    with fused_wgrad_on_cpu() if fusion else contextlib.nullcontext():
                        training = _switched(pg, args)
                        pg.seed(args)
                        config = pg.transformer_config(args)
                        model = _get_model(training, pg, args, config)
                        _train_setup_calls(training, args, model, config)
                        with CommSpy().installed() as spy:
                            _one_step(pg, args, model[0], config, num_microbatches=4)
                    grads[flag] = _our_grads(model[0]) if flag else _ddp_grads(model[0])
                    if flag and not fusion:
                        out[(overlap, "reduce-scatters")] = sum(c[0] == "reduce_scatter" for c in spy.calls)
                        out[(overlap, "groups")] = len(model[0].vescale_groups)
                out[(overlap, "fused grads differ" if fusion else "grads differ")] = sorted(
                    k for k in grads[False] if not torch.equal(grads[False][k], grads[True][k]))
    return out


# ---- 6: flags without effect ---------------------------------------------------------
FLAGS_WITHOUT_EFFECT = {  # flag: (args field, a value that sets it, words of the reason)
    "--data-parallel-sharding-strategy": ("data_parallel_sharding_strategy", "optim_grads", "Megatron-FSDP"),
    "--ddp-reduce-scatter-with-fp32-accumulation": ("ddp_reduce_scatter_with_fp32_accumulation", True,
                                                    "reduce dtype"),
    "--check-for-large-grads": ("check_for_large_grads", True, "NaN / Inf only"),
    "--ddp-bucket-size": ("ddp_bucket_size", 1000, "buckets are its groups"),
    "--ddp-num-buckets": ("ddp_num_buckets", 2, "buckets are its groups"),
    "--ddp-pad-buckets-for-high-nccl-busbw": ("ddp_pad_buckets_for_high_nccl_busbw", True, "16 bytes"),
    "--use-precision-aware-optimizer": ("use_precision_aware_optimizer", True, "fp32 master weights"),
    "--use-torch-optimizer-for-cpu-offload": ("use_torch_optimizer_for_cpu_offload", True, "on the host"),
    "--overlap-cpu-optimizer-d2h-h2d": ("overlap_cpu_optimizer_d2h_h2d", True, "copy stream"),
    # parsed by Megatron-LM into torch dtypes (core_v0.16.1 arguments.py lines 645-653)
    "--main-grads-dtype": ("main_grads_dtype", torch.bfloat16, "fp32 optimizer states"),
    "--main-params-dtype": ("main_params_dtype", torch.float16, "fp32 optimizer states"),
    "--exp-avg-dtype": ("exp_avg_dtype", torch.bfloat16, "--vescale-optimizer adamw8bit"),
    "--exp-avg-sq-dtype": ("exp_avg_sq_dtype", torch.uint8, "--vescale-optimizer adamw8bit"),
    # beside --vescale-no-prefetch only (set below): otherwise it asks for what RaggedFSDP does
    "--overlap-param-gather": ("overlap_param_gather", True, "--vescale-no-prefetch"),
}


def _flags(rank: int, world_size: int) -> Dict[str, Any]:
    """Megatron-LM's get_model twice with every flag RaggedFSDP does not use, then the
    example's build twice with --min-lr (which its learning-rate scheduler uses): the warnings each time."""
    import warnings

    out: Dict[str, Any] = {"lm": [], "example": []}
    with _megatron_job(ARGV) as (pg, _):
        for flag in (False, True, True):  # DDP first: Megatron's own flags say nothing there
            args = _lm_args(pg, ARGV + (["--use-vescale-fsdp"] if flag else []))
            for field, value, _ in FLAGS_WITHOUT_EFFECT.values():
                setattr(args, field, value)
            args.vescale_prefetch = False
            if not flag:
                args.ddp_num_buckets = None  # Megatron-LM asserts one of the two bucket flags at most
                args.overlap_param_gather = False  # and this one only beside the distributed optimizer
                # megatron-core 0.16.1 swaps its module-global dist_reduce_scatter_func for good when a
                # DDP is built with it (param_and_grad_buffer.py): later DDPs in this process would use it
                args.ddp_reduce_scatter_with_fp32_accumulation = False
            training = _switched(pg, args)
            pg.seed(args)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                _get_model(training, pg, args, pg.transformer_config(args))
            out["lm"] += [str(w.message) for w in caught if "has no effect" in str(w.message)]
        for _ in range(2):
            args = pg.build_parser().parse_args(ARGV + ["--use-vescale-fsdp", "--min-lr", "1e-4"])
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                pg.build(args)
            out["example"] += [str(w.message) for w in caught if "has no effect" in str(w.message)]
    return out


# ---- D: clash with another FSDP ------------------------------------------------------
def _clash(rank: int, world_size: int) -> Dict[str, str]:
    out = {}
    with _megatron_job(ARGV) as (pg, _):
        for field in ("use_megatron_fsdp", "use_torch_fsdp2"):
            args = _lm_args(pg, ARGV + ["--use-vescale-fsdp"])
            setattr(args, field, True)
            training = _switched(pg, args)
            config = pg.transformer_config(args)
            try:
                model = _get_model(training, pg, args, config)
                out[field] = f"no error: built {type(model[0]).__name__}"
            except ValueError as e:
                from vescale_zero.integrations.megatron import clash_message

                out[field] = "ok" if str(e) == clash_message(field) else f"other message: {e}"
    return out


# ---- 3: --check-for-nan-in-loss-and-grad --------------------------------------------
def _nan(rank: int, world_size: int) -> Dict[str, str]:
    out = {}
    with _megatron_job(ARGV) as (pg, _):
        for name, argv, check in (("ddp", ARGV, True), ("vescale", ARGV + ["--use-vescale-fsdp"], True),
                                  ("vescale one rank", ARGV + ["--use-vescale-fsdp"], True),
                                  ("vescale unchecked", ARGV + ["--use-vescale-fsdp"], False)):
            args = _lm_args(pg, argv)
            args.check_for_nan_in_loss_and_grad = check
            training = _switched(pg, args)
            pg.seed(args)
            config = pg.transformer_config(args)
            model = _get_model(training, pg, args, config)
            if name == "vescale one rank":  # rank 0's activations (so its local gradients) alone turn NaN
                if rank == 0:
                    model[0].module.embedding.register_forward_hook(lambda m, i, o: o * float("nan"))
            else:
                with torch.no_grad():  # every rank diverges alike: a NaN weight in the first layer
                    weight = model[0].module.decoder.layers[0].mlp.linear_fc1.weight
                    (weight if name == "ddp" else weight.to_local()).fill_(float("nan"))
            try:
                with record_host_syncs(torch.device("cpu")) as syncs:
                    _one_step(pg, args, model[0], config)
                out[name] = "stepped"
                out[name + " syncs in data_parallel.py"] = [s for s in syncs if "data_parallel.py" in s]
            except RuntimeError as e:
                out[name] = str(e)
    return out


# ---- 4: --log-params-norm ----------------------------------------------------------
def _calc_params_l2_norm(args, model: List[torch.nn.Module], force_create_fp32_copy: bool = False) -> float:
    """core_v0.16.1 megatron/training/utils.py calc_params_l2_norm, lines 48-190 (the
    non-Megatron-FSDP path): the same megatron-core helpers and collectives in the same order,
    the multi-tensor L2 norm written as a plain norm of the collected tensors."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared
    from megatron.core.utils import get_data_parallel_group_if_dtensor, to_local_if_dtensor

    def norm_2(tensors: List[torch.Tensor]) -> torch.Tensor:
        if not tensors:
            return torch.zeros(1)
        return torch.stack([t.float().norm() ** 2 for t in tensors]).sum().reshape(1)

    def data_of(param: torch.Tensor, into: List[torch.Tensor], sharded: List[torch.Tensor]) -> None:
        local = to_local_if_dtensor(param)
        if not args.bf16:
            into.append(local.data)
        elif not force_create_fp32_copy and hasattr(local, "main_param"):
            if getattr(local, "main_param_sharded", False):
                if local.main_param is not None:
                    sharded.append(local.main_param)
            else:
                into.append(local.main_param)
        else:
            into.append(local.data.float())

    dense, moe, sharded, dp_group = [], [], [], None
    for chunk in model:
        for param in chunk.parameters():
            dp_group = get_data_parallel_group_if_dtensor(param, dp_group)
            if not param_is_not_tensor_parallel_duplicate(param):
                continue
            if not getattr(param, "allreduce", True):
                data_of(param, moe, sharded)
            elif param_is_not_shared(param):
                data_of(param, dense, sharded)
    total = norm_2(dense)
    if dp_group is not None:
        torch.distributed.all_reduce(total, group=dp_group)
    sharded_total = norm_2(sharded)
    torch.distributed.all_reduce(sharded_total, group=mpu.get_data_parallel_group(with_context_parallel=True))
    total += sharded_total
    moe_total = norm_2(moe)
    dense_group = mpu.get_model_parallel_group()
    expert_group = mpu.get_expert_tensor_model_pipeline_parallel_group()
    ranks = torch.distributed.get_process_group_ranks
    if ranks(dense_group) == ranks(expert_group):
        total += moe_total
        torch.distributed.all_reduce(total, group=dense_group)
    else:
        torch.distributed.all_reduce(total, group=dense_group)
        torch.distributed.all_reduce(moe_total, group=expert_group)
        total += moe_total
    return total.item() ** 0.5


NORM_VARIANTS = {"dense": [], "bf16": ["--bf16"],
                 "experts ep2": ["--num-experts", "2", "--expert-model-parallel-size", "2"],
                 "hsdp": ["--num-distributed-optimizer-instances", "2"]}


def _params_norm(rank: int, world_size: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for variant, extra in NORM_VARIANTS.items():
        with _megatron_job(ARGV + extra) as (pg, _):
            for name, argv in (("ddp", ARGV + extra), ("vescale", ARGV + extra + ["--use-vescale-fsdp"])):
                args = _lm_args(pg, argv)
                if name == "ddp":  # the same weights, unsharded (DDP's instances are for its distributed optimizer)
                    args.num_distributed_optimizer_instances = 1
                training = _switched(pg, args)
                pg.seed(args)
                config = pg.transformer_config(args)
                model = _get_model(training, pg, args, config)
                try:  # core_v0.16.1 training.py line 2894: params_norm = calc_params_l2_norm(model)
                    out[(variant, name)] = training.calc_params_l2_norm(model)
                except Exception as e:  # noqa: BLE001 - reported by the test
                    out[(variant, name)] = f"{type(e).__name__}: {e}"
                if name == "ddp":
                    out[(variant, "terms")] = sum(p.numel() for p in model[0].parameters())
    return out


# ---- E: --optimizer muon -------------------------------------------------------------
def _muon(rank: int, world_size: int) -> Dict[str, Any]:
    from vescale_zero.integrations.megatron import RaggedOptimizer
    from vescale_zero.optim import Muon

    out: Dict[str, Any] = {}
    with _megatron_job(ARGV) as (pg, _):
        args = _lm_args(pg, ARGV + ["--use-vescale-fsdp"])
        args.optimizer = "muon"
        training = _switched(pg, args)
        pg.seed(args)
        config = pg.transformer_config(args)
        model = _get_model(training, pg, args, config)
        opt_config = pg.optimizer_config(args)
        try:
            # core_v0.16.1 training.py setup_model_and_optimizer, lines 1459-1477: 'muon' in the
            # optimizer name goes to get_megatron_muon_optimizer.
            optimizer = training.get_megatron_muon_optimizer(
                opt_config, model, config_overrides=None, use_gloo_process_groups=True,
                layer_wise_distributed_optimizer=False)
        except ValueError as e:
            out["built"] = str(e)
            return out
        out["built"] = "ok"
        out["ours"] = isinstance(optimizer, RaggedOptimizer) and any(
            isinstance(o, Muon) for o in getattr(optimizer, "optimizers", [optimizer.optimizer]))
        args.vescale_optimizer = "shampoo"
        try:
            training.get_megatron_muon_optimizer(opt_config, model, config_overrides=None)
            out["two optimizers"] = "no error"
        except ValueError as e:
            out["two optimizers"] = "ok" if "--vescale-optimizer muon" in str(e) else str(e)
    return out


# ---- G: --optimizer-cpu-offload -------------------------------------------------------
def _megatron_optimizer_config(args, drop=()):
    """core_v0.16.1 training.py get_megatron_optimizer_config, lines 1410-1435: the Adam config's
    fields read from the arguments by name (``drop``: fields left at their defaults)."""
    from megatron.core import optimizer

    cls = getattr(optimizer, "AdamOptimizerConfig", optimizer.OptimizerConfig)  # megatron-core 0.16 and 0.17 have it
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                  if hasattr(args, f.name) and f.name not in drop})


def _offload(rank: int, world_size: int) -> Dict[str, Any]:
    """Megatron-LM's get_model, get_megatron_optimizer (its config from the arguments) and 3 steps
    under the switch, without and with --optimizer-cpu-offload and what Megatron-LM's validate_args
    asks beside it (core_v0.16.1 arguments.py lines 1189-1194: --use-precision-aware-optimizer, which
    megatron-core's OptimizerConfig allows only with --use-distributed-optimizer): losses, weights,
    whether each group is offloaded, and the warnings."""
    import warnings

    argv = ARGV + ["--global-batch-size", "8", "--clip-grad", "0", "--train-iters", "3", "--use-vescale-fsdp"]
    out: Dict[str, Any] = {}
    with _megatron_job(argv) as (pg, _):
        for name, extra in (("plain", []), ("offload", ["--optimizer-cpu-offload", "--use-distributed-optimizer"])):
            args = _lm_args(pg, argv + extra)
            args.use_precision_aware_optimizer = bool(extra)
            training = _switched(pg, args)
            pg.seed(args)
            config = pg.transformer_config(args)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model = _get_model(training, pg, args, config)
            # use_precision_aware_optimizer stays out of the config here: its check needs Transformer
            # Engine (megatron-core 0.16.1 is_te_min_version), not installed on this machine
            optimizer = training.get_megatron_optimizer(
                _megatron_optimizer_config(args, drop=("use_precision_aware_optimizer",)), model)
            losses = pg.train_loop(args, model[0], optimizer, config)["losses"]
            out[name] = {"losses": losses, "weights": _full_weights(model[0]),
                         "offloaded": [g.host_copies is not None for g in model[0].vescale_groups],
                         "said": [str(w.message) for w in caught if "has no effect" in str(w.message)]}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Dict[str, List[Any]]:
    root = str(tmp_path_factory.mktemp("megatron_lm_ckpt"))
    return run_cases_on_ranks({
        "isinstance": (_isinstance_ddp, ()), "meta": (_meta_init, ()),
        "torch_ckpt": (_torch_checkpoint, (root,)), "grad_reduce": (_grad_reduce, ()), "flags": (_flags, ()),
        "clash": (_clash, ()), "nan": (_nan, ()),
        "params_norm": (_params_norm, ()), "muon": (_muon, ()),
        "dist_opt": (_distributed_optimizer, (root,)), "hashes": (_hashes, ()), "offload": (_offload, ()),
    }, 2, timeout=400)


def test_megatron_lm_train_isinstance_ddp(results):
    """A: training.DDP stays a class: Megatron-LM's isinstance in train() passes, flag on or off."""
    for res in results["isinstance"]:
        assert res.pop("grads equal"), "RaggedFSDP's reduced gradients differ from megatron-core DDP's"
        for flag, checks in res.items():
            assert all(checks.values()), (flag, checks)


def test_megatron_lm_init_model_with_meta_device(results):
    """1: Megatron-LM's get_model with --init-model-with-meta-device builds RaggedFSDP's
    weights equal to megatron-core DDP's eager build, bit for bit, and 2 AdamW steps (fp32, 2
    micro-batches, dp 2: every reduction has two addends) stay bit-identical."""
    for res in results["meta"]:
        assert res["keys"], res
        assert res["init differ"] == [], (res["init differ"], res["init max"])
        ref_losses, losses = res["losses"]
        assert losses == ref_losses and len(losses) == 2, res["losses"]
        assert res["end differ"] == [], res["end differ"]


def test_megatron_lm_ckpt_format_torch(results):
    """2: Megatron-LM's torch-format save_checkpoint under the switch writes the full model
    (megatron-core DDP's keys and shapes, our gathered weights), and load_checkpoint in a fresh
    job resumes it: the third step's loss and the weights after it equal DDP's 3 uninterrupted
    steps bit for bit (fp32, dp 2: every reduction has two addends)."""
    for res in results["torch_ckpt"]:
        assert res["keys"] and res["shapes"] == [], res
        assert res["saved differ"] == [], res["saved differ"]
        assert res["loaded iteration"] == 2, res
        ddp_losses, losses = res["losses"]
        assert losses == ddp_losses and len(losses) == 3, res["losses"]
        assert res["end differ"] == [], res["end differ"]


def test_megatron_lm_use_distributed_optimizer(results):
    """--use-distributed-optimizer (with --overlap-grad-reduce --overlap-param-gather) is accepted
    under the switch, without a warning (RaggedFSDP shards the optimizer state and prefetches the
    next group's gather), and Megatron-LM's train() runs through its pre-hook calls: 3 steps equal
    megatron-core DDP + distributed optimizer's bit for bit (fp32, dp 2: each reduction has two
    addends; AdamW on the same elements in the same order); ours saved at 2 (torch format)
    resumes to the same third step."""
    for res in results["dist_opt"]:
        assert res["ours"] == {"loaded": None, "losses equal": True, "end differ": []}, res["ours"]
        assert res["ours saved"] == {"loaded": None, "losses equal": True, "end differ": []}, res["ours saved"]
        assert res["ours from ours"] == {"loaded": 2, "losses equal": True, "end differ": []}, res
        assert res["warnings"] == [], res["warnings"]  # both flags mean something here: nothing to say


def test_megatron_lm_resumes_ddp_distributed_optimizer_torch_checkpoint(results):
    """C: megatron-core DDP + distributed optimizer's --ckpt-format torch checkpoint (its
    state_dict in the model file, its parameter state in distrib_optim.pt) resumes under the
    switch, with --use-distributed-optimizer (Megatron-LM calls load_parameter_state) or without
    it (the switch loads the file): the third step's loss and the weights after it equal DDP's
    3 uninterrupted steps bit for bit, so the fp32 masters, both moments and the step loaded
    exactly; under --bf16 too (the masters from the file's "param": the weights after the step,
    rounded to bf16, are DDP's bf16 weights; without the masters they are not)."""
    for res in results["dist_opt"]:
        assert res["ddp saved file"], res
        assert res["ours from ddp buckets 2000"] == {"loaded": 2, "losses equal": True, "end differ": []}, res
        # where the cuts dropped padding, the layout needs Megatron's buckets: refused, naming the fix
        said = res["ours from ddp buckets 1"]
        assert isinstance(said, str) and "cannot be mapped to the parameters" in said and \
            "--dist-ckpt-optim-fully-reshardable" in said and "--no-load-optim" in said, said
        for name in ("ours from ddp", "ours from ddp, no flag", "bf16 ours from ddp"):
            assert res[name] == {"loaded": 2, "losses equal": True, "end differ": []}, (name, res[name])


def test_megatron_lm_weight_hash_check(results):
    """F: Megatron-LM's weight-hash check passes on a correct RaggedFSDP model (the shards
    differ by design: the full parameters are hashed), as on megatron-core DDP; a replica that
    diverges (HSDP: one instance's shard changed) fails it as DDP's changed copy does. At dp2
    without HSDP no rank holds another's shard: a changed shard reaches every rank's gather alike."""
    for res in results["hashes"]:
        for variant in ("dp2", "hsdp"):
            assert res[(variant, "ddp", "correct")] is True and res[(variant, "ddp", "corrupted")] is False, res
            assert res[(variant, "vescale", "correct")] is True, (variant, res)
        assert res[("hsdp", "vescale", "corrupted")] is False, res
        assert res[("dp2", "vescale", "corrupted")] is True, res


def test_megatron_lm_grad_reduce_once_per_step(results):
    """5: with or without --overlap-grad-reduce, one reduce-scatter per group per step (4
    micro-batches), and bf16 gradients accumulated in fp32: the reduced gradients equal
    megatron-core DDP's (fp32 main_grad accumulation, 1/dp scaling, two addends) bit for bit."""
    for res in results["grad_reduce"]:
        for overlap in (False, True):
            assert res[(overlap, "reduce-scatters")] == res[(overlap, "groups")] == 3, (overlap, res)
            assert res[(overlap, "grads differ")] == [], (overlap, res[(overlap, "grads differ")])


def test_megatron_lm_gradient_accumulation_fusion(results):
    """Issue 27: --gradient-accumulation-fusion (Megatron-LM's default) under the switch, bf16 with
    fp32 main_grad, 4 micro-batches, with and without --overlap-grad-reduce: megatron-core's fused
    wgrad GEMM adds into the full-size main_grad views of RaggedFSDP's gradient buffers, and the
    reduced gradients equal megatron-core DDP's with the same flag bit for bit."""
    for res in results["grad_reduce"]:
        for overlap in (False, True):
            assert res[(overlap, "fused grads differ")] == [], (overlap, res[(overlap, "fused grads differ")])


def test_megatron_lm_flags_without_effect(results):
    """6: each Megatron-LM flag RaggedFSDP does not use is named once (rank 0, however many
    models are built), with its reason; none under megatron-core DDP; none for the example's
    --min-lr, which its OptimizerParamScheduler decays to (tests/test_megatron_example.py)."""
    rank0, rank1 = results["flags"]
    assert rank1 == {"lm": [], "example": []}, rank1
    for flag, (_, _, reason) in FLAGS_WITHOUT_EFFECT.items():
        said = [m for m in rank0["lm"] if m.startswith(flag + " has no effect under --use-vescale-fsdp")]
        assert len(said) == 1 and reason in said[0], (flag, rank0["lm"])
    assert len(rank0["lm"]) == len(FLAGS_WITHOUT_EFFECT), rank0["lm"]
    assert rank0["example"] == [], rank0["example"]


def test_megatron_lm_clash_with_other_fsdp(results):
    """D: --use-vescale-fsdp with --use-megatron-fsdp / --use-torch-fsdp2 stops with the one message."""
    for res in results["clash"]:
        assert res == {"use_megatron_fsdp": "ok", "use_torch_fsdp2": "ok"}, res


def test_megatron_lm_check_for_nan_in_grad(results):
    """3: a NaN gradient stops RaggedFSDP as it stops megatron-core's DDP; off: no check."""
    for res in results["nan"]:
        assert "found NaN in local grad norm" in res["ddp"], res
        assert "found NaN or Inf in the gradients" in res["vescale"], res
        assert "found NaN or Inf in the gradients" in res["vescale one rank"], res  # every rank stops, none hangs
        assert "--no-check-for-nan-in-loss-and-grad" in res["vescale"], res
        assert res["vescale unchecked"] == "stepped", res
        assert res["vescale unchecked syncs in data_parallel.py"] == [], res  # no host sync with the flag off


def test_megatron_lm_params_norm(results):
    """4: Megatron-LM's calc_params_l2_norm gives DDP's figure on RaggedFSDP's shards (same
    weights; norm^2 is a sum of N squares in another order: within gamma_N relative)."""
    for res in results["params_norm"]:
        for variant in NORM_VARIANTS:
            ddp, ours, n = res[(variant, "ddp")], res[(variant, "vescale")], res[(variant, "terms")]
            # n squares per rank, at most 2n in all: each sum within gamma_2n of the exact one
            assert isinstance(ours, float) and abs(ours ** 2 - ddp ** 2) <= 2 * gamma(2 * n) * ddp ** 2, (
                variant, ours, ddp)


def test_megatron_lm_optimizer_muon(results):
    """E: --optimizer muon builds vescale-zero's Muon on the shards; beside another --vescale-optimizer, refused."""
    for res in results["muon"]:
        assert res == {"built": "ok", "ours": True, "two optimizers": "ok"}, res


if __name__ == "__main__":
    sys.exit(pytest.main([os.path.abspath(__file__), "-q"]))


def test_megatron_lm_optimizer_cpu_offload(results):
    """G: --optimizer-cpu-offload through Megatron-LM's get_model and get_megatron_optimizer: every
    group keeps its shards on the host (fraction 1.0, Megatron-LM's default), and 3 fp32 steps equal
    the run without the flag bit for bit (losses, weights); --use-precision-aware-optimizer, which
    Megatron-LM demands beside it, is not called without effect."""
    for rank, res in enumerate(results["offload"]):
        plain, offload = res["plain"], res["offload"]
        assert plain["offloaded"] and not any(plain["offloaded"]), (rank, plain["offloaded"])
        assert offload["offloaded"] and all(offload["offloaded"]), (rank, offload["offloaded"])
        assert len(offload["losses"]) == 3 and offload["losses"] == plain["losses"], (rank, offload, plain)
        assert sorted(offload["weights"]) == sorted(plain["weights"])
        assert all(torch.equal(offload["weights"][k], v) for k, v in plain["weights"].items()), rank
        assert offload["said"] == [], (rank, offload["said"])
