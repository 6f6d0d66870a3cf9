"""Pretrain a GPT with megatron-core, with Megatron-style arguments and ``--use-vescale-fsdp``.

    torchrun --nproc-per-node 8 examples/megatron/pretrain_gpt.py @configs/megatron/gpt_vescale.args

Built on megatron-core alone (Megatron-LM is not on the package index); the flags keep
Megatron-LM's names, so an argument file moves between the two. Tensor and pipeline
parallelism, schedules, ``finalize_model_grads`` and mixed precision (``Float16Module``)
are megatron-core's; only the data-parallel wrapper and the optimizer change with
``--use-vescale-fsdp`` (``RaggedFSDP`` + ``get_vescale_optimizer`` instead of
``DistributedDataParallel`` + ``get_megatron_optimizer``). Data: a synthetic corpus of
repeated phrases, so the loss falls quickly.

Runs on GPUs (NCCL). megatron-core itself calls CUDA unconditionally, so on CPU it runs
only inside our tests, behind a test-only shim (``tests/megatron_shim.py``).

An argument file (``@FILE``) may hold one flag and its value per line, as
``configs/megatron/gpt_vescale.args`` does; ``#`` starts a comment. Flags after it on the
command line override it (``--fp16`` after a file's ``--bf16`` too: the last of the two wins).

As Megatron-LM (tag core_v0.16.1) does: the learning rate follows megatron-core's
``OptimizerParamScheduler`` (``--lr-decay-style``, default linear to ``--min-lr`` over
``--lr-decay-iters``, warmup by ``--lr-warmup-iters`` / ``--lr-warmup-fraction``); ``--save``
/ ``--save-interval`` / ``--load`` write and resume ``torch_dist`` checkpoints
(``iter_NNNNNNN/`` and ``latest_checkpointed_iteration.txt``); the log line is
``training_log``'s (iteration, consumed samples, learning rate, lm loss, loss scale, grad
norm, skipped iterations).

``--optimizer-cpu-offload`` (with ``--optimizer-offload-fraction``, ``--no-pin-cpu-*``) under
``--use-vescale-fsdp`` keeps the master weights, gradients and optimizer state of the offloaded
groups in host memory and steps the optimizer there; gathers and reduce-scatters stay on the GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shlex
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

from vescale_zero.integrations.megatron import (
    RaggedFSDP,
    add_vescale_fsdp_args,
    get_vescale_optimizer,
    validate_vescale_args,
    vescale_optimizer_block,
    vescale_optimizer_name,
    vescale_options_from_args,
)
from vescale_zero.integrations.megatron.megatron_compat import canonical_lr
from vescale_zero.testing import SyntheticCorpus


def argument_file_line(line: str) -> List[str]:
    """The arguments on one line of an ``@FILE``: split as a shell would (``--lr 3e-4`` is two
    arguments, quotes group), ``#`` to the end of the line ignored. argparse's default reads
    one argument per line, which turns ``--num-layers 8`` into a single unknown argument."""
    return shlex.split(line, comments=True)


class _HalfPrecision(argparse.Action):
    """``--bf16`` / ``--fp16``: the last one given wins (a command line's ``--fp16`` overrides an
    argument file's ``--bf16``); Megatron-LM refuses the two together, so one switches the other off."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        namespace.bf16 = self.dest == "bf16"
        namespace.fp16 = self.dest == "fp16"


def _fused_wgrad_available() -> bool:
    from megatron.core.tensor_parallel import layers

    return bool(layers._grad_accum_fusion_available)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                fromfile_prefix_chars="@")
    p.convert_arg_line_to_args = argument_file_line
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=64)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--vocab-size", type=int, default=512)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall"], default="allgather")
    g.add_argument("--moe-router-load-balancing-type", nargs="+", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"])
    g.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0)
    g.add_argument("--moe-z-loss-coeff", type=float, default=None)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--init-model-with-meta-device", action="store_true",
                   help="build the model on the meta device; RaggedFSDP materialises it group by group")
    g = p.add_argument_group("activation recompute")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--recompute-modules", nargs="*", default=None,
                   help="with --recompute-granularity selective (Megatron's default: core_attn)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1,
                   help="with --use-vescale-fsdp: HSDP, shard inside each of N instances, replicate across them")
    g.add_argument("--use-megatron-fsdp", action="store_true")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    # Megatron-LM's default is on; here on where megatron-core finds apex's fused kernel
    g.add_argument("--gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_true",
                   default=_fused_wgrad_available())
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_false")
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=8)
    g.add_argument("--train-iters", type=int, default=20)
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--bf16", action=_HalfPrecision, nargs=0, default=False)
    g.add_argument("--fp16", action=_HalfPrecision, nargs=0, default=False)
    g.add_argument("--seed", type=int, default=1234)
    # Megatron-LM's optimizer offload flags (core_v0.16.1 names and defaults); RaggedFSDP keeps the
    # offloaded groups' shards and optimizer state in host memory (integrations/megatron/optimizer_offload.py)
    g.add_argument("--optimizer-cpu-offload", action="store_true")
    g.add_argument("--optimizer-offload-fraction", type=float, default=1.0)
    g.add_argument("--no-pin-cpu-grads", dest="pin_cpu_grads", action="store_false")
    g.add_argument("--no-pin-cpu-params", dest="pin_cpu_params", action="store_false")
    g.add_argument("--log-interval", type=int, default=1)
    g = p.add_argument_group("learning rate and weight decay (Megatron-LM's SchedulerConfig)")
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                   default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--lr-wsd-decay-style", choices=["exponential", "linear", "cosine", "minus_sqrt"],
                   default="exponential")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--start-weight-decay", type=float, default=None, help="default: --weight-decay")
    g.add_argument("--end-weight-decay", type=float, default=None, help="default: --weight-decay")
    g.add_argument("--weight-decay-incr-style", choices=["constant", "linear", "cosine"], default="constant")
    g = p.add_argument_group("checkpointing (torch_dist)")
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", type=str, default=None)
    add_vescale_fsdp_args(p)
    return p


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _one_or_list(value: Any) -> Any:
    """A ``nargs="+"`` flag as Megatron-LM passes it on: one value alone, several as a list."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def transformer_config(args: argparse.Namespace) -> TransformerConfig:
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    moe: Dict[str, Any] = {}
    if args.num_experts:
        moe = dict(num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                   moe_token_dispatcher_type=args.moe_token_dispatcher_type,
                   moe_router_load_balancing_type=_one_or_list(args.moe_router_load_balancing_type),
                   moe_aux_loss_coeff=_one_or_list(args.moe_aux_loss_coeff), moe_z_loss_coeff=args.moe_z_loss_coeff,
                   expert_model_parallel_size=args.expert_model_parallel_size)
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel, params_dtype=dtype, bf16=args.bf16, fp16=args.fp16,
        pipeline_dtype=dtype, use_cpu_initialization=not torch.cuda.is_available(),
        init_model_with_meta_device=args.init_model_with_meta_device,
        add_bias_linear=args.add_bias_linear, gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers, recompute_modules=args.recompute_modules, **moe,
    )


def build_model_unwrapped(args: argparse.Namespace, config: TransformerConfig) -> torch.nn.Module:
    """This pipeline stage's ``GPTModel`` (inside ``Float16Module`` under bf16/fp16)."""
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False)
    # As Megatron-LM's get_model: under --init-model-with-meta-device the model is built on
    # meta and stays there; RaggedFSDP materialises it (integrations/megatron/meta_init.py).
    meta = config.init_model_with_meta_device
    with torch.device("meta") if meta else contextlib.nullcontext():
        model: torch.nn.Module = GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=args.vocab_size,
            max_sequence_length=args.max_position_embeddings or args.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        )
    if not meta:
        model.to(_device())
    if args.bf16 or args.fp16:
        model = Float16Module(config, model)
    return model


