"""``vescale-zero``: command-line tools.

    vescale-zero plan --model llama3-70b --granularity row [--sizes 8 64 1024] [--plot pad.png] [--gpus 4096]
    vescale-zero plan --shapes my_model.json ...
    vescale-zero consolidate CKPT model.safetensors [--optimizer]
    vescale-zero convert --from fsdp2|deepspeed|megatron SRC DST [--tag T] [--iteration N] [--layer-spec local|te]
                         [--weights-only]

``plan`` prints, per FSDP group (one instance) and FSDP size, the shard size, padding, planning
time, bytes per rank and the order the planner laid the group out in (``model``, or another
order where that pads less, see ``planner.plan``), then the whole model (each group times its
instances, e.g. 80 decoder layers); ``--plot`` draws padding against FSDP size beside FSDP2's dim-0 padding,
ZeRO-3's flat padding and Megatron-FSDP's alignment; ``--gpus N`` lists every HSDP shape
``init_device_mesh(device_type, (replicas, shard), mesh_dim_names=("replicate", "shard"))`` of N GPUs
(what ``fully_shard`` takes) with its padding and its all-gather, reduce-scatter and cross-replica
all-reduce bytes per rank and step, and suggests one.

``convert`` is the one place of the core that reaches into the adapters: DeepSpeed's and Megatron's
checkpoint converters live with their hosts (``vescale_zero.integrations.*.checkpoint_conversion``)
and are imported only when ``--from deepspeed`` / ``--from megatron`` asks for them (:func:`convert`).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from ..primitives.granularity import describe_rows_short, preset_granularity, rows_short_of_preset
from ..primitives.planner import MODEL_ORDER, plan
from .model_shapes import (
    MODEL_NAMES,
    Group,
    fsdp2_padding,
    group_counts,
    group_specs,
    layer_groups,
    load_shapes,
    megatron_fsdp_padding,
    zero3_padding,
)

__all__ = ["HSDPTraffic", "hsdp_traffic", "main"]

DEFAULT_SIZES = [2**k for k in range(3, 15)]


MODEL_ROW = "(model)"
"""The ``group`` of a table's whole-model row: every group times its instances."""


def _padding_table(groups: Dict[str, Group], counts: Dict[str, int], policy: str, sizes: Sequence[int],
                   dtype_bytes: int) -> List[dict]:
    """Per FSDP size: a row per group (one instance of it) and a :data:`MODEL_ROW` row for the
    whole model (each group's numbers times its instance count, summed)."""
    rows = []
    for m in sizes:
        total = pad = shard = reordered = 0
        ms = 0.0
        for name, group in groups.items():
            specs = group_specs(group, policy)
            t0 = time.perf_counter()
            p = plan(specs, m)
            elapsed = 1e3 * (time.perf_counter() - t0)
            ms = max(ms, elapsed)
            n = counts.get(name, 1)
            total += n * sum(s.numel for s in specs)
            pad += n * p.padding
            shard += n * p.shard_size
            reordered += p.order != MODEL_ORDER
            rows.append({"group": name, "count": n, "ranks": m, "shard": p.shard_size,
                         "padding_pct": 100 * p.padding_ratio, "ms": elapsed,
                         "mib_per_rank": p.shard_size * dtype_bytes / 2**20, "order": p.order})
        keep_rows = policy != "element"
        peers = {"fsdp2_pct": [fsdp2_padding(g, m) for g in groups.values()],
                 "zero3_pct": [zero3_padding(g, m) for g in groups.values()],
                 "megatron_fsdp_pct": [megatron_fsdp_padding(g, m, keep_rows) for g in groups.values()]}
        rows.append({"group": MODEL_ROW, "count": sum(counts.get(name, 1) for name in groups), "ranks": m,
                     "shard": shard, "padding_pct": 100 * pad / (total + pad), "ms": ms,
                     "mib_per_rank": shard * dtype_bytes / 2**20,
                     "order": f"{reordered} of {len(groups)} reordered",
                     **{key: _pct(sum(counts.get(name, 1) * p for name, p in zip(groups, pads)), total)
                        for key, pads in peers.items()}})
    return rows


def _pct(pad: int, total: int) -> float:
    return 100.0 * pad / (total + pad)


