"""Peak per-rank memory of vescale-zero, PyTorch FSDP2, DeepSpeed ZeRO-3 and DDP on one GPT.

    .venv/bin/python benchmarks/memory.py [--ranks 2 4] [--precisions fp32 bf16] [--layers 4]
        [--d-model 256] [--systems vescale fsdp2 zero3 ddp vescale_off fsdp2_off zero3_off]
        [--fake-ranks 8 64 1024]

Part 1 (real ranks, gloo, CPU, spawned): each system builds the GPT its own way for a model too
big for one rank -- vescale-zero on meta + ``fully_shard`` + ``vz.materialize``; FSDP2
``fully_shard`` on a meta model + ``to_empty`` + init; ZeRO-3 under ``deepspeed.zero.Init``;
DDP eagerly (it holds the whole model) -- and runs two AdamW steps; the second is measured.

[Note: what the tracker cannot see] Memory a backend allocates inside a collective, below the
dispatcher, is invisible to a tensor tracker. On gloo, ``reduce_scatter_tensor`` (FSDP2,
ZeRO-3) all-reduces a *clone* of the whole buffer made in C++: not counted. vescale-zero's gloo
reduce-scatter (an ``all_to_all`` into a full-size receive buffer + a local sum,
``vescale_zero/collectives.py``) allocates that buffer in Python: counted. ``vescale_trs`` is
vescale-zero on torch's ``reduce_scatter_tensor``, as its peers: the like-for-like row on gloo
(on NCCL a reduce-scatter has no such buffer).

Precisions: ``fp32``; ``bf16`` = bf16 parameters / compute, fp32 master weights and fp32 gradient
reduce, as each system does it (FSDP2 and vescale ``MixedPrecisionPolicy(bf16, fp32)``, ZeRO-3
``bf16.enabled`` + ``communication_data_type: fp32``, DDP fp32 weights under ``torch.autocast``).

Memory is counted exactly with :class:`vescale_zero.testing.live_bytes.LiveBytes` (every tensor
storage alive, ``resize_`` followed) and split at the peak by role: ``params`` (the persistent
parameters: shards, master copies), ``grads`` (the persistent gradients), ``optim`` (optimizer
state), ``comm`` (gathered full parameters, full gradients before their reduce, collective
buffers) and ``act`` (the rest: activations and temporaries). ``RSS`` is the process's resident
set growth over the same run (sampled every 2 ms; noisy on CPU, the allocator keeps freed pages).

The floor (no literals, the same for every system): ``(params + grads + AdamW state) / world``
+ 2 x the largest group's full parameters (compute dtype) and gradients (reduce dtype) (x2: one
group prefetched) + the unsharded model's own activation peak on the same local batch (measured
by the same tracker); ``excess`` = peak - floor, as measured (negative allowed).

[Note: offload rows] ``vescale_off``, ``fsdp2_off`` and ``zero3_off`` are the same systems with
their host offload: vescale-zero ``fully_shard(..., offload_policy=CPUOffloadPolicy(pin_memory=False))``,
FSDP2 ``fully_shard(..., offload_policy=CPUOffloadPolicy(pin_memory=False))`` (pinning needs an
accelerator), ZeRO-3 ``offload_optimizer`` and ``offload_param`` to ``cpu`` (``pin_memory`` off). They
get a table of their own, each after its row without offload, with the bytes split by where they
live, device or host, and by role. Each place has its own peak (on a GPU they are two memories): the
tracker logs every storage's size changes, and the log is replayed per place (:func:`peaks_by_where`).
On a CPU the host *is* the device, so the place of a storage is told by the buffer it belongs to,
exactly, by storage (data pointer), not by its ``device`` (:func:`host_buffers`): host = vescale-zero's
offloaded groups' master shards (``group.master.local``), gradient shards (``group.sharded_grad``) and
the AdamW state of their parameters; FSDP2's offloaded sharded parameters, their gradients and state;
ZeRO-3's parameter partitions (``ds_tensor``, its flat groups), fp32 partitions, gradient partitions
and optimizer state. Everything else -- gathered parameters (``compute.full``), full gradients before
their reduce (``grads.full``), collective buffers, activations -- is device; so is a host temporary
that dies before the step's role snapshots (after backward, after the optimizer step). Floors:
offloaded, device = 2 x the largest group's full parameters and gradients + the activation peak,
host = (params + grads + AdamW state) / world; not offloaded, device = the whole floor, host = 0.

Part 2 (``--fake-ranks``): estimated memory at world sizes we cannot run, in one process on
PyTorch's fake process group (``FakeStore`` + ``init_process_group("fake")``: collectives
return at once, tensors are real), for a stack of Llama-3-8B-shaped layers (``--fake-layers``).

[Note: inputs in the compute dtype] The stack's input is hidden states, not token ids: under
``--fake-precision bf16`` they are made in bf16, as a DeepSpeed user feeds a bf16 engine (ZeRO-3
casts no inputs: fp32 ones meet its bf16 weights, "expected m1 and m2 to have the same dtype").
FSDP2 and vescale-zero cast floating inputs to ``param_dtype`` themselves, so the same bf16
batch reaches every system, and the unsharded model whose activation peak is the floor's term.

[Note: granularity of the comparison] ZeRO-3 gathers one ``nn.Linear`` (a submodule with
parameters) at a time, fetching and releasing inside a layer, while vescale-zero and FSDP2 as
set up above gather a whole layer: against the per-layer floor ZeRO-3 sits far below both by
its unit, not its design. The ``_lin`` rows (``vescale_lin``, ``fsdp2_lin``) wrap every
``nn.Linear`` in its own ``fully_shard`` group (then each layer's rest, then the root): ZeRO-3's
unit. They are printed in a table of their own, with ZeRO-3 again, whose floor is counted from
that table's largest unit (one Linear), so each table compares systems gathering the same unit.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import socket
import sys
import threading
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from vescale_zero.testing import GPT, GPTConfig, SyntheticCorpus  # noqa: E402
from vescale_zero.testing.live_bytes import LiveBytes  # noqa: E402
from vescale_zero.testing.llama import LlamaShapedStack, stack_layers  # noqa: E402
from vescale_zero.testing.sharding import fake_world, shard_on_meta  # noqa: E402

OFFLOAD_SYSTEMS = ("vescale_off", "fsdp2_off", "zero3_off")  # [Note: offload rows]
SYSTEMS = ("vescale", "vescale_trs", "fsdp2", "zero3", "ddp", "vescale_lin", "fsdp2_lin") + OFFLOAD_SYSTEMS
REAL_SYSTEMS = SYSTEMS[:5] + OFFLOAD_SYSTEMS
FAKE_SYSTEMS = ("vescale", "fsdp2", "zero3", "ddp", "vescale_lin", "fsdp2_lin")  # no _trs row: collectives
# allocate nothing on the fake process group
PER_LINEAR = ("vescale_lin", "fsdp2_lin", "zero3")  # [Note: granularity of the comparison]
ROLES = ("params", "grads", "optim", "comm", "act")
WHERE = ("device", "host")
MiB = 2 ** 20


# ---- building each system ----------------------------------------------------------------
def zero3_buckets(hidden: int) -> Dict[str, int]:
    """ZeRO-3's bucket sizes as Hugging Face's ``"auto"`` sets them from the hidden size. Its
    defaults (a 5e8-element reduce bucket, allocated whole) would charge it ~1.9 GiB of fp32
    on any model: a configuration choice, not its design."""
    return {"reduce_bucket_size": hidden * hidden, "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden}


def build(system: str, model_fn, precision: str, batch: int, blocks_of, hidden: int):
    """``(model, optimizer, engine, step)`` for ``system``; ``step(x, y)`` trains one step."""
    bf16 = precision == "bf16"
    offload = system.endswith("_off")  # [Note: offload rows]
    system = system[:-len("_off")] if offload else system
    if system in ("vescale", "vescale_trs", "vescale_lin", "fsdp2", "fsdp2_lin"):
        from vescale_zero.collectives import set_reduce_scatter_impl

        if system.startswith("vescale"):
            set_reduce_scatter_impl("native" if system == "vescale_trs" else "auto")
        per_linear = system.endswith("_lin")  # [Note: granularity of the comparison]
        model = shard_on_meta("vescale" if system.startswith("vescale") else "fsdp2", model_fn,
                              lambda m: (_linears(m) if per_linear else []) + list(blocks_of(m)), torch.device("cpu"),
                              param_dtype=torch.bfloat16 if bf16 else None, offload=offload)
    elif system == "zero3":
        import deepspeed

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # a 40 s JIT build we do not use
        cfg = {"train_batch_size": batch * dist.get_world_size(), "gradient_accumulation_steps": 1,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
               "zero_optimization": {"stage": 3, **zero3_buckets(hidden)}, "gradient_clipping": 0.0,
               "steps_per_print": 10 ** 9}
        if offload:
            cfg["zero_optimization"].update(offload_optimizer={"device": "cpu", "pin_memory": False},
                                            offload_param={"device": "cpu", "pin_memory": False})
        if bf16:
            cfg["bf16"] = {"enabled": True}
            cfg["communication_data_type"] = "fp32"
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = model_fn()
        engine, *_ = deepspeed.initialize(model=model, config=cfg)

        def step(x, y):
            engine.backward(engine(x, y))
            engine.step()

        return engine.module, engine.optimizer, engine, step
    elif system == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # its gradients are views of its buckets (else the buckets live in C++, out of the tracker's sight)
        model = DistributedDataParallel(model_fn(), gradient_as_bucket_view=True)
    else:
        raise ValueError(f"system {system!r}: one of {SYSTEMS}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    autocast = system == "ddp" and bf16

    def step(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=system != "ddp")  # DDP keeps its buckets (the gradients) for good

    return model, opt, None, step


# ---- roles of the storages alive at the peak ---------------------------------------------
def _tensors(obj) -> List[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class RoleMarks:
    """Marks storages by role while a step runs: collective arguments and the parameters (and
    their gradients) leaf modules compute with that are not persistent count as ``comm``."""

    def __init__(self, tracker: LiveBytes) -> None:
        self.tracker = tracker
        self.comm: set = set()
        self.grads: set = set()
        self.hooks: list = []
        self._seen: set = set()

    def leaf_forward(self, module, _inputs, _output) -> None:
        if next(module.children(), None) is not None:
            return
        for p in module.parameters(recurse=False):
            self.comm |= self.tracker.keys_of([_local(p)])
            if id(p) not in self._seen and p.requires_grad:
                self._seen.add(id(p))
                self.hooks.append(p.register_hook(self.grad_arriving))
                self.hooks.append(p.register_post_accumulate_grad_hook(self.grad_ready))

    def grad_arriving(self, grad) -> None:
        """[Note: gradients seen as they arrive] The incoming gradient, before it is
        accumulated: a system's own post-accumulate hook, registered before ours, may copy
        ``.grad`` into its reduce buffer and drop it before :meth:`grad_ready` sees it."""
        self.comm |= self.tracker.keys_of([_local(grad)])

    def grad_ready(self, p) -> None:
        if p.grad is not None:
            self.comm |= self.tracker.keys_of([_local(p.grad)])

    def collective(self, args) -> None:
        self.comm |= self.tracker.keys_of(_tensors(args))


class _MarkingLiveBytes(LiveBytes):
    """``LiveBytes`` that passes every collective's arguments to ``marks.collective`` and logs
    every change of a storage's size (``log``: ``(key, bytes)``, in order), so that the live
    bytes of any subset of the storages can be replayed afterwards (:func:`peaks_by_where`)."""

    marks: RoleMarks

    def __init__(self) -> None:
        super().__init__()
        self.log: List[Tuple[int, int]] = []

    def _set(self, key: int, nbytes: int) -> None:
        if key in self._size:  # a tracked storage (LiveBytes ignores the others)
            self.log.append((key, nbytes))
        super()._set(key, nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented and func.namespace in ("c10d", "_c10d_functional"):
            self.marks.collective((args, kwargs))
        return out


def persistent_roles(tracker: LiveBytes, model: nn.Module, opt, engine) -> Dict[str, set]:
    """Keys of the persistent parameters, gradients and optimizer state (call after backward
    and after the optimizer step; the union is taken)."""
    inner = getattr(opt, "optimizer", opt)  # DeepSpeed's ZeRO wrapper holds the torch optimizer
    owners = list(model.parameters()) + [p for g in inner.param_groups for p in g["params"]]
    params = [_local(p) for p in owners] + [p.ds_tensor for p in owners if hasattr(p, "ds_tensor")]
    grads = [_local(p.grad) for p in owners if p.grad is not None]
    if engine is not None:  # ZeRO-3's own gradient partitions
        for name, value in vars(opt).items():
            if "grad" in name.lower():
                grads += _tensors(value)
        # its fp32 partitions (a copy of its own under offload_optimizer, stepped one sub-group at
        # a time: its torch optimizer's groups hold them only then) and their gradients
        flat = _tensors(list(getattr(opt, "fp32_partitioned_groups_flat", [])))
        params += flat
        grads += [t.grad for t in flat if t.grad is not None]
    state = [_local(t) for s in inner.state.values() for t in _tensors(s)]
    return {"params": tracker.keys_of(params), "grads": tracker.keys_of(grads), "optim": tracker.keys_of(state)}


def host_buffers(model: nn.Module, opt, engine) -> List[torch.Tensor]:
    """The buffers an offloading system keeps in host memory ([Note: offload rows]), found
    through its own objects: vescale-zero's offloaded groups' master shard
    (``group.master.local``), gradient shard (``group.sharded_grad``) and the optimizer state of
    their parameters; FSDP2's parameters with ``offload_to_cpu`` (``CPUOffloadPolicy``): their
    sharded local tensors, gradients and optimizer state; ZeRO-3 with ``offload_param``: the
    parameter partitions (``ds_tensor``, the flat fp16 groups), with ``offload_optimizer``: the
    fp32 partitions, their gradients, the flat gradient partition buffer and the optimizer
    state. Empty for a system that offloads nothing."""
    from torch.distributed.fsdp import FSDPModule

    from vescale_zero.fully_shard import RaggedFSDPModule, groups_of

    inner = getattr(opt, "optimizer", opt)

    def state_of(params) -> List[torch.Tensor]:
        return [_local(t) for p in params for t in _tensors(inner.state.get(p, {}))]

    out: List[torch.Tensor] = []
    for group in groups_of(model):
        if group.host_copies is not None:
            grad = group.sharded_grad.live
            out += [group.master.local] + ([grad] if grad is not None else []) + state_of(group.sharded_params)
    for module in model.modules():
        fsdp2 = isinstance(module, FSDPModule) and not isinstance(module, RaggedFSDPModule)  # ours are FSDPModules too
        param_group = module._get_fsdp_state()._fsdp_param_group if fsdp2 else None
        for fsdp_param in (param_group.fsdp_params if param_group is not None else []):
            if fsdp_param.offload_to_cpu:
                p = fsdp_param.sharded_param
                out += [_local(p)] + ([_local(p.grad)] if p.grad is not None else []) + state_of([p])
    if engine is not None:
        if getattr(opt, "offload_param", False):
            out += [p.ds_tensor for p in model.parameters() if hasattr(p, "ds_tensor")]
            out += _tensors(list(getattr(opt, "fp16_partitioned_groups_flat", [])))
            out += _tensors(list(getattr(opt, "param_groups_fp16_flat_cpu_memory", [])))
        if getattr(opt, "offload_optimizer", False):
            flat = list(opt.fp32_partitioned_groups_flat)
            out += flat + [t.grad for t in flat if t.grad is not None] + state_of(flat)
            out += _tensors(getattr(opt, "grad_partitions_flat_buffer", None))
    return out


def peaks_by_where(log: List[Tuple[int, int]], where_of: Callable[[int], str]) -> Dict[str, Tuple[int, Dict]]:
    """Replay a tracker's log: per place (``WHERE``), the peak of the live bytes of the storages
    that live there and those storages (key -> bytes) at that peak."""
    live, top = dict.fromkeys(WHERE, 0), {w: (0, -1) for w in WHERE}
    sizes: Dict[int, int] = {}
    for i, (key, nbytes) in enumerate(log):  # where each place peaks ...
        w = where_of(key)
        live[w] += nbytes - sizes.get(key, 0)
        sizes[key] = nbytes
        if live[w] > top[w][0]:
            top[w] = (live[w], i)
    out = {}
    for w, (peak, at) in top.items():  # ... and what lives there then
        sizes = {}
        for key, nbytes in log[:at + 1]:
            sizes[key] = nbytes
        out[w] = (peak, {k: n for k, n in sizes.items() if n and where_of(k) == w})
    return out


# ---- one rank ----------------------------------------------------------------------------
class _RssSampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.running = 0.0, True

    @staticmethod
    def rss() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.rss())
            time.sleep(0.002)


def measure_rank(system: str, model_fn, blocks_of, precision: str, batches, step_batch: int, hidden: int) -> Dict:
    """Build ``system`` and train ``len(batches)`` steps; the last one is measured."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = _RssSampler.rss()
    sampler = _RssSampler()
    sampler.start()
    model, opt, engine, step = build(system, model_fn, precision, step_batch, blocks_of, hidden)
    for x, y in batches[:-1]:
        step(x, y)
    tracker = _MarkingLiveBytes()
    marks = RoleMarks(tracker)
    tracker.marks = marks
    handle = nn.modules.module.register_module_forward_hook(marks.leaf_forward)
    roles: Dict[str, set] = {r: set() for r in ("params", "grads", "optim")}
    host: set = set()
    inner_step = getattr(engine, "step", None) if engine is not None else opt.step
    owner = engine if engine is not None else opt

    def step_with_roles(*a, **k):  # the roles after backward, before the optimizer step ...
        for r, keys in persistent_roles(tracker, model, opt, engine).items():
            roles[r] |= keys
        host.update(tracker.keys_of(host_buffers(model, opt, engine)))
        out = inner_step(*a, **k)
        for r, keys in persistent_roles(tracker, model, opt, engine).items():  # ... and after it
            roles[r] |= keys
        host.update(tracker.keys_of(host_buffers(model, opt, engine)))
        return out

    owner.step = step_with_roles
    try:
        with tracker:
            step(*batches[-1])
    finally:
        owner.step = inner_step
        handle.remove()
        for h in marks.hooks:
            h.remove()
    sampler.running = False
    sampler.join()
    key_role: Dict[int, str] = {}
    for role, keys in (("comm", marks.comm), ("optim", roles["optim"]), ("grads", roles["grads"]),
                       ("params", roles["params"])):  # later wins: persistent roles over comm marks
        key_role.update(dict.fromkeys(keys, role))
    split = tracker.split(key_role, other="act")
    where: Dict[str, Dict[str, int]] = {}
    for w, (peak, storages) in peaks_by_where(tracker.log, lambda key: "host" if key in host else "device").items():
        by_role: Dict[str, int] = {}
        for key, nbytes in storages.items():
            by_role[key_role.get(key, "act")] = by_role.get(key_role.get(key, "act"), 0) + nbytes
        where[w] = {"peak": peak, **{r: by_role.get(r, 0) for r in ROLES}}
    return {"peak": tracker.peak, **{r: split.get(r, 0) for r in ROLES}, "rss": sampler.peak - base, "where": where}


