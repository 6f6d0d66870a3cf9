"""Runs the sections, each in a process of its own, and writes the report.

[Note: one process per section] Each section runs in a fresh ``python -m vescale_zero.gpu_check
--section NAME`` process, with its own time limit, started in a session of its own (killed whole
at the limit, a JIT build's compilers too). A CUDA error is sticky for the process that met it,
an NCCL hang holds its process, torch's CUDA sanitizer is switched on by an environment variable
read at ``import torch``, and DeepSpeed keeps the first process group it saw: one process each
keeps a failure to its own section and gives each its own allocator peaks. The section writes an
``Outcome`` as JSON; a process that dies first (or hangs) is a FAIL with its last words. Scratch
files live in a temporary directory; ``--out`` gets only ``report.md``, ``report.json`` and
``sections.log`` (every section's output).

A section's process starts in the scratch directory, with the runner's working directory at the
end of its ``PYTHONPATH``: an installed vescale-zero (a wheel in ``PYTHONPATH``) comes first even
when the check is started from the repository's root, whose ``vescale_zero/`` lacks
``vescale_zero.integrations`` (``setup.py`` maps it from ``integrations/``); a ``--prelude`` module
of the repository (``tests.megatron_shim``) is still found. So whether a section's ``needs`` are
importable is asked in its own process.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Sequence

import torch

from .plan import DRY, FULL, SECTIONS, Context, Section
from .report import Outcome, one_line, render_json, render_markdown

__all__ = ["run_check", "run_section", "environment"]

PACKAGES = ("vescale-zero", "deepspeed", "megatron-core", "transformers", "accelerate", "peft", "trl", "hjson",
            "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions", "datasets")
DRY_TIMEOUT_S = 150.0  # per section on a CPU (2 busy cores)
LOG_TAIL = 200  # lines of each section's output kept in sections.log


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


def environment(device: torch.device) -> Dict[str, Any]:
    """What the report's head says about the machine (of the device: its properties only)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        what = (f"{props.name}, capability {props.major}.{props.minor}, {props.total_memory / 2**30:.0f} GiB, "
                f"{torch.cuda.device_count()} visible")
    else:
        what = f"cpu (dry mode: tiny sizes, gloo), {os.cpu_count()} cores"
    versions = {name: _version(name) for name in PACKAGES}
    return {
        "device": what,
        "torch": f"{_version('torch')} (CUDA {torch.version.cuda or '-'}), Python {platform.python_version()}",
        "packages": ", ".join(f"{k} {v}" for k, v in versions.items()),
    }


def _missing(section: Section) -> str:
    """"" if every module ``section`` needs is importable here, else which are not."""
    missing = [m for m in section.needs if not _importable(m)]
    return f"not installed: {', '.join(missing)} (carry its wheel: README, GPU check)" if missing else ""


