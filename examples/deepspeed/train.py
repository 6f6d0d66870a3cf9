r"""A DeepSpeed training script that switches to ragged sharding by its config alone.

    torchrun --standalone --nproc-per-node 2 examples/deepspeed/train.py \
        --deepspeed_config configs/deepspeed/ragged.json
    deepspeed --num_gpus 2 examples/deepspeed/train.py --deepspeed_config configs/deepspeed/zero3.json

The only line a DeepSpeed user adds is the ``vescale_zero.integrations.deepspeed`` import.
Runs on GPUs (NCCL) or, without CUDA, on CPU processes (gloo).
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402

import vescale_zero.integrations.deepspeed  # noqa: E402,F401  (registers "stage": "ragged")
from vescale_zero.testing import GPT, GPTConfig, SyntheticCorpus  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skip a 40 s JIT build on CPU
    deepspeed.init_distributed()

    cfg = GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_layers=4, n_heads=4)
    engine, _, _, _ = deepspeed.initialize(args=args, model=GPT(cfg))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = corpus.batch(step, micro * accum * world, rank, world)
        for i in range(accum):
            loss = engine(x.chunk(accum)[i].to(engine.device), y.chunk(accum)[i].to(engine.device))
            engine.backward(loss)
            engine.step()
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}  lr {engine.get_lr()[0]:.2e}", flush=True)
    if rank == 0:
        stage = engine.zero_optimization_stage() if not hasattr(engine, "ragged_options") else "ragged"
        print(f"done: {args.steps} steps, stage {stage}, {1e3 * (time.perf_counter() - t0) / args.steps:.1f} ms/step")
    # Tear gloo/NCCL down while everything is alive: left to interpreter exit, destroying a
    # gloo group can abort the process (seen with torch 2.13, with or without vescale-zero).
    del engine
    gc.collect()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