def activation_peak(model_fn, precision: str, x, y) -> int:
    """The unsharded model's own transient peak (activations, temporaries) for one forward +
    backward on the local batch, in the compute dtype, its gradients already allocated."""
    model = model_fn()
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    model(x, y).backward()  # .grad exists from now on: the measured backward adds into it
    tracker = LiveBytes()
    with tracker:
        start = tracker.live
        model(x, y).backward()
    return tracker.peak - start


# ---- the GPT runs ------------------------------------------------------------------------
def _gpt_cfg(args) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers,
                     n_heads=args.heads)


def _gpt_blocks(model):
    return list(model.blocks)


def _worker(rank: int, world: int, port: int, system: str, precision: str, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    if system == "zero3":
        import deepspeed

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = _gpt_cfg(args)
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)
    batches = [corpus.batch(i, args.batch * world, rank, world) for i in range(2)]
    result = measure_rank(system, lambda: GPT(cfg), _gpt_blocks, precision, batches, args.batch, cfg.d_model)
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        out[f"{world}:{precision}:{system}"] = gathered
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _linears(model: nn.Module) -> List[nn.Module]:
    """Every ``nn.Linear`` of ``model``: the unit ZeRO-3 gathers ([Note: granularity of the comparison])."""
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def floor_parts(model_fn, blocks_of, precision: str, world: int, act: int) -> Dict[str, float]:
    """The floor's terms, counted from the model built on meta (see the module docstring)."""
    with torch.device("meta"):
        model = model_fn()
    master = torch.empty((), dtype=torch.float32).element_size()
    compute = torch.empty((), dtype=torch.bfloat16 if precision == "bf16" else torch.float32).element_size()
    total = sum(p.numel() for p in model.parameters())
    in_blocks = {id(p) for b in blocks_of(model) for p in b.parameters()}
    groups = [sum(p.numel() for p in b.parameters()) for b in blocks_of(model)]
    groups.append(sum(p.numel() for p in model.parameters() if id(p) not in in_blocks))
    adam = 2 * master  # exp_avg and exp_avg_sq per element, in the master dtype
    sharded = total * (master + master + adam) / world  # fp32 master, fp32-reduced gradient shard, AdamW
    gathered = 2 * max(groups) * (compute + master)
    return {"sharded": sharded, "gathered": gathered, "act": act, "floor": sharded + gathered + act}


