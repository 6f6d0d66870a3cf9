"""vescale-zero against its peers on the same GPT, data and AdamW, in one run.

    .venv/bin/python benchmarks/peers.py [--ranks 2 4] [--cycles 2] [--precisions fp32 bf16]
        [--reduce-scatter both|ours|torch] [--variants ddp fsdp2 ...] [--compile [--compile-backend B]]
        [--json peers.json]

Variants: DDP (the no-sharding limit), PyTorch FSDP2 ``fully_shard``, DeepSpeed ZeRO-3,
vescale-zero ``fully_shard`` and vescale-zero's DeepSpeed ``"stage": "ragged"``; then,
where megatron-core is installed (``--no-megatron`` leaves it out), megatron-core's own
``GPTModel`` of the same dims under its ``DistributedDataParallel`` and under our
``RaggedFSDP`` (``examples/megatron/pretrain_gpt.py``; on CPU through the test shim, see
``build_megatron_variant``), reported in a table of their own since the model differs. Each
variant runs in fresh processes (so its memory is its own) and the variants cycle
A B C D E ... A B C D E .... gloo on CPU, NCCL when GPUs are present.

Precisions (``--precisions``): ``fp32``, and ``bf16`` = bf16 parameters and compute with fp32
reduce and fp32 master weights, for the variants that have it: FSDP2
(``MixedPrecisionPolicy(bf16, fp32)``), ZeRO-3 (``bf16.enabled`` with
``communication_data_type: fp32``), vescale-zero (``MixedPrecisionPolicy(bf16, fp32)``) and
DeepSpeed ragged (``bf16.enabled``; it reduces in fp32). DDP and the megatron-core pair run
fp32 only. bf16 matmuls are 3-5x slower than fp32 on CPUs without avx512_bf16, so the bf16
table uses its own, smaller GPT (``--bf16-d-model``); compare ratios within one table.

Reduce-scatter (``--reduce-scatter``): on gloo, vescale-zero reduce-scatters as one
``all_to_all`` + a local sum (``vescale_zero/primitives/collectives.py`` [Note: gloo reduce-scatter]),
while FSDP2 and ZeRO-3 call torch's ``reduce_scatter_tensor``, which gloo runs as an
all-reduce of a clone (twice the bytes). ``ours`` runs vescale-zero as shipped; ``torch``
makes every vescale-zero variant use torch's ``reduce_scatter_tensor`` too (rows suffixed
``_trs``), so the ratios show what the design buys with the same collective as its peers;
``both`` (default) prints both. The switch is ``vescale_zero.primitives.collectives.set_reduce_scatter_impl``
("native"). On NCCL vescale-zero already calls ``reduce_scatter_tensor``: no ``_trs`` rows.

Variants (``--variants``): run only these (base names, e.g. ``ddp fsdp2 vescale``; default all).

torch.compile (``--compile``): every variant that can compile its transformer blocks, DDP,
FSDP2 and vescale-zero (``_trs`` included), gets a compiled twin, suffixed ``_c``, printed next
to it: each block is compiled (``block.compile(backend=--compile-backend)``, inductor by
default) after the variant has wrapped the model (before ``DistributedDataParallel``, which
wraps the whole model), so all three are measured identically; the warm-up steps compile. A
compiled row's ratio columns compare it with its peers' compiled rows, and ``graphs/blk`` is
the number of graphs Dynamo compiled per block (1 = each block compiles whole; the hooks of
FSDP2 and vescale-zero run eagerly around it). ZeRO-3, DeepSpeed ragged and the megatron-core
pair have no compiled twin. The copy and fill columns of a compiled row count only what still
runs as ATen kernels (inductor's generated kernels are not in them), against the unsharded
model compiled the same way: compare them between compiled rows only.

Reported per rank:

* ms/step (median and spread over all timed steps of all cycles) and tokens/s;
* peak memory: on GPU the CUDA allocator's peak; on CPU the highest resident set size
  sampled every 2 ms during the timed steps, minus the RSS before the model was built
  (freed pages are returned to the OS with malloc_trim after set-up);
* bytes through collectives per step (profiled: all-gather, reduce-scatter, all-reduce; an
  all_to_all counts as a reduce-scatter, which is what vescale-zero runs as one on gloo);
* ``copy MiB``: bytes *written* by copy kernels (copy_, cat, _chunk_cat,
  split_with_sizes_copy, _foreach_copy_, _to_copy; the outermost one only, so a
  ``_foreach_copy_`` and the per-tensor ``copy_``s it runs on CPU count once) that no
  collective makes (not under, nor during, a c10d / gloo / nccl op on the same thread, nor
  on a thread that runs no model work, i.e. a gloo worker);
* ``fill+acc MiB``: bytes written by ``zero_`` / ``fill_`` (called as such or through a zeros
  factory; not the fill that starts another kernel, e.g. a sum's) and by the in-place adds that
  autograd's AccumulateGrad runs when a parameter's ``.grad`` already exists (vescale-zero
  attaches zeroed views of its full gradient buffer before backward, so every gradient is
  added into it; FSDP2 and a plain model take autograd's gradient tensor as is);
* both of those minus the same count for the unsharded model on the same local batch (in the
  same dtype), so the model's own copies are not charged to the parallel layer. The
  difference is printed as measured, negative included. Exact dtypes come from the profiler;
  a tensor list whose dtype it does not record and whose kernel shows no per-tensor copies
  (fused CUDA kernels) is counted in the run's parameter dtype.
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
BF16_VARIANTS = ("fsdp2", "zero3", "vescale", "ds_ragged")  # those with bf16 params + fp32 reduce
MEGATRON_VARIANTS = ("mcore_ddp", "mcore_vescale")
OURS = ("vescale", "ds_ragged", "mcore_vescale")  # reduce-scatter through vescale_zero.primitives.collectives
TORCH_RS = "_trs"  # suffix: the variant with vescale-zero forced onto torch's reduce_scatter_tensor
COMPILED = "_c"  # suffix: the variant with each transformer block compiled (--compile)
COMPILABLE = ("ddp", "fsdp2", "vescale")  # those whose blocks are compiled under --compile
PRECISIONS = ("fp32", "bf16")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COPY_OPS = {"aten::copy_", "aten::cat", "aten::_chunk_cat", "aten::split_with_sizes_copy", "aten::_foreach_copy_",
            "aten::_to_copy"}
FILL_OPS = {"aten::zero_", "aten::fill_"}
ZERO_FACTORIES = {"aten::zeros", "aten::zeros_like", "aten::new_zeros"}
MODEL_WORK = ("aten::mm", "aten::addmm", "aten::bmm", "aten::embedding")  # marks threads that run the model
_ITEM = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "int": 4, "bool": 1,
         "unsigned char": 1, "c10::Float8_e4m3fn": 1}
_DTYPE_NAME = {"fp32": "float", "bf16": "c10::BFloat16"}


def force_torch_reduce_scatter() -> None:
    """Make vescale-zero reduce-scatter with torch's ``reduce_scatter_tensor`` on every backend
    (on gloo: torch's all-reduce emulation, the collective FSDP2 and ZeRO-3 run) instead of its
    all_to_all + local sum (``vescale_zero.primitives.collectives`` [Note: gloo reduce-scatter])."""
    from vescale_zero.primitives.collectives import set_reduce_scatter_impl

    set_reduce_scatter_impl("native")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _bytes(shape, dtype: str, fallback: str) -> int:
    if shape and isinstance(shape[0], list):  # a list of tensors: the profiler has no dtype for it
        return sum(_bytes(s, fallback, fallback) for s in shape)
    return _numel(shape) * _ITEM.get(dtype, _ITEM[fallback])


def _is_collective(name: str) -> bool:
    return name.startswith(("c10d::", "gloo:", "nccl:"))


def _ancestors(e):
    parent = e.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def _top_copies(e):
    """The outermost ``copy_`` kernels below ``e``."""
    for child in e.cpu_children:
        if child.name == "aten::copy_":
            yield child
        else:
            yield from _top_copies(child)


def _inside_collective(e, spans) -> bool:
    """A kernel made by a collective's backend (e.g. gloo's reduce-scatter clones its input):
    a descendant of a collective, or running within one's time span on the same thread."""
    if any(_is_collective(a.name) for a in _ancestors(e)):
        return True
    return any(t == e.thread and s <= e.time_range.start and e.time_range.end <= t_end for t, s, t_end in spans)


