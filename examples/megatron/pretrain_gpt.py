"""Pretrain a GPT with megatron-core, with Megatron-style arguments and ``--use-vescale-fsdp``.

    torchrun --nproc-per-node 8 examples/megatron/pretrain_gpt.py @configs/megatron/gpt_vescale.args

Built on megatron-core alone (Megatron-LM is not on the package index); the flags keep
Megatron-LM's names, so an argument file moves between the two. Tensor and pipeline
parallelism, schedules, ``finalize_model_grads`` and mixed precision (``Float16Module``)
are megatron-core's; only the data-parallel wrapper and the optimizer change with
``--use-vescale-fsdp`` (``VeScaleFSDP`` + ``get_vescale_optimizer`` instead of
``DistributedDataParallel`` + ``get_megatron_optimizer``). Data: a synthetic corpus of
repeated phrases, so the loss falls quickly.

Runs on GPUs (NCCL). megatron-core itself calls CUDA unconditionally, so on CPU it runs
only inside our tests, behind a test-only shim (``tests/megatron_shim.py``).

An argument file (``@FILE``) may hold one flag and its value per line, as
``configs/megatron/gpt_vescale.args`` does; ``#`` starts a comment. Flags after it on the
command line override it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

from vescale_zero.integrations.megatron import (
    VeScaleFSDP,
    add_vescale_fsdp_args,
    get_vescale_optimizer,
    validate_vescale_args,
    vescale_optimizer_block,
    vescale_optimizer_name,
    vescale_options_from_args,
)
from vescale_zero.integrations.megatron.arguments import warn_once
from vescale_zero.testing import SyntheticCorpus


def argument_file_line(line: str) -> List[str]:
    """The arguments on one line of an ``@FILE``: split as a shell would (``--lr 3e-4`` is two
    arguments, quotes group), ``#`` to the end of the line ignored. argparse's default reads
    one argument per line, which turns ``--num-layers 8`` into a single unknown argument."""
    return shlex.split(line, comments=True)


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
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--init-model-with-meta-device", action="store_true",
                   help="build the model on the meta device; VeScaleFSDP materialises it group by group")
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
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=8)
    g.add_argument("--train-iters", type=int, default=20)
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=int, default=1)
    add_vescale_fsdp_args(p)
    return p


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def transformer_config(args: argparse.Namespace) -> TransformerConfig:
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    moe: Dict[str, Any] = {}
    if args.num_experts:
        moe = dict(num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                   moe_token_dispatcher_type=args.moe_token_dispatcher_type, moe_aux_loss_coeff=0.0,
                   expert_model_parallel_size=args.expert_model_parallel_size)
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel, params_dtype=dtype, bf16=args.bf16, fp16=args.fp16,
        pipeline_dtype=dtype, use_cpu_initialization=not torch.cuda.is_available(),
        init_model_with_meta_device=args.init_model_with_meta_device,
        add_bias_linear=args.add_bias_linear, gradient_accumulation_fusion=False, hidden_dropout=0.0,
        attention_dropout=0.0,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers, recompute_modules=args.recompute_modules, **moe,
    )


def build_model_unwrapped(args: argparse.Namespace, config: TransformerConfig) -> torch.nn.Module:
    """This pipeline stage's ``GPTModel`` (inside ``Float16Module`` under bf16/fp16)."""
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False)
    # As Megatron-LM's get_model: under --init-model-with-meta-device the model is built on
    # meta and stays there; VeScaleFSDP materialises it (integrations/megatron/meta_init.py).
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
    """The model chunk in its data-parallel wrapper: ``VeScaleFSDP`` or Megatron's DDP."""
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
        return VeScaleFSDP(config, ddp_config, model, options=vescale_options_from_args(args))
    return DistributedDataParallel(config, ddp_config, model)


def optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        clip_grad=args.clip_grad, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        bf16=args.bf16, fp16=args.fp16, use_distributed_optimizer=args.use_distributed_optimizer,
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
    ``VeScaleFSDP`` and ``VeScaleOptimizer`` with ``--use-vescale-fsdp``."""
    seed(args)
    config = transformer_config(args)
    model = build_model(args, config)
    opt_config = optimizer_config(args)
    if args.min_lr:
        warn_once("--min-lr", f"--min-lr {args.min_lr} has no effect in this example: it runs no learning-rate "
                  f"scheduler, so the learning rate stays --lr {args.lr} (Megatron-LM's OptimizerParamScheduler "
                  "decays towards --min-lr)")
    if args.use_vescale_fsdp:
        name = vescale_optimizer_name(args)
        optimizer = get_vescale_optimizer(opt_config, [model], optimizer=name,
                                          block=vescale_optimizer_block(args) if name else None)
    else:
        optimizer = get_megatron_optimizer(opt_config, [model])
    return model, optimizer, config


def train_loop(
    args: argparse.Namespace, model: torch.nn.Module, optimizer: Any, config: TransformerConfig, first_step: int = 0
) -> Dict[str, List]:
    """``--train-iters`` iterations of Megatron's schedule: ``{"losses": [...] (last
    pipeline stage, mean over data parallel), "grad_norms": [...]}``."""
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    dp_size = parallel_state.get_data_parallel_world_size()
    if args.global_batch_size % (args.micro_batch_size * dp_size):
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} is not a multiple of --micro-batch-size x data-parallel "
            f"size ({args.micro_batch_size} x {dp_size})"
        )
    num_microbatches = args.global_batch_size // (args.micro_batch_size * dp_size)
    forward_backward = get_forward_backward_func()
    losses, norms, times = [], [], []
    printer = dist.get_rank() == dist.get_world_size() - 1  # a last-stage rank prints
    for step in range(first_step, args.train_iters):
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        out = forward_backward(
            forward_step_func=forward_step, data_iterator=iter(batches(args, step, num_microbatches)), model=[model],
            num_microbatches=num_microbatches, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
        ok, grad_norm, _ = optimizer.step()
        times.append(time.perf_counter() - start)
        norms.append(float(grad_norm) if grad_norm is not None else None)
        if parallel_state.is_pipeline_last_stage():
            loss = torch.stack([o["lm loss"] for o in out]).mean()
            dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
            losses.append(loss.item() / dp_size)
            if printer and step % args.log_interval == 0:
                norm = f"{grad_norm:.4f}" if grad_norm is not None else "n/a"
                print(f"iteration {step + 1:4d}/{args.train_iters} | lm loss {losses[-1]:.4f} | grad norm {norm} | "
                      f"{1e3 * times[-1]:.1f} ms{'' if ok else ' | skipped (overflow)'}", flush=True)
    if printer and losses:
        wrapper = "VeScaleFSDP (ragged)" if args.use_vescale_fsdp else "DistributedDataParallel"
        print(f"done: {wrapper}, tp={args.tensor_model_parallel_size} pp={args.pipeline_model_parallel_size} "
              f"dp={dp_size}, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
              f"median {1e3 * statistics.median(times):.1f} ms/iteration", flush=True)
    return {"losses": losses, "grad_norms": norms}


def main(argv: Optional[List[str]] = None) -> Dict[str, List]:
    args = build_parser().parse_args(argv)
    setup(args)
    model, optimizer, config = build(args)
    return train_loop(args, model, optimizer, config)


if __name__ == "__main__":
    main(sys.argv[1:])
