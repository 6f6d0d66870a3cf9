"""Sharded checkpoint save / load: vescale-zero against ZeRO-3 and FSDP2, in one run.

    .venv/bin/python benchmarks/checkpoint_io.py [--ranks 2 3] [--repeats 3] [--dir DIR] [--json io.json]

Peers, all on the same GPT (``vescale_zero.testing.GPT``, tied embedding / head) and torch
AdamW, built by ``benchmarks/peers.py``'s ``build_variant`` and trained for ``--train-steps``
steps so the Adam state exists; fp32 on gloo (CPU), NCCL when GPUs are present:

* ``vescale``: ``vescale_zero.fully_shard`` per block + root (``granularity="row"``),
  ``vescale_zero.checkpoint.save(path, model, opt)`` / ``checkpoint.load(path, model, opt)``;
* ``zero3``: DeepSpeed ``stage: 3`` with ``"optimizer": {"type": "AdamW", "params":
  {"torch_adam": true}}``, ``engine.save_checkpoint(dir, tag)`` / ``engine.load_checkpoint(dir, tag)``
  (default flags: optimizer and scheduler states loaded, ``load_module_strict=True``);
* ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` per block + root,
  ``get_state_dict(model, opt)`` + ``dcp.save({"model", "optim"}, checkpoint_id=dir)`` /
  ``get_state_dict`` + ``dcp.load(..., checkpoint_id=dir)`` + ``set_state_dict``.

Each peer runs in fresh processes, one world size after another. Per repeat (``--repeats``,
a new directory each time, under a fresh temporary directory inside ``--dir``), per rank:

* save ms / load ms: ``time.perf_counter`` around the whole call (for FSDP2 the
  ``get_state_dict`` / ``set_state_dict`` around DCP are inside the timed region), with a
  barrier just before the start and just after the end, so every rank's time is the slowest
  rank's; the figure is the max over ranks, and the table shows its median over repeats.
  Files are written to and read from the page cache (nothing is fsync'ed and the cache is
  not dropped), so these are serialisation + memory-copy costs more than disk costs.
* bytes written per rank: the sizes, after the save, of the files that rank writes, known by
  name: vescale ``rankNNNNN.pt``; ZeRO-3 ``zero_pp_rank_R_mp_rank_00_{model,optim}_states.pt``;
  FSDP2 ``__R_*.distcp``. Every other file of the checkpoint (vescale ``metadata.json``,
  ZeRO-3 ``latest`` and its ``zero_to_*.py`` scripts, DCP ``.metadata``) is charged to rank 0, which
  writes it. The table shows the max over ranks; "files/rank" is rank 0's count / another rank's.
* bytes read per rank: the sizes of the distinct checkpoint files that rank opens for
  reading during the load, seen by a Python audit hook on ``open`` (``builtins.open``,
  ``io.open`` and ``os.open`` all raise it). vescale's loader opens ``metadata.json``, rank 0's
  file (buffers, hyper-parameters) and the files whose ranges overlap this rank's pieces
  (from the index in ``metadata.json``), each read once; ZeRO-3 at the same world size opens this rank's
  two files; DCP this rank's ``.distcp``
  plus ``.metadata`` and whichever other ``.distcp`` holds replicated items it needs (DCP
  writes each replicated item, e.g. AdamW ``step``, once, on a rank it picks). File size is an
  upper bound on what a reader that seeks (DCP) reads, and counts a file read twice once, so
  two more figures are printed under the table and kept in the JSON: ``read_opened_bytes``
  (the size of every open, re-opens included) and ``read_syscall_bytes``, the growth of
  ``rchar`` in ``/proc/self/io`` across the load, i.e. the bytes actually passed through
  ``read()`` (gloo's socket receives do not count; a module first imported during a load
  would); under the table its median over repeats of the max over ranks.
* loaded == saved: after the save, this rank's local pieces of every parameter (vescale's
  sharded parameters, ZeRO-3's ``ds_tensor``, FSDP2's ``DTensor.to_local()``) and every
  tensor of the torch AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``; ZeRO-3's inner
  optimizer over its fp32 partitions) are cloned, then all of them are zeroed, the checkpoint
  is loaded, and each must be ``torch.equal`` to its clone: OK on every rank and repeat, else FAIL.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for benchmarks.peers

from benchmarks.peers import build_variant, train_step  # noqa: E402

PEERS = ("vescale", "zero3", "fsdp2")
WRITER_RANK = {  # file name -> the rank that writes it; files matching none are rank 0's
    "vescale": re.compile(r"^rank(\d+)\.pt$"),
    "zero3": re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_"),
    "fsdp2": re.compile(r"^__(\d+)_\d+\.distcp$"),
}


# ----------------------------------------------------------------------------- file accounting

class _OpenRecorder:
    """Paths opened for reading under ``root`` between start() and stop() (a Python audit hook)."""

    def __init__(self) -> None:
        self.root: Optional[str] = None
        self.opened: List[str] = []
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: Tuple[Any, ...]) -> None:
        if event != "open" or self.root is None:
            return
        path, mode, flags = args
        if not isinstance(path, (str, bytes, os.PathLike)):
            return  # an fd
        path = os.path.abspath(os.fsdecode(path))
        if not path.startswith(self.root):
            return
        if isinstance(mode, str):
            reading = "r" in mode and "+" not in mode
        else:
            reading = (flags or 0) & os.O_ACCMODE == os.O_RDONLY
        if reading and os.path.isfile(path):
            self.opened.append(path)

    def start(self, root: str) -> None:
        self.opened, self.root = [], os.path.abspath(root) + os.sep

    def stop(self) -> List[str]:
        self.root = None
        return self.opened


def _rchar() -> int:
    """Bytes this process has passed through read() / pread() so far (/proc/self/io): file
    reads, page cache included; gloo's socket receives do not count."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def _files_under(root: str) -> List[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files)


