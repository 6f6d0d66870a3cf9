"""Sections around the README's main job: a GPT with each block and the root under
``vescale_zero.fully_shard``, bf16 mixed precision (fp32 master and reduce), ``AdamW(fused=True)``
and global-norm clipping, as ``examples/train_gpt.py`` trains it -- on the device, at world size 1.

* ``main_job``: it trains (the loss is finite and falls); beside it, the same model in fp32
  against the unsharded model with the same optimizer, once as it comes (a figure: CUDA's atomics
  vary run to run) and once under deterministic algorithms, where it must be bit-identical.
* ``checkpoint``: ``vescale_zero.checkpoint.save`` / ``load`` into a fresh model and optimizer:
  every parameter piece and optimizer state equal, and the next loss equal.
* ``sync_debug``: one step under ``torch.cuda.set_sync_debug_mode("warn")`` (each host sync
  counted, with who asked) and one under ``"error"``.
* ``sanitizer``: steps in a process started with ``TORCH_CUDA_SANITIZER=1``; every report of
  torch's CUDA sanitizer (unsynchronised accesses between streams) counted, none raised.
"""

from __future__ import annotations

import math
import os
import statistics
import time
import traceback
import warnings
from collections import Counter
from dataclasses import replace
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn

import vescale_zero as vz

from ..testing import GPT, GPTConfig, SyntheticCorpus
from ..torch_compat import collect_sanitizer_reports
from .device import MiB, PeakMemory, synchronize, world_of_one
from .plan import Context
from .report import Outcome, one_line

__all__ = ["build_main_job", "train_step", "main_job", "checkpoint", "sync_debug", "sanitizer"]

LR = 3e-3
_TORCH_DIR = os.path.dirname(torch.__file__)
SYNC_WARNING = "called a synchronizing CUDA operation"


def build_main_job(cfg: GPTConfig, device: torch.device, mixed: bool = True) -> Tuple[nn.Module, torch.optim.Optimizer]:
    """The main job's model (each block, then the root, under ``fully_shard``; bf16 parameters
    and compute with fp32 master and reduce when ``mixed``) and its ``AdamW(fused=True)``."""
    with torch.device(device):
        model = GPT(cfg)
    mp = vz.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
    for block in model.blocks:
        vz.fully_shard(block, mp_policy=mp)
    vz.fully_shard(model, mp_policy=mp)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=True)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch, clip: float = 1.0) -> torch.Tensor:
    """One step: forward, backward, clipping to ``clip`` (0: none), optimizer step; the loss
    (still on the device: nothing here reads a device value on the host)."""
    x, y = batch
    loss = model(x, y)
    loss.backward()
    if clip:
        vz.clip_grad_norm_(model, clip)
    opt.step()
    opt.zero_grad()
    return loss.detach()


def trained(values: List[float]) -> str:
    """"" if the losses are finite and fell (the mean of the last 3 by 5% below the first), else why not."""
    if not all(math.isfinite(v) for v in values):
        return "a loss is not finite"
    return "" if statistics.mean(values[-3:]) < 0.95 * values[0] else "the loss did not fall by 5%"


def batches(cfg: GPTConfig, global_batch: int, device: torch.device) -> Callable[[int], Tuple[torch.Tensor, ...]]:
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)
    return lambda step: tuple(t.to(device) for t in corpus.batch(step, global_batch, 0, 1))


def _fp32_gap(ctx: Context, deterministic: bool = False) -> Dict[str, Any]:
    """The main job's model in fp32 against the unsharded model (same initial weights, data and
    ``AdamW(fused=True)``, no clipping): how far apart their losses and parameters are. On CUDA the
    embedding's backward accumulates with atomics (run-to-run order), so ``deterministic`` runs both
    under ``torch.use_deterministic_algorithms``: a gap left there is ours, not the kernels'."""
    if deterministic:
        torch.use_deterministic_algorithms(True)
        try:
            return _fp32_gap(ctx)
        finally:
            torch.use_deterministic_algorithms(False)
    s = ctx.sizes
    batch = batches(s.gpt, s.global_batch, ctx.device)
    sharded, opt = build_main_job(s.gpt, ctx.device, mixed=False)
    with torch.device(ctx.device):
        plain = GPT(s.gpt)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=0.1, fused=True)
    ours, ref = [], []
    for i in range(s.parity_steps):
        ours.append(train_step(sharded, opt, batch(i), clip=0))
        ref.append(train_step(plain, plain_opt, batch(i), clip=0))
    full = vz.full_state_dict(sharded)
    gaps = [(full[k].float() - v.float()).abs().max().item() for k, v in plain.state_dict().items()]
    loss_gaps = [abs(a.item() - b.item()) for a, b in zip(ours, ref)]
    return {"steps": s.parity_steps, "first_loss_equal": loss_gaps[0] == 0.0, "max_loss_gap": max(loss_gaps),
            "max_param_gap": max(gaps), "bit_identical": max(gaps) == 0.0 and max(loss_gaps) == 0.0}