def build_model(args: argparse.Namespace, config: TransformerConfig) -> torch.nn.Module:
    """The model chunk in its data-parallel wrapper: ``RaggedFSDP`` or Megatron's DDP."""
    if config.init_model_with_meta_device and not args.use_vescale_fsdp:
        raise ValueError("--init-model-with-meta-device needs --use-vescale-fsdp in this example: Megatron's DDP "
                         "cannot hold a model on the meta device")
    model = build_model_unwrapped(args, config)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        use_distributed_optimizer=args.use_distributed_optimizer, use_megatron_fsdp=args.use_megatron_fsdp,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
    )
    if args.use_vescale_fsdp:
        return RaggedFSDP(config, ddp_config, model, options=vescale_options_from_args(args))
    return DistributedDataParallel(config, ddp_config, model)


def optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        clip_grad=args.clip_grad, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        bf16=args.bf16, fp16=args.fp16, use_distributed_optimizer=args.use_distributed_optimizer,
        optimizer_cpu_offload=args.optimizer_cpu_offload, optimizer_offload_fraction=args.optimizer_offload_fraction,
        pin_cpu_grads=args.pin_cpu_grads, pin_cpu_params=args.pin_cpu_params,
    )


def batches(args: argparse.Namespace, step: int, num_microbatches: int) -> List[Dict[str, torch.Tensor]]:
    """This data-parallel rank's micro-batches of the global batch of ``step``."""
    corpus = SyntheticCorpus(args.vocab_size, args.seq_length, seed=args.seed)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    tokens, labels = corpus.batch(step, args.global_batch_size, dp_rank, dp_size)
    position_ids = torch.arange(args.seq_length).unsqueeze(0).expand_as(tokens)
    device = _device()
    out = []
    for i in range(num_microbatches):
        sl = slice(i * args.micro_batch_size, (i + 1) * args.micro_batch_size)
        out.append({"tokens": tokens[sl].to(device), "labels": labels[sl].to(device),
                    "position_ids": position_ids[sl].contiguous().to(device)})
    return out


