"""Step time with and without offload, ours beside its peers with the same offload, in one run.

    .venv/bin/python benchmarks/offload.py [--ranks 2] [--cycles 2] [--steps 6] [--d-model 256]
        [--layers 4] [--systems vescale fsdp2 zero3 ragged] [--nvme-dir /tmp/offload_nvme]

Systems, each without and with offload (rows ``*_off``; ``*_nvme`` with optimizer state in files):

* ``vescale``: ``vz.fully_shard_layers``; offloaded with ``CPUOffloadPolicy``;
* ``fsdp2``: torch's ``fully_shard`` per block and root; offloaded with its ``CPUOffloadPolicy``
  (``pin_memory=False`` on a CPU-only machine: pinning needs an accelerator);
* ``zero3``: DeepSpeed ``"stage": 3``; offloaded with ``offload_optimizer`` + ``offload_param``
  to ``cpu`` (DeepSpeed's CPU Adam, as its docs configure it); ``_nvme``: ``offload_optimizer``
  to ``nvme`` (needs DeepSpeed's async I/O op; skipped with the reason where it does not build);
* ``ragged``: the same DeepSpeed configs with ``"stage": "ragged"``.

Every system trains the same GPT on the same data with AdamW (lr 1e-3), fp32, on gloo/CPU (NCCL
when GPUs are present); the variants cycle A B C ... A B C ..., each in fresh processes.
Reported: the median ms/step of rank 0 over every timed step of every cycle (spread: min-max of
the per-cycle medians), and two ratios computed from those medians: ``/no offload`` (the same
system without offload) and ``/peer`` (ours against the peer with the same offload: vescale
against FSDP2, ragged against ZeRO-3). On a CPU the "host" is the device: offload adds its
copies and moves no bytes across a bus, so the ratios show the cost of the mechanism, not of
PCIe.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEMS = ("vescale", "fsdp2", "zero3", "ragged")
PEER = {"vescale": "fsdp2", "ragged": "zero3"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _deepspeed_config(stage, offload: str, batch: int, nvme_dir: str) -> dict:
    zero: Dict = {"stage": stage}
    if offload == "off":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    elif offload == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": True}
    optimizer = {"type": "AdamW", "params": {"lr": 1e-3}}
    if offload == "none":
        optimizer["params"]["torch_adam"] = True
    return {"train_batch_size": batch, "gradient_accumulation_steps": 1, "optimizer": optimizer,
            "zero_optimization": zero, "steps_per_print": 10**9}


def build(system: str, offload: str, cfg, device: torch.device, args) -> tuple:
    """``(model or engine, optimizer or None, engine or None)``; ``offload``: none, off (cpu), nvme."""
    from vescale_zero.testing import GPT

    model = GPT(cfg).to(device)
    if system == "vescale":
        from torch.distributed.fsdp import CPUOffloadPolicy

        import vescale_zero as vz

        policy = CPUOffloadPolicy(pin_memory=device.type != "cpu") if offload == "off" else None
        vz.fully_shard_layers(model, granularity="row", offload_policy=policy)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3), None
    if system == "fsdp2":
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        kw = {"offload_policy": CPUOffloadPolicy(pin_memory=device.type != "cpu")} if offload == "off" else {}
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3), None
    import deepspeed

    import vescale_zero.integrations.deepspeed  # noqa: F401

    stage = 3 if system == "zero3" else "ragged"
    config = _deepspeed_config(stage, offload, args.global_batch, os.path.join(args.nvme_dir, f"rank{dist.get_rank()}"))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, None, engine


def worker(rank: int, world: int, port: int, system: str, offload: str, args, out: Dict) -> None:
    from peers import start_rank, train_step  # benchmarks/peers.py

    cuda = torch.cuda.is_available()
    # cpu:gloo beside NCCL: torch's clip / full_tensor on host-side parameters (README, Offload)
    device = start_rank(rank, world, port, system in ("zero3", "ragged"), nccl="cpu:gloo,cuda:nccl")
    from vescale_zero.testing import GPTConfig, SyntheticCorpus

    cfg = GPTConfig(vocab_size=512, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=8)
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)
    try:
        model, opt, engine = build(system, offload, cfg, device, args)
    except Exception as error:  # a configuration this machine cannot run: reported, not hidden
        if rank == 0:
            out["skipped"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        dist.destroy_process_group()
        return

    def step(i: int) -> None:
        train_step(model, opt, engine, *(t.to(device) for t in corpus.batch(i, args.global_batch, rank, world)))

    for i in range(args.warmup):
        step(i)
    times: List[float] = []
    for i in range(args.warmup, args.warmup + args.steps):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(i)
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    if rank == 0:
        out["times"] = times
    dist.destroy_process_group()


def run(system: str, offload: str, args) -> Dict:
    manager = mp.Manager()
    out = manager.dict()
    try:
        mp.start_processes(worker, args=(args.ranks, _free_port(), system, offload, args, out), nprocs=args.ranks,
                           join=True, start_method="spawn")
    except mp.ProcessExitedException:
        # gloo sometimes aborts a process at exit, after its work (environment.md): keep a finished
        # run's figures, re-raise otherwise
        if "times" not in out and "skipped" not in out:
            raise
    return dict(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--nvme", action="store_true", help="also the DeepSpeed systems with optimizer state in files")
    parser.add_argument("--nvme-dir", default=os.path.join(tempfile.gettempdir(), "vescale_offload_nvme"))
    args = parser.parse_args(argv)
    sys.path.insert(0, REPO)
    variants = [(s, o) for s in args.systems for o in ("none", "off")]
    if args.nvme:
        variants += [(s, "nvme") for s in args.systems if s in ("zero3", "ragged")]
    per_cycle: Dict[tuple, List[float]] = {v: [] for v in variants}
    steps: Dict[tuple, List[float]] = {v: [] for v in variants}
    skipped: Dict[tuple, str] = {}
    for _ in range(args.cycles):
        for v in variants:
            if v in skipped:
                continue
            result = run(*v, args)
            if "skipped" in result:
                skipped[v] = result["skipped"]
                continue
            steps[v] += result["times"]
            per_cycle[v].append(statistics.median(result["times"]))
    med = {v: statistics.median(t) for v, t in steps.items() if t}
    print(f"\n{args.ranks} ranks, GPT {args.layers}x{args.d_model}, seq {args.seq_len}, global batch "
          f"{args.global_batch}, fp32 AdamW, {args.cycles} cycles x {args.steps} steps "
          f"({'NCCL' if torch.cuda.is_available() else 'gloo, CPU'})")
    print(f"{'system':<16s} {'ms/step':>9s} {'spread':>15s} {'/no offload':>12s} {'/peer':>7s}")
    for system, offload in variants:
        name = system + ("" if offload == "none" else f"_{offload}")
        if (system, offload) in skipped:
            print(f"{name:<16s} skipped: {skipped[(system, offload)]}")
            continue
        if (system, offload) not in med:
            continue
        m = med[(system, offload)]
        spread = f"{min(per_cycle[(system, offload)]):.1f}-{max(per_cycle[(system, offload)]):.1f}"
        base = med.get((system, "none"))
        peer = med.get((PEER.get(system, ""), offload))
        print(f"{name:<16s} {m:9.1f} {spread:>15s} {m / base if base else float('nan'):12.3f} "
              f"{m / peer if peer else float('nan'):7.3f}")


if __name__ == "__main__":
    main()