def main_job(ctx: Context) -> Outcome:
    s = ctx.sizes
    if ctx.device.type == "cuda":  # cuBLAS is deterministic only with a fixed workspace, set before its first call
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    with world_of_one(ctx.device, ctx.timeout_s):
        model, opt = build_main_job(s.gpt, ctx.device)
        batch = batches(s.gpt, s.global_batch, ctx.device)
        synchronize(ctx.device)
        t0 = time.perf_counter()
        with PeakMemory(ctx.device) as peak:
            losses = [train_step(model, opt, batch(i)) for i in range(s.steps)]
            synchronize(ctx.device)
        seconds = time.perf_counter() - t0
        values = [loss.item() for loss in losses]
        rep = vz.sharding_report(model)
        gap = _fp32_gap(ctx)
        det = _fp32_gap(ctx, deterministic=True)
    tail = statistics.mean(values[-3:])
    figures = {"steps": s.steps, "losses": values, "first_loss": values[0], "last3_mean_loss": tail,
               "ms_per_step": 1e3 * seconds / s.steps, "peak_allocated_MiB": peak.allocated / MiB,
               "groups": rep.num_groups, "params": rep.numel, "padding_ratio": rep.padding_ratio, "fp32_gap": gap,
               "fp32_gap_deterministic": det}
    describe = lambda g: ("bit-identical" if g["bit_identical"] else  # noqa: E731
                          f"max loss gap {g['max_loss_gap']:.3g}, max parameter gap {g['max_param_gap']:.3g}")
    gap_text = f"{describe(gap)}; deterministic algorithms: {describe(det)}"
    lines = [f"- GPT {s.gpt.n_layers}x{s.gpt.d_model}, seq {s.gpt.seq_len}, global batch {s.global_batch}, "
             f"{rep.num_groups} groups, {rep.numel:,} parameters, padding {100 * rep.padding_ratio:.3f}%",
             f"- bf16 (fp32 master + reduce), AdamW(fused=True), clip 1.0: loss {values[0]:.4f} -> {values[-1]:.4f} "
             f"in {s.steps} steps (mean of the last 3: {tail:.4f}); {figures['ms_per_step']:.1f} ms/step; "
             f"peak allocated {peak.allocated / MiB:.1f} MiB",
             f"- fp32, {gap['steps']} steps against the unsharded model with the same AdamW(fused=True), no "
             f"clipping: {gap_text} (first loss {'equal' if gap['first_loss_equal'] else 'differs'})"]
    why = trained(values)
    if not det["bit_identical"]:  # with the kernels' order fixed, sharding must not change a bit (H200: 0, 2 runs)
        why = (why + "; " if why else "") + "fp32 under deterministic algorithms differs from the unsharded model"
    ok = not why
    summary = (f"loss {values[0]:.3f} -> {tail:.3f} (last 3) in {s.steps} steps; fp32 vs unsharded: {gap_text}"
               + (f"; FAIL: {why}" if why else ""))
    return Outcome("main_job", "PASS" if ok else "FAIL", summary, lines, figures)


def _pieces(model: nn.Module, opt: torch.optim.Optimizer) -> List[Tuple[str, torch.Tensor]]:
    """Every parameter's local piece and every optimizer state tensor's, in a fixed order."""
    out = []
    for name, p in model.named_parameters():
        out.append((name, vz.local_piece(p)))
        for key, value in sorted(opt.state.get(p, {}).items()):
            if torch.is_tensor(value):
                out.append((f"{name}:{key}", vz.local_piece(value) if hasattr(value, "to_local") else value))
    return out


def checkpoint(ctx: Context) -> Outcome:
    s = ctx.sizes
    path = os.path.join(ctx.workdir, "checkpoint")
    with world_of_one(ctx.device, ctx.timeout_s):
        batch = batches(s.gpt, s.global_batch, ctx.device)
        model, opt = build_main_job(s.gpt, ctx.device)
        for i in range(3):
            train_step(model, opt, batch(i))
        t0 = time.perf_counter()
        vz.checkpoint.save(path, model, opt, extra={"step": 3})
        save_s = time.perf_counter() - t0
        fresh, fresh_opt = build_main_job(replace(s.gpt, seed=s.gpt.seed + 1), ctx.device)
        t0 = time.perf_counter()
        extra = vz.checkpoint.load(path, fresh, fresh_opt)
        load_s = time.perf_counter() - t0
        saved, loaded = _pieces(model, opt), _pieces(fresh, fresh_opt)
        differ = [a for (a, x), (b, y) in zip(saved, loaded) if a != b or not torch.equal(x, y)]
        if len(saved) != len(loaded):
            differ.append(f"{len(saved)} tensors saved, {len(loaded)} loaded")
        with torch.no_grad():
            x, y = batch(3)
            next_equal = torch.equal(model(x, y), fresh(x, y))
    nbytes = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)
    ok = not differ and next_equal and extra == {"step": 3}
    figures = {"tensors": len(saved), "differ": differ[:10], "next_loss_equal": next_equal, "extra": extra,
               "save_s": save_s, "load_s": load_s, "bytes": nbytes}
    summary = (f"{len(saved)} parameter / optimizer-state pieces {'equal' if not differ else 'DIFFER'} after "
               f"load, next loss {'equal' if next_equal else 'DIFFERS'}; save {save_s:.2f} s, load {load_s:.2f} s, "
               f"{nbytes / MiB:.1f} MiB")
    if differ:
        summary += f"; first differing: {differ[0]}"
    return Outcome("checkpoint", "PASS" if ok else "FAIL", summary, [], figures)