def loss_func(output_tensor: torch.Tensor):
    loss = output_tensor.float().mean()
    return loss, {"lm loss": loss.detach().clone()}  # the schedule divides ``loss`` in place


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, loss_func


def setup(args: argparse.Namespace) -> None:
    """Process groups (NCCL on GPU, gloo on CPU) and Megatron's model-parallel state."""
    validate_vescale_args(args)
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
    )


def seed(args: argparse.Namespace) -> None:
    """The same initial weights on every build with the same seed."""
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)


def build(args: argparse.Namespace) -> Tuple[torch.nn.Module, Any, TransformerConfig]:
    """``(model, optimizer, config)``: the wrapped model chunk and Megatron's optimizer, or
    ``RaggedFSDP`` and ``RaggedOptimizer`` with ``--use-vescale-fsdp``."""
    seed(args)
    config = transformer_config(args)
    model = build_model(args, config)
    opt_config = optimizer_config(args)
    if args.use_vescale_fsdp:
        name = vescale_optimizer_name(args)
        optimizer = get_vescale_optimizer(opt_config, [model], optimizer=name,
                                          block=vescale_optimizer_block(args) if name else None)
    else:
        optimizer = get_megatron_optimizer(opt_config, [model])
    return model, optimizer, config


def optimizer_param_scheduler(args: argparse.Namespace, optimizer: Any) -> OptimizerParamScheduler:
    """megatron-core's scheduler set up as Megatron-LM's ``get_optimizer_param_scheduler``
    (megatron/training/training.py, tag core_v0.16.1, iteration-based branch): steps counted
    in samples, decay over ``--lr-decay-iters`` (default ``--train-iters``), warmup by
    ``--lr-warmup-fraction`` of the decay or ``--lr-warmup-iters``; weight decay from
    ``--start/--end-weight-decay`` (default ``--weight-decay``, as its validate_args sets)."""
    if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
        raise ValueError("give one of --lr-warmup-fraction and --lr-warmup-iters, not both")
    decay_steps = (args.lr_decay_iters or args.train_iters) * args.global_batch_size
    warmup_steps = (args.lr_warmup_fraction * decay_steps if args.lr_warmup_fraction is not None
                    else args.lr_warmup_iters * args.global_batch_size)
    wsd_steps = args.lr_wsd_decay_iters * args.global_batch_size if args.lr_wsd_decay_iters is not None else None
    start_wd = args.weight_decay if args.start_weight_decay is None else args.start_weight_decay
    end_wd = args.weight_decay if args.end_weight_decay is None else args.end_weight_decay
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=warmup_steps,
        lr_decay_steps=decay_steps, lr_decay_style=args.lr_decay_style, start_wd=start_wd, end_wd=end_wd,
        wd_incr_steps=args.train_iters * args.global_batch_size, wd_incr_style=args.weight_decay_incr_style,
        wsd_decay_steps=wsd_steps, lr_wsd_decay_style=args.lr_wsd_decay_style,
    )


TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's names (megatron/training/checkpointing.py)


def _iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _sharded_state_dict(args: argparse.Namespace, model: torch.nn.Module, optimizer: Any,
                        metadata: Optional[dict], is_loading: bool = False) -> Dict[str, Any]:
    # RaggedFSDP writes its own shards (integrations/megatron/dist_checkpoint.py); megatron-core
    # DDP's state is its module's, as Megatron-LM's unwrap_model(model)[0].sharded_state_dict()
    chunk = model if args.use_vescale_fsdp else model.module
    model_sd = chunk.sharded_state_dict(is_loading=is_loading) if args.use_vescale_fsdp else chunk.sharded_state_dict()
    return {"model": model_sd,
            "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)}


def save_checkpoint(args: argparse.Namespace, iteration: int, consumed_samples: int, model: torch.nn.Module,
                    optimizer: Any, scheduler: Optional[OptimizerParamScheduler]) -> None:
    """``--save``: ``iter_NNNNNNN/`` in ``torch_dist`` (megatron-core's dist_checkpointing),
    then the tracker file, as Megatron-LM's save_checkpoint lays them out."""
    path = _iteration_dir(args.save, iteration)
    os.makedirs(path, exist_ok=True)
    metadata = {"distrib_optim_sharding_type": "fully_reshardable"} if args.use_distributed_optimizer else None
    state = _sharded_state_dict(args, model, optimizer, metadata)
    state.update(iteration=iteration, consumed_train_samples=consumed_samples)
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    dist_checkpointing.save(state, path, content_metadata=metadata)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(args.save, TRACKER), "w") as f:
            f.write(str(iteration))
    dist.barrier()


def load_checkpoint(args: argparse.Namespace, model: torch.nn.Module, optimizer: Any,
                    scheduler: Optional[OptimizerParamScheduler]) -> Tuple[int, int]:
    """``--load``: the tracker's iteration (none: a fresh start, ``(0, 0)``), as Megatron-LM's
    load_checkpoint; restores model, optimizer and scheduler; ``(iteration, consumed samples)``."""
    tracker = os.path.join(args.load, TRACKER)
    if not os.path.isfile(tracker):
        if dist.get_rank() == 0:
            print(f"WARNING: could not find {tracker}; training from random initialization", flush=True)
        return 0, 0
    with open(tracker) as f:
        iteration = int(f.read().strip())
    path = _iteration_dir(args.load, iteration)
    state = _sharded_state_dict(args, model, optimizer, dist_checkpointing.load_content_metadata(path),
                                is_loading=True)
    loaded = dist_checkpointing.load(state, path)  # with the saved common (non-tensor) entries
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None and loaded.get("opt_param_scheduler") is not None:
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    return int(loaded["iteration"]), int(loaded["consumed_train_samples"])


def training_log(args: argparse.Namespace, iteration: int, consumed_samples: int, elapsed_ms: float,
                 learning_rate: Optional[float], batch_size: int, loss: Optional[float], loss_scale: float,
                 grad_norm: Optional[float], skipped: int, nan: int) -> str:
    """Megatron-LM's training_log line (megatron/training/training.py, tag core_v0.16.1)."""
    line = f" [{time.strftime('%Y-%m-%d %H:%M:%S')}]"
    line += f" iteration {iteration:8d}/{args.train_iters:8d} |"
    line += f" consumed samples: {consumed_samples:12d} |"
    line += f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
    if learning_rate is not None:
        line += f" learning rate: {learning_rate:.6E} |"
    line += f" global batch size: {batch_size:5d} |"
    if loss is not None and loss > 0.0:
        line += f" lm loss: {loss:.6E} |"
    line += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    line += f" number of skipped iterations: {skipped:3d} |"
    line += f" number of nan iterations: {nan:3d} |"
    return line


