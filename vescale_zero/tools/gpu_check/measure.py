"""Sections that measure: memory at fake world sizes, step time at world size 1, the copies
around the collectives against the device's bandwidth. Every system is built, stepped and
measured by the same code, in the same process, one after another (freed in between).

* ``memory``: a stack of Llama-3-8B-shaped layers in bf16 (fp32 master and reduce,
  ``AdamW(fused=True)``) sharded by vescale-zero and by FSDP2 the same way
  (:func:`vescale_zero.tools.gpu_check.sharding.shard_on_meta`, as ``benchmarks/memory.py``), on
  PyTorch's fake process group at each fake world size: this process is rank 0 (a ragged shard
  is as large on every rank: one plan, one shard size). One step, then the peak of a second.
* ``step_time``: a ~1B-parameter GPT in bf16 (fp32 master and reduce; DDP: fp32 weights under
  ``torch.autocast``) with ``AdamW(fused=True)``, ours vs FSDP2 vs DDP: warm-up steps, then
  timed steps each between device synchronisations (:func:`.device.timed_steps`).
* ``copies``: ``vescale_zero.tools.gpu_check.copy_overhead`` (what ``benchmarks/copy_overhead.py``
  prints) for one Llama-3-70B layer in bf16 at the listed shard-group sizes, in GB/s and as a
  share of the device's nominal bandwidth.
"""

from __future__ import annotations

import gc
import statistics
from typing import Dict, List, Optional

import torch
from torch import nn

import vescale_zero as vz

from ...testing import GPT, SyntheticCorpus
from .device import MiB, PeakMemory, nominal_bandwidth, timed_steps, world_of_one
from .plan import Context
from .report import Outcome

__all__ = ["memory", "step_time", "copies", "MEMORY_SYSTEMS", "TIMED_SYSTEMS"]

MEMORY_SYSTEMS = ("vescale", "fsdp2")
TIMED_SYSTEMS = ("vescale", "fsdp2", "ddp")


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else "-"


def _fake_world_peak(ctx: Context, system: str, world: int) -> Dict[str, float]:
    from .llama import LlamaShapedStack, stack_layers
    from .sharding import fake_world, shard_on_meta

    s = ctx.sizes
    _free(ctx.device)  # the last system's buffers (reference cycles: hooks <-> groups) and cached blocks
    with fake_world(world):
        model = shard_on_meta(system, lambda: LlamaShapedStack(s.llama_layers, **s.llama), stack_layers, ctx.device,
                              param_dtype=torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, s.llama_seq, s.llama["hidden"], generator=g).to(ctx.device, torch.bfloat16)

        def step() -> None:
            model(x, None).backward()
            opt.step()
            opt.zero_grad()

        step()  # the optimizer's state exists from here on
        with PeakMemory(ctx.device) as peak:
            step()
    return {"allocated": peak.allocated, "reserved": peak.reserved}


def memory(ctx: Context) -> Outcome:
    s = ctx.sizes
    rows: Dict[int, Dict[str, Dict]] = {}
    for world in s.fake_worlds:
        rows[world] = {system: _fake_world_peak(ctx, system, world) for system in MEMORY_SYSTEMS}
    what = "the CUDA allocator's peaks" if ctx.device.type == "cuda" else "live tensor bytes: no allocator off CUDA"
    lines = [f"{s.llama_layers} Llama-3-8B-shaped layers (hidden {s.llama['hidden']}, ffn {s.llama['ffn']}, "
             f"{s.llama['heads']} heads, {s.llama['kv_heads']} KV heads), bf16 + fp32 master / reduce, AdamW(fused), "
             f"1 x {s.llama_seq} tokens; rank 0 of a fake process group; peak of the second step, MiB ({what})", "",
             "| fake world | ours allocated | FSDP2 allocated | ours/FSDP2 | ours reserved | FSDP2 reserved "
             "| ours/FSDP2 |", "|---:|---:|---:|---:|---:|---:|---:|"]
    summary = []
    for world, r in rows.items():
        ours, fsdp2 = r["vescale"], r["fsdp2"]
        res = [f"{x['reserved'] / MiB:.1f}" if x["reserved"] is not None else "-" for x in (ours, fsdp2)]
        res_ratio = _ratio(ours["reserved"], fsdp2["reserved"]) if ours["reserved"] is not None else "-"
        alloc_ratio = _ratio(ours["allocated"], fsdp2["allocated"])
        lines.append(f"| {world} | {ours['allocated'] / MiB:.1f} | {fsdp2['allocated'] / MiB:.1f} | {alloc_ratio} "
                     f"| {res[0]} | {res[1]} | {res_ratio} |")
        summary.append(f"world {world}: ours/FSDP2 allocated {alloc_ratio}, reserved {res_ratio}")
    figures = {str(w): {sys_: {k: v for k, v in x.items()} for sys_, x in r.items()} for w, r in rows.items()}
    return Outcome("memory", "PASS", "; ".join(summary), lines, figures)


