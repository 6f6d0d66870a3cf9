"""FP8 all-gather: bytes on the wire per layer gather vs bf16, and the cost of the tiles.

    .venv/bin/python benchmarks/fp8_gather.py [--model llama3-8b] [--sizes 8 64 512]

Per FSDP size, for one transformer layer of the model: the bf16 gather (2 bytes/element of
the padded buffer), the fp8 gather (one byte slot per rank: 1 byte/element of the matrices +
one fp32 scale per 128x128 tile, bf16 for norms and biases, fp8_gather
[Note: one collective per group]), their ratio and the padding each layout costs (fp8 matrices
need whole 128-row tile bands). Then, on this machine, pack + unpack time of one rank's shard
against a plain bf16 cast of it (the work the fp8 path adds per gather).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vescale_zero.fp8_gather import FP8GatherLayout, default_fp8_filter, tile_band_granularity
from vescale_zero.model_shapes import MODEL_NAMES, group_specs, layer_groups
from vescale_zero.planner import TensorSpec, plan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODEL_NAMES, default="llama3-8b")
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 512])
    p.add_argument("--tile", type=int, default=128)
    p.add_argument("--timing-size", type=int, default=8, help="FSDP size of the timed shard")
    args = p.parse_args()
    groups = layer_groups(args.model)
    name = "decoder_layer" if "decoder_layer" in groups else max(groups, key=lambda g: len(groups[g]))
    layer = groups[name]
    shapes = [s for _, s in layer]
    fp8 = [default_fp8_filter(n, torch.empty(s, device="meta")) for n, s in layer]
    fp8_specs = [TensorSpec(torch.Size(s).numel(), tile_band_granularity(s, args.tile) if f else 1, n)
                 for (n, s), f in zip(layer, fp8)]
    print(f"{args.model}, group {name!r}: {sum(torch.Size(s).numel() for s in shapes):,d} elements, tile {args.tile}")
    print(f"{'ranks':>6s} {'bf16 MiB':>10s} {'fp8 MiB':>10s} {'fp8/bf16':>9s} {'row pad %':>10s} {'band pad %':>11s}")
    for ws in args.sizes:
        rows = plan(group_specs(layer, "row"), ws)
        bands = plan(fp8_specs, ws)
        layout = FP8GatherLayout(bands, shapes, args.tile, fp8, torch.bfloat16)
        bf16 = rows.global_size * 2
        wire = ws * layout.slot_bytes
        print(f"{ws:6d} {bf16 / 2**20:10.2f} {wire / 2**20:10.2f} {wire / bf16:9.3f} "
              f"{100 * rows.padding_ratio:10.3f} {100 * bands.padding_ratio:11.3f}")

    ws = args.timing_size
    bands = plan(fp8_specs, ws)
    layout = FP8GatherLayout(bands, shapes, args.tile, fp8, torch.bfloat16)
    S = bands.shard_size
    master = torch.randn(S)
    slot = torch.zeros(layout.slot_bytes, dtype=torch.uint8)
    layout.pack_local(0, master, slot)
    gathered = slot.repeat(ws)  # rank 0's bytes in every slot: the values do not matter for the time
    out = torch.empty(bands.global_size, dtype=torch.bfloat16)

    def timed(fn, n=5):
        fn()
        times = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return 1e3 * statistics.median(times)

    quant = timed(lambda: layout.pack_local(0, master, slot))
    deq = timed(lambda: layout.unpack_full(gathered, out))
    cast = timed(lambda: master.to(torch.bfloat16))
    print(f"\none shard at {ws} ranks ({S:,d} elements), CPU, {torch.get_num_threads()} threads, median of 5:")
    print(f"  pack own slot {quant:.1f} ms | unpack gathered {deq:.1f} ms | "
          f"bf16 cast of the shard {cast:.1f} ms")


if __name__ == "__main__":
    main()