def train_loop(
    args: argparse.Namespace, model: torch.nn.Module, optimizer: Any, config: TransformerConfig, first_step: int = 0,
    scheduler: Optional[OptimizerParamScheduler] = None, consumed_samples: Optional[int] = None,
    save: bool = False,
) -> Dict[str, List]:
    """``--train-iters`` iterations of Megatron's schedule: ``{"losses": [...] (last
    pipeline stage, mean over data parallel), "grad_norms": [...], "learning_rates": [...]
    (each step's, read from the optimizer's groups before it steps)}``. With ``scheduler``, as
    Megatron-LM's train_step: stepped by the global batch's samples after each successful
    update. ``save`` (as main() runs it): ``--save`` every ``--save-interval`` iterations and at
    the end, as Megatron-LM's train / pretrain."""
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    dp_size = parallel_state.get_data_parallel_world_size()
    if args.global_batch_size % (args.micro_batch_size * dp_size):
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} is not a multiple of --micro-batch-size x data-parallel "
            f"size ({args.micro_batch_size} x {dp_size})"
        )
    num_microbatches = args.global_batch_size // (args.micro_batch_size * dp_size)
    batch_size = num_microbatches * args.micro_batch_size * dp_size
    consumed = first_step * batch_size if consumed_samples is None else consumed_samples
    forward_backward = get_forward_backward_func()
    losses, norms, times, lrs = [], [], [], []
    interval = {"loss": 0.0, "advanced": 0, "skipped": 0, "nan": 0}  # Megatron-LM's total_loss_dict
    printer = dist.get_rank() == dist.get_world_size() - 1  # a last-stage rank prints (print_rank_last)
    iteration, saved = first_step, False
    for step in range(first_step, args.train_iters):
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        out = forward_backward(
            forward_step_func=forward_step, data_iterator=iter(batches(args, step, num_microbatches)), model=[model],
            num_microbatches=num_microbatches, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
        lrs.append(canonical_lr(optimizer.param_groups) if hasattr(optimizer, "param_groups")
                   else None)
        ok, grad_norm, _ = optimizer.step()
        if ok and scheduler is not None:
            scheduler.step(increment=batch_size)
        iteration, consumed = step + 1, consumed + batch_size
        times.append(time.perf_counter() - start)
        norms.append(float(grad_norm) if grad_norm is not None else None)
        interval["skipped"] += 0 if ok else 1
        if parallel_state.is_pipeline_last_stage():
            loss = torch.stack([o["lm loss"] for o in out]).mean()
            dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
            losses.append(loss.item() / dp_size)
            if ok:
                interval["loss"] += losses[-1]
                interval["advanced"] += 1
                interval["nan"] += int(not math.isfinite(losses[-1]))
        if printer and iteration % args.log_interval == 0:
            scale = optimizer.get_loss_scale() if hasattr(optimizer, "get_loss_scale") else None
            lr = canonical_lr(optimizer.param_groups) if hasattr(optimizer, "param_groups") else None
            loss = interval["loss"] / max(1, interval["advanced"]) if losses else None
            print(training_log(args, iteration, consumed, 1e3 * times[-1], lr, batch_size, loss,
                               float(scale) if scale is not None else 1.0,
                               float(grad_norm) if grad_norm is not None else None,
                               interval["skipped"], interval["nan"]), flush=True)
            interval = {"loss": 0.0, "advanced": 0, "skipped": 0, "nan": 0}
        saved = bool(save and args.save and args.save_interval and iteration % args.save_interval == 0)
        if saved:
            save_checkpoint(args, iteration, consumed, model, optimizer, scheduler)
    if save and args.save and iteration > first_step and not saved:
        save_checkpoint(args, iteration, consumed, model, optimizer, scheduler)
    if printer and losses:
        wrapper = "RaggedFSDP (ragged)" if args.use_vescale_fsdp else "DistributedDataParallel"
        print(f"done: {wrapper}, tp={args.tensor_model_parallel_size} pp={args.pipeline_model_parallel_size} "
              f"dp={dp_size}, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
              f"median {1e3 * statistics.median(times):.1f} ms/iteration", flush=True)
    return {"losses": losses, "grad_norms": norms, "learning_rates": lrs}


def main(argv: Optional[List[str]] = None) -> Dict[str, List]:
    args = build_parser().parse_args(argv)
    setup(args)
    model, optimizer, config = build(args)
    scheduler = optimizer_param_scheduler(args, optimizer)
    first_step, consumed = load_checkpoint(args, model, optimizer, scheduler) if args.load else (0, 0)
    return train_loop(args, model, optimizer, config, first_step, scheduler, consumed, save=True)


if __name__ == "__main__":
    main(sys.argv[1:])