def _build_timed(system: str, ctx: Context):
    """``(step(i), parameters)`` of ``system`` on the ~1B GPT."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
    from torch.nn.parallel import DistributedDataParallel

    s = ctx.sizes
    with torch.device(ctx.device):
        model: nn.Module = GPT(s.big_gpt)
    params = sum(p.numel() for p in model.parameters())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    autocast = system == "ddp"
    if system == "vescale":
        for block in model.blocks:
            vz.fully_shard(block, mp_policy=mp)
        vz.fully_shard(model, mp_policy=mp)
    elif system == "fsdp2":
        for block in model.blocks:
            fsdp2_fully_shard(block, mp_policy=mp)
        fsdp2_fully_shard(model, mp_policy=mp)
    else:
        model = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    corpus = SyntheticCorpus(s.big_gpt.vocab_size, s.big_gpt.seq_len)

    def step(i: int) -> None:
        x, y = (t.to(ctx.device) for t in corpus.batch(i, s.big_batch, 0, 1))
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step, params


def step_time(ctx: Context) -> Outcome:
    s = ctx.sizes
    results: Dict[str, Dict] = {}
    with world_of_one(ctx.device, ctx.timeout_s):
        for system in TIMED_SYSTEMS:
            _free(ctx.device)  # the last system's model, optimizer and cached blocks
            step, params = _build_timed(system, ctx)
            times = timed_steps(step, ctx.device, s.warmup, s.timed)
            with PeakMemory(ctx.device) as peak:  # one more step: off CUDA the tracker would slow the timed ones
                step(s.warmup + s.timed)
            results[system] = {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
                               "times_ms": times, "peak_allocated_MiB": peak.allocated / MiB}
            del step
    tokens = s.big_batch * s.big_gpt.seq_len
    for r in results.values():
        r["tokens_per_s"] = tokens / (r["median_ms"] / 1e3)
        r["vs_fsdp2"] = r["median_ms"] / results["fsdp2"]["median_ms"]
        r["vs_ddp"] = r["median_ms"] / results["ddp"]["median_ms"]
    g = s.big_gpt
    size = f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.2f}M"
    lines = [f"GPT {g.n_layers}x{g.d_model} ({size} parameters), seq {g.seq_len}, batch {s.big_batch}, "
             f"bf16 (fp32 master + reduce; DDP: fp32 weights under autocast), AdamW(fused=True), world size 1; "
             f"{s.warmup} warm-up then {s.timed} timed steps per system, each between device synchronisations", "",
             "| system | median ms | min | max | tokens/s | /FSDP2 | /DDP | peak allocated MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['median_ms']:.1f} | {r['min_ms']:.1f} | {r['max_ms']:.1f} | "
                     f"{r['tokens_per_s']:.0f} | {r['vs_fsdp2']:.3f} | {r['vs_ddp']:.3f} | "
                     f"{r['peak_allocated_MiB']:.0f} |")
    ours = results["vescale"]
    summary = (f"{size} GPT: ours {ours['median_ms']:.1f} ms/step, /FSDP2 {ours['vs_fsdp2']:.3f}, "
               f"/DDP {ours['vs_ddp']:.3f}")
    return Outcome("step_time", "PASS", summary, lines, {"params": params, **results})


def copies(ctx: Context) -> Outcome:
    from ..model_shapes import layer_groups
    from .copy_overhead import KINDS, auto_scale, fsdp2_system, measure, per_step, scaled, vescale_system

    s = ctx.sizes
    if ctx.device.type == "cpu":
        torch.set_num_threads(1)  # as benchmarks/copy_overhead.py: on a busy CPU spinning threads are descheduled
    scale = s.copy_scale or auto_scale([s.copy_model], "decoder_layer", ctx.device)
    shapes = scaled([shape for _, shape in layer_groups(s.copy_model)["decoder_layer"]], scale)
    bandwidth = nominal_bandwidth(ctx.device)
    name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    bw_text = f"{bandwidth / 1e12:.2f} TB/s nominal" if bandwidth else "no nominal bandwidth known"
    lines = [f"{s.copy_model} decoder layer (last dim / {scale}), bf16 params + fp32 master / reduce; one rank's "
             f"kernels around 2 all-gathers + 1 reduce-scatter, ms per step (medians of {s.copy_reps}); GB/s: bytes "
             f"read + written; {name}: {bw_text}", "",
             "| ranks | kind | FSDP2 ms | FSDP2 GB/s (% nominal) | ours ms | ours GB/s (% nominal) | ours/FSDP2 |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    figures: Dict[str, Dict] = {"scale": scale, "bandwidth_Bps": bandwidth}
    summary: List[str] = []

    def rate(gbs: Optional[float]) -> str:
        return "-" if not gbs else f"{gbs:.1f}" + (f" ({100 * gbs * 1e9 / bandwidth:.0f}%)" if bandwidth else "")

    for m in s.copy_ranks:
        systems = [fsdp2_system(shapes, m, "bf16", ctx.device), vescale_system(shapes, m, "bf16", ctx.device)]
        measure(systems, ctx.device, s.copy_reps)
        steps = {sys_.name: per_step(sys_, gathers=2) for sys_ in systems}
        del systems
        _free(ctx.device)
        figures[str(m)] = {}
        for kind in KINDS + ("per step",):
            row = {}
            for sys_name in ("fsdp2", "vescale"):
                ms, nbytes = steps[sys_name][kind]
                row[sys_name] = {"ms": ms, "bytes": nbytes, "GBps": nbytes / (ms / 1e3) / 1e9 if nbytes and ms > 0
                                 else None}
            ours, theirs = row["vescale"], row["fsdp2"]
            moved = ours["bytes"] and theirs["bytes"]
            lines.append(f"| {m} | {kind} | {theirs['ms']:.3f} | {rate(theirs['GBps'])} | {ours['ms']:.3f} | "
                         f"{rate(ours['GBps'])} | {_ratio(ours['ms'], theirs['ms']) if moved else '-'} |")
            figures[str(m)][kind] = row
        summary.append(f"{m} ranks: ours {ours['ms']:.3f} ms, FSDP2 {theirs['ms']:.3f} ms per step "
                       f"({_ratio(ours['ms'], theirs['ms'])}); ours {rate(ours['GBps'])} GB/s")
    return Outcome("copies", "PASS", "; ".join(summary), lines, figures)

