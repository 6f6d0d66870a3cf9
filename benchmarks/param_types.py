"""What DTensor parameters cost: the optimizer step on ``RaggedDTensor`` parameters vs on
plain 1-D tensors (the representation before sharded parameters became DTensors), same run,
and the same pair for PyTorch FSDP2 (its ``Shard(0)`` DTensor parameters vs plain views of
its own shards).

    .venv/bin/python benchmarks/param_types.py [--ranks 2] [--rounds 7] [--layers 4] [--d-model 256]
        [--systems vescale fsdp2]

Both optimizers of a pair step the *same storage*: the plain one holds ``nn.Parameter``
views of the DTensors' local pieces (what the sharded parameters were before), with the same
gradients (the local pieces of the DTensor gradients). So the only difference measured is
the DTensor dispatch (``vescale_zero.primitives.ragged_tensor`` [Note: ops on ragged tensors]; for
FSDP2, torch's DTensor dispatch). The variants run interleaved, each round every system and
optimizer kind both ways; printed: median ms per optimizer step and per training step
(forward + backward + step), and the ratio DTensor / plain: the median of each round's ratio
(the pair ran back to back, so a slower stretch of a shared machine moves both). Absolute
times on a shared machine are noise: read the ratios.

Where the DTensor step still costs more than the plain one, it is per tensor, not per
element. torch's element-wise optimizers step the local pieces directly
(``vescale_zero.api.local_optim_steps``): what is left is one pass over the lists, and torch's
own ``_init_group`` reading ``p.grad``, ``torch.is_complex(p)``, ``p.device`` of a tensor
subclass (about 0.1-0.3 us more per read than of an ``nn.Parameter``, which torch
special-cases; any subclass pays it, FSDP2's DTensors too). FSDP2's DTensors take torch's
dispatch for every op: about 0.6 us per tensor in each list, and a wrapper per output of
an out-of-place op. The ratio falls as tensors grow (``--d-model``), and on a GPU that host
time overlaps the kernels already queued.
"""

from __future__ import annotations

import argparse
import importlib
import os
import socket
import statistics
import time
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import vescale_zero as vz
from vescale_zero.testing import GPT, GPTConfig, SyntheticCorpus

KINDS = {
    # torch's default on a CPU: the per-tensor path (about 8 ops per parameter, each dispatched)
    "AdamW default": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "AdamW foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "SGD momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=True),
}


def _vescale(model: torch.nn.Module) -> torch.nn.Module:
    vz.fully_shard_layers(model)
    return model


def _fsdp2(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


SYSTEMS = {"vescale": _vescale, "fsdp2": _fsdp2}


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    cfg = GPTConfig(vocab_size=512, seq_len=64, d_model=args.d_model, n_layers=args.layers, n_heads=8)
    models = {system: build(GPT(cfg)) for system, build in SYSTEMS.items() if system in args.systems}
    params = {}
    for system, model in models.items():
        sharded = [p for p in model.parameters() if p.requires_grad]
        params[system] = (sharded, [torch.nn.Parameter(p.to_local()) for p in sharded])  # views of the same shards
    opts = {(system, kind, rep): make(params[system][rep == "plain"]) for system in models
            for kind, make in KINDS.items() for rep in ("dtensor", "plain")}
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)
    times: Dict[tuple, List[float]] = {(key, part): [] for key in opts for part in ("opt", "step")}
    timing: Dict[str, float] = {}  # --breakdown: seconds spent in each part of the step under way
    if args.breakdown:
        _time_parts(opts, timing)
    step = 0
    for round_ in range(args.rounds + 1):  # round 0 warms up (optimizer state, allocator)
        for key, opt in opts.items():
            system, _, rep = key
            model, (sharded, plain) = models[system], params[system]
            x, y = corpus.batch(step, 8 * world, rank, world)
            step += 1
            dist.barrier()
            t0 = time.perf_counter()
            model(x, y).backward()
            if rep == "plain":
                for p, q in zip(sharded, plain):
                    q.grad = None if p.grad is None else p.grad.to_local()
            timing.clear()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            opt.zero_grad()
            model.zero_grad()
            dist.barrier()
            if round_:
                times[(key, "opt")].append(t2 - t1)
                times[(key, "step")].append(t2 - t0)
                for part, seconds in timing.items():
                    times.setdefault((key, part), []).append(seconds)
    if rank == 0:
        out.update({k: statistics.median(v) for k, v in times.items()})
        for system in models:  # each round's DTensor / plain ratio: the pair ran back to back
            for kind in KINDS:
                for part in ("opt", "step"):
                    pairs = zip(times[((system, kind, "dtensor"), part)], times[((system, kind, "plain"), part)])
                    out[((system, kind), part, "paired")] = statistics.median(d / p for d, p in pairs)
    dist.destroy_process_group()


