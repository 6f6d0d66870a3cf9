"""Run a function on N gloo ranks in fresh processes, with a hard timeout.

``run_on_ranks(fn, world_size, *args)`` spawns ``world_size`` processes, each calling
``fn(rank, world_size, *args)`` with the default process group initialised, and returns
the list of per-rank return values. A rank that raises fails the test with its
traceback; ranks that are still running after ``timeout`` seconds are killed, so a
mismatched collective fails instead of hanging.
"""

from __future__ import annotations

import gc
import os
import pickle
import socket
import tempfile
import time
import traceback
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_on_ranks"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    result: Any
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = ("ok", fn(rank, world_size, *args))
        # Free the model's reference cycles (hooks <-> groups <-> process group) now, not
        # at interpreter exit, where destroying a gloo group aborts the process.
        gc.collect()
        dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent, then re-raised there
        result = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_on_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0) -> List[Any]:
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _entry, args=(world_size, _free_port(), out_dir, fn, args), nprocs=world_size, join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        crash = None
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    for p in ctx.processes:
                        p.kill()
                    raise TimeoutError(f"ranks still running after {timeout:.0f}s (a collective mismatch?)")
        except mp.ProcessExitedException as e:  # a rank died; the others' reports say why
            crash = e
            for p in ctx.processes:
                p.kill()
        results, errors = [], []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"{rank}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {rank} exited without a result")
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {rank} failed:\n{value}")
            results.append(value)
        if errors or crash:
            raise AssertionError("\n".join(errors + ([f"({crash})"] if crash else [])))
        return results
