"""The GPU check's CPU dry mode (``python -m vescale_zero.gpu_check --device cpu``), run the way
CI runs it, so that the check is known to work before a GPU ever sees it: every section passes,
or is skipped saying why (only the CUDA-only ones: sync debug, sanitizer, FusedAdam); the report
files exist and parse; the report is printed. megatron-core runs behind the test-only CUDA shim,
applied in its section's process through ``--prelude``. And the isolation the GPU run relies on
([Note: one process per section]): a section that raises, or whose process dies, is a FAIL
naming why, and the check goes on and still writes its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
import types
import warnings

import pytest
import torch

from vescale_zero.tools.gpu_check import SECTIONS
from vescale_zero.torch_compat import collect_sanitizer_reports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_ONLY = {s.name for s in SECTIONS if s.cuda_only}


def _check(out: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "vescale_zero.gpu_check", "--device", "cpu", "--out", out, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=500)


def sabotage(section: str) -> None:
    """A ``--prelude`` that breaks two sections: one raises, one's process dies."""
    if section == "main_job":
        raise ValueError("sabotaged on purpose")
    if section == "checkpoint":
        print("dying on purpose", flush=True)
        os._exit(3)


@pytest.mark.slow  # ~25 s; CI's own stage also runs the dry mode on the oldest torch
def test_dry_mode_passes_or_skips_every_section_and_writes_its_report(tmp_path):
    pytest.importorskip("deepspeed")
    pytest.importorskip("megatron.core")
    run = _check(str(tmp_path), "--prelude", "tests.megatron_shim:gpu_check_prelude")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    markdown = (tmp_path / "report.md").read_text()
    assert (tmp_path / "sections.log").stat().st_size > 0
    assert markdown.startswith("# vescale-zero GPU check") and markdown in run.stdout  # printed
    status = {s["name"]: s["status"] for s in report["sections"]}
    assert list(status) == [s.name for s in SECTIONS], status
    assert {n for n, st in status.items() if st == "SKIP"} == CUDA_ONLY, status
    assert {n for n, st in status.items() if st != "SKIP"} == {n for n in status if n not in CUDA_ONLY}
    assert all(st == "PASS" for n, st in status.items() if n not in CUDA_ONLY), report["sections"]
    for s in report["sections"]:
        assert s["summary"], s  # a PASS says what it measured, a SKIP why
        assert f"| {s['name']} | {s['status']} |" in markdown
    figures = {s["name"]: s["figures"] for s in report["sections"]}
    assert figures["main_job"]["fp32_gap"]["bit_identical"], figures["main_job"]  # fp32: as the unsharded model
    assert figures["checkpoint"]["differ"] == [] and figures["checkpoint"]["next_loss_equal"]
    for world in ("8", "64"):
        assert all(figures["memory"][world][s]["allocated"] > 0 for s in ("vescale", "fsdp2")), figures["memory"]
    assert {"vescale", "fsdp2", "ddp"} <= set(figures["step_time"]), figures["step_time"]


def test_a_failing_section_is_reported_and_the_check_goes_on(tmp_path):
    run = _check(str(tmp_path), "--sections", "main_job", "checkpoint", "sync_debug", "--prelude",
                 "tests.test_gpu_check:sabotage")
    assert run.returncode == 1, run.stdout[-4000:] + run.stderr[-4000:]
    sections = {s["name"]: s for s in json.loads((tmp_path / "report.json").read_text())["sections"]}
    assert list(sections) == ["main_job", "checkpoint", "sync_debug"]
    assert sections["main_job"]["status"] == "FAIL"
    assert sections["main_job"]["summary"] == "ValueError: sabotaged on purpose"
    assert sections["checkpoint"]["status"] == "FAIL"
    assert sections["checkpoint"]["summary"] == "its process exited with 3 before reporting: dying on purpose"
    assert sections["sync_debug"]["status"] == "SKIP"
    assert "Traceback" in (tmp_path / "sections.log").read_text()  # the raised section's traceback is kept
    late = _check(str(tmp_path / "late"), "--sections", "main_job", "--budget", "1")
    (section,) = json.loads((tmp_path / "late" / "report.json").read_text())["sections"]
    assert late.returncode == 0 and section["status"] == "SKIP", section
    assert section["summary"].endswith("left in the 1 s budget, it needs 20 s"), section


def _sync_here() -> None:
    warnings.warn("called a synchronizing CUDA operation", stacklevel=1)  # what set_sync_debug_mode("warn") emits


def test_host_syncs_are_counted_by_caller_and_the_mode_is_reset(monkeypatch):
    """The sync-debug section's counting, on CPU: torch's mode switch stood in for (a CPU build has
    no CUDA to watch), the warnings it emits made by hand."""
    from vescale_zero.tools.gpu_check import jobs

    modes = []

    def switch(mode):  # torch 2.11's switch warns about "synchronizing operations" itself: not a sync
        warnings.warn("set_sync_debug_mode: not all synchronizing operations will warn", stacklevel=1)
        modes.append(mode)

    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", switch)

    def step():
        _sync_here()
        _sync_here()
        warnings.warn("something else", stacklevel=1)

    sites = jobs.host_syncs(step)
    assert modes == ["warn", 0]
    ((site, count),) = sites.items()
    assert count == 2 and site.startswith("tests/test_gpu_check.py:") and "_sync_here" in site, sites

    def raising():
        raise RuntimeError("called a synchronizing CUDA operation\nmore")

    assert jobs.error_mode(raising) == "RuntimeError: called a synchronizing CUDA operation"
    assert modes[2:] == ["error", 0]


def test_sanitizer_reports_are_collected_not_raised(monkeypatch):
    """The sanitizer section's counting, on CPU: torch's sanitizer object stood in for, the report
    built with torch's own classes, so their fields are those of the installed torch."""
    import torch.cuda._sanitizer as csan

    from vescale_zero.tools.gpu_check import jobs

    stack = traceback.extract_stack()  # outermost first, as the sanitizer keeps its stacks
    access = lambda kind, op, stream: csan.Access(kind, 1, stream, op, ["self"], False, stack)  # noqa: E731
    report = csan.UnsynchronizedAccessError(1234, None, access(csan.AccessType.WRITE, "aten::add_(Tensor self)", 7),
                                            access(csan.AccessType.READ, "c10d::allgather_(Tensor t)", 0))

    class Handler:
        def _handle_kernel_launch(self, *args, **kwargs):
            return [report]

    handler = Handler()
    monkeypatch.setattr(csan, "cuda_sanitizer", types.SimpleNamespace(
        enabled=True, dispatch=types.SimpleNamespace(event_handler=handler)))
    reports = []
    collect_sanitizer_reports(reports)
    assert handler._handle_kernel_launch("stream", set(), set(), set(), None, {}) == []  # nothing raised
    assert reports == [report]
    text = jobs._describe_report(report)
    assert text.startswith("reading from by c10d::allgather_ on stream 0, then writing to by aten::add_ on stream 7, "
                           "at tests/test_gpu_check.py:"), text