def _time_parts(opts: Dict[tuple, torch.optim.Optimizer], timing: Dict[str, float]) -> None:
    """``--breakdown``: times torch's ``_init_group`` (the lists built from ``p.grad`` and the
    state), the functional (``torch.optim.adam.adam`` / ``sgd.sgd``, with, for ragged
    parameters, vescale_zero's pass over the lists) and that pass alone, into ``timing``."""
    from vescale_zero.api import local_optim_steps

    def timed(fn, part):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timing[part] = timing.get(part, 0.0) + time.perf_counter() - t0
        return run

    for opt in opts.values():
        opt._init_group = timed(opt._init_group, "init")
    for name in ("adam", "sgd"):
        module = importlib.import_module(f"torch.optim.{name}")
        setattr(module, name, timed(getattr(module, name), "functional"))
    for name in ("_local_lists", "_hand_back"):
        setattr(local_optim_steps, name, timed(getattr(local_optim_steps, name), "unwrap"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--systems", nargs="+", choices=tuple(SYSTEMS), default=list(SYSTEMS))
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the parts of each optimizer step (torch's _init_group, the functional, "
                             "vescale_zero's pass over the lists): where a DTensor step's extra time goes")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(worker, args=(args.ranks, port, args, out), nprocs=args.ranks)
    print(f"GPT {args.layers} x {args.d_model}, {args.ranks} ranks (gloo, CPU), median of {args.rounds} rounds")
    print("ratio: DTensor / plain, the median over rounds of each round's pair (run back to back)")
    print(f"{'system':<8} {'optimizer':<14} {'opt ms DTensor':>15} {'opt ms plain':>13} {'ratio':>6} "
          f"{'step ms DTensor':>16} {'step ms plain':>14} {'ratio':>6}")
    for system in args.systems:
        for kind in KINDS:
            od, op = out[((system, kind, "dtensor"), "opt")] * 1e3, out[((system, kind, "plain"), "opt")] * 1e3
            sd, sp = out[((system, kind, "dtensor"), "step")] * 1e3, out[((system, kind, "plain"), "step")] * 1e3
            ro, rs = out[((system, kind), "opt", "paired")], out[((system, kind), "step", "paired")]
            print(f"{system:<8} {kind:<14} {od:>15.2f} {op:>13.2f} {ro:>6.3f} {sd:>16.2f} {sp:>14.2f} {rs:>6.3f}")
    if args.breakdown:
        print("\nwhere the optimizer step goes, us (median): DTensor / plain; 'unwrap' is vescale_zero's pass over the "
              "lists (inside 'functional'); 'other' is the step minus _init_group and the functional")
        print(f"{'system':<8} {'optimizer':<14} {'_init_group':>15} {'functional':>17} {'unwrap':>7} {'other':>13}")
        for system in args.systems:
            for kind in KINDS:
                us = {rep: {part: out.get(((system, kind, rep), part), 0.0) * 1e6
                            for part in ("opt", "init", "functional", "unwrap")} for rep in ("dtensor", "plain")}
                other = {rep: u["opt"] - u["init"] - u["functional"] for rep, u in us.items()}
                d, p = us["dtensor"], us["plain"]
                print(f"{system:<8} {kind:<14} {d['init']:>7.0f} / {p['init']:<5.0f} {d['functional']:>8.0f} / "
                      f"{p['functional']:<6.0f} {d['unwrap']:>7.0f} {other['dtensor']:>5.0f} / {other['plain']:<5.0f}")


if __name__ == "__main__":
    main()
