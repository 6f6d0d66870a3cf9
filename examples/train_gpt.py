"""Train a small GPT with ragged sharding: the project's main job.

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \
        examples/train_gpt.py --shard 8        # HSDP: shard inside each node, replicate across

Runs on CPU (gloo) or GPU (NCCL, one GPU per process) with the same code. Prints the loss
of every step and a summary: padding, bytes gathered / scattered per step, ms per step.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

import vescale_zero as vz
from vescale_zero.testing import GPT, GPTConfig, SyntheticCorpus


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--granularity", default="row", help="element | row | <N>rows | an int")
    p.add_argument("--mixed-precision", choices=["none", "bf16"], default="none")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--shard", type=int, default=0,
                   help="HSDP: shard over groups of this many ranks, replicate across them (default: all ranks)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    cfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers,
                    n_heads=args.heads)
    model = GPT(cfg).to(device)
    mesh = None
    if args.shard:
        if args.shard < 1 or world % args.shard:
            raise SystemExit(f"--shard {args.shard} must divide the {world} ranks (e.g. the GPUs per node)")
        mesh = init_device_mesh(device.type, (world // args.shard, args.shard), mesh_dim_names=("replicate", "shard"))
    granularity = int(args.granularity) if args.granularity.isdigit() else args.granularity
    mp = (vz.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if args.mixed_precision == "bf16" else None)
    for block in model.blocks:
        vz.fully_shard(block, mesh=mesh, granularity=granularity, mp_policy=mp)
    vz.fully_shard(model, mesh=mesh, granularity=granularity, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)

    times, losses = [], []
    bar = tqdm(range(args.steps), disable=rank != 0, desc="train", unit="step")
    for step in bar:
        if step == 1:
            vz.reset_comm_stats(model)  # count a steady-state step, not the first
        x, y = (t.to(device) for t in corpus.batch(step, args.global_batch, rank, world))
        t0 = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        vz.clip_grad_norm_(model, args.clip)
        opt.step()
        opt.zero_grad()
        reduced = loss.detach().float().clone()
        dist.all_reduce(reduced, op=dist.ReduceOp.AVG)
        if use_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(reduced.item())
        if rank == 0:
            bar.write(f"step {step:3d}  loss {losses[-1]:.4f}")

    rep = vz.sharding_report(model)
    steady = max(1, args.steps - 1)
    peak = (torch.cuda.max_memory_allocated() / 2**20 if use_cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if rank == 0:
        print(
            "\nsummary\n"
            f"  ranks {world} ({'nccl' if use_cuda else 'gloo'}), groups {rep.num_groups}, parameters {rep.numel:,}, "
            f"granularity {args.granularity}\n"
            f"  loss {losses[0]:.4f} -> {losses[-1]:.4f}\n"
            f"  padding {rep.padding:,} elements ({100 * rep.padding_ratio:.3f}%), "
            f"shard {rep.shard_numel:,} elements per rank\n"
            f"  per step: all-gathered {rep.bytes_all_gathered / steady / 2**20:.2f} MiB "
            f"({rep.all_gathers // steady} collectives), "
            f"reduce-scattered {rep.bytes_reduce_scattered / steady / 2**20:.2f} MiB "
            f"({rep.reduce_scatters // steady} collectives)\n"
            f"  ms/step median {1e3 * statistics.median(times[1:] or times):.1f} (first step {1e3 * times[0]:.1f})\n"
            f"  peak memory rank 0: {peak:.0f} MiB ({'CUDA allocated' if use_cuda else 'process max RSS'})"
        )
    # gloo's worker threads drop a finished collective's tensors a moment after wait()
    # returns; if that happens while this interpreter is already shutting down, the process
    # aborts ("terminate called without an active exception"). Leave together.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
