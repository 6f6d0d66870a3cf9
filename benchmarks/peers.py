"""vescale-zero against its peers on the same GPT, data and AdamW, in one run.

    .venv/bin/python benchmarks/peers.py [--ranks 2 4] [--cycles 2] [--json peers.json]

Variants: DDP (the no-sharding limit), PyTorch FSDP2 ``fully_shard``, DeepSpeed ZeRO-3,
vescale-zero ``fully_shard`` and vescale-zero's DeepSpeed ``"stage": "ragged"``; then,
where megatron-core is installed (``--no-megatron`` leaves it out), megatron-core's own
``GPTModel`` of the same dims under its ``DistributedDataParallel`` and under our
``VeScaleFSDP`` (``examples/megatron/pretrain_gpt.py``; on CPU through the test shim, see
``build_megatron_variant``), reported in a table of their own since the model differs. Each
variant runs in fresh processes (so its memory is its own) and the variants cycle
A B C D E ... A B C D E .... fp32 on gloo (CPU), NCCL when GPUs are present. Reported per rank:

* ms/step (median and spread over all timed steps of all cycles) and tokens/s;
* peak memory: on GPU the CUDA allocator's peak; on CPU the highest resident set size
  sampled every 2 ms during the timed steps, minus the RSS before the model was built
  (freed pages are returned to the OS with malloc_trim after set-up);
* bytes through collectives per step (profiled: all-gather, reduce-scatter, all-reduce; an
  all_to_all counts as a reduce-scatter, which is what vescale-zero runs as one on gloo);
* bytes copied outside collectives per step: bytes through copy kernels (copy_, cat,
  _chunk_cat, split_with_sizes_copy, _foreach_copy_, _to_copy) that are not made by a
  collective (not under, nor during, a c10d / gloo / nccl op on the same thread) (tensor lists counted as 4-byte elements: exact for fp32), minus the same count for the unsharded model on the same local batch, so the
  model's own copies (e.g. attention reshapes) are not charged to the parallel layer.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import socket
import statistics
import threading
import time
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

VARIANTS = ("ddp", "fsdp2", "zero3", "vescale", "ds_ragged")
MEGATRON_VARIANTS = ("mcore_ddp", "mcore_vescale")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COPY_OPS = {"aten::copy_", "aten::cat", "aten::_chunk_cat", "aten::split_with_sizes_copy", "aten::_foreach_copy_",
            "aten::_to_copy"}
_ITEM = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "int": 4, "bool": 1}
# A TensorList input carries no dtype in the profiler: counted as 4-byte elements (exact in fp32).


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _bytes(shape, dtype) -> int:
    if shape and isinstance(shape[0], list):  # a list of tensors
        return sum(_bytes(s, dtype) for s in shape)
    return _numel(shape) * _ITEM.get(dtype, 4)


def _is_collective(name: str) -> bool:
    return name.startswith(("c10d::", "gloo:", "nccl:"))


def _inside_collective(e, spans) -> bool:
    """A copy made by a collective's backend (e.g. gloo's reduce-scatter clones its input):
    a descendant of a collective, or running within one's time span on the same thread."""
    parent = e.cpu_parent
    while parent is not None:
        if _is_collective(parent.name):
            return True
        parent = parent.cpu_parent
    return any(t == e.thread and s <= e.time_range.start and e.time_range.end <= t_end for t, s, t_end in spans)


def _traffic(prof) -> Dict[str, int]:
    out = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0, "copied": 0}
    spans = [(e.thread, e.time_range.start, e.time_range.end) for e in prof.events() if _is_collective(e.name)]
    for e in prof.events():
        name, shapes, types = e.name, e.structured_input_shapes or e.input_shapes or [], e.input_dtypes or []
        if name == "c10d::_allgather_base_" and shapes:
            out["all_gather"] += _bytes(shapes[0], types[0] if types else "float")
        elif name in ("c10d::_reduce_scatter_base_", "c10d::alltoall_base_") and len(shapes) > 1:
            # all_to_all: vescale-zero's reduce-scatter on gloo (collectives.py [Note: gloo reduce-scatter])
            out["reduce_scatter"] += _bytes(shapes[1], types[1] if len(types) > 1 else "float")
        elif name.startswith("c10d::allreduce") and shapes:
            out["all_reduce"] += _bytes(shapes[0], types[0] if types else "float")
        elif name in COPY_OPS and shapes and not _inside_collective(e, spans):
            out["copied"] += _bytes(shapes[0], types[0] if types else "float")
    return out


