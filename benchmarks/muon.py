"""Muon on ragged shards against its peers: bytes per rank per step, step time, the optimizer's exposed time.

    .venv/bin/python benchmarks/muon.py                       # both parts
    .venv/bin/python benchmarks/muon.py --ranks 2 4 --steps 8 # part 1 only at those sizes
    .venv/bin/python benchmarks/muon.py --plan-only           # part 2 only

Bytes are what each rank receives per training step (planner [Note: bytes per rank per step]):
an all-gather or reduce-scatter of a buffer of B bytes over m ranks brings (m-1)/m*B into each
rank, an all-reduce 2*(m-1)/m*B, a reduce or broadcast (m-1)/m*B, an all_to_all what the other
ranks send this one; Muon's moves are the same in and out.

Part 1, real ranks on this machine (CPU/gloo, fp32, a GPT of 4 layers): every system trains the
same model from the same weights; per step and per rank the bytes all-gathered, reduce-scattered
(or all-reduced / reduced) and moved by the optimizer, counted by a spy on the collectives, the
median step time and the optimizer's exposed time (from the return of backward to the return of
``step()``). Systems: today's Muon (main's ``vescale_zero/optim/muon.py``, read with git: every
matrix to a root anywhere), ours
piecewise (the same plan, a matrix whole on one rank stays), ours placed (every matrix whole),
ours as the cost model chooses, the last two with the step hidden in backward, DeepSpeed
ZeRO-1/2 with its own Muon, and FSDP2 (measured, with a plain SGD step) plus torchtitan's
``dist_muon`` moves modelled from its source: ``DistMuon`` refuses a CPU device ("DistMuon
requires one CUDA device per process", torchtitan 0.3.0). Ours are checked against the plan: the
bytes each collective moved equal the bytes the plan predicts.

Part 2, the plan alone at 8, 64 and 1024 ranks for 4 Llama-3-8B layers and one DeepSeek-V3 MoE
layer, bf16 gathers, fp32 reductions and moves, for the same systems (peers' layouts from their
sources, and checked against part 1's measurements: FSDP2 pads dim 0 of each parameter to the
world size; DeepSpeed ZeRO-1 and ZeRO-2 all-reduce the gradients (ZeRO-2's default
``use_multi_rank_bucket_allreduce``; without it each flat partition is reduced to its owner and a
Muon matrix that partitions cut all-reduced) and all-gather the updated parameters once per step;
they hold the full parameters throughout, so they gather once per step where FSDP with
reshard_after_forward gathers twice).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import socket
import statistics
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import vescale_zero as vz  # noqa: E402
from vescale_zero.api.fully_shard import groups_of  # noqa: E402
from vescale_zero.optim import Muon  # noqa: E402
from vescale_zero.optim.muon import MuonLayout, assign_roots  # noqa: E402
from vescale_zero.primitives.planner import (  # noqa: E402
    OptimizerUnits,
    StepTraffic,
    TensorSpec,
    optimizer_aware_plan,
)
from vescale_zero.testing import GPT, GPTConfig, SyntheticCorpus  # noqa: E402
from vescale_zero.tools.model_shapes import layer_groups  # noqa: E402

KINDS = ("all_gather", "reduce", "optimizer")


# ---- counting bytes ------------------------------------------------------------------------
def received(kind: str, buffer_bytes: int, m: int) -> float:
    """What one rank receives for a collective on a buffer of ``buffer_bytes`` over ``m`` ranks."""
    return {"all_gather": 1, "reduce_scatter": 1, "reduce": 1, "broadcast": 1, "all_reduce": 2}[kind] \
        * (m - 1) / m * buffer_bytes


class TorchSpy:
    """Counts the bytes of every torch.distributed collective a peer (DeepSpeed, FSDP2) calls,
    by the names it calls them through (``torch.distributed.<name>``)."""

    NAMES = {"all_gather_into_tensor": ("all_gather", "output_tensor"),
             "_all_gather_base": ("all_gather", "output_tensor"),
             "all_gather_single": ("all_gather", "output_tensor"),
             "all_gather": ("all_gather", "tensor_list"),
             "reduce_scatter_tensor": ("reduce_scatter", "input"),
             "_reduce_scatter_base": ("reduce_scatter", "input"),
             "reduce_scatter_single": ("reduce_scatter", "input"),
             "all_reduce": ("all_reduce", "tensor"), "reduce": ("reduce", "tensor"),
             "broadcast": ("broadcast", "tensor"), "all_to_all_single": ("all_to_all", "output")}

    def __init__(self) -> None:
        self.bytes = {k: 0.0 for k in KINDS}
        self.seen: Dict[str, int] = {}

    def _wrap(self, name: str, real):
        import inspect

        kind, arg = self.NAMES[name]
        signature = inspect.signature(real)

        def spy(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            group = bound.get("group")
            m, t = dist.get_world_size(group), bound[arg]
            if kind == "all_to_all":
                splits = bound.get("output_split_sizes")
                me = dist.get_rank(group)
                rows = list(splits) if splits else [t.shape[0] // m] * m
                per = (t[0].numel() if t.dim() > 1 else 1) * t.element_size()
                self.bytes["optimizer"] += sum(n for r, n in enumerate(rows) if r != me) * per
            else:
                buffer = sum(x.numel() * x.element_size() for x in t) if isinstance(t, list) else \
                    t.numel() * t.element_size()
                key = "all_gather" if kind in ("all_gather", "broadcast") else "reduce"
                self.bytes[key] += received(kind, buffer, m)
            self.seen[name] = self.seen.get(name, 0) + 1
            return real(*args, **kwargs)
        return spy

    @contextlib.contextmanager
    def installed(self):
        saved = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}
        for n, real in saved.items():
            setattr(dist, n, self._wrap(n, real))
        # DeepSpeed's comm backend keeps the two functions it took from torch at its start
        cdb = getattr(sys.modules.get("deepspeed.comm.comm"), "cdb", None)
        kept = {a: getattr(cdb, a) for a in ("all_gather_function", "reduce_scatter_function")} if cdb else {}
        for a, real in kept.items():
            name = "all_gather_into_tensor" if a.startswith("all_gather") else "reduce_scatter_tensor"
            setattr(cdb, a, self._wrap(name, real))
        try:
            yield self
        finally:
            for n, real in saved.items():
                setattr(dist, n, real)
            for a, real in kept.items():
                setattr(cdb, a, real)


class OurSpy:
    """Our collectives (tests/comm_spy.py's CommSpy: the names the core calls), in bytes received."""

    def __init__(self) -> None:
        from tests.comm_spy import CommSpy

        self.spy = CommSpy()

    @contextlib.contextmanager
    def installed(self):
        with self.spy.installed():
            yield self

    def bytes(self, itemsize: int) -> Dict[str, float]:
        out = {k: 0.0 for k in KINDS}
        for kind, m, numel, *_ in self.spy.calls:
            if kind == "all_to_all":
                out["optimizer"] += numel * 4  # what this rank sent = what it received (Muon's moves)
            elif kind == "reduce_scatter":  # the spy sees the output, this rank's shard
                out["reduce"] += received(kind, m * numel * itemsize, m)
            else:
                out["all_gather" if kind == "all_gather" else "reduce"] += received(kind, numel * itemsize, m)
        return out


# ---- part 1: real ranks ----------------------------------------------------------------------
def _main_muon():
    """main's Muon (``git show main:vescale_zero/optim/muon.py``), loaded beside ours in the
    package it was written for; ``None`` where git or that file is not there."""
    import importlib.util
    import subprocess

    try:
        source = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "show",
                                 "main:vescale_zero/optim/muon.py"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    spec = importlib.util.spec_from_loader("vescale_zero.optim._muon_on_main", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "vescale_zero.optim"
    exec(compile(source, "main:vescale_zero/optim/muon.py", "exec"), module.__dict__)
    return module.Muon


class TodaysMuon(Muon):
    """Muon as on main before the optimizer-aware plan: roots spread over all ranks by cost alone,
    every matrix through the two all_to_alls (a matrix whole on one rank too, when its root is elsewhere)."""

    def _plan(self, params):
        layout = super()._plan(params)
        if not getattr(layout, "_today", False):
            roots = tuple(assign_roots(layout.costs, layout.world))
            layout = MuonLayout(layout.key, layout.group, layout.world, layout.rank, layout.ranges, layout.shapes,
                                layout.costs, roots, (layout.world > 1,) * len(layout.costs))
            object.__setattr__(layout, "_today", True)
            self._layout = layout
        return layout


CFG = dict(vocab_size=512, seq_len=64, d_model=128, n_layers=4, n_heads=4)
LR = 0.02


def _ours(aware, hidden: bool, today: bool = False):
    def build(model):
        for block in model.blocks:
            vz.fully_shard(block, reshard_after_forward=True, optimizer_aware=aware)
        vz.fully_shard(model, reshard_after_forward=False, optimizer_aware=aware)
        params = [p for p in model.parameters() if p.requires_grad]
        if today:  # main's own code where it can be read, else its roots and moves through ours
            main = _main_muon()
            return model, (main(params, lr=LR, weight_decay=0.1) if main is not None else
                           TodaysMuon(params, lr=LR, weight_decay=0.1))
        return model, Muon(params, lr=LR, weight_decay=0.1, hide_in_backward=hidden)
    return build


def _plan_bytes(model, m: int) -> Dict[str, float]:
    """The plan's bytes per rank per step (the groups' PlacementChoice), summed over the groups,
    less one gather of the last layer: the runtime keeps the group backward needs first gathered
    from its forward (runtime/hooks [Note: orders]), where the plan counts a gather in each."""
    out = {k: 0.0 for k in KINDS}
    for g in groups_of(model):
        b = g.placement.step_bytes
        out["all_gather"] += b.all_gather
        out["reduce"] += b.reduce_scatter + b.replicas
        out["optimizer"] += b.optimizer
    last = model.blocks[-1].vescale_group
    out["all_gather"] -= (m - 1) * last.plan.shard_size * 4
    return out


def _deepspeed(stage: int):
    def build(model):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        world = dist.get_world_size()
        cfg = {"train_batch_size": 8 * world, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
               "gradient_clipping": 0.0, "steps_per_print": 10**9, "zero_optimization": {"stage": stage},
               "optimizer": {"type": "Muon", "params": {"lr": LR, "weight_decay": 0.1, "torch_adam": True}}}
        engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
        return engine, engine
    return build


def _fsdp2(model):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=False)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def _dist_muon_moves(model, m: int) -> float:
    """torchtitan's DistMuon (Owned compute layout) on FSDP2's Shard(0) pieces: every matrix's
    prepared input to its owner and the direction back, in the parameter's dtype; the mean per rank."""
    moved = 0
    for p in model.parameters():
        if p.dim() >= 2:
            rows, per_row = p.shape[0], p[0].numel()
            moved += (rows - math.ceil(rows / m)) * per_row if m > 1 else 0
    return 2 * moved * 4 / m


SYSTEMS = {
    "ours, today's Muon": _ours(Muon.optimizer_aware(force="piecewise"), False, today=True),
    "ours piecewise": _ours(Muon.optimizer_aware(force="piecewise"), False),
    "ours placed": _ours(Muon.optimizer_aware(force="placed"), False),
    "ours chosen": _ours(Muon.optimizer_aware(), False),
    "ours placed, hidden": _ours(Muon.optimizer_aware(force="placed"), True),
    "ours chosen, hidden": _ours(Muon.optimizer_aware(), True),
    "FSDP2 + dist_muon*": _fsdp2,
    "DeepSpeed ZeRO-1 Muon": _deepspeed(1),
    "DeepSpeed ZeRO-2 Muon": _deepspeed(2),
}


def worker(rank: int, world: int, port: int, args, out) -> None:
    """Builds every system, then steps them in turn, step by step (a shared machine's load falls
    on all of them alike), each step's collectives counted by its spy."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    cfg = GPTConfig(**CFG)
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)
    rows, systems = {}, {}
    for name, build in SYSTEMS.items():
        if args.only and not any(o in name for o in args.only):
            continue
        torch.manual_seed(0)
        try:
            model, opt = build(GPT(cfg))
        except Exception as e:  # noqa: BLE001 - a peer that does not run here: say why
            rows[name] = {"error": f"{type(e).__name__}: {e}"[:160]}
            continue
        systems[name] = (model, opt, OurSpy() if name.startswith("ours") else TorchSpy(), [], [])
    for step in range(args.steps + 1):
        x, y = corpus.batch(step, 8 * world, rank, world)
        for model, opt, spy, steps, exposed in systems.values():
            measured = step > 0
            with spy.installed() if measured else contextlib.nullcontext():
                dist.barrier()
                t0 = time.perf_counter()
                loss = model(x, y)
                if hasattr(opt, "backward"):  # a DeepSpeed engine
                    opt.backward(loss)
                else:
                    loss.backward()
                t1 = time.perf_counter()
                opt.step()
                t2 = time.perf_counter()
                if not hasattr(opt, "backward"):
                    opt.zero_grad()
                dist.barrier()
            if measured:
                steps.append(t2 - t0)
                exposed.append(t2 - t1)
    for name, (model, opt, spy, steps, exposed) in systems.items():
        ours = name.startswith("ours")
        got = spy.bytes(4) if ours else spy.bytes
        row = {"bytes": {k: v / args.steps for k, v in got.items()}, "step_ms": 1e3 * statistics.median(steps),
               "exposed_ms": 1e3 * statistics.median(exposed)}
        if ours:
            row["plan"] = _plan_bytes(model, world)
            row["choices"] = sorted({g.placement.choice for g in groups_of(model)})
        if name.startswith("FSDP2"):
            row["bytes"]["optimizer"] = _dist_muon_moves(model, world)
            row["modelled"] = True
        if "today" in name:  # main's Muon calls torch's all_to_all_single itself: its own count of what it sent
            row["bytes"]["optimizer"] = float(opt.last_step_stats["bytes_moved"])
        rows[name] = row
    for _, opt, *_ in systems.values():
        if getattr(opt, "_hidden", None) is not None:
            opt._hidden.close()
    gathered: List[Optional[dict]] = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        out[world] = gathered
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mib(x: float) -> str:
    return f"{x / 2**20:8.3f}"


def part1(args) -> None:
    out = mp.Manager().dict()
    for world in args.ranks:
        try:
            mp.spawn(worker, args=(world, _free_port(), args, out), nprocs=world)
        except mp.ProcessExitedException:  # gloo may abort a process at exit (environment.md): keep its results
            if world not in out:
                raise
        per_rank = out[world]
        print(f"\n{world} ranks, CPU/gloo fp32, GPT {CFG['n_layers']}x{CFG['d_model']} (vocab {CFG['vocab_size']}, "
              f"seq {CFG['seq_len']}, batch 8/rank); MiB per rank per step (mean over ranks; max for the optimizer)")
        print(f"{'system':26s} {'gathered':>9s} {'reduced':>9s} {'optimizer':>9s} {'opt max':>9s} {'total':>9s} "
              f"{'step ms':>8s} {'exposed ms':>10s}  plan = measured")
        for name in per_rank[0]:
            rows = [r[name] for r in per_rank]
            if "error" in rows[0]:
                print(f"{name:26s} does not run here: {rows[0]['error']}")
                continue
            mean = {k: statistics.fmean(r["bytes"][k] for r in rows) for k in KINDS}
            top = max(r["bytes"]["optimizer"] for r in rows)
            total = sum(mean.values())
            step = statistics.median(r["step_ms"] for r in rows)
            exposed = statistics.median(r["exposed_ms"] for r in rows)
            check = ""
            if "plan" in rows[0] and "today" not in name:
                same = all(abs(r["plan"][k] - r["bytes"][k]) < 1e-6 for r in rows for k in ("all_gather", "reduce"))
                same = same and abs(statistics.fmean(r["plan"]["optimizer"] for r in rows) - mean["optimizer"]) < 1e-6
                check = ("yes" if same else "NO") + f"  ({', '.join(rows[0]['choices'])})"
            timing = (f"{'n/a':>8s} {'n/a':>10s}" if rows[0].get("modelled") else f"{step:8.1f} {exposed:10.1f}")
            print(f"{name:26s} {_mib(mean['all_gather']):>9s} {_mib(mean['reduce']):>9s} {_mib(mean['optimizer']):>9s} "
                  f"{_mib(top):>9s} {_mib(total):>9s} {timing}  {check}")
        print("* FSDP2's collectives measured (with an SGD step); dist_muon's moves modelled: torchtitan 0.3.0's "
              "DistMuon refuses a CPU device")


# ---- part 2: the plan alone at scale ---------------------------------------------------------
GATHER, REDUCE, MOVE = 2, 4, 4  # bf16 gathers, fp32 reductions, fp32 moves


def _units(group) -> List[Optional[OptimizerUnits]]:
    return [OptimizerUnits(math.prod(s), float(s[0] * math.prod(s[1:]) * min(s[0], math.prod(s[1:]))))
            if len(s) >= 2 else None for _, s in group]


def _muon_bytes(plans, groups, m: int, today: bool = False) -> Tuple[float, float]:
    """(mean, max) per rank of Muon's moves over all the groups' matrices, roots as Muon assigns them."""
    ranges, shapes = [[] for _ in range(m)], []
    for plan_, group in zip(plans, groups):
        for i, (_, shape) in enumerate(group):
            if len(shape) < 2:
                continue
            placement = plan_.placement(i)
            for r in range(m):
                ranges[r].append(placement.local_range(r))
            shapes.append((shape[0], math.prod(shape[1:])))
    layout = MuonLayout.of(range(len(shapes)), None, 0, ranges, shapes)
    if today:  # main's roots: by cost alone, every matrix through the moves
        layout = MuonLayout(layout.key, None, m, 0, layout.ranges, layout.shapes, layout.costs,
                            tuple(assign_roots(layout.costs, m)), (m > 1,) * len(shapes))
    sent = layout.bytes_sent(range(len(shapes)), MOVE)
    return sum(sent) / m, max(sent)


def _ours_at_scale(groups, m: int, force: Optional[str], gathers: int, today: bool = False):
    traffic = StepTraffic(GATHER, REDUCE, gathers=gathers)
    plans, coll = [], 0.0
    for group in groups:
        specs = [TensorSpec(math.prod(s), 1, n) for n, s in group]
        choice = optimizer_aware_plan(specs, _units(group), m, traffic, align=8, force=force)
        plans.append(choice.plan)
        coll += choice.step_bytes.all_gather + choice.step_bytes.reduce_scatter
    mean, top = _muon_bytes(plans, groups, m, today)
    return coll, mean, top, sum(p.padding for p in plans) / sum(p.global_size for p in plans)


def _fsdp2_at_scale(groups, m: int):
    """FSDP2's collectives (dim 0 of each parameter padded to m, Shard(0)) and torchtitan's
    DistMuon moves (``Owned``: each matrix to one owner, owners balanced by Newton-Schulz cost,
    and back): (collectives, mean, max) per rank."""
    coll = 0.0
    ranges, shapes = [[] for _ in range(m)], []
    for group in groups:
        padded = sum(math.ceil(s[0] / m) * m * math.prod(s[1:]) for _, s in group)
        coll += (m - 1) / m * padded * (2 * GATHER + REDUCE)
        for _, s in group:
            if len(s) >= 2:
                rows, per_row, share = s[0], math.prod(s[1:]), math.ceil(s[0] / m)
                for r in range(m):
                    lo, hi = min(rows, r * share), min(rows, (r + 1) * share)
                    ranges[r].append((lo * per_row, hi * per_row))
                shapes.append((rows, per_row))
    layout = MuonLayout.of(range(len(shapes)), None, 0, ranges, shapes)
    owners = tuple(assign_roots(layout.costs, m))
    layout = MuonLayout(layout.key, None, m, 0, layout.ranges, layout.shapes, layout.costs, owners,
                        (m > 1,) * len(shapes))
    sent = layout.bytes_sent(range(len(shapes)), MOVE)
    return coll, sum(sent) / m, max(sent)


def _deepspeed_at_scale(groups, m: int, multi_rank_allreduce: bool = True):
    """DeepSpeed ZeRO-1/2 with its Muon: the gradients reduced, then one all-gather of the updated
    parameters (flat partitions over the whole model, padded to m). By default
    (``use_multi_rank_bucket_allreduce``) every gradient bucket is all-reduced; without it each
    partition's gradients are reduced to its owner and a Muon matrix a partition boundary cuts is
    all-reduced (every holder orthogonalises it whole)."""
    sizes = [(math.prod(s), len(s) >= 2) for g in groups for _, s in g]
    n = sum(e for e, _ in sizes)
    part = -(-n // m)
    gather = (m - 1) / m * part * m * GATHER
    if multi_rank_allreduce:
        return gather + 2 * (m - 1) / m * part * m * REDUCE
    cut, at = 0, 0
    for e, matrix in sizes:
        if matrix and at // part != (at + e - 1) // part:
            cut += e
        at += e
    return gather + (m - 1) / m * (part * m + cut) * REDUCE


def part2(args) -> None:
    cases = {"4 x Llama-3-8B layer": [layer_groups("llama3-8b")["decoder_layer"]] * 4,
             "DeepSeek-V3 MoE layer": [layer_groups("deepseek-v3-671b")["moe_layer"]]}
    print("\nThe plan alone: MiB per rank per step (bf16 gathers, fp32 reductions and moves); "
          "FSDP with reshard_after_forward gathers twice a step, ZeRO-1/2 once (they hold the full parameters)")
    print(f"{'model':22s} {'ranks':>5s} {'system':34s} {'collectives':>12s} {'optimizer':>10s} {'opt max':>10s} "
          f"{'total':>12s} {'padding':>8s}")
    for model, groups in cases.items():
        for m in args.scale:
            rows = []
            for label, force, gathers, today in (("ours, today's Muon (raf)", "piecewise", 2, True),
                                                 ("ours piecewise (raf)", "piecewise", 2, False),
                                                 ("ours chosen (raf)", None, 2, False),
                                                 ("ours placed (raf)", "placed", 2, False),
                                                 ("ours chosen (no raf)", None, 1, False)):
                coll, mean, top, pad = _ours_at_scale(groups, m, force, gathers, today)
                rows.append((label, coll, mean, top, f"{100 * pad:.2f}%"))
            rows.append(("FSDP2 + dist_muon (raf)",) + _fsdp2_at_scale(groups, m) + ("-",))
            rows.append(("DeepSpeed ZeRO-1/2 Muon", _deepspeed_at_scale(groups, m), 0.0, 0.0, "-"))
            rows.append(("DeepSpeed ZeRO-2 Muon, reduce**", _deepspeed_at_scale(groups, m, False), 0.0, 0.0, "-"))
            for label, coll, mean, top, pad in rows:
                print(f"{model:22s} {m:5d} {label:34s} {coll / 2**20:12.1f} {mean / 2**20:10.2f} {top / 2**20:10.2f} "
                      f"{(coll + mean) / 2**20:12.1f} {pad:>8s}")
    print("raf: reshard_after_forward (two gathers a step); ** use_multi_rank_bucket_allreduce false (its default is "
          "true: every bucket all-reduced)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=6, help="measured steps (after one warm-up step)")
    p.add_argument("--scale", type=int, nargs="+", default=[8, 64, 1024])
    p.add_argument("--only", type=lambda s: s.split(","), default=None, help="systems whose name contains these")
    p.add_argument("--plan-only", action="store_true")
    p.add_argument("--real-only", action="store_true")
    args = p.parse_args()
    if not args.plan_only:
        part1(args)
    if not args.real_only:
        part2(args)


if __name__ == "__main__":
    main()