def _last_words(log: str) -> str:
    """The line of a dead process's output that says why: its last exception line, else its last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if line.split(":")[0].endswith(("Error", "Exception", "Errors"))]
    return (errors or lines or ["(no output)"])[-1][:300]


def _run_child(section: Section, device: str, timeout_s: float, scratch: str, prelude: Optional[str]) -> Outcome:
    """One section in its own process ([Note: one process per section])."""
    result = os.path.join(scratch, f"{section.name}.json")
    log_path = os.path.join(scratch, f"{section.name}.log")
    cmd = [sys.executable, "-m", "vescale_zero.tools.gpu_check", "--section", section.name, "--device", device,
           "--result", result, "--timeout", str(max(10.0, timeout_s - 15))]
    cmd += ["--prelude", prelude] if prelude else []
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), os.getcwd()) if p)  # see the module's note
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", PYTHONUNBUFFERED="1", PYTHONPATH=path, **dict(section.env))
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=scratch,
                                 start_new_session=True)
        try:
            rc = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # its session: the section's process and what it started
            child.wait()
            rc = None
    seconds = time.perf_counter() - t0
    with open(log_path) as f:
        output = f.read()
    if os.path.exists(result):  # written whole or not at all (run_section)
        with open(result) as f:
            outcome = Outcome(**json.load(f))
    elif rc is None:
        outcome = Outcome(section.name, "FAIL", f"timed out after {timeout_s:.0f} s; last: {_last_words(output)}")
    else:
        how = f"killed by signal {-rc}" if rc < 0 else f"exited with {rc}"
        outcome = Outcome(section.name, "FAIL", f"its process {how} before reporting: {_last_words(output)}")
    outcome.seconds = seconds
    return outcome


def run_check(out: str, device: str, budget_s: float, prelude: Optional[str] = None,
              only: Optional[Sequence[str]] = None) -> int:
    """Every section (or those in ``only``) in order, within ``budget_s`` seconds; writes
    ``report.md``, ``report.json`` and ``sections.log`` into ``out`` and prints the report.
    Returns 0 if no section failed, else 1."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here (use --device cpu for the dry mode)")
    os.makedirs(out, exist_ok=True)
    start = time.perf_counter()
    out = os.path.abspath(out)
    env = environment(dev)
    scratch = tempfile.mkdtemp(prefix="vescale_gpu_check_")
    outcomes: List[Outcome] = []
    logs: List[str] = []
    try:
        for section in SECTIONS:
            if only and section.name not in only:
                continue
            left = budget_s - (time.perf_counter() - start)
            reason = section.cuda_only if dev.type != "cuda" else ""
            if not reason and left < section.least_s:
                reason = f"{left:.0f} s left in the {budget_s:.0f} s budget, it needs {section.least_s:.0f} s"
            if reason:
                outcome = Outcome(section.name, "SKIP", reason)
            else:
                limit = min(section.timeout_s if dev.type == "cuda" else DRY_TIMEOUT_S, left)
                outcome = _run_child(section, device, limit, scratch, prelude)
                with open(os.path.join(scratch, f"{section.name}.log")) as f:
                    tail = f.read().splitlines()[-LOG_TAIL:]
                logs.append(f"===== {section.name}: {outcome.status} ({outcome.seconds:.1f} s)\n" + "\n".join(tail))
            outcomes.append(outcome)
            print(f"[gpu_check] {outcome.name}: {outcome.status} ({outcome.seconds:.1f} s) {outcome.summary}",
                  file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    total = time.perf_counter() - start
    places = sorted({o.figures.get("imported_from") for o in outcomes} - {None})
    env["vescale_zero imported from"] = ", ".join(places) or "-"
    markdown = render_markdown(env, outcomes, total, budget_s)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(markdown)
    with open(os.path.join(out, "report.json"), "w") as f:
        f.write(render_json(env, outcomes, total, budget_s))
    with open(os.path.join(out, "sections.log"), "w") as f:
        f.write("\n".join(logs) + "\n")
    print(markdown, flush=True)
    return 1 if any(o.status == "FAIL" for o in outcomes) else 0


class _Skip(Exception):
    """A section that cannot run here, and why."""


def run_section(name: str, device: str, result: str, timeout_s: float, prelude: Optional[str]) -> int:
    """The process of one section ([Note: one process per section]): the prelude, the section,
    its ``Outcome`` written to ``result`` as JSON (a raised exception is a FAIL naming it)."""
    section = next(s for s in SECTIONS if s.name == name)
    t0 = time.perf_counter()
    scratch = tempfile.mkdtemp(prefix=f"vescale_gpu_check_{name}_")
    try:
        missing = _missing(section)
        if missing:
            raise _Skip(missing)
        if prelude:
            module, _, function = prelude.partition(":")
            getattr(importlib.import_module(module), function)(name)
        dev = torch.device(device)
        if dev.type == "cuda":
            dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
            torch.cuda.set_device(dev)
        module, _, function = section.function.partition(":")
        run = getattr(importlib.import_module(f"vescale_zero.tools.gpu_check.{module}"), function)
        outcome = run(Context(dev, FULL if dev.type == "cuda" else DRY, scratch, timeout_s))
    except _Skip as e:
        outcome = Outcome(name, "SKIP", str(e))
    except BaseException as e:  # noqa: BLE001 - the section's failure is its report
        traceback.print_exc()
        outcome = Outcome(name, "FAIL", one_line(e))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    outcome.seconds = time.perf_counter() - t0
    outcome.figures["imported_from"] = os.path.dirname(importlib.import_module("vescale_zero").__file__)
    with open(result + ".tmp", "w") as f:
        json.dump(asdict(outcome), f, default=str)
    os.replace(result + ".tmp", result)  # the runner sees the whole result or none
    return 0
