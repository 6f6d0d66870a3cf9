"""Test-only: let megatron-core 0.16 run on CPU (gloo) inside a test process.

megatron-core calls CUDA unconditionally: ``torch.cuda.current_device()`` as a device,
``device="cuda"`` in tensor factories, CUDA streams, and the CUDA RNG state in its
tensor-parallel RNG tracker. ``install_cuda_shim()`` redirects those to the CPU in the
calling process only. Never import this from the package: product code is device-agnostic
and runs megatron-core on real GPUs.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

__all__ = ["install_cuda_shim"]

_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint",
              "zeros_like", "ones_like", "empty_like", "full_like")
_installed = False


def _is_cuda(device: Any) -> bool:
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _on_cpu(factory):
    @functools.wraps(factory)
    def call(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return call


class _NoStream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *args: Any) -> "_NoEvent":
        return _NoEvent()


class _NoEvent(_NoStream):
    def record(self, *args: Any) -> None:
        pass

    def query(self) -> bool:
        return True


def install_cuda_shim() -> None:
    """Idempotent. Call in each rank process before building megatron-core objects."""
    global _installed
    if _installed:
        return
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.is_available = lambda: False
    cuda.synchronize = lambda *a, **k: None
    cuda.Stream, cuda.Event = _NoStream, _NoEvent
    cuda.current_stream = cuda.default_stream = lambda *a, **k: _NoStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    for name in _FACTORIES:
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    torch.Tensor.cuda = lambda self, *a, **k: self

    import megatron.core.tensor_parallel.random as tp_random

    tp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16.1 reads it unguarded when TE is absent
        moe_utils.te_general_gemm = None
    _installed = True
