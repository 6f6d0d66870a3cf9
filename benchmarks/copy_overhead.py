"""What FSDP2's copies around its collectives cost, against vescale-zero's zero-copy path.

    .venv/bin/python benchmarks/copy_overhead.py [--models llama3-70b gpt-oss-120b] [--sizes 8 64 1024]

FSDP2 shards each parameter on dim 0 and packs all of a group's shards rank-major, so it
copies around every collective: before the all-gather, the rank's shards into the gather
input (copy-in); after it, each parameter's m pieces out of the gathered buffer
(``split_with_sizes_copy``, copy-out); before the reduce-scatter, every gradient chunked
and interleaved into the scatter input (``_chunk_cat``, copy-in); after it, the reduced
shard. vescale-zero's parameters and gradients are views of the collective buffers, so
those copies do not happen (``tests/test_fully_shard.py`` asserts it by data pointers).

The copies need one GPU only: world size m is simulated by the shapes. Runs where CUDA
is present; elsewhere it says so and exits 0 (``--cpu`` runs it on the CPU anyway, with
--scale to shrink the layers, as a smoke test).
"""

from __future__ import annotations

import argparse
import sys

import torch
from tqdm import tqdm

from vescale_zero.model_shapes import MODEL_NAMES, layer_groups


def _bench(fn, device: torch.device, reps: int) -> float:
    fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps
    import time

    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return 1e3 * (time.perf_counter() - t0) / reps


def measure(shapes, m: int, dtype: torch.dtype, device: torch.device, reps: int):
    """ms of FSDP2's four copies for one group at world size m (dim-0 padding as FSDP2)."""
    padded = [((s[0] + m - 1) // m * m,) + tuple(s[1:]) for s in shapes]
    shard_numels = [torch.Size(p).numel() // m for p in padded]
    unsharded = [torch.empty(p, dtype=dtype, device=device) for p in padded]
    shards = [u.view(m, -1)[0] for u in unsharded]
    ag_in = torch.empty(sum(shard_numels), dtype=dtype, device=device)
    ag_out = torch.empty(m * sum(shard_numels), dtype=dtype, device=device)
    rs_in = torch.empty_like(ag_out)
    rs_out = torch.empty_like(ag_in)
    grads = [torch.empty_like(u) for u in unsharded]
    sharded_grads = [torch.empty(n, dtype=dtype, device=device) for n in shard_numels]
    outs = [u.view(m, -1) for u in unsharded]

    def ag_copy_in():
        torch.cat([s.reshape(-1) for s in shards], out=ag_in)

    def ag_copy_out():
        torch.split_with_sizes_copy(ag_out.view(m, -1), shard_numels, dim=1, out=outs)

    def rs_copy_in():
        torch._chunk_cat(grads, dim=0, num_chunks=m, out=rs_in.view(m, -1))

    def rs_copy_out():
        torch._foreach_copy_(sharded_grads, list(torch.split(rs_out, shard_numels)))

    item = torch.empty((), dtype=dtype).element_size()
    result = {}
    for name, fn, numel in (("ag_in", ag_copy_in, ag_in.numel()), ("ag_out", ag_copy_out, ag_out.numel()),
                            ("rs_in", rs_copy_in, rs_in.numel()), ("rs_out", rs_copy_out, rs_out.numel())):
        ms = _bench(fn, device, reps)
        result[name] = (ms, 2 * numel * item / (ms / 1e3) / 1e9)  # read + write
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["llama3-70b", "gpt-oss-120b"], choices=MODEL_NAMES)
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256, 1024])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--cpu", action="store_true", help="run on CPU (a smoke test; use --scale)")
    p.add_argument("--scale", type=int, default=1, help="divide every dim-0 by this (CPU smoke tests)")
    args = p.parse_args()
    if not torch.cuda.is_available() and not args.cpu:
        print("copy_overhead: no CUDA device here; skipped (pass --cpu --scale 64 for a CPU smoke run)")
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    dtype = torch.bfloat16
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, bf16; per step and layer, "
          "ms (GB/s) of the copies FSDP2 makes; vescale-zero makes none of them (0 ms)")
    print(f"{'model':14s} {'layer':14s} {'ranks':>6s} {'AG copy-in':>18s} {'AG copy-out':>18s} {'RS copy-in':>18s} "
          f"{'RS copy-out':>18s} {'total ms':>9s}")
    cases = [(model, g) for model in args.models for g in ("decoder_layer",) if g in layer_groups(model)]
    for model, gname in tqdm(cases, desc="layers", file=sys.stderr):
        shapes = [tuple(max(1, s[0] // args.scale) if i == 0 else d for i, d in enumerate(s)) for _, s in layer_groups(model)[gname]]
        for m in args.sizes:
            r = measure(shapes, m, dtype, device, args.reps)
            cells = " ".join(f"{r[k][0]:8.3f} ({r[k][1]:6.1f})" for k in ("ag_in", "ag_out", "rs_in", "rs_out"))
            print(f"{model:14s} {gname:14s} {m:6d} {cells} {sum(v[0] for v in r.values()):9.3f}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
