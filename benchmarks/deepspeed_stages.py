"""DeepSpeed "ragged" vs ZeRO-3 vs stage 0 on the same model: ms/step and peak memory per rank.

    .venv/bin/python benchmarks/deepspeed_stages.py [--ranks 2] [--cycles 2]

Each variant runs in fresh processes (so that peak memory is its own), the variants cycle
A B C A B C, fp32 on gloo (or NCCL when CUDA is present). Memory: on GPU the CUDA
allocator's peak; on CPU the growth of the process's peak RSS over its RSS just before
the model is built (what the model, its gradients, optimizer state and transient
buffers added), on rank 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import socket
import statistics
import time
from typing import Dict, List

import torch
import torch.multiprocessing as mp
from tqdm import tqdm

VARIANTS = ("ragged", 3, 0)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(rank: int, world: int, port: int, stage, args: argparse.Namespace, out: Dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    import vescale_zero.integrations.deepspeed  # noqa: F401
    from vescale_zero.testing import GPT, GPTConfig, SyntheticCorpus

    if not cuda:
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    cfg = GPTConfig(vocab_size=1024, seq_len=64, d_model=args.d_model, n_layers=args.layers, n_heads=8)
    gc.collect()
    base = _rss_mib()
    ds_cfg = {
        "train_batch_size": args.global_batch, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=GPT(cfg), config=ds_cfg)
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)
    times: List[float] = []
    for step in range(args.warmup + args.steps):
        x, y = (t.to(engine.device) for t in corpus.batch(step, args.global_batch, rank, world))
        torch.distributed.barrier()
        t0 = time.perf_counter()
        engine.backward(engine(x, y))
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        torch.distributed.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() / 2**20 if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base)
    if rank == 0:
        out[str(stage)] = out.get(str(stage), []) + [{"times": times, "peak_mib": peak}]
    del engine
    gc.collect()
    torch.distributed.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--cycles", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--json", help="also write raw results here")
    args = p.parse_args()
    with mp.Manager() as manager:
        out = manager.dict()
        runs = [(c, v) for c in range(args.cycles) for v in VARIANTS]
        for _, stage in tqdm(runs, desc="runs (A B C A B C)"):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.spawn(worker, args=(args.ranks, port, stage, args, out), nprocs=args.ranks)
        results = dict(out)
    rows = {}
    for v in VARIANTS:
        runs_v = results[str(v)]
        ms = [1e3 * t for r in runs_v for t in r["times"]]
        rows[v] = (statistics.median(ms), min(ms), max(ms), statistics.median(r["peak_mib"] for r in runs_v))
    dev = "CUDA peak allocated" if torch.cuda.is_available() else "peak RSS growth, rank 0"
    print(f"\n{args.ranks} ranks, fp32, GPT {args.layers}x{args.d_model} (vocab 1024), "
          f"global batch {args.global_batch}, {args.cycles} cycles x {args.steps} steps")
    print(f"{'stage':8s} {'median ms':>10s} {'min':>8s} {'max':>8s} {'memory MiB':>11s} "
          f"{'ragged/x time':>14s} {'ragged/x mem':>13s}")
    for v, (med, lo, hi, mem) in rows.items():
        print(f"{str(v):8s} {med:10.1f} {lo:8.1f} {hi:8.1f} {mem:11.0f} "
              f"{rows['ragged'][0] / med:14.3f} {rows['ragged'][3] / mem:13.3f}")
    print(f"(memory: {dev})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f)


if __name__ == "__main__":
    main()