def run_real(args) -> Dict[str, Dict]:
    cfg = _gpt_cfg(args)
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)
    tables = {}
    with mp.Manager() as manager:
        out = manager.dict()
        for world in args.ranks:
            for precision in args.precisions:
                for system in [s for s in args.systems if s in REAL_SYSTEMS]:
                    mp.start_processes(_worker, args=(world, _free_port(), system, precision, args, out),
                                       nprocs=world, start_method="spawn")
                x, y = corpus.batch(1, args.batch * world, 0, world)
                act = activation_peak(lambda: GPT(cfg), precision, x, y)
                floor = floor_parts(lambda: GPT(cfg), _gpt_blocks, precision, world, act)
                rows = {s: max(out[f"{world}:{precision}:{s}"], key=lambda r: r["peak"]) for s in args.systems
                        if s in REAL_SYSTEMS}
                tables[(world, precision)] = (rows, floor)
                title = (f"{world} ranks, gloo CPU, {_describe(precision)}, GPT {cfg.n_layers}x{cfg.d_model} "
                         f"(vocab {cfg.vocab_size}, seq {cfg.seq_len}), local batch {args.batch}")
                plain = {s: r for s, r in rows.items() if s not in OFFLOAD_SYSTEMS}
                if plain:
                    print_table(title, plain, floor)
                if any(s in OFFLOAD_SYSTEMS for s in rows):
                    # each rank's own places peak apart: the rank with the highest device peak, then host peak
                    where_rows = {s: _worst_where(out[f"{world}:{precision}:{s}"]) for s in _offload_table(rows)}
                    print_where_table(title + " -- by where the bytes live (offload rows)", where_rows, floor)
    return tables