def _plot(rows: List[dict], title: str, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    summary = [r for r in rows if r["group"] == MODEL_ROW]
    xs = [r["ranks"] for r in summary]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, label, style in (("padding_pct", "vescale-zero (planner)", "o-"), ("fsdp2_pct", "FSDP2 (dim-0)", "s--"),
                              ("zero3_pct", "ZeRO-3 (flat: cuts rows)", "^:"),
                              ("megatron_fsdp_pct", "Megatron-FSDP (bound)", "d-.")):
        ax.plot(xs, [max(r[key], 1e-4) for r in summary], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("FSDP size (ranks)")
    ax.set_ylabel("padding, % of buffer (0 drawn at 1e-4)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


GATHERS_PER_STEP = 2
"""All-gathers of each group per training step: forward, and again in backward (``reshard_after_forward=True``,
``fully_shard``'s default, frees the full parameters between the two)."""


@dataclass(frozen=True)
class HSDPTraffic:
    """Bytes one rank sends per training step under HSDP ``replicas x shard`` (bandwidth-optimal ring
    collectives; each rank receives as many): the all-gathers and the reduce-scatter run inside the
    shard group, the all-reduce of the reduced shard across the replicas (the only inter-group bytes)."""

    all_gather: int
    reduce_scatter: int
    all_reduce: int


def hsdp_traffic(shard_numel: int, shard: int, replicas: int, param_bytes: int, reduce_bytes: int,
                 gathers: int = GATHERS_PER_STEP) -> HSDPTraffic:
    """Per-rank bytes per step of a model whose shard (all its groups) holds ``shard_numel`` elements.

    A ring all-gather or reduce-scatter over ``shard`` ranks sends ``shard - 1`` shards; a ring
    all-reduce over ``replicas`` ranks sends ``2 (replicas - 1) / replicas`` of the buffer.
    """
    return HSDPTraffic(gathers * (shard - 1) * shard_numel * param_bytes, (shard - 1) * shard_numel * reduce_bytes,
                       2 * (replicas - 1) * shard_numel * reduce_bytes // replicas)


def _suggest_hsdp(groups: Dict[str, Group], counts: Dict[str, int], policy: str, gpus: int, dtype_bytes: int,
                  reduce_bytes: int, max_padding: float) -> None:
    """Every ``replicas x shard`` mesh of ``gpus`` ranks (shard >= 2) with its padding, memory and traffic;
    the suggestion is the largest shard size (least memory per rank) whose padding stays within
    ``max_padding``%, the least padding if none does."""
    shapes = [m for m in range(2, gpus + 1) if gpus % m == 0]
    rows = _padding_table(groups, counts, policy, shapes, dtype_bytes)
    summary = [r for r in rows if r["group"] == MODEL_ROW]
    within = [r for r in summary if r["padding_pct"] <= max_padding]
    best = max(within, key=lambda r: r["ranks"]) if within else min(summary, key=lambda r: r["padding_pct"])
    mib = 2**20
    print(f"\nHSDP shapes for {gpus} GPUs ({policy} blocks): replicas x shard, whole model, per rank and step "
          f"({dtype_bytes}-byte gathers, {reduce_bytes}-byte reductions)")
    print(f"{'shard':>6s} {'replicas':>8s} {'padding %':>10s} {'MiB/rank':>10s} {'all-gather MiB':>15s} "
          f"{'reduce-scatter MiB':>19s} {'all-reduce MiB':>15s}")
    for r in summary:
        t = hsdp_traffic(r["shard"], r["ranks"], gpus // r["ranks"], dtype_bytes, reduce_bytes)
        mark = "  <- suggested" if r is best else ""
        print(f"{r['ranks']:6d} {gpus // r['ranks']:8d} {r['padding_pct']:10.3f} {r['mib_per_rank']:10.1f} "
              f"{t.all_gather / mib:15.1f} {t.reduce_scatter / mib:19.1f} {t.all_reduce / mib:15.1f}{mark}")
    print(f"  all-gather: {GATHERS_PER_STEP} per step (forward; backward after reshard_after_forward), inside the "
          "shard group;\n  reduce-scatter: inside the shard group; all-reduce: the reduced shard across replicas "
          "(the only bytes between shard groups).\n  Ring algorithms: each rank sends (and receives) these bytes.")
    why = (f"the largest shard size with padding <= {max_padding}%" if within
           else f"no shape pads <= {max_padding}%; the least padding")
    replicas = gpus // best["ranks"]
    print(f"suggestion: FSDP size {best['ranks']} x {replicas} replicas, "
          f"{best['padding_pct']:.3f}% padding, {best['mib_per_rank']:.1f} MiB/rank ({why}):\n"
          f"  fully_shard(module, mesh=init_device_mesh(device_type, ({replicas}, {best['ranks']}), "
          f"mesh_dim_names=(\"replicate\", \"shard\")))")


_LEGEND = """\
  count      instances of the group in the model (its layers); the {model} row sums count x per instance
  shard      elements per rank of one instance's buffer (the {model} row: of the whole model)
  padding %  of that buffer; fsdp2 / zero3 / mfsdp %: the whole model padded by FSDP2 (dim 0),
             ZeRO-3 (flat) and Megatron-FSDP (bound); plan ms: planning time (the {model} row: the longest)
  MiB/rank   shard x element bytes
  order      the layout order the planner chose (model, or another where that pads less)"""


def _cmd_plan(args: argparse.Namespace) -> int:
    if args.shapes:
        groups, counts = load_shapes(args.shapes)
    else:
        groups, counts = layer_groups(args.model), group_counts(args.model)
    name = args.shapes or args.model
    rows = _padding_table(groups, counts, args.granularity, args.sizes, args.dtype_bytes)
    print(f"{name}, {args.granularity} blocks, {args.dtype_bytes}-byte elements")
    params = [(f"{g}.{p}", shape) for g, group in groups.items() for p, shape in group]
    short = rows_short_of_preset(params, args.granularity)
    if short:
        print(f"note: {describe_rows_short(args.granularity, short, len(params))}")
    print(f"{'group':24s} {'count':>5s} {'ranks':>6s} {'shard':>14s} {'padding %':>10s} {'plan ms':>8s} "
          f"{'MiB/rank':>10s} {'fsdp2 %':>8s} {'zero3 %':>8s} {'mfsdp %':>8s}  order")
    for r in rows:
        extra = (" " * 27 if r["group"] != MODEL_ROW
                 else f" {r['fsdp2_pct']:8.3f} {r['zero3_pct']:8.4f} {r['megatron_fsdp_pct']:8.3f}")
        print(f"{r['group'][:24]:24s} {r['count']:5d} {r['ranks']:6d} {r['shard']:14,d} {r['padding_pct']:10.3f} "
              f"{r['ms']:8.2f} {r['mib_per_rank']:10.1f}{extra}  {r['order']}")
    print(_LEGEND.format(model=MODEL_ROW))
    if args.plot:
        _plot(rows, f"{name}: padding vs FSDP size ({args.granularity} blocks)", args.plot)
        print(f"wrote {args.plot}")
    if args.gpus:
        reduce_bytes = args.reduce_dtype_bytes or args.dtype_bytes
        _suggest_hsdp(groups, counts, args.granularity, args.gpus, args.dtype_bytes, reduce_bytes, args.max_padding)
    return 0


def _granularity_error(value: str) -> Optional[str]:
    """Why ``--granularity value`` is not a preset (``None`` if it is one)."""
    try:
        preset_granularity((2, 2), value)
    except ValueError as e:
        n = value.strip()
        hint = f"; did you mean '{n}rows' ({n} rows per block)?" if n.isdigit() else ""
        return f"--granularity {value!r}: {e}{hint}"
    return None


def _save_safetensors(state: dict, output: str) -> None:
    import torch

    try:
        from safetensors.torch import save_file
    except ImportError:
        raise SystemExit(f"writing {output} needs safetensors: pip install safetensors (or write a .pt file)") from None
    others = sorted(k for k, v in state.items() if not torch.is_tensor(v))
    if others:
        raise SystemExit(f"{output}: safetensors holds tensors only, and {others[:3]} are not (per-block optimizer "
                         "state such as Shampoo's); write a .pt file, or drop --optimizer")
    # Tied parameters share storage, which safetensors refuses: each name gets its own copy.
    save_file({k: v.contiguous().clone() for k, v in state.items()}, output)


def _cmd_consolidate(args: argparse.Namespace) -> int:
    import torch

    from ..checkpoint import CheckpointError, consolidate

    try:
        state = consolidate(args.checkpoint, with_optimizer=args.optimizer)
    except (CheckpointError, ValueError) as e:
        print(f"vescale-zero consolidate: {e}", file=sys.stderr)
        return 2
    if args.output.endswith(".safetensors"):
        _save_safetensors(state, args.output)
    else:
        torch.save(state, args.output)
    tensors = [v for v in state.values() if torch.is_tensor(v)]
    mib = sum(t.numel() * t.element_size() for t in tensors) / 2**20
    print(f"wrote {args.output}: {len(state)} entries, {sum(t.numel() for t in tensors):,d} elements, {mib:.1f} MiB")
    return 0


SOURCES = ("fsdp2", "deepspeed", "megatron")


def convert(source: str, src: str, dst: str, tag: Optional[str] = None, weights_only: bool = False,
            iteration: Optional[int] = None, layer_spec: str = "local") -> None:
    """``vescale-zero convert --from SOURCE SRC DST``; ``tag`` is DeepSpeed's, ``iteration`` and
    ``layer_spec`` Megatron's. A host's converter is its adapter's, imported here, lazily: the
    command is a tool at the top layer, and the rest of the core imports no adapter."""
    from ..checkpoint import CheckpointError, from_fsdp2

    if source == "fsdp2":
        from_fsdp2(src, dst, weights_only=weights_only)
    elif source == "deepspeed":
        from ..integrations.deepspeed.checkpoint_conversion import from_deepspeed

        from_deepspeed(src, tag, dst, weights_only=weights_only)
    elif source == "megatron":
        from ..integrations.megatron.checkpoint_conversion import from_megatron

        from_megatron(src, dst, iteration=iteration, layer_spec=layer_spec, weights_only=weights_only)
    else:
        raise CheckpointError(f"--from {source!r}: choose {', '.join(SOURCES)}")


def _cmd_convert(args: argparse.Namespace) -> int:
    from ..checkpoint import CheckpointError

    try:
        convert(args.source, args.src, args.dst, tag=args.tag, weights_only=args.weights_only,
                iteration=args.iteration, layer_spec=args.layer_spec)
    except CheckpointError as e:
        print(f"vescale-zero convert: {e}", file=sys.stderr)
        return 2
    where = ("at TP = PP = EP = 1 and any data-parallel size" if args.source == "megatron" else "at any world size")
    print(f"wrote {args.dst}: load it {where} with vescale_zero.checkpoint.load")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="vescale-zero", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="padding, shard size and planning time per FSDP size")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", choices=MODEL_NAMES, help="a model preset")
    src.add_argument("--shapes", help='your model: JSON {"group": [["param", [dims]], ...]}')
    p.add_argument("--granularity", default="row", help="element | row | <N>rows (default: row)")
    p.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES, help="FSDP sizes (default 8 ... 16384)")
    p.add_argument("--dtype-bytes", type=int, default=2, help="bytes per element for MiB/rank (default 2: bf16)")
    p.add_argument("--plot", help="write a PNG of padding vs FSDP size here")
    p.add_argument("--gpus", type=int, help="suggest the HSDP shape (FSDP size x replicas) for this many GPUs")
    p.add_argument("--reduce-dtype-bytes", type=int,
                   help="bytes per gradient element reduced, for --gpus traffic (default: --dtype-bytes)")
    p.add_argument("--max-padding", type=float, default=3.0, help="padding %% the HSDP suggestion accepts (default 3)")
    c = sub.add_parser("consolidate", help="join a sharded checkpoint into one full state dict (torch or safetensors)")
    c.add_argument("checkpoint", help="a checkpoint directory written by vescale_zero.checkpoint.save")
    c.add_argument("output", help="the file to write: .safetensors for safetensors, anything else for torch.save")
    c.add_argument("--optimizer", action="store_true", help="also the optimizer state, as 'name::key'")
    v = sub.add_parser("convert",
                       help="convert an FSDP2 (DCP), DeepSpeed or Megatron checkpoint into a vescale-zero one")
    v.add_argument("--from", dest="source", required=True, choices=SOURCES,
                   help="the source framework")
    v.add_argument("src", help="fsdp2: the DCP directory; deepspeed: the save_dir given to save_checkpoint; "
                               "megatron: the --save directory (or one iter_NNNNNNN in it) of a torch_dist checkpoint")
    v.add_argument("dst", help="the new checkpoint directory (must not exist)")
    v.add_argument("--tag", help="deepspeed: the tag (default: the one in SRC/latest)")
    v.add_argument("--iteration", type=int, help="megatron: the iteration (default: latest_checkpointed_iteration.txt)")
    v.add_argument("--layer-spec", choices=["local", "te"], default="local",
                   help="megatron: the layer spec of the model, which names its modules (default: local)")
    v.add_argument("--weights-only", action="store_true", help="leave the optimizer state behind")
    args = parser.parse_args(argv)
    if args.command == "consolidate":
        return _cmd_consolidate(args)
    if args.command == "convert":
        return _cmd_convert(args)
    if any(m < 1 for m in args.sizes):
        parser.error("--sizes must be positive")
    if args.gpus is not None and args.gpus < 2:
        parser.error(f"--gpus {args.gpus}: HSDP needs at least 2 GPUs (a shard group of 2 or more)")
    bad = _granularity_error(args.granularity)
    if bad:
        parser.error(bad)
    return _cmd_plan(args)


if __name__ == "__main__":
    sys.exit(main())
