"""Structure-aware optimizers on ragged shards: step time and state memory per rank.

    .venv/bin/python benchmarks/optimizers.py [--ranks 4] [--layers 4] [--d-model 256] [--only adamw,adamw8bit]

One GPT, sharded with each optimizer's granularity, on ``--ranks`` gloo ranks (or GPUs):
per optimizer the median optimizer-step time, the optimizer-state bytes on rank 0 and,
for Muon, the bytes each rank sends and its share of the Newton-Schulz work -- beside the
gather-everything Muon of FSDP2 / DeepSpeed-style integrations (every rank assembles every
full matrix and orthogonalises all of them).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import vescale_zero as vz
from vescale_zero.optim import AdamW8bit, Muon, Shampoo
from vescale_zero.optim.muon import newton_schulz
from vescale_zero.testing import GPT, GPTConfig, SyntheticCorpus


class GatherEverythingMuon(Muon):
    """The baseline: every full matrix on every rank (one all-reduce of zero-filled pieces
    each), Newton-Schulz on all of them everywhere, each rank keeps its piece."""

    def _muon_step(self, muon, while_moving=lambda: None):
        while_moving()
        sent = 0
        for p, group in muon:
            state = self.state[p]
            buf = state.setdefault("momentum_buffer", torch.zeros_like(p, dtype=torch.float32))
            buf.mul_(group["momentum"]).add_(p.grad.float())
            direction = p.grad.float().add(buf, alpha=group["momentum"])
            rng = p.sharded_range
            m, n = rng.shape[0], p.sharded_range.shape[1] if len(rng.shape) > 1 else 1
            full = torch.zeros(m * n, device=p.device)
            full[rng.start:rng.end] = direction
            dist.all_reduce(full, group=self.process_group)
            sent += 4 * full.numel()
            ortho = newton_schulz(full.view(m, n), group["ns_steps"]) * max(1.0, m / n) ** 0.5
            if group["weight_decay"]:
                p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(ortho.reshape(-1)[rng.start:rng.end].view_as(p), alpha=-group["lr"])
        total = sum(p.sharded_range.shape[0] * p.sharded_range.shape[1] * min(p.sharded_range.shape[:2])
                    for p, _ in muon)
        self.last_step_stats = {"ns_cost": [float(total)] * dist.get_world_size(self.process_group),
                                "bytes_moved": sent,
                                "ns_share_max": 1.0}  # every rank orthogonalises every matrix


VARIANTS = {
    "adamw": (None, lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
    "adamw8bit": (AdamW8bit.granularity(256), lambda ps: AdamW8bit(ps, lr=1e-3, block=256)),
    "shampoo": (Shampoo.granularity(64), lambda ps: Shampoo(ps, lr=1e-3, block=64, update_freq=10)),
    "muon": (None, lambda ps: Muon(ps, lr=0.02)),
    "muon-gather-all": (None, lambda ps: GatherEverythingMuon(ps, lr=0.02)),
}


def worker(rank, world, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    cfg = GPTConfig(vocab_size=512, seq_len=32, d_model=args.d_model, n_layers=args.layers, n_heads=8)
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)
    rows = {}
    for name, (granularity, make) in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        vz.fully_shard_layers(model, granularity=granularity)
        opt = make([p for p in model.parameters() if p.requires_grad])
        times = []
        for step in range(args.steps):
            x, y = (t.to(device) for t in corpus.batch(step, 8 * world, rank, world))
            model(x, y).backward()
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            times.append(time.perf_counter() - t0)
            opt.zero_grad()
        state = sum(t.numel() * t.element_size() for s in opt.state.values() for v in s.values()
                    for t in ([v] if torch.is_tensor(v)
                              else [b for blk in v for b in blk.values()] if isinstance(v, list) else []))
        stats = getattr(opt, "last_step_stats", {})
        rows[name] = {"ms": 1e3 * statistics.median(times[1:]), "state_mib": state / 2**20,
                      "moved_mib": stats.get("bytes_moved", 0) / 2**20,
                      "ns_max_share": stats.get("ns_share_max", max(stats["ns_cost"]) / sum(stats["ns_cost"]))
                      if stats.get("ns_cost") else None}
        del model, opt
    if rank == 0:
        out.update(rows)
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--only", type=lambda s: s.split(","), default=None,
                   help=f"comma-separated optimizers to time (default all: {','.join(VARIANTS)})")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(worker, args=(args.ranks, port, args, out), nprocs=args.ranks)
    print(f"\n{args.ranks} ranks, {'NCCL' if torch.cuda.is_available() else 'gloo CPU'}, "
          f"GPT {args.layers}x{args.d_model}, median optimizer step over {args.steps - 1} steps")
    print(f"{'optimizer':16s} {'step ms':>8s} {'state MiB/rank':>15s} {'sent MiB/rank':>14s} {'NS share max':>13s}")
    for name, r in out.items():
        share = f"{r['ns_max_share']:.3f}" if r["ns_max_share"] is not None else "-"
        print(f"{name:16s} {r['ms']:8.1f} {r['state_mib']:15.2f} {r['moved_mib']:14.2f} {share:>13s}")
    if "muon" in out and "muon-gather-all" in out:
        a, b = out["muon"], out["muon-gather-all"]
        print(f"muon vs gather-everything: step {a['ms'] / b['ms']:.3f}x, "
              f"bytes sent {a['moved_mib'] / max(b['moved_mib'], 1e-9):.3f}x, "
              f"largest Newton-Schulz share {a['ns_max_share']:.3f} vs {b['ns_max_share']:.3f} (everyone does all)")


if __name__ == "__main__":
    main()
