"""Optimizer state in files (vescale_zero.optim.state_files) vs in memory: step time, peak RSS, tracker bytes.

    .venv/bin/python benchmarks/offload_nvme.py [--ranks 2] [--layers 8] [--d-model 512] [--dir /path/on/nvme]

One GPT (``fully_shard_layers``: one group per block), AdamW (foreach), trained on ``--ranks``
gloo ranks three times, each in fresh processes so that each has its own peak RSS: state in
memory, state in files (one staging buffer), state in files with read-ahead (two buffers, an
I/O thread). Per variant, rank 0's: median optimizer-step and whole-iteration time over
``--steps`` steps after two warm-up steps; the peak RSS over those steps (``VmHWM`` after
``/proc/self/clear_refs`` reset it at the end of the warm-up); and one more step under
``LiveBytes``: the peak live tensor bytes and the optimizer-state bytes alive at that peak.
Then the raw file I/O of ``StateFileDir`` (``os.pwritev`` / ``os.preadv``) on ``--dir``, once
from the page cache and once after ``fsync`` + ``POSIX_FADV_DONTNEED`` (the disk itself).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import socket
import statistics
import tempfile
import time
from typing import Dict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import vescale_zero as vz
from tests.live_bytes import LiveBytes
from vescale_zero.optim import offload_state_to_files
from vescale_zero.optim.state_file_io import StateFileDir
from vescale_zero.primitives.ragged_tensor import local_piece
from vescale_zero.testing import GPT, GPTConfig, SyntheticCorpus

VARIANTS = {"memory": 0, "files": 1, "files, read-ahead": 2}  # name -> buffer_count (0: in memory)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> bool:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _state_locals(opt) -> list:
    return [local_piece(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]


def _worker(rank: int, world: int, port: int, buffer_count: int, directory: str, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=8, seq_len=64, vocab_size=512)
    model = GPT(cfg)
    vz.fully_shard_layers(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    files = offload_state_to_files(opt, model, directory, buffer_count=buffer_count) if buffer_count else None
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)
    batches = [corpus.batch(i, args.batch * world, rank, world) for i in range(args.steps + 3)]

    def iteration(x, y, timed):
        t0 = time.perf_counter()
        model(x, y).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        opt.zero_grad()
        timed.append((t2 - t0, t2 - t1))

    warm = []
    for x, y in batches[:2]:
        iteration(x, y, warm)
    state_total = (sum(files.payload_bytes().values()) if files is not None
                   else sum(t.numel() * t.element_size() for t in _state_locals(opt)))
    largest = max(files.payload_bytes().values()) if files is not None else None
    reset = _reset_peak_rss()
    rss_before = _status("VmRSS")
    timed = []
    for x, y in batches[2:-1]:
        iteration(x, y, timed)
    peak_rss = _status("VmHWM") if reset else None
    x, y = batches[-1]
    model(x, y).backward()
    with LiveBytes() as tracker:
        opt.step()
    state_keys = tracker.keys_of(files.staging_buffers() if files is not None else _state_locals(opt))
    opt.zero_grad()
    result = {
        "iter_ms": 1e3 * statistics.median(t for t, _ in timed),
        "step_ms": 1e3 * statistics.median(s for _, s in timed),
        "peak_rss": peak_rss, "rss_before": rss_before, "tracker_peak": tracker.peak,
        "tracker_state": tracker.split({k: "state" for k in state_keys}).get("state", 0),
        "state_total": state_total, "largest_group": largest,
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        out.update(gathered[0])
    dist.barrier()
    dist.destroy_process_group()


def run_variant(buffer_count: int, args) -> Dict:
    directory = tempfile.mkdtemp(prefix="vz-offload-", dir=args.dir)
    try:
        with mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(_worker, args=(args.ranks, _free_port(), buffer_count, directory, args, out), nprocs=args.ranks)
            return dict(out)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def io_throughput(directory: str, mib: int, reps: int = 3) -> Dict[str, float]:
    """MB/s of StateFileDir.write / .read of ``mib`` MiB: from the page cache, and from the disk."""
    work = tempfile.mkdtemp(prefix="vz-io-", dir=directory)
    files = StateFileDir(work, 0, 1)
    nbytes = mib << 20
    buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    into = torch.empty_like(buf)
    best = {"write": 0.0, "read (page cache)": 0.0, "read (disk)": 0.0}
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            files.write(0, buf, nbytes, 0)
            best["write"] = max(best["write"], nbytes / (time.perf_counter() - t0) / 1e6)
            t0 = time.perf_counter()
            files.read(0, into, nbytes, 0)
            best["read (page cache)"] = max(best["read (page cache)"], nbytes / (time.perf_counter() - t0) / 1e6)
            fd = files._fd(0)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            files.read(0, into, nbytes, 0)
            best["read (disk)"] = max(best["read (disk)"], nbytes / (time.perf_counter() - t0) / 1e6)
        assert torch.equal(buf, into)
    finally:
        files.close(remove=True)
        shutil.rmtree(work, ignore_errors=True)
    return best


def _mb(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dir", default=None, help="where the state files go (default: the temp directory)")
    parser.add_argument("--io-mib", type=int, default=256)
    args = parser.parse_args()
    rows = {name: run_variant(bc, args) for name, bc in VARIANTS.items()}
    mem = rows["memory"]
    print(f"GPT {args.layers} x d{args.d_model}, {args.ranks} ranks, AdamW foreach; rank 0; state files in "
          f"{args.dir or tempfile.gettempdir()}")
    print("| state | iteration ms | step ms | peak RSS MiB | tracker peak MiB | state at tracker peak MiB |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['iter_ms']:.1f} | {r['step_ms']:.1f} | {_mb(r['peak_rss'])} | {_mb(r['tracker_peak'])} "
              f"| {_mb(r['tracker_state'])} |")
    files = rows["files"]
    expected = files["state_total"] - files["largest_group"]
    print(f"optimizer state {_mb(files['state_total'])} MiB on rank 0, largest group {_mb(files['largest_group'])} MiB:"
          f" expected drop {_mb(expected)} MiB")
    for name in ("files", "files, read-ahead"):
        r = rows[name]
        rss = ("-" if r["peak_rss"] is None or mem["peak_rss"] is None
               else f"{_mb(mem['peak_rss'] - r['peak_rss'])} MiB")
        print(f"{name}: step time x{r['step_ms'] / mem['step_ms']:.2f}, iteration x{r['iter_ms'] / mem['iter_ms']:.2f};"
              f" peak RSS drop {rss}, tracker peak drop {_mb(mem['tracker_peak'] - r['tracker_peak'])} MiB")
    io = io_throughput(args.dir or tempfile.gettempdir(), args.io_mib)
    print("state file I/O (StateFileDir, " + f"{args.io_mib} MiB): " + ", ".join(f"{k} {v:.0f} MB/s"
                                                                          for k, v in io.items()))


if __name__ == "__main__":
    main()