def _offload_table(rows: Dict[str, Dict]) -> List[str]:
    """The systems of the offload table: each offloading system after its row without offload."""
    out = []
    for off in OFFLOAD_SYSTEMS:
        base = off[:-len("_off")]
        out += [s for s in (base, off) if s in rows and s not in out]
    return out


def _worst_where(ranks: List[Dict]) -> Dict[str, Dict]:
    """Per place, the split of the rank whose peak there is the highest."""
    return {w: max((r["where"][w] for r in ranks), key=lambda x: x["peak"]) for w in WHERE}


def where_floors(system: str, floor: Dict[str, float]) -> Dict[str, float]:
    """The floor of each place ([Note: offload rows]): offloaded, the device holds the gathered
    groups and the activations, the host the sharded parameters, gradients and AdamW state;
    otherwise the device holds all of it and the host nothing."""
    if system in OFFLOAD_SYSTEMS:
        return {"device": floor["gathered"] + floor["act"], "host": floor["sharded"]}
    return {"device": floor["floor"], "host": 0.0}


def print_where_table(title: str, rows: Dict[str, Dict], floor: Dict[str, float]) -> None:
    """One line per system: for the device and for the host, the peak of the bytes that live there,
    its split by role, the floor of that place and the excess over it (MiB)."""
    print(f"\n{title}")
    print(f"floors: offloaded: device = 2 groups full {floor['gathered'] / MiB:.2f} + act {floor['act'] / MiB:.2f}, "
          f"host = sharded {floor['sharded'] / MiB:.2f}; not offloaded: device = {floor['floor'] / MiB:.2f}, host = 0")
    cols = ("peak",) + ROLES + ("floor", "excess")
    print(f"{'':11s} " + " | ".join(f"{w:^{9 * len(cols) - 1}s}" for w in WHERE))
    print(f"{'system':11s} " + " | ".join(" ".join(f"{c:>8s}" for c in cols) for _ in WHERE))
    for system, r in rows.items():
        floors = where_floors(system, floor)
        parts = []
        for w in WHERE:
            x = r[w]
            values = [x["peak"]] + [x[k] for k in ROLES] + [floors[w], x["peak"] - floors[w]]
            parts.append(" ".join(f"{v / MiB:8.2f}" for v in values[:-1]) + f" {values[-1] / MiB:+8.2f}")
        print(f"{system:11s} " + " | ".join(parts))