class _RssSampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.running = 0.0, True

    @staticmethod
    def rss_mib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.rss_mib())
            time.sleep(0.002)


def build_variant(variant: str, cfg, device, args):
    """``(model or engine, optimizer or None, DeepSpeed engine or None)`` for ``variant``."""
    from vescale_zero.testing import GPT

    model = GPT(cfg).to(device)
    if variant == "plain":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3), None
    if variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    elif variant == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif variant == "vescale":
        import vescale_zero as vz

        vz.fully_shard_layers(model, granularity="row")
    else:  # DeepSpeed: zero3 or ds_ragged
        import deepspeed

        import vescale_zero.integrations.deepspeed  # noqa: F401

        cfg_ds = {"train_batch_size": args.global_batch, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                  "zero_optimization": {"stage": 3 if variant == "zero3" else "ragged"}, "steps_per_print": 10**9}
        if variant == "ds_ragged":
            cfg_ds["zero_optimization"]["granularity"] = "row"
        engine, *_ = deepspeed.initialize(model=model, config=cfg_ds)
        return engine, None, engine
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), None


def train_step(model, opt, engine, x: torch.Tensor, y: torch.Tensor) -> None:
    """One step of a variant from :func:`build_variant`: through its DeepSpeed engine, or
    backward + ``opt.step()`` on the model."""
    if engine is not None:
        engine.backward(engine(x, y))
        engine.step()
    else:
        model(x, y).backward()
        opt.step()
        opt.zero_grad()