def _written_by(peer: str, root: str, rank: int) -> List[str]:
    """The files of the checkpoint under ``root`` that ``rank`` wrote."""
    mine = []
    for path in _files_under(root):
        match = WRITER_RANK[peer].search(os.path.basename(path))
        if (int(match.group(1)) if match else 0) == rank:
            mine.append(path)
    return mine


# ----------------------------------------------------------------------------- the peers

@dataclass
class Trained:
    """One peer's trained model, and how to checkpoint it and see this rank's state."""

    save: Callable[[str], None]
    load: Callable[[str], None]
    local_state: Callable[[], List[torch.Tensor]]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _optimizer_tensors(opt: torch.optim.Optimizer) -> List[torch.Tensor]:
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p, {})
            out += [_local(state[k]) for k in sorted(state) if torch.is_tensor(state[k])]
    return out


def _vescale(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Trained:
    from vescale_zero import checkpoint

    def local_state() -> List[torch.Tensor]:
        return [p.data for _, p, *_ in checkpoint.managed_pieces(model)] + _optimizer_tensors(opt)

    return Trained(lambda path: checkpoint.save(path, model, opt),
                   lambda path: checkpoint.load(path, model, opt), local_state)


def _zero3(engine: Any) -> Trained:
    tag = "bench"

    def load(path: str) -> None:
        loaded, _ = engine.load_checkpoint(path, tag=tag)
        if loaded is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint at {path!r}")

    def local_state() -> List[torch.Tensor]:
        return [p.ds_tensor.data for p in engine.module.parameters()] + _optimizer_tensors(engine.optimizer.optimizer)

    return Trained(lambda path: engine.save_checkpoint(path, tag=tag), load, local_state)


def _fsdp2(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Trained:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def save(path: str) -> None:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    def load(path: str) -> None:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def local_state() -> List[torch.Tensor]:
        return [_local(p.data) for p in model.parameters()] + _optimizer_tensors(opt)

    return Trained(save, load, local_state)


def _build_and_train(peer: str, cfg: Any, device: torch.device, args: argparse.Namespace) -> Trained:
    from vescale_zero.testing import SyntheticCorpus

    model, opt, engine = build_variant(peer, cfg, device, args)
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)
    rank, world = dist.get_rank(), dist.get_world_size()
    for i in range(args.train_steps):
        x, y = (t.to(device) for t in corpus.batch(i, args.global_batch, rank, world))
        train_step(model, opt, engine, x, y)
    if peer == "vescale":
        return _vescale(model, opt)
    if peer == "zero3":
        return _zero3(engine)
    return _fsdp2(model, opt)


# ----------------------------------------------------------------------------- measuring

def _timed(fn: Callable[[], None], device: torch.device) -> float:
    """Seconds from a barrier before ``fn`` to a barrier after it."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    return time.perf_counter() - t0


def _zero_(tensors: List[torch.Tensor]) -> None:
    with torch.no_grad():
        for t in tensors:
            t.zero_()


def _repeat(peer: str, trained: Trained, path: str, recorder: _OpenRecorder, device: torch.device) -> Dict[str, Any]:
    """Save to ``path``, zero this rank's state, load it back; this rank's figures."""
    rank = dist.get_rank()
    before = [t.detach().clone() for t in trained.local_state()]
    save_s = _timed(lambda: trained.save(path), device)
    written = _written_by(peer, path, rank)
    _zero_(trained.local_state())
    recorder.start(path)
    rchar = _rchar()
    load_s = _timed(lambda: trained.load(path), device)
    rchar = _rchar() - rchar
    opened = recorder.stop()
    after = trained.local_state()
    equal = len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
    distinct = set(opened)
    return {
        "save_s": save_s, "load_s": load_s, "written_bytes": sum(os.path.getsize(p) for p in written),
        "written_files": len(written), "written_names": [os.path.relpath(p, path) for p in written],
        "read_bytes": sum(os.path.getsize(p) for p in distinct), "read_files": len(distinct),
        "read_opened_bytes": sum(os.path.getsize(p) for p in opened), "read_opens": len(opened),
        "read_syscall_bytes": rchar,
        "read_names": sorted(os.path.relpath(p, path) for p in distinct),
        "tensors_checked": len(before), "equal": equal,
    }


def _init_distributed(rank: int, world: int, port: int, peer: str) -> torch.device:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if peer == "zero3":
        if not cuda:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        if not cuda:
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skip its JIT build
        deepspeed.init_distributed(dist_backend=backend)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    return device


def worker(rank: int, world: int, port: int, peer: str, args: argparse.Namespace, root: str, out: Dict) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # DeepSpeed's deprecated collectives, once per step
    recorder = _OpenRecorder()
    device = _init_distributed(rank, world, port, peer)
    from vescale_zero.testing import GPTConfig

    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers,
                    n_heads=8)
    trained = _build_and_train(peer, cfg, device, args)
    repeats = []
    for i in range(args.repeats):
        path = os.path.join(root, f"{peer}-w{world}-r{i}")
        repeats.append(_repeat(peer, trained, path, recorder, device))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path)
    gathered = [None] * world
    dist.all_gather_object(gathered, repeats)
    if rank == 0:
        out[f"{world}:{peer}"] = gathered
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- reporting

def _summarise(per_rank: List[List[Dict[str, Any]]]) -> Dict[str, Any]:
    """Medians over repeats of the slowest rank's times; maxima over ranks of the bytes."""
    repeats = range(len(per_rank[0]))
    save_ms = [1e3 * max(r[i]["save_s"] for r in per_rank) for i in repeats]
    load_ms = [1e3 * max(r[i]["load_s"] for r in per_rank) for i in repeats]
    every = [x for r in per_rank for x in r]
    return {
        "save_ms": statistics.median(save_ms), "load_ms": statistics.median(load_ms),
        "save_ms_all": save_ms, "load_ms_all": load_ms,
        "written_mib": max(x["written_bytes"] for x in every) / 2**20,
        "read_mib": max(x["read_bytes"] for x in every) / 2**20,
        "read_opened_mib": max(x["read_opened_bytes"] for x in every) / 2**20,
        "read_syscall_mib": statistics.median(max(r[i]["read_syscall_bytes"] for r in per_rank)
                                              for i in repeats) / 2**20,
        "files_rank0": per_rank[0][0]["written_files"],
        "files_other": per_rank[1][0]["written_files"] if len(per_rank) > 1 else None,
        "written_names_rank0": per_rank[0][0]["written_names"],
        "read_names_rank0": per_rank[0][0]["read_names"],
        "ok": all(x["equal"] for x in every),
        "tensors_checked": per_rank[0][0]["tensors_checked"],
    }


def _table(rows: Dict[str, Dict[str, Any]]) -> str:
    head = ("| peer | save ms med | load ms med | MiB written/rank (max) | MiB read/rank (max) | files/rank | "
            "÷FSDP2 save | ÷ZeRO-3 save | ÷FSDP2 load | ÷ZeRO-3 load | loaded == saved |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for peer, r in rows.items():
        files = f"{r['files_rank0']} / {r['files_other']}" if r["files_other"] is not None else f"{r['files_rank0']}"
        lines.append(
            f"| {peer} | {r['save_ms']:.1f} | {r['load_ms']:.1f} | {r['written_mib']:.2f} | {r['read_mib']:.2f} | "
            f"{files} | {r['save_ms'] / rows['fsdp2']['save_ms']:.2f} | "
            f"{r['save_ms'] / rows['zero3']['save_ms']:.2f} | "
            f"{r['load_ms'] / rows['fsdp2']['load_ms']:.2f} | {r['load_ms'] / rows['zero3']['load_ms']:.2f} | "
            f"{'OK' if r['ok'] else 'FAIL'} |")
    return "\n".join(lines)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", help="a fresh temporary directory is made (and removed) inside it; default: the system's")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (each repeat's files are removed)")
    p.add_argument("--train-steps", type=int, default=2)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--json", help="write the raw measurements and the summary here")
    return p.parse_args()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    args = _parse()
    if torch.cuda.is_available():
        args.ranks = [min(r, torch.cuda.device_count()) for r in args.ranks]
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="checkpoint_io-", dir=args.dir)
    started = time.perf_counter()
    runs = [(w, peer) for w in args.ranks for peer in PEERS]
    try:
        with mp.Manager() as manager:
            out = manager.dict()
            bar = tqdm(runs, desc="checkpoint save/load")
            for world, peer in bar:
                bar.set_postfix_str(f"{peer} x{world}")
                mp.spawn(worker, args=(world, _free_port(), peer, args, root, out), nprocs=world)
            raw = dict(out)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    backend = "NCCL" if torch.cuda.is_available() else "gloo CPU"
    summary = {}
    for world in args.ranks:
        rows = {peer: _summarise(raw[f"{world}:{peer}"]) for peer in PEERS}
        summary[world] = rows
        print(f"\n{world} ranks, {backend}, fp32 GPT {args.layers}x{args.d_model} (vocab {args.vocab}, seq "
              f"{args.seq_len}) + AdamW after {args.train_steps} steps; median of {args.repeats} repeats\n")
        print(_table(rows))
        for peer, r in rows.items():
            print(f"  {peer}: rank 0 wrote {', '.join(r['written_names_rank0'])}; "
                  f"read {', '.join(r['read_names_rank0'])}; "
                  f"MiB/rank (max) counting every open {r['read_opened_mib']:.2f}, through read() "
                  f"{r['read_syscall_mib']:.2f}; {r['tensors_checked']} tensors checked per rank")
    print(f"\nwall time {time.perf_counter() - started:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "raw": raw}, f, indent=1)


if __name__ == "__main__":
    main()
