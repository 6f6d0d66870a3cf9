"""The work each FSDP implementation does around its collectives, every system measured alike.

    .venv/bin/python benchmarks/copy_overhead.py [--device cpu|cuda] [--models llama3-70b gpt-oss-120b]
        [--ranks 8 64] [--precisions fp32 bf16] [--fp8-tile 128] [--scale 32] [--reps 5] [--threads 1]

For one rank of an FSDP group of ``m`` ranks holding one decoder layer (shapes from
``vescale_zero/tools/model_shapes.py``), it builds the buffers each library builds, lays them out
as it lays them out (FSDP2: per-parameter dim-0 padding and rank-major packing; vescale-zero:
the planner's ragged layout, ``DBuffer``s, row granularity) and times the kernels each one
runs between its sharded parameters and its all-gather, and between autograd's gradients
and its sharded gradients. The collectives themselves are excluded for every system (no
process group: this measures one rank's local work, with the other ranks' data standing in
the gathered buffers). Allocations are excluded for every system (buffers are made once;
on GPU the caching allocator serves them). A kind a system does not run is measured anyway:
its function does what the library does there, i.e. nothing, and the table prints what the
timer saw.

What runs per kind for each system (a table: FSDP2 vs vescale-zero), and how it is timed:
``vescale_zero/tools/gpu_check/copy_overhead.py``, which the GPU check shares.

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
from typing import List, Sequence

import torch

from vescale_zero.tools.gpu_check.copy_overhead import (
    KINDS,
    PER_GATHER,
    PRECISIONS,
    System,
    auto_scale,
    fsdp2_system,
    measure,
    per_step,
    scaled,
    vescale_plan,
    vescale_system,
)
from vescale_zero.tools.model_shapes import MODEL_NAMES, layer_groups


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
    totals = {s.name: per_step(s, gathers)["per step"] for s in systems}
    for kind in KINDS:
        times = gathers if kind in PER_GATHER else 1
        med = {s.name: statistics.median(s.times[kind]) for s in systems}
        cells = [_cell(med[s.name], s.kinds[kind].nbytes) for s in systems]
        ratios = [_ratio(med[s.name], med[base.name], bool(s.kinds[kind].nbytes and base.kinds[kind].nbytes))
                  for s in systems[1:]]
        lines.append(f"{kind:16s} {times:6d} " + " ".join(cells) + " " + " ".join(f"{x:>15s}" for x in ratios))
    cells = [_cell(*totals[s.name]) for s in systems]
    ratios = [_ratio(totals[s.name][0], totals[base.name][0], True) for s in systems[1:]]
    lines.append(f"{'per step':16s} {'':6s} " + " ".join(cells) + " " + " ".join(f"{x:>15s}" for x in ratios))
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", nargs="+", default=["llama3-70b", "gpt-oss-120b"], choices=MODEL_NAMES)
    p.add_argument("--group", default="decoder_layer", help="layer group of vescale_zero.tools.model_shapes")
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
