"""8-bit AdamW against fp32 AdamW: one training curve each, on one process.

    .venv/bin/python benchmarks/adamw8bit_curve.py [--steps 600] [--block 256] [--lr 3e-3]

A small GPT (``vescale_zero.testing.GPT``) on the synthetic corpus, the same initial weights
and batches for both optimizers (same betas, eps, weight decay). Prints the loss every
``--every`` steps (mean over the last ``--every`` steps) for each, and the gap
``8-bit - fp32`` (absolute and relative) at each point and over the last 100 steps.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List

import torch

from vescale_zero.optim import AdamW8bit
from vescale_zero.testing import GPT, GPTConfig, SyntheticCorpus


def curve(make: Callable, cfg: GPTConfig, steps: int, batch: int) -> List[float]:
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)
    model = GPT(cfg)
    opt = make(model.parameters())
    losses = []
    for step in range(steps):
        loss = model(*corpus.global_batch(step, batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=64, seq_len=32, d_model=args.d_model, n_layers=args.layers, n_heads=4)
    kw = dict(lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    runs: Dict[str, List[float]] = {}
    for name, make in (("fp32", lambda ps: torch.optim.AdamW(ps, **kw)),
                       ("8bit", lambda ps: AdamW8bit(ps, block=args.block, **kw))):
        t0 = time.perf_counter()
        runs[name] = curve(make, cfg, args.steps, args.batch)
        print(f"{name}: {args.steps} steps in {time.perf_counter() - t0:.1f} s")
    print(f"\nGPT {args.layers}x{args.d_model}, batch {args.batch}, lr {args.lr}, block {args.block}")
    print(f"{'step':>6s} {'fp32':>8s} {'8bit':>8s} {'gap':>9s} {'gap %':>7s}")
    for end in range(args.every, args.steps + 1, args.every):
        a = statistics.fmean(runs["fp32"][end - args.every:end])
        b = statistics.fmean(runs["8bit"][end - args.every:end])
        print(f"{end:6d} {a:8.4f} {b:8.4f} {b - a:+9.4f} {100 * (b - a) / a:+7.2f}")
    a, b = statistics.fmean(runs["fp32"][-100:]), statistics.fmean(runs["8bit"][-100:])
    print(f"last 100 steps: fp32 {a:.4f}, 8bit {b:.4f}, gap {b - a:+.4f} ({100 * (b - a) / a:+.2f}%)")


if __name__ == "__main__":
    main()
