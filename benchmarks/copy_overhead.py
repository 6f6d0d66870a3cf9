"""The work each FSDP implementation does around its collectives, every system measured alike.

    .venv/bin/python benchmarks/copy_overhead.py [--device cpu|cuda] [--models llama3-70b gpt-oss-120b]
        [--ranks 8 64] [--precisions fp32 bf16] [--fp8-tile 128] [--scale 32] [--reps 5] [--threads 1]

For one rank of an FSDP group of ``m`` ranks holding one decoder layer (shapes from
``vescale_zero/model_shapes.py``), it builds the buffers each library builds, lays them out
as it lays them out (FSDP2: per-parameter dim-0 padding and rank-major packing; vescale-zero:
the planner's ragged layout, ``DBuffer``s, row granularity) and times the kernels each one
runs between its sharded parameters and its all-gather, and between autograd's gradients
and its sharded gradients. The collectives themselves are excluded for every system (no
process group: this measures one rank's local work, with the other ranks' data standing in
the gathered buffers). Allocations are excluded for every system (buffers are made once;
on GPU the caching allocator serves them). A kind a system does not run is measured anyway:
its function does what the library does there, i.e. nothing, and the table prints what the
timer saw.

Per kind, what runs (read from torch's ``_fsdp_collectives.py`` / ``_fsdp_param.py`` and our
``param_group.py`` / ``fp8_gather.py``; reshard after forward, so two all-gathers per step):

======================  ===========================================  ==========================================
kind                    FSDP2 (``fully_shard``, Shard(0))            vescale-zero (``fully_shard``, ragged)
======================  ===========================================  ==========================================
AG copy-in  (x gathers) mixed precision: ``_foreach_copy_`` of the    mixed precision: one ``copy_`` casting the
                        padded fp32 shards into a flat bf16 input,    fp32 master shard into the bf16 gather
                        then ``_foreach_copy_`` of it into the gather input; fp32: nothing (the gather input
                        output's rank slice; fp32: the second only    *is* the master shard). FP8: quantize the
                                                                      shard's tiles (``FP8GatherLayout``)
AG copy-out (x gathers) ``split_with_sizes_copy`` of the rank-major   nothing (parameters are views of the
                        gathered buffer into each parameter           gathered buffer). FP8: dequantize the
                                                                      gathered fp8 buffer into it
grad accumulate         nothing: autograd's gradient tensor is        nothing: autograd's gradient tensor is
                        taken as is (AccumulateGrad steals it)        taken as is (AccumulateGrad steals it)
RS copy-in              ``_chunk_cat`` of the gradients into the      zero the input's padding, then one ``copy_``
                        rank-major reduce-scatter input, cast to the  per gradient into its view of the input,
                        reduce dtype in the same kernel               cast to the reduce dtype in the same kernel
RS copy-out             reduce dtype != param's own: a cast of the    reduce dtype != param's own: one ``copy_``
                        output; then ``as_strided`` views per         of the output into the sharded gradient;
                        parameter (no copy)                           else nothing; ``narrow`` views per parameter
======================  ===========================================  ==========================================

GB/s counts bytes read + bytes written by the kernels of a kind. ``vescale/fsdp2`` is the
ratio of medians measured in this run; a kind where either system runs nothing prints ``-``
there (both times are still printed, as measured), the per-step total always has its ratio.
Precisions: ``fp32`` (no mixed precision), ``bf16`` (bf16 params and gradients, fp32
reduce and master), ``bf16-reduce`` (bf16 params and reduce, fp32 master). FP8 (vescale-zero
``fp8_all_gather_tile``) is shown where its tile-band plan pads less than ``--fp8-max-pad``;
FSDP2's FP8 all-gather needs torchao and is not measured here.

``--scale N`` divides the last dimension of every tensor of >= 2 dimensions by N (dim 0, the
dimension FSDP2 shards and vescale's rows run along, is kept, so both layouts keep their
padding pattern); the default fits a CPU machine (32) and, on CUDA, is the smallest power of 2
that fits the device (80 GB: 1 for a Llama-3-70B layer alone, 2 with GPT-OSS-120B). Device-agnostic:
``--device cuda`` times with CUDA events, ``cpu`` with ``perf_counter``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from vescale_zero.dbuffer import DBuffer
from vescale_zero.fp8_gather import FP8GatherLayout, tile_band_granularity
from vescale_zero.granularity import preset_granularity
from vescale_zero.model_shapes import MODEL_NAMES, layer_groups
from vescale_zero.planner import TensorSpec, plan

KINDS = ("AG copy-in", "AG copy-out", "grad accumulate", "RS copy-in", "RS copy-out")
PER_GATHER = ("AG copy-in", "AG copy-out")  # run on every all-gather
# name: (original / master dtype, param dtype, reduce dtype)
PRECISIONS = {
    "fp32": (torch.float32, torch.float32, torch.float32),
    "bf16": (torch.float32, torch.bfloat16, torch.float32),
    "bf16-reduce": (torch.float32, torch.bfloat16, torch.bfloat16),
}
ALIGN_BYTES = 16  # vescale_zero.fully_shard.DEFAULT_ALIGN_BYTES


def _noop() -> None:
    """A kind the library does not run: timed like any other."""


@dataclass
class Kernels:
    """What one system runs for one kind: a callable and the bytes it reads + writes."""

    fn: Callable[[], None] = _noop
    nbytes: int = 0


@dataclass
class System:
    name: str
    kinds: Dict[str, Kernels]
    note: str = ""
    times: Dict[str, List[float]] = field(default_factory=dict)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def scaled(shapes: Sequence[Tuple[int, ...]], scale: int) -> List[Tuple[int, ...]]:
    """Divide the last dim of every >= 2-D shape by ``scale`` (dim 0 kept)."""
    return [tuple(s[:-1]) + (max(1, s[-1] // scale),) if len(s) >= 2 else tuple(s) for s in shapes]


def fsdp2_system(shapes, m: int, precision: str, device: torch.device) -> System:
    """One rank (rank 0) of PyTorch FSDP2 ``fully_shard`` over ``m`` ranks, one group.

    Mirrors ``foreach_all_gather`` (``_get_param_all_gather_inputs`` + ``all_gather_copy_in``),
    ``foreach_all_gather_copy_out`` and ``foreach_reduce`` in torch 2.13."""
    orig, param, reduce = PRECISIONS[precision]
    mixed = param != orig
    rows = [-(-s[0] // m) for s in shapes]  # padded dim-0 chunk per rank
    rest = [math.prod(s[1:]) for s in shapes]
    numels = [r * c for r, c in zip(rows, rest)]
    total = sum(numels)
    sharded = [torch.randn(n, dtype=orig, device=device) for n in numels]  # _sharded_param_data
    ag_out = torch.empty(m * total, dtype=param, device=device)
    ag_in = ag_out.narrow(0, 0, total)  # rank 0's slice: all_gather_copy_in
    ag_in_pieces = list(torch.split(ag_in, numels))
    flat = torch.empty(total if mixed else 0, dtype=param, device=device)  # the foreach-copy input under MP
    flat_pieces = list(torch.split(flat, numels)) if mixed else []

    def ag_copy_in() -> None:
        if mixed:
            torch._foreach_copy_(flat_pieces, sharded)  # the cast to param_dtype
            torch._foreach_copy_(ag_in_pieces, flat_pieces)
        else:
            torch._foreach_copy_(ag_in_pieces, sharded)

    p, o, r = _size(param), _size(orig), _size(reduce)
    ag_in_bytes = total * (o + p) + total * 2 * p if mixed else total * (o + p)
    gathered = [torch.empty(m * n, dtype=param, device=device) for n in numels]  # all_gather_outputs
    gathered_2d = [g.view(m, -1) for g in gathered]
    ag_out_2d = ag_out.view(m, -1)

    def ag_copy_out() -> None:
        torch.split_with_sizes_copy(ag_out_2d, numels, dim=1, out=gathered_2d)

    grads = [torch.randn(s, dtype=param, device=device) for s in shapes]  # autograd's, unpadded
    rs_in = torch.empty(m * total, dtype=reduce, device=device)
    rs_in_2d = rs_in.view(m, -1)

    def rs_copy_in() -> None:
        torch._chunk_cat(grads, dim=0, num_chunks=m, out=rs_in_2d)

    rs_out = torch.randn(total, dtype=reduce, device=device)
    shard_shapes = [(min(rw, s[0]),) + tuple(s[1:]) for rw, s in zip(rows, shapes)]
    views = [(shape, torch.empty(shape, device="meta").stride(), sum(numels[:i]))  # contiguous_sharded_stride
             for i, shape in enumerate(shard_shapes)]

    def rs_copy_out() -> None:
        out = rs_out if reduce == orig else rs_out.to(orig)  # _to_dtype_if_needed
        for shape, stride, off in views:  # new_sharded_grad
            torch.as_strided(out, size=shape, stride=stride, storage_offset=off)

    grad_numel = sum(math.prod(s) for s in shapes)
    return System("fsdp2", {
        "AG copy-in": Kernels(ag_copy_in, ag_in_bytes),
        "AG copy-out": Kernels(ag_copy_out, 2 * m * total * p),
        "grad accumulate": Kernels(),
        "RS copy-in": Kernels(rs_copy_in, grad_numel * p + m * total * r),
        "RS copy-out": Kernels(rs_copy_out, 0 if reduce == orig else total * (r + o)),
    }, note=f"padding {100 * (m * total - grad_numel) / (m * total):.2f}%")


def vescale_plan(shapes, m: int, precision: str, fp8_tile: Optional[int]):
    """The plan ``fully_shard`` makes: row granularity (FP8: whole tile bands for the matrices,
    fp8_gather [Note: which tensors are FP8]), 16-byte alignment."""
    orig, param, reduce = PRECISIONS[precision]
    specs = [TensorSpec(math.prod(s), tile_band_granularity(s, fp8_tile) if fp8_tile and len(s) >= 2
                        else preset_granularity(s, "row"), str(i)) for i, s in enumerate(shapes)]
    align = max(1, ALIGN_BYTES // min(_size(d) for d in (orig, param, reduce)))
    return plan(specs, m, align=align)


def vescale_system(shapes, m: int, precision: str, device: torch.device, fp8_tile: Optional[int] = None) -> System:
    """One rank (rank 0) of vescale-zero ``fully_shard``: the buffers of ``ParamGroup`` as
    ``DBuffer``s and the kernels its unshard / post_backward / finish_grad_sync run."""
    orig, param, reduce = PRECISIONS[precision]
    pl = vescale_plan(shapes, m, precision, fp8_tile)
    S, G = pl.shard_size, pl.global_size
    new = lambda dtype, **kw: DBuffer(pl, 0, dtype, device, shapes=shapes, **kw)  # noqa: E731
    master = new(orig, with_full=False)
    master.local.normal_()
    compute = new(orig, local=master.local) if param == orig else new(param)
    grad = new(reduce, with_local=False)  # GradReducer.full: the reduce-scatter's input
    sharded_grad = new(orig, with_full=False)
    for buf in (compute, grad):
        buf.allocate(zero=True)
    p, o, r = _size(param), _size(orig), _size(reduce)
    kinds: Dict[str, Kernels] = {}
    if fp8_tile:
        layout = FP8GatherLayout(pl, shapes, fp8_tile, [len(s) >= 2 for s in shapes], param)
        B = layout.slot_bytes
        slot = torch.zeros(B, dtype=torch.uint8, device=device)
        layout.pack_local(0, master.local, slot)
        gathered = slot.repeat(m)  # the other ranks' bytes stand in

        def quantize() -> None:
            layout.pack_local(0, master.local, slot)

        def dequantize() -> None:
            layout.unpack_full(gathered, compute.full)

        kinds["AG copy-in"] = Kernels(quantize, S * o + B)
        kinds["AG copy-out"] = Kernels(dequantize, m * B + G * p)
    elif param != orig:
        kinds["AG copy-in"] = Kernels(lambda: compute.local.copy_(master.local), S * (o + p))
        kinds["AG copy-out"] = Kernels()
    else:
        kinds["AG copy-in"] = Kernels()
        kinds["AG copy-out"] = Kernels()

    new_grads = [torch.randn(s, dtype=param, device=device) for s in shapes]  # autograd's
    grad_views = [grad.full_view(i) for i in range(len(shapes))]

    def copy_in() -> None:  # GradReducer._copy_in: the padding zeroed, each gradient copied (and cast) in
        grad.zero_padding()
        for view, g in zip(grad_views, new_grads):
            view.copy_(g)

    grad_numel = sum(math.prod(s) for s in shapes)
    kinds["grad accumulate"] = Kernels()  # autograd's gradients stay its own until the reduce-scatter
    kinds["RS copy-in"] = Kernels(copy_in, (G - grad_numel) * r + grad_numel * (p + r))
    out = sharded_grad.local if reduce == orig else torch.randn(S, dtype=reduce, device=device)

    def rs_copy_out() -> None:
        if out is not sharded_grad.local:
            sharded_grad.local.copy_(out)  # finish_grad_sync: one cast per group
        for i in range(len(shapes)):  # sp.grad = sharded_grad.local_view(i)
            sharded_grad.local_view(i)

    kinds["RS copy-out"] = Kernels(rs_copy_out, 0 if reduce == orig else S * (r + o))
    return System("vescale-fp8" if fp8_tile else "vescale", kinds, note=f"padding {100 * pl.padding_ratio:.2f}%")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], None], device: torch.device) -> float:
    """Wall time of ``fn`` in ms, device work included (CUDA events on GPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _sync(device)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def measure(systems: Sequence[System], device: torch.device, reps: int) -> None:
    """Median over ``reps`` of every kind of every system, interleaved (one warm-up round)."""
    for s in systems:
        s.times = {k: [] for k in KINDS}
    for rep in range(reps + 1):
        for s in systems:
            for kind in KINDS:
                ms = time_ms(s.kinds[kind].fn, device)
                if rep:
                    s.times[kind].append(ms)


def _cell(ms: float, nbytes: int) -> str:
    gbs = f"{nbytes / (ms / 1e3) / 1e9:7.1f}" if nbytes and ms > 0 else "      -"
    return f"{ms:9.3f} ({gbs})"


def _ratio(a: float, b: float, moved: bool) -> str:
    return f"{a / b:9.3f}" if moved and b > 0 else "        -"


def report(systems: Sequence[System], gathers: int) -> List[str]:
    """Rows per kind and the per-step total; ratios against the first system (FSDP2)."""
    base = systems[0]
    head = f"{'kind':16s} {'x/step':>6s} " + " ".join(f"{s.name + ' ms (GB/s)':>19s}" for s in systems)
    head += " " + " ".join(f"{s.name + '/' + base.name:>15s}" for s in systems[1:])
    lines = [head]
    totals = {s.name: [0.0, 0] for s in systems}
    for kind in KINDS:
        per_step = gathers if kind in PER_GATHER else 1
        med = {s.name: statistics.median(s.times[kind]) for s in systems}
        cells = []
        for s in systems:
            cells.append(_cell(med[s.name], s.kinds[kind].nbytes))
            totals[s.name][0] += per_step * med[s.name]
            totals[s.name][1] += per_step * s.kinds[kind].nbytes
        ratios = [_ratio(med[s.name], med[base.name], bool(s.kinds[kind].nbytes and base.kinds[kind].nbytes))
                  for s in systems[1:]]
        lines.append(f"{kind:16s} {per_step:6d} " + " ".join(cells) + " " + " ".join(f"{x:>15s}" for x in ratios))
    cells = [_cell(*totals[s.name]) for s in systems]
    ratios = [_ratio(totals[s.name][0], totals[base.name][0], True) for s in systems[1:]]
    lines.append(f"{'per step':16s} {'':6s} " + " ".join(cells) + " " + " ".join(f"{x:>15s}" for x in ratios))
    return lines


def auto_scale(models: Sequence[str], group: str, device: torch.device) -> int:
    """The smallest power of 2 that fits the largest layer in 80% of the free device memory,
    allowing ~32 bytes per element (FSDP2's and vescale-zero's fp32 buffers side by side)."""
    free, _ = torch.cuda.mem_get_info(device)
    scale = 1
    while True:
        worst = max(sum(math.prod(s) for s in scaled([s for _, s in layer_groups(m)[group]], scale)) for m in models)
        if 32 * worst <= 0.8 * free or scale >= 1024:
            return scale
        scale *= 2


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", nargs="+", default=["llama3-70b", "gpt-oss-120b"], choices=MODEL_NAMES)
    p.add_argument("--group", default="decoder_layer", help="layer group of vescale_zero.model_shapes")
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64], help="FSDP sizes m (one rank's work is timed)")
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=list(PRECISIONS))
    p.add_argument("--fp8-tile", type=int, default=128, help="vescale-zero FP8 all-gather tile (0: leave FP8 out)")
    p.add_argument("--fp8-max-pad", type=float, default=0.25, help="leave FP8 out where its plan pads more than this")
    p.add_argument("--gathers", type=int, default=2, help="all-gathers per step (2: reshard after forward)")
    p.add_argument("--scale", type=int, default=None,
                   help="divide every >= 2-D tensor's last dim (default: 32 on CPU; on CUDA the smallest power of 2 "
                        "that fits the device)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (1: steadier on a shared machine, where spinning OpenMP threads get descheduled)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    scale = args.scale or (auto_scale(args.models, args.group, device) if device.type == "cuda" else 32)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"copy_overhead: {name}; one rank's work around its collectives (collectives and allocations excluded "
          f"for every system), median of {args.reps}, interleaved; {args.gathers} all-gathers + 1 reduce-scatter "
          f"per step; last dim of >= 2-D tensors / {scale}")
    for model in args.models:
        group = layer_groups(model)[args.group]
        shapes = scaled([s for _, s in group], scale)
        n = sum(math.prod(s) for s in shapes)
        for precision in args.precisions:
            for m in args.ranks:
                systems = [fsdp2_system(shapes, m, precision, device), vescale_system(shapes, m, precision, device)]
                skipped = ""
                if args.fp8_tile:
                    fp8_pad = vescale_plan(shapes, m, precision, args.fp8_tile).padding_ratio
                    if fp8_pad <= args.fp8_max_pad:
                        systems.append(vescale_system(shapes, m, precision, device, args.fp8_tile))
                    else:
                        skipped = f"; FP8 left out: its {args.fp8_tile}-row tile bands pad {100 * fp8_pad:.0f}%"
                measure(systems, device, args.reps)
                notes = ", ".join(f"{s.name} {s.note}" for s in systems)
                print(f"\n{model} {args.group} ({n / 1e6:.1f}M elements), {precision}, {m} ranks: {notes}{skipped}")
                print("\n".join(report(systems, args.gathers)))
                del systems
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
