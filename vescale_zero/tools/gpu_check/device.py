"""The device side of the GPU check: the world of one rank, synchronising, peak memory, bandwidth.

Everything here takes the device it works on; ``torch.cuda`` is called only for a CUDA device.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Callable, Iterator, List, Optional

import torch
import torch.distributed as dist

__all__ = ["world_of_one", "synchronize", "PeakMemory", "nominal_bandwidth", "timed_steps", "MiB", "GiB"]

MiB, GiB = 2 ** 20, 2 ** 30

# Nominal memory bandwidth (bytes/s) by device name, most specific first: the vendor's figures.
_BANDWIDTH = (("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
              ("A100-SXM4-80GB", 2.039e12), ("A100", 1.555e12))


@contextlib.contextmanager
def world_of_one(device: torch.device, timeout_s: float) -> Iterator[None]:
    """The default process group for the block: this process alone, NCCL on CUDA, gloo
    elsewhere, with the section's timeout (MASTER_ADDR / MASTER_PORT come from the runner)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, timeout=timedelta(seconds=timeout_s))
    try:
        yield
    finally:
        dist.destroy_process_group()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PeakMemory:
    """``with PeakMemory(device) as peak: step()``; then ``peak.allocated`` (bytes) and
    ``peak.reserved`` (bytes; ``None`` off CUDA). On CUDA the caching allocator's peaks over the
    block; elsewhere (the dry mode, run from a checkout of the repository: ``tests/`` is test
    machinery, not installed) the peak of live tensor bytes (:class:`tests.live_bytes.LiveBytes`:
    every storage alive, the model's too)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.allocated = 0
        self.reserved: Optional[int] = None
        self._tracker = None

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            try:
                from tests.live_bytes import LiveBytes
            except ImportError as e:
                raise RuntimeError("the GPU check's CPU dry mode measures memory with tests/live_bytes.py: run it "
                                   "from the repository's root (tests/ is not installed)") from e

            self._tracker = LiveBytes()
            self._tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.allocated = torch.cuda.max_memory_allocated(self.device)
            self.reserved = torch.cuda.max_memory_reserved(self.device)
        else:
            self._tracker.__exit__(*exc)
            self.allocated = self._tracker.peak


def nominal_bandwidth(device: torch.device) -> Optional[float]:
    """The device's nominal memory bandwidth in bytes/s, told by its name; ``None`` if unknown
    (and for the CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in _BANDWIDTH if key in name), None)


def timed_steps(step: Callable[[int], None], device: torch.device, warmup: int, timed: int) -> List[float]:
    """``warmup`` calls of ``step(i)``, then ``timed`` more, each between two device
    synchronisations; the timed ones' wall times in ms. Every system is measured by this."""
    for i in range(warmup):
        step(i)
    times = []
    for i in range(warmup, warmup + timed):
        synchronize(device)
        t0 = time.perf_counter()
        step(i)
        synchronize(device)
        times.append(1e3 * (time.perf_counter() - t0))
    return times
