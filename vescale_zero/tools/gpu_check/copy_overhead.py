"""The work each FSDP implementation does around its collectives, every system measured alike.

For one rank of an FSDP group of ``m`` ranks holding one decoder layer (shapes from
``vescale_zero/tools/model_shapes.py``), :func:`fsdp2_system` and :func:`vescale_system` build the
buffers each library builds, lay them out as it lays them out (FSDP2: per-parameter dim-0
padding and rank-major packing; vescale-zero: the planner's ragged layout, ``DBuffer``s, row
granularity) and hand out the kernels each one runs between its sharded parameters and its
all-gather, and between autograd's gradients and its sharded gradients; :func:`measure` times
them. The collectives themselves are excluded for every system (no process group: this
measures one rank's local work, with the other ranks' data standing in the gathered buffers).
Allocations are excluded for every system (buffers are made once; on GPU the caching allocator
serves them). A kind a system does not run is measured anyway: its function does what the
library does there, i.e. nothing. Shared by ``benchmarks/copy_overhead.py`` (tables) and the
GPU check (GB/s against the device's bandwidth).

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

GB/s counts bytes read + bytes written by the kernels of a kind. Precisions: ``fp32`` (no
mixed precision), ``bf16`` (bf16 params and gradients, fp32 reduce and master), ``bf16-reduce``
(bf16 params and reduce, fp32 master). :func:`scaled` divides the last dimension of every
tensor of >= 2 dimensions (dim 0, the dimension FSDP2 shards and vescale's rows run along, is
kept, so both layouts keep their padding pattern). Device-agnostic: on CUDA the kernels are
timed with CUDA events, elsewhere with ``perf_counter``.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ...primitives.dbuffer import DBuffer
from ...primitives.granularity import preset_granularity
from ...primitives.planner import TensorSpec, plan
from ...runtime.fp8_gather import FP8GatherLayout, tile_band_granularity
from ..model_shapes import layer_groups

__all__ = ["KINDS", "PER_GATHER", "PRECISIONS", "Kernels", "System", "scaled", "fsdp2_system", "vescale_plan",
           "vescale_system", "time_ms", "measure", "per_step", "auto_scale"]

KINDS = ("AG copy-in", "AG copy-out", "grad accumulate", "RS copy-in", "RS copy-out")
PER_GATHER = ("AG copy-in", "AG copy-out")  # run on every all-gather
# name: (original / master dtype, param dtype, reduce dtype)
PRECISIONS = {
    "fp32": (torch.float32, torch.float32, torch.float32),
    "bf16": (torch.float32, torch.bfloat16, torch.float32),
    "bf16-reduce": (torch.float32, torch.bfloat16, torch.bfloat16),
}
ALIGN_BYTES = 16  # vescale_zero.api.fully_shard.DEFAULT_ALIGN_BYTES


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


def per_step(system: System, gathers: int) -> Dict[str, Tuple[float, int]]:
    """Per kind ``(median ms, bytes moved)`` over one step (``gathers`` all-gathers and one
    reduce-scatter), and ``"per step"``: their sums. Call after :func:`measure`."""
    out: Dict[str, Tuple[float, int]] = {}
    total_ms, total_bytes = 0.0, 0
    for kind in KINDS:
        n = gathers if kind in PER_GATHER else 1
        ms = statistics.median(system.times[kind])
        out[kind] = (n * ms, n * system.kinds[kind].nbytes)
        total_ms, total_bytes = total_ms + n * ms, total_bytes + n * system.kinds[kind].nbytes
    out["per step"] = (total_ms, total_bytes)
    return out


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
