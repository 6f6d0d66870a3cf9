"""Run a function on N gloo ranks in fresh processes, with a hard timeout.

``run_on_ranks(fn, world_size, *args)`` starts ``world_size`` processes, each calling
``fn(rank, world_size, *args)`` with the default process group initialised, and returns
the list of per-rank return values. ``run_cases_on_ranks`` runs several named cases one
after another in one such start (see [Note: ranks forked from a warm server]), and names
the case that failed. A rank that raises fails the test with its
traceback; ranks that are still running after ``timeout`` seconds are killed, so a
mismatched collective fails instead of hanging; a rank that dies (a signal: SIGSEGV in a
native library) fails it at once, naming the case it was in, with its Python stack on stderr.
``run_with_a_killed_rank`` runs ranks one of which is to die of SIGKILL (crash-safety tests),
``run_with_a_stuck_rank`` ranks one of which stops answering while alive (timeout tests).
"""

from __future__ import annotations

import faulthandler
import gc
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_cases_on_ranks", "run_on_ranks", "run_with_a_killed_rank", "run_with_a_stuck_rank"]


# [Note: ranks forked from a warm server]
# A spawned rank imports torch and vescale_zero afresh: 5 to 7 s on CI's two cores, most of a
# small test, and a few hundred times a run. The ranks are forked instead from one server per
# test session (multiprocessing's "forkserver", started at the first run) that has imported
# them once: a clean process, with no thread, process group or patch of the test's. What a
# rank does after the fork is what a spawned rank did (each rank still imports the test's
# module, and the hosts it uses, itself). A forked rank would see the environment the server
# started with: each rank takes the test's ``os.environ`` of the moment instead.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor", "vescale_zero",
            "tests.distributed"]
_START_METHOD = "forkserver"
mp.get_context(_START_METHOD).set_forkserver_preload(_PRELOAD)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _take_environment(environ: Dict[str, str], rank: int, world_size: int, port: int, **extra: str) -> None:
    """This rank's environment: the test's, not the server's ([Note: ranks forked from a warm server]),
    and the rendezvous of its process group."""
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      **extra)


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple,
           environ: Dict[str, str]) -> None:
    _take_environment(environ, rank, world_size, port, **{_CASE_FILE: os.path.join(out_dir, f"{rank}.case")})
    faulthandler.enable()  # a rank killed by a signal prints its Python stack
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
            _entry, args=(world_size, _free_port(), out_dir, fn, args, dict(os.environ)), nprocs=world_size,
            join=False, start_method=_START_METHOD,
        )
        deadline = time.monotonic() + timeout
        crash = None
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    for p in ctx.processes:
                        p.kill()
                    # a rank that raised leaves its peers waiting in a collective: say why
                    _, errors = _read_reports(out_dir, range(world_size))
                    raise TimeoutError("\n".join([f"ranks still running after {timeout:.0f}s (a collective mismatch?)"]
                                                  + errors))
        except mp.ProcessExitedException as e:  # a rank died; the others' reports say why
            crash = e
            for p in ctx.processes:
                p.kill()
        reports, errors = _read_reports(out_dir, range(world_size))
        results = list(reports.values())
        if errors or crash:
            raise AssertionError("\n".join(errors + ([f"({crash})"] if crash else [])))
        return results


class CaseFailed(RuntimeError):
    """Raised on a rank by :func:`run_cases_on_ranks` for the case whose function raised."""


_CASE_FILE = "VZ_TEST_CASE_FILE"  # where a rank writes the case it runs (read if it dies)


def _run_cases(rank: int, world_size: int, cases: Dict[str, Tuple[Callable, tuple]]) -> Dict[str, Any]:
    out = {}
    for name, (fn, args) in cases.items():
        with open(os.environ[_CASE_FILE], "w") as f:
            f.write(str(name))  # a case name may be a tuple
        try:
            out[name] = fn(rank, world_size, *args)
        except BaseException as e:  # noqa: BLE001 - re-raised naming the case
            raise CaseFailed(f"case {name!r} failed on rank {rank} (of {world_size})") from e
        gc.collect()
        dist.barrier()  # the next case starts on all ranks together
    return out


def run_cases_on_ranks(cases: Dict[str, Tuple[Callable, tuple]], world_size: int,
                       timeout: float = 240.0) -> Dict[str, List[Any]]:
    """Runs ``cases`` (``{name: (fn, args)}``, each as ``fn(rank, world_size, *args)`` in
    :func:`run_on_ranks`) one after another in ONE spawn of ``world_size`` ranks; returns
    ``{name: [per-rank results]}``. A case that raises fails the run with a ``CaseFailed``
    naming it (the cases after it do not run); ``timeout`` is for all the cases together."""
    per_rank = run_on_ranks(_run_cases, world_size, cases, timeout=timeout)
    return {name: [r[name] for r in per_rank] for name in cases}


