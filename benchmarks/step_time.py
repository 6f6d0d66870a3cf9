"""Step time of the same GPT under DDP, PyTorch FSDP2 and vescale-zero, in one run.

    .venv/bin/python benchmarks/step_time.py [--ranks 2] [--rounds 6] [--json out.json]

The variants run interleaved (A B C A B C ...) on the same ranks, model, data and AdamW,
fp32 on gloo (CPU) or NCCL (one GPU per rank), so that machine noise hits all of them
alike; medians, spreads and ratios are printed. Absolute times on shared machines are
noise: compare the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from peers import build_variant  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from tqdm import tqdm

from vescale_zero.testing import GPTConfig, SyntheticCorpus

VARIANTS = ("ddp", "fsdp2", "vescale")


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    cfg = GPTConfig(vocab_size=512, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=8)
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)
    setups = {v: build_variant(v, cfg, device, args)[:2] for v in VARIANTS}
    times: Dict[str, List[float]] = {v: [] for v in VARIANTS}
    step = 0

    def run(variant: str, n: int, record: bool) -> None:
        nonlocal step
        model, opt = setups[variant]
        for _ in range(n):
            x, y = (t.to(device) for t in corpus.batch(step, args.global_batch, rank, world))
            dist.barrier()
            t0 = time.perf_counter()
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            if use_cuda:
                torch.cuda.synchronize()
            dist.barrier()
            if record:
                times[variant].append(time.perf_counter() - t0)
            step += 1

    for v in VARIANTS:
        run(v, args.warmup, record=False)
    rounds = tqdm(range(args.rounds), desc="interleaved rounds", disable=rank != 0)
    for _ in rounds:
        for v in VARIANTS:
            run(v, args.steps, record=True)
    if rank == 0:
        out.update({v: times[v] for v in VARIANTS})
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=4, help="timed steps per variant per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--json", help="also write the raw times and the summary here")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(args.ranks, port, args, out), nprocs=args.ranks)
        times = dict(out)
    tokens = args.global_batch * args.seq_len
    summary = {}
    for v in VARIANTS:
        ms = [1e3 * t for t in times[v]]
        summary[v] = {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms),
                      "tokens_per_s": tokens / (statistics.median(ms) / 1e3)}
    for v in VARIANTS:  # step-time ratios: below 1 is faster than the reference
        summary[v]["vs_fsdp2"] = summary[v]["median_ms"] / summary["fsdp2"]["median_ms"]
        summary[v]["vs_ddp"] = summary[v]["median_ms"] / summary["ddp"]["median_ms"]
    print(f"\n{args.ranks} ranks, {'NCCL' if torch.cuda.is_available() else 'gloo CPU'}, fp32, "
          f"GPT {args.layers}x{args.d_model}, seq {args.seq_len}, global batch {args.global_batch}, "
          f"{args.rounds} rounds x {args.steps} steps interleaved")
    print(f"{'variant':10s} {'median ms':>10s} {'min':>8s} {'max':>8s} {'tokens/s':>10s} {'/fsdp2':>8s} {'/ddp':>8s}")
    for v in VARIANTS:
        s = summary[v]
        print(f"{v:10s} {s['median_ms']:10.1f} {s['min_ms']:8.1f} {s['max_ms']:8.1f} {s['tokens_per_s']:10.0f} "
              f"{s['vs_fsdp2']:8.3f} {s['vs_ddp']:8.3f}")
    print("/fsdp2, /ddp: median step time over that of FSDP2, DDP (below 1: faster)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "times_s": times}, f, indent=1)


if __name__ == "__main__":
    main()