def _describe(precision: str) -> str:
    return "bf16 params/compute, fp32 master + reduce" if precision == "bf16" else "fp32"


def print_table(title: str, rows: Dict[str, Dict], floor: Dict[str, float], rss: bool = True) -> None:
    print(f"\n{title}")
    print(f"floor = sharded {floor['sharded'] / MiB:.2f} + 2 groups full {floor['gathered'] / MiB:.2f} + "
          f"act {floor['act'] / MiB:.2f} = {floor['floor'] / MiB:.2f} MiB per rank")
    head = f"{'system':9s} {'peak MiB':>9s} " + " ".join(f"{r:>8s}" for r in ROLES)
    head += f" {'floor':>8s} {'excess':>8s}" + (f" {'RSS MiB':>8s}" if rss else "")
    print(head)
    for system, r in rows.items():
        line = f"{system:9s} {r['peak'] / MiB:9.2f} " + " ".join(f"{r[k] / MiB:8.2f}" for k in ROLES)
        line += f" {floor['floor'] / MiB:8.2f} {(r['peak'] - floor['floor']) / MiB:+8.2f}"
        print(line + (f" {r['rss'] / MiB:8.1f}" if rss else ""))


# ---- fake process group: world sizes we cannot run -------------------------------------------
def _fake_model(args):
    dims = dict(hidden=args.fake_hidden, ffn=args.fake_ffn, heads=args.fake_heads, kv_heads=args.fake_kv_heads)
    return (lambda: LlamaShapedStack(args.fake_layers, **dims)), dims