def _read_reports(
    out_dir: str, ranks: Iterable[int], exit_codes: Optional[Dict[int, Any]] = None,
) -> Tuple[Dict[int, Any], List[str]]:
    """The ranks' pickled reports in ``out_dir``: ``({rank: value}, [error lines])``; a rank
    without a report or whose function raised gives an error line (with its exit code if known)."""
    results, errors = {}, []
    for rank in ranks:
        path = os.path.join(out_dir, f"{rank}.pkl")
        if not os.path.exists(path):
            code = f" (exit code {exit_codes[rank]})" if exit_codes else ""
            case = os.path.join(out_dir, f"{rank}.case")
            if os.path.exists(case):
                with open(case) as f:
                    code += f" in case {f.read()!r}"
            errors.append(f"rank {rank} exited without a result{code}")
            continue
        with open(path, "rb") as f:
            status, value = pickle.load(f)
        if status == "error":
            errors.append(f"rank {rank} failed:\n{value}")
        results[rank] = value
    return results, errors


def _entry_to_die(rank: int, world_size: int, port: int, out_dir: str, timeout_s: float, fn: Callable,
                  args: tuple, environ: Dict[str, str]) -> None:
    """Like :func:`_entry`, with a short collective timeout, and no teardown: a survivor's
    process group has a dead peer, so it reports and leaves at once."""
    _take_environment(environ, rank, world_size, port)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
        result: Any = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    os._exit(0)


def run_with_a_killed_rank(fn: Callable, world_size: int, victim: int, *args: Any, collective_timeout: float = 30.0,
                           timeout: float = 240.0) -> Dict[int, Any]:
    """Like :func:`run_on_ranks` for a run in which rank ``victim`` kills itself with SIGKILL
    (``fn`` arranges that); returns ``{rank: result}`` of the survivors. Fails unless the
    victim died of SIGKILL and every survivor returned (or raised: its traceback fails the
    test) within ``timeout``; survivors' collectives give up after ``collective_timeout``."""
    return _run_with_a_victim(fn, world_size, victim, args, collective_timeout, timeout, stuck=False)


def run_with_a_stuck_rank(fn: Callable, world_size: int, victim: int, *args: Any, collective_timeout: float = 30.0,
                          timeout: float = 240.0) -> Dict[int, Any]:
    """Like :func:`run_with_a_killed_rank` for a run in which rank ``victim`` stops answering
    but stays alive (``fn`` makes it sleep past ``timeout``): returns ``{rank: result}`` of the
    survivors, once each has returned. Fails unless every survivor returned within ``timeout``
    while the victim was still alive (then it is killed)."""
    return _run_with_a_victim(fn, world_size, victim, args, collective_timeout, timeout, stuck=True)


def _run_with_a_victim(fn: Callable, world_size: int, victim: int, args: tuple, collective_timeout: float,
                       timeout: float, stuck: bool) -> Dict[int, Any]:
    ctx = mp.get_context(_START_METHOD)
    survivors = [r for r in range(world_size) if r != victim]
    with tempfile.TemporaryDirectory() as out_dir:
        port = _free_port()
        procs = [ctx.Process(target=_entry_to_die, args=(r, world_size, port, out_dir, collective_timeout, fn, args,
                                                             dict(os.environ)))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for r in survivors if stuck else range(world_size):
            procs[r].join(max(0.1, deadline - time.monotonic()))
        hung = [r for r in (survivors if stuck else range(world_size)) if procs[r].is_alive()]
        victim_alive = procs[victim].is_alive()
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            raise TimeoutError(f"ranks {hung} still running after {timeout:.0f}s: a survivor hangs on its "
                               f"{'stuck' if stuck else 'dead'} peer (rank {victim})")
        if stuck and not victim_alive:
            raise AssertionError(f"rank {victim} was to stay alive (stuck) until its peers returned; it exited with "
                                 f"code {procs[victim].exitcode}")
        if not stuck and procs[victim].exitcode != -signal.SIGKILL:
            raise AssertionError(f"rank {victim} was to die of SIGKILL; its exit code is {procs[victim].exitcode}")
        results, errors = _read_reports(out_dir, survivors, {r: procs[r].exitcode for r in survivors})
        if errors:
            raise AssertionError("\n".join(errors))
        return results