def _args(e):
    return e.structured_input_shapes or e.input_shapes or [], e.input_dtypes or []


def _copy_written(e, fallback: str) -> int:
    """Bytes a copy kernel writes: its destination, in the destination's dtype."""
    shapes, types = _args(e)
    if e.name in ("aten::copy_", "aten::split_with_sizes_copy"):  # self is the destination / all of it is moved
        return _bytes(shapes[0], types[0], fallback)
    if e.name in ("aten::_chunk_cat", "aten::cat"):  # out= (index 3 / 2), when given, has the dtype written
        out = 3 if e.name == "aten::_chunk_cat" else 2
        if len(shapes) > out and shapes[out] and types[out] in _ITEM:
            return _bytes(shapes[out], types[out], fallback)
    written = 0
    copies = list(_top_copies(e))  # _foreach_copy_ (on CPU) and _to_copy run one copy_ per tensor
    for c in copies:
        c_shapes, c_types = _args(c)
        written += _bytes(c_shapes[0], c_types[0], fallback)
    if copies:
        return written
    return _bytes(shapes[0], types[0] if types else fallback, fallback) if shapes else 0


TRAFFIC_KEYS = ("all_gather", "reduce_scatter", "all_reduce", "copied", "filled")


def _traffic(prof, fallback: str = "float") -> Dict[str, int]:
    """Per-step bytes of one rank from a profile of one step (see the module docstring)."""
    out = dict.fromkeys(TRAFFIC_KEYS, 0)
    events = list(prof.events())
    spans = [(e.thread, e.time_range.start, e.time_range.end) for e in events if _is_collective(e.name)]
    model_threads = {e.thread for e in events if e.name in MODEL_WORK or e.name.startswith("autograd::engine")}
    for e in events:
        name = e.name
        shapes, types = _args(e)
        if name == "c10d::_allgather_base_" and shapes:
            out["all_gather"] += _bytes(shapes[0], types[0] if types else fallback, fallback)
        elif name in ("c10d::_reduce_scatter_base_", "c10d::alltoall_base_") and len(shapes) > 1:
            # all_to_all: vescale-zero's reduce-scatter on gloo (collectives.py [Note: gloo reduce-scatter])
            out["reduce_scatter"] += _bytes(shapes[1], types[1] if len(types) > 1 else fallback, fallback)
        elif name.startswith("c10d::allreduce") and shapes:
            out["all_reduce"] += _bytes(shapes[0], types[0] if types else fallback, fallback)
        elif e.thread not in model_threads or not shapes:
            continue
        elif name in COPY_OPS:
            if not any(a.name in COPY_OPS for a in _ancestors(e)) and not _inside_collective(e, spans):
                out["copied"] += _copy_written(e, fallback)
        elif name in FILL_OPS:
            # a fill of its own or of a zeros factory; not one that initialises another kernel's
            # output (sum's, say), nor the fill_ a zero_ runs (the zero_ counts)
            caller = next((a for a in _ancestors(e) if a.name.startswith("aten::")), None)
            if (caller is None or caller.name in ZERO_FACTORIES) and not _inside_collective(e, spans):
                out["filled"] += _bytes(shapes[0], types[0] if types else fallback, fallback)
        elif name == "aten::add_" and e.cpu_parent is not None and e.cpu_parent.name.endswith("AccumulateGrad"):
            out["filled"] += _bytes(shapes[0], types[0] if types else fallback, fallback)
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