def _caller(stack: traceback.StackSummary) -> str:
    """The innermost frame outside torch (who asked), and the innermost one (where in torch)."""
    outside = next((f for f in reversed(stack) if not f.filename.startswith(_TORCH_DIR)
                    and "warnings" not in os.path.basename(f.filename)), None)
    inner = stack[-1] if len(stack) else None
    where = lambda f: f"{'/'.join(f.filename.split(os.sep)[-2:])}:{f.lineno} {f.name}"  # noqa: E731
    if outside is None:
        return where(inner) if inner else "?"
    return where(outside) + (f" (in {where(inner)})" if inner is not None and inner is not outside else "")


def host_syncs(step: Callable[[], Any]) -> Counter:
    """Run ``step()`` under ``torch.cuda.set_sync_debug_mode("warn")``: every host synchronisation
    it makes, counted by who asked (:func:`_caller`)."""
    sites: Counter = Counter()

    def note(message, category, filename, lineno, file=None, line=None) -> None:
        # torch's own words for a sync (c10's warn_or_error_on_sync); torch 2.11's mode switch itself
        # warns about "synchronizing operations", which is not a sync of the step (H200, 2026-11-27)
        if SYNC_WARNING in str(message):
            sites[_caller(traceback.extract_stack()[:-1])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sites


def error_mode(step: Callable[[], Any]) -> str:
    """Run ``step()`` under ``torch.cuda.set_sync_debug_mode("error")``: "" if it ran through,
    else the error's line."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    except RuntimeError as e:
        return one_line(e)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return ""


def sync_debug(ctx: Context) -> Outcome:
    s = ctx.sizes
    with world_of_one(ctx.device, ctx.timeout_s):
        model, opt = build_main_job(s.gpt, ctx.device)
        batch = batches(s.gpt, s.global_batch, ctx.device)
        for i in range(2):  # warm-up: optimizer state, lazily built buffers
            train_step(model, opt, batch(i))
        watched = batch(2), batch(3)  # on the device first: a pageable host-to-device copy counts as a sync
        synchronize(ctx.device)
        sites = host_syncs(lambda: train_step(model, opt, watched[0]))
        synchronize(ctx.device)
        error = error_mode(lambda: train_step(model, opt, watched[1]))
    count = sum(sites.values())
    lines = [f"- {n} x {site}" for site, n in sites.most_common()]
    figures = {"syncs_in_warn_step": count, "sites": dict(sites), "error_mode_step": error or "ran through"}
    summary = f"{count} host syncs in one step (warn mode); error mode: {error or 'the step ran through'}"
    return Outcome("sync_debug", "PASS" if count == 0 and not error else "FAIL", summary, lines, figures)


def _describe_report(error: Exception) -> str:
    """One line for one sanitizer report: who accessed what, on which streams, asked from where."""
    try:
        cur, prev = error.current_access, error.previous_access
        op = lambda a: str(a.operator).split("(")[0]  # noqa: E731
        return (f"{prev.type} by {op(prev)} on stream {prev.stream}, then {cur.type} by {op(cur)} on stream "
                f"{cur.stream}, at {_caller(cur.stack_trace)}")
    except AttributeError:
        return str(error).strip().splitlines()[0][:300]


def sanitizer(ctx: Context) -> Outcome:
    reports: List[Exception] = []
    collect_sanitizer_reports(reports)
    s = ctx.sizes
    with world_of_one(ctx.device, ctx.timeout_s):
        model, opt = build_main_job(s.gpt, ctx.device)
        batch = batches(s.gpt, s.global_batch, ctx.device)
        losses = [train_step(model, opt, batch(i)) for i in range(s.sanitizer_steps)]
        synchronize(ctx.device)
        values = [loss.item() for loss in losses]
    kinds = Counter(_describe_report(e) for e in reports)
    lines = [f"- {n} x {text}" for text, n in kinds.most_common()]
    figures = {"steps": s.sanitizer_steps, "reports": len(reports), "distinct": dict(kinds), "losses": values}
    summary = f"{len(reports)} sanitizer reports in {s.sanitizer_steps} steps ({len(kinds)} distinct)"
    return Outcome("sanitizer", "PASS" if not reports else "FAIL", summary, lines, figures)