def _fake_batches(args, hidden: int):
    """Two batches of hidden states in the compute dtype ([Note: inputs in the compute dtype])."""
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if args.fake_precision == "bf16" else torch.float32
    return [(torch.randn(1, args.fake_seq, hidden, generator=g).to(dtype), None) for _ in range(2)]


def _fake_worker(_index: int, world: int, args, out) -> None:
    """Rank 0 of a fake world of ``world`` ranks, every system in turn, in a process of its own
    per world size (DeepSpeed keeps the first process group it saw for good)."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()), DS_ACCELERATOR="cpu")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model_fn, dims = _fake_model(args)
    batches = _fake_batches(args, dims["hidden"])
    for system in args.fake_systems:
        with fake_world(world):
            try:
                out[f"{world}:{system}"] = measure_rank(system, model_fn, stack_layers, args.fake_precision, batches,
                                                        1, dims["hidden"])
            except Exception as e:  # noqa: BLE001 - reported in the table: the system does not run here
                out[f"{world}:{system}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}"


def run_fake(args) -> None:
    """Rank 0 of a fake world of each size, one process per size."""
    model_fn, dims = _fake_model(args)
    act = activation_peak(model_fn, args.fake_precision, *_fake_batches(args, dims["hidden"])[-1])
    with mp.Manager() as manager:
        out = manager.dict()
        for world in args.fake_ranks:
            mp.start_processes(_fake_worker, args=(world, args, out), nprocs=1, start_method="spawn")
            results = {s: out[f"{world}:{s}"] for s in args.fake_systems}
            title = (f"{world} ranks (fake process group, rank 0; estimate), {_describe(args.fake_precision)}, "
                     f"{args.fake_layers} Llama-3-8B-shaped layers (hidden {dims['hidden']}, ffn {dims['ffn']}, "
                     f"{dims['heads']} heads, {dims['kv_heads']} KV heads; no embedding/head), 1 x "
                     f"{args.fake_seq} tokens")
            tables = [("", stack_layers, [s for s in results if s not in PER_LINEAR[:2]])]
            if any(s in results for s in PER_LINEAR[:2]):  # [Note: granularity of the comparison]
                tables.append((" -- one group per nn.Linear, ZeRO-3's unit", _linears,
                               [s for s in PER_LINEAR if s in results]))
            for suffix, units, systems in tables:
                rows = {s: results[s] for s in systems if isinstance(results[s], dict)}
                floor = floor_parts(model_fn, units, args.fake_precision, world, act)
                print_table(title + suffix, rows, floor, rss=False)
                for system in systems:
                    if not isinstance(results[system], dict):
                        print(f"{system:9s} does not run on the fake process group: {results[system]}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="*", default=[2, 4])
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--systems", nargs="+", default=list(REAL_SYSTEMS), choices=REAL_SYSTEMS)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--fake-ranks", type=int, nargs="*", default=[8, 64, 1024])
    p.add_argument("--fake-systems", nargs="+", default=list(FAKE_SYSTEMS), choices=FAKE_SYSTEMS)
    p.add_argument("--fake-layers", type=int, default=2)
    p.add_argument("--fake-hidden", type=int, default=4096)
    p.add_argument("--fake-ffn", type=int, default=14336)
    p.add_argument("--fake-heads", type=int, default=32)
    p.add_argument("--fake-kv-heads", type=int, default=8)
    p.add_argument("--fake-seq", type=int, default=64)
    p.add_argument("--fake-precision", choices=["fp32", "bf16"], default="fp32")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.ranks:
        run_real(args)
    if args.fake_ranks:
        run_fake(args)


if __name__ == "__main__":
    main()