def _compile_blocks(model, backend: str) -> None:
    """``--compile``: each transformer block compiled, its module hooks included (torchtitan's way),
    through a graph counter of its own (``block.graph_counter``; blocks then compile separately)."""
    from vescale_zero.torch_compat import compile_counter

    for block in model.blocks:
        block.graph_counter = compile_counter(backend)
        block.compile(backend=block.graph_counter)


def _graphs_per_block(model) -> float:
    """Graphs Dynamo handed the backend, per compiled block (:func:`_compile_blocks`)."""
    counts = [m.graph_counter.frame_count for m in model.modules() if hasattr(m, "graph_counter")]
    return sum(counts) / len(counts)


def build_variant(variant: str, cfg, device, args, precision: str = "fp32", compile_backend=None):
    """``(model or engine, optimizer or None, DeepSpeed engine or None)`` for ``variant``.

    ``precision="bf16"``: bf16 parameters and compute, fp32 reduce and fp32 master weights
    (the ``plain`` baseline is the model in bf16: it only stands for the model's own work).
    ``compile_backend``: compile each block with it once the variant has wrapped the model
    (one of :data:`COMPILABLE`, or ``plain``)."""
    from vescale_zero.testing import GPT

    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: one of {PRECISIONS}")
    bf16 = precision == "bf16"
    if bf16 and variant not in BF16_VARIANTS + ("plain",):
        raise ValueError(f"{variant} has no bf16-param / fp32-reduce mode here; bf16 variants: {BF16_VARIANTS}")
    if compile_backend is not None and variant not in COMPILABLE + ("plain",):
        raise ValueError(f"{variant} is not compiled here; compiled variants: {COMPILABLE}")
    model = GPT(cfg).to(device)
    if variant == "plain":
        if bf16:
            model = model.to(torch.bfloat16)
        if compile_backend is not None:
            _compile_blocks(model, compile_backend)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3), None
    if variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if compile_backend is not None:
            _compile_blocks(model, compile_backend)  # DDP wraps the whole model: its blocks compile first
        model = DistributedDataParallel(model)
    elif variant == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        kw = {"mesh": mesh, **({"mp_policy": mp} if mp else {})}
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
    elif variant == "vescale":
        import vescale_zero as vz

        mp = vz.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        vz.fully_shard_layers(model, granularity="row", mp_policy=mp)
    else:  # DeepSpeed: zero3 or ds_ragged
        import deepspeed

        import vescale_zero.integrations.deepspeed  # noqa: F401

        cfg_ds = {"train_batch_size": args.global_batch, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                  "zero_optimization": {"stage": 3 if variant == "zero3" else "ragged"}, "steps_per_print": 10**9}
        if variant == "ds_ragged":
            cfg_ds["zero_optimization"]["granularity"] = "row"  # reduces in fp32 under bf16 by default
        if bf16:
            cfg_ds["bf16"] = {"enabled": True}
            if variant == "zero3":
                cfg_ds["communication_data_type"] = "fp32"  # ZeRO-3 reduces in bf16 otherwise
        engine, *_ = deepspeed.initialize(model=model, config=cfg_ds)
        return engine, None, engine
    if compile_backend is not None and variant != "ddp":
        _compile_blocks(model, compile_backend)
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
    script = os.path.join(REPO, "examples/megatron/pretrain_gpt.py")
    spec = importlib.util.spec_from_file_location("pretrain_gpt", script)
    pg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pg)
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    argv = ["--num-layers", str(args.layers), "--hidden-size", str(args.d_model), "--num-attention-heads", "8",
            "--seq-length", str(args.seq_len), "--vocab-size", "512",
            "--micro-batch-size", str(args.global_batch // world), "--global-batch-size", str(args.global_batch),
            "--lr", "1e-3", "--clip-grad", "0", "--weight-decay", "0.01"]
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
    from vescale_zero.torch_compat import work_class

    work = work_class()
    original = work.wait

    def wait(self, *args, **kwargs):
        with torch.profiler.record_function("c10d::wait"):
            return original(self, *args, **kwargs)

    work.wait = wait


def _split_variant(variant: str):
    """``"vescale_trs_c"`` -> ``("vescale", True, True)``: the base variant, whether it runs torch's
    reduce-scatter, and whether its blocks are compiled."""
    compiled = variant.endswith(COMPILED)
    if compiled:
        variant = variant[: -len(COMPILED)]
    if variant.endswith(TORCH_RS):
        return variant[: -len(TORCH_RS)], True, compiled
    return variant, False, compiled


def _model_step(model, opt, engine, corpus, args, rank: int, world: int, device):
    """``step(i)``: one training step of a :func:`build_variant` variant on batch ``i``."""

    def step(i: int) -> None:
        x, y = (t.to(device) for t in corpus.batch(i, args.global_batch, rank, world))
        train_step(model, opt, engine, x, y)

    return step


def _gpt_config(args: argparse.Namespace, precision: str):
    from vescale_zero.testing import GPTConfig

    d_model = args.bf16_d_model if precision == "bf16" else args.d_model
    return GPTConfig(vocab_size=512, seq_len=args.seq_len, d_model=d_model, n_layers=args.layers, n_heads=8)


def start_rank(rank: int, world: int, port: int, with_deepspeed: bool, nccl: str = "nccl") -> torch.device:
    """Join the benchmark's process group as ``rank`` (through DeepSpeed's ``init_distributed``
    when ``with_deepspeed``; ``nccl``: the backend string on GPUs), make the rank's device current
    and share the CPU threads among the ranks; returns the device."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if with_deepspeed:
        import deepspeed

        if not cuda:
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    else:
        dist.init_process_group(nccl if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    return device


def worker(rank: int, world: int, port: int, variant: str, precision: str, args: argparse.Namespace,
           out: Dict) -> None:
    base_variant, torch_rs, compiled = _split_variant(variant)
    backend = args.compile_backend if compiled else None
    cuda = torch.cuda.is_available()
    device = start_rank(rank, world, port, base_variant in ("zero3", "ds_ragged"))
    if torch_rs:
        force_torch_reduce_scatter()
    _profile_collective_waits()
    from vescale_zero.testing import SyntheticCorpus

    cfg = _gpt_config(args, precision)
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)
    gc.collect()
    base = _RssSampler.rss_mib()
    megatron = base_variant in MEGATRON_VARIANTS
    if megatron:
        model, opt, step = build_megatron_variant(base_variant, args, world)
        engine = None
    else:
        model, opt, engine = build_variant(base_variant, cfg, device, args, precision, backend)
        step = _model_step(model, opt, engine, corpus, args, rank, world, device)

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
    graphs = _graphs_per_block(model) if compiled else None
    from torch.profiler import profile

    fallback = _DTYPE_NAME[precision]
    with profile(record_shapes=True) as prof:
        step(args.warmup + args.steps)
    traffic = _traffic(prof, fallback)
    if megatron:  # another model (megatron-core's GPTModel): no plain baseline to subtract
        traffic["copied"] = traffic["filled"] = None
    else:  # the unsharded model's own copies and fills on the same local batch, subtracted as measured
        plain, popt, _ = build_variant("plain", cfg, device, args, precision, backend)
        plain_step = _model_step(plain, popt, None, corpus, args, rank, world, device)
        plain_step(0)  # AdamW's state exists from the first step on, as in the variant's profiled step
        with profile(record_shapes=True) as prof:  # the same work as step(), batch included
            plain_step(1)
        own = _traffic(prof, fallback)
        traffic["copied"] -= own["copied"]
        traffic["filled"] -= own["filled"]
        del plain, popt, plain_step
    gathered = [None] * world
    dist.all_gather_object(gathered, {"times": times, "peak_mib": peak, "graphs_per_block": graphs, **traffic})
    key = f"{world}:{precision}:{variant}"
    if rank == 0:
        out[key] = out.get(key, []) + [gathered]
    del step, model, opt, engine
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


def _median_mib(per_rank, key: str):
    if per_rank[0][key] is None:
        return None
    return statistics.median(r[key] for r in per_rank) / 2**20


def _summarise(runs, args):
    ms = [1e3 * t for cycle in runs for r in cycle for t in r["times"]]
    per_rank = [r for cycle in runs for r in cycle]
    med = statistics.median(ms)
    return {
        "median_ms": med, "min_ms": min(ms), "max_ms": max(ms),
        "tokens_per_s": args.global_batch * args.seq_len / (med / 1e3),
        "peak_mib": max(r["peak_mib"] for r in per_rank),
        "graphs_per_block": max((r.get("graphs_per_block") or 0) for r in per_rank) or None,
        **{f"{k}_mib": _median_mib(per_rank, k) for k in TRAFFIC_KEYS},
    }


def variants_for(precision: str, args: argparse.Namespace, cuda: bool) -> List[str]:
    """The variants of one precision's table, in run order (see ``--reduce-scatter``)."""
    names = list(VARIANTS if precision == "fp32" else BF16_VARIANTS)
    if precision == "fp32" and not args.no_megatron and _has_megatron():
        names += MEGATRON_VARIANTS
    if args.variants:
        names = [v for v in names if v in args.variants]
    out = []
    for v in names:
        rs = []
        if v not in OURS or cuda or args.reduce_scatter in ("ours", "both"):
            rs.append(v)
        if v in OURS and not cuda and args.reduce_scatter in ("torch", "both"):
            rs.append(v + TORCH_RS)
        for name in rs:  # each compiled twin right after its eager row
            out.append(name)
            if args.compile and v in COMPILABLE:
                out.append(name + COMPILED)
    return out


def _fmt(x, width: int, digits: int = 2) -> str:
    return f"{'-':>{width}s}" if x is None else f"{x:{width}.{digits}f}"


def _ratio(rows, v: str, ref: str) -> str:
    """``v``'s time over ``ref``'s; a compiled row over ``ref``'s compiled row."""
    if v.endswith(COMPILED):
        ref += COMPILED
    return f"{rows[v]['median_ms'] / rows[ref]['median_ms']:7.3f}" if ref in rows else f"{'-':>7s}"


def _eager_ratio(rows, v: str) -> str:
    """A compiled row's time over its eager twin's."""
    eager = v[: -len(COMPILED)] if v.endswith(COMPILED) else None
    return f"{rows[v]['median_ms'] / rows[eager]['median_ms']:7.3f}" if eager in rows else f"{'-':>7s}"


def print_table(world: int, precision: str, rows: Dict[str, Dict], args: argparse.Namespace) -> None:
    backend = "NCCL" if torch.cuda.is_available() else "gloo CPU"
    d_model = args.bf16_d_model if precision == "bf16" else args.d_model
    mp = "bf16 params / fp32 reduce + master" if precision == "bf16" else "fp32"
    print(f"\n{world} ranks, {backend}, {mp}, GPT {args.layers}x{d_model}, seq {args.seq_len}, "
          f"global batch {args.global_batch}; {args.cycles} cycles x {args.steps} steps per variant")
    print(f"{'variant':14s} {'ms med':>8s} {'min':>7s} {'max':>7s} {'tok/s':>7s} {'peak MiB':>9s} {'AG MiB':>7s} "
          f"{'RS MiB':>7s} {'AR MiB':>7s} {'copy MiB':>9s} {'fill+acc':>9s} {'/fsdp2':>7s} {'/zero3':>7s} {'/ddp':>7s}"
          + (f" {'/eager':>7s} {'graphs/blk':>10s}" if args.compile else ""))
    for v, r in rows.items():
        if v.startswith("mcore"):
            continue
        print(f"{v:14s} {r['median_ms']:8.1f} {r['min_ms']:7.1f} {r['max_ms']:7.1f} {r['tokens_per_s']:7.0f} "
              f"{r['peak_mib']:9.1f} {_fmt(r['all_gather_mib'], 7)} {_fmt(r['reduce_scatter_mib'], 7)} "
              f"{_fmt(r['all_reduce_mib'], 7)} {_fmt(r['copied_mib'], 9)} {_fmt(r['filled_mib'], 9)} "
              f"{_ratio(rows, v, 'fsdp2')} {_ratio(rows, v, 'zero3')} {_ratio(rows, v, 'ddp')}"
              + (f" {_eager_ratio(rows, v)} {_fmt(r['graphs_per_block'], 10, 1)}" if args.compile else ""))
    for ours in ("vescale", "vescale" + TORCH_RS):
        if ours not in rows or not {"fsdp2", "zero3"} <= set(rows):
            continue
        r = rows[ours]
        rs = "torch's reduce_scatter_tensor" if ours.endswith(TORCH_RS) else "its own reduce-scatter"
        line = (f"targets ({ours}, {rs}): time <= 0.8x FSDP2 [{_ratio(rows, ours, 'fsdp2').strip()}], "
                f"<= 0.9x ZeRO-3 [{_ratio(rows, ours, 'zero3').strip()}]")
        if "ddp" in rows:
            line += f", <= 1.15x DDP [{_ratio(rows, ours, 'ddp').strip()}]"
        print(line + f"; peak memory {r['peak_mib']:.0f} MiB vs FSDP2 {rows['fsdp2']['peak_mib']:.0f}, "
              f"ZeRO-3 {rows['zero3']['peak_mib']:.0f}; copies {r['copied_mib']:.2f} MiB/step, "
              f"fill+acc {r['filled_mib']:.2f} MiB/step (vs the unsharded model)")
    mcore = [v for v in rows if v.startswith("mcore")]
    if mcore:
        where = "CUDA" if torch.cuda.is_available() else "CPU via tests/megatron_shim.py"
        print(f"megatron-core GPTModel, same dims, Megatron's schedule ({where}):")
        print(f"{'variant':18s} {'ms med':>8s} {'min':>7s} {'max':>7s} {'peak MiB':>9s} {'AG MiB':>7s} "
              f"{'RS MiB':>7s} {'AR MiB':>7s} {'/mcore_ddp':>10s}")
        for v in mcore:
            r = rows[v]
            print(f"{v:18s} {r['median_ms']:8.1f} {r['min_ms']:7.1f} {r['max_ms']:7.1f} {r['peak_mib']:9.1f} "
                  f"{_fmt(r['all_gather_mib'], 7)} {_fmt(r['reduce_scatter_mib'], 7)} {_fmt(r['all_reduce_mib'], 7)} "
                  f"{_ratio(rows, v, 'mcore_ddp'):>10s}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--cycles", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--bf16-d-model", type=int, default=128, help="width of the bf16 table's GPT (bf16 is slow on CPU)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--reduce-scatter", choices=("both", "ours", "torch"), default="both",
                   help="vescale-zero's reduce-scatter on gloo: its own (all_to_all), torch's reduce_scatter_tensor "
                        "(as FSDP2 / ZeRO-3; rows suffixed _trs), or both")
    p.add_argument("--variants", nargs="+", choices=VARIANTS + MEGATRON_VARIANTS,
                   help="run only these variants (default: all)")
    p.add_argument("--compile", action="store_true",
                   help="also run DDP, FSDP2 and vescale-zero with each block compiled (rows suffixed _c)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend for --compile")
    p.add_argument("--json", help="write the raw measurements and the summary here")
    p.add_argument("--no-megatron", action="store_true", help="leave out megatron-core DDP vs RaggedFSDP")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        args.ranks = [min(r, torch.cuda.device_count()) for r in args.ranks]
    tables = {(w, prec): variants_for(prec, args, cuda) for w in args.ranks for prec in args.precisions}
    runs = [(w, prec, v) for (w, prec), vs in tables.items() for _ in range(args.cycles) for v in vs]
    with mp.Manager() as manager:
        out = manager.dict()
        for world, precision, variant in tqdm(runs, desc="runs (variants cycled)"):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.spawn(worker, args=(world, port, variant, precision, args, out), nprocs=world)
        raw = dict(out)
    if cuda and args.reduce_scatter != "ours":
        print("NCCL: vescale-zero already runs torch's reduce_scatter_tensor; no _trs rows")
    summary = {}
    for (world, precision), vs in tables.items():
        rows = {v: _summarise(raw[f"{world}:{precision}:{v}"], args) for v in vs}
        summary[f"{world}:{precision}"] = rows
        print_table(world, precision, rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "raw": raw}, f, indent=1)


if __name__ == "__main__":
    main()