def build_megatron_variant(variant: str, args: argparse.Namespace, world: int):
    """``(model, optimizer, step)``: megatron-core's ``GPTModel`` (local layer spec, the GPT
    dims of the other variants) through ``examples/megatron/pretrain_gpt.py`` under
    megatron-core ``DistributedDataParallel`` + Megatron's optimizer (``mcore_ddp``) or
    ``--use-vescale-fsdp`` (``mcore_vescale``); ``step(i)`` is one iteration of Megatron's
    schedule. Without CUDA, megatron-core runs through the test shim (tests/megatron_shim.py)
    and the DDP side through its CPU stand-in for Megatron's FP32 optimizer step."""
    import importlib.util
    import sys

    cuda = torch.cuda.is_available()
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    if not cuda:
        from tests.megatron_shim import MegatronFP32Step, install_cuda_shim

        install_cuda_shim()
    spec = importlib.util.spec_from_file_location("pretrain_gpt", os.path.join(REPO, "examples/megatron/pretrain_gpt.py"))
    pg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pg)
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    argv = ["--num-layers", str(args.layers), "--hidden-size", str(args.d_model), "--num-attention-heads", "8",
            "--seq-length", str(args.seq_len), "--vocab-size", "512", "--micro-batch-size", str(args.global_batch // world),
            "--global-batch-size", str(args.global_batch), "--lr", "1e-3", "--clip-grad", "0", "--weight-decay", "0.01"]
    margs = pg.build_parser().parse_args(argv + (["--use-vescale-fsdp"] if variant == "mcore_vescale" else []))
    pg.setup(margs)
    if variant == "mcore_vescale" or cuda:
        model, opt, config = pg.build(margs)
    else:
        pg.seed(margs)
        config = pg.transformer_config(margs)
        model = pg.build_model(margs, config)
        opt = MegatronFP32Step(model, pg.optimizer_config(margs))
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    forward_backward = get_forward_backward_func()

    def step(i: int) -> None:
        model.zero_grad_buffer()
        opt.zero_grad()
        forward_backward(forward_step_func=pg.forward_step, data_iterator=iter(pg.batches(margs, i, 1)), model=[model],
                         num_microbatches=1, seq_length=margs.seq_length, micro_batch_size=margs.micro_batch_size,
                         forward_only=False)
        opt.step()

    return model, opt, step


def _profile_collective_waits() -> None:
    """Mark every ``Work.wait`` as part of its collective in the profile: gloo completes
    async reduce-scatters there (copying this rank's chunk out of an all-reduced clone),
    and that copy is the backend's, for every variant alike. (DDP waits inside its C++
    reducer, so its backend copies still count against it.)"""
    work = torch._C._distributed_c10d.Work
    original = work.wait

    def wait(self, *args, **kwargs):
        with torch.profiler.record_function("c10d::wait"):
            return original(self, *args, **kwargs)

    work.wait = wait


def worker(rank: int, world: int, port: int, variant: str, args: argparse.Namespace, out: Dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if variant in ("zero3", "ds_ragged"):
        import deepspeed

        if not cuda:
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    else:
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    _profile_collective_waits()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    from vescale_zero.testing import GPTConfig, SyntheticCorpus

    cfg = GPTConfig(vocab_size=512, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=8)
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)
    gc.collect()
    base = _RssSampler.rss_mib()
    megatron = variant in MEGATRON_VARIANTS
    if megatron:
        model, opt, megatron_step = build_megatron_variant(variant, args, world)
        engine = None
    else:
        model, opt, engine = build_variant(variant, cfg, device, args)

    def step(i: int) -> None:
        if megatron:
            megatron_step(i)
            return
        x, y = (t.to(device) for t in corpus.batch(i, args.global_batch, rank, world))
        train_step(model, opt, engine, x, y)

    for i in range(args.warmup):
        step(i)
    gc.collect()
    if not cuda:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    else:
        torch.cuda.reset_peak_memory_stats()
    sampler = _RssSampler()
    sampler.start()
    times: List[float] = []
    for i in range(args.warmup, args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step(i)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    sampler.running = False
    sampler.join()
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else sampler.peak - base
    from torch.profiler import profile

    with profile(record_shapes=True) as prof:
        step(args.warmup + args.steps)
    traffic = _traffic(prof)
    if megatron:  # another model (megatron-core's GPTModel): no plain baseline to subtract
        traffic["copied"] = None
    elif variant != "plain":  # the unsharded model's own copies on the same local batch
        plain, popt, _ = build_variant("plain", cfg, device, args)
        with profile(record_shapes=True) as prof:  # the same work as step(), batch included
            x, y = (t.to(device) for t in corpus.batch(0, args.global_batch, rank, world))
            plain(x, y).backward()
            popt.step()
            popt.zero_grad()
        traffic["copied"] = max(0, traffic["copied"] - _traffic(prof)["copied"])
    gathered = [None] * world
    dist.all_gather_object(gathered, {"times": times, "peak_mib": peak, **traffic})
    if rank == 0:
        out[f"{world}:{variant}"] = out.get(f"{world}:{variant}", []) + [gathered]
    del model, opt, engine
    gc.collect()
    if megatron:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _has_megatron() -> bool:
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return False
    return True


def _summarise(runs, args, world):
    ms = [1e3 * t for cycle in runs for r in cycle for t in r["times"][: len(r["times"])]]
    per_rank = [r for cycle in runs for r in cycle]
    med = statistics.median(ms)
    return {
        "median_ms": med, "min_ms": min(ms), "max_ms": max(ms),
        "tokens_per_s": args.global_batch * args.seq_len / (med / 1e3),
        "peak_mib": max(r["peak_mib"] for r in per_rank),
        "all_gather_mib": statistics.median(r["all_gather"] for r in per_rank) / 2**20,
        "reduce_scatter_mib": statistics.median(r["reduce_scatter"] for r in per_rank) / 2**20,
        "all_reduce_mib": statistics.median(r["all_reduce"] for r in per_rank) / 2**20,
        "copied_mib": None if per_rank[0]["copied"] is None else statistics.median(r["copied"] for r in per_rank) / 2**20,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--cycles", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--json", help="write the raw measurements and the summary here")
    p.add_argument("--no-megatron", action="store_true", help="leave out megatron-core DDP vs VeScaleFSDP")
    args = p.parse_args()
    variants = VARIANTS + (() if args.no_megatron or not _has_megatron() else MEGATRON_VARIANTS)
    if torch.cuda.is_available():
        args.ranks = [min(r, torch.cuda.device_count()) for r in args.ranks]
    runs = [(w, c, v) for w in args.ranks for c in range(args.cycles) for v in variants]
    with mp.Manager() as manager:
        out = manager.dict()
        for world, _, variant in tqdm(runs, desc=f"runs ({' '.join(variants)}, cycled)"):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.spawn(worker, args=(world, port, variant, args, out), nprocs=world)
        raw = dict(out)
    summary = {}
    backend = "NCCL" if torch.cuda.is_available() else "gloo CPU"
    for world in args.ranks:
        rows = {v: _summarise(raw[f"{world}:{v}"], args, world) for v in VARIANTS}
        summary[world] = rows
        print(f"\n{world} ranks, {backend}, fp32, GPT {args.layers}x{args.d_model}, seq {args.seq_len}, "
              f"global batch {args.global_batch}; {args.cycles} cycles x {args.steps} steps per variant")
        print(f"{'variant':10s} {'ms med':>8s} {'min':>7s} {'max':>7s} {'tok/s':>7s} {'peak MiB':>9s} {'AG MiB':>7s} "
              f"{'RS MiB':>7s} {'AR MiB':>7s} {'copy MiB':>9s} {'/fsdp2':>7s} {'/zero3':>7s} {'/ddp':>6s}")
        for v, r in rows.items():
            print(f"{v:10s} {r['median_ms']:8.1f} {r['min_ms']:7.1f} {r['max_ms']:7.1f} {r['tokens_per_s']:7.0f} "
                  f"{r['peak_mib']:9.1f} {r['all_gather_mib']:7.2f} {r['reduce_scatter_mib']:7.2f} {r['all_reduce_mib']:7.2f} "
                  f"{r['copied_mib']:9.2f} {r['median_ms'] / rows['fsdp2']['median_ms']:7.3f} "
                  f"{r['median_ms'] / rows['zero3']['median_ms']:7.3f} {r['median_ms'] / rows['ddp']['median_ms']:6.3f}")
        ours = rows["vescale"]
        print(f"targets (vescale): time <= 0.8x FSDP2 [{ours['median_ms'] / rows['fsdp2']['median_ms']:.3f}], "
              f"<= 0.9x ZeRO-3 [{ours['median_ms'] / rows['zero3']['median_ms']:.3f}], "
              f"<= 1.15x DDP [{ours['median_ms'] / rows['ddp']['median_ms']:.3f}]; peak memory <= FSDP2 "
              f"[{ours['peak_mib']:.0f} vs {rows['fsdp2']['peak_mib']:.0f} MiB] and ZeRO-3 [{rows['zero3']['peak_mib']:.0f} MiB]; "
              f"copies outside collectives {ours['copied_mib']:.2f} MiB/step")
        if f"{world}:mcore_ddp" in raw:
            ddp, ours = (_summarise(raw[f"{world}:{v}"], args, world) for v in MEGATRON_VARIANTS)
            summary[world].update(mcore_ddp=ddp, mcore_vescale=ours)
            print(f"megatron-core GPTModel, same dims, Megatron's schedule ({'CUDA' if torch.cuda.is_available() else 'CPU via tests/megatron_shim.py'}):")
            print(f"{'variant':14s} {'ms med':>8s} {'min':>7s} {'max':>7s} {'peak MiB':>9s} {'AG MiB':>7s} {'RS MiB':>7s} "
                  f"{'AR MiB':>7s} {'/mcore_ddp':>10s}")
            for v, r in (("mcore_ddp", ddp), ("mcore_vescale", ours)):
                print(f"{v:14s} {r['median_ms']:8.1f} {r['min_ms']:7.1f} {r['max_ms']:7.1f} {r['peak_mib']:9.1f} "
                      f"{r['all_gather_mib']:7.2f} {r['reduce_scatter_mib']:7.2f} {r['all_reduce_mib']:7.2f} "
                      f"{r['median_ms'] / ddp['median_ms']:10.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "raw": raw}, f, indent=1)


if __name__ == "__main__":
    main()
