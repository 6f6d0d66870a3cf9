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

__all__ = ["install_cuda_shim", "gpu_check_prelude", "MegatronFP32Step", "megatron_optimizer_on_cpu",
           "fused_wgrad_on_cpu"]

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


class _FP8Off:
    """Transformer Engine's FP8GlobalStateManager with FP8 training off."""

    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def get_fp8_recipe() -> None:
        return None


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
    # ``with torch.device("meta")`` redirects the factories it listed on first use (a cached
    # set of the torch functions): list the real ones before they are wrapped, else the
    # wrappers' inner calls are not recognised and land on the CPU.
    from torch.utils._device import _device_constructors

    _device_constructors()
    for name in _FACTORIES:
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    torch.Tensor.cuda = lambda self, *a, **k: self

    import megatron.core.tensor_parallel.random as tp_random

    tp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    if not hasattr(tp_random, "FP8GlobalStateManager"):
        # 0.16.1's CheckpointWithoutOutput (selective recompute of "layernorm") sets
        # ``self.fp8 = fp8 is not None`` -- always true -- and then calls Transformer Engine's
        # FP8 hooks: stand in for TE with FP8 off, as on a GPU with TE and bf16 training.
        tp_random.FP8GlobalStateManager = _FP8Off
        tp_random.activation_recompute_forward = lambda *a, **k: contextlib.nullcontext()
        tp_random.fp8_autocast = lambda *a, **k: contextlib.nullcontext()
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16.1 reads it unguarded when TE is absent
        moe_utils.te_general_gemm = None
    _installed = True


def gpu_check_prelude(section: str) -> None:
    """The GPU check's dry mode with megatron-core on CPU: ``python -m vescale_zero.gpu_check
    --device cpu --prelude tests.megatron_shim:gpu_check_prelude`` installs the shim in the
    megatron section's process, and nowhere else."""
    if section == "megatron":
        install_cuda_shim()


@contextlib.contextmanager
def megatron_optimizer_on_cpu():
    """Build megatron-core's own optimizers on CPU: its distributed optimizer accepts
    parameters only when ``param.type()`` names a CUDA tensor type. Use with
    ``--clip-grad 0`` (its clipping asserts CUDA tensors)."""
    original = torch.Tensor.type

    def type_(self, *args: Any, **kwargs: Any):
        name = original(self, *args, **kwargs)
        if not args and not kwargs and name.startswith("torch.") and not name.startswith("torch.cuda."):
            return "torch.cuda." + name[len("torch."):]
        return name

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


class MegatronFP32Step:
    """Megatron's ``FP32Optimizer.step`` on CPU: megatron-core's optimizer classes call
    CUDA (multi-tensor kernels, ``clip_grad_by_total_norm_fp32`` asserts CUDA tensors), so
    the DDP reference runs the same math -- ``main_grad`` as the gradient, Megatron's own
    grad-norm over the model-parallel group, clipping, torch AdamW on Megatron's param
    groups -- here."""

    def __init__(self, model, config) -> None:
        from vescale_zero.integrations.megatron.megatron_compat import param_groups

        groups = param_groups([model], config)  # as get_megatron_optimizer builds them, on every release
        for g in groups:
            g["lr"] = g["max_lr"] * g["lr_mult"]
            g["weight_decay"] = config.weight_decay * g["wd_mult"]
        self.config = config
        self.inner = torch.optim.AdamW(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                                       eps=config.adam_eps)
        self.params = [p for g in groups for p in g["params"]]

    @property
    def param_groups(self) -> list:
        """Megatron's param groups (``max_lr``, ``lr_mult``...), for its ``OptimizerParamScheduler``."""
        return self.inner.param_groups

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        from megatron.core import parallel_state
        from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        for p in self.params:
            p.grad = p.main_grad
        counted = [p.grad for p in self.params if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)]
        norm = get_grad_norm_fp32(counted, grad_stats_parallel_group=parallel_state.get_model_parallel_group())
        coeff = self.config.clip_grad / (norm + 1.0e-6)  # clip_grad_by_total_norm_fp32 (which asserts CUDA)
        if self.config.clip_grad > 0 and coeff < 1.0:
            for p in self.params:
                p.grad.mul_(coeff)
        self.inner.step()
        return True, norm, None


class _FusedWeightGradientOnCPU:
    """Test-only stand-in for apex's ``fused_weight_gradient_mlp_cuda`` (CUDA only): the weight
    gradient GEMM that accumulates into ``main_grad`` (``C = grad_output^T @ input + C``, cuBLAS
    with beta 1, fp32 accumulation for the fp32 variant), as megatron-core's
    ``LinearWithGradAccumulationAndAsyncCommunication.backward`` calls it with 2-D tensors."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        assert main_grad.dtype == torch.float32, main_grad.dtype
        main_grad.addmm_(grad_output.t().float(), total_input.float())

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))


@contextlib.contextmanager
def fused_wgrad_on_cpu():
    """megatron-core's linear layers with ``gradient_accumulation_fusion`` on CPU: they find
    the fused kernel (megatron/core/tensor_parallel/layers.py imports it once, at import)."""
    from megatron.core.tensor_parallel import layers

    saved = (getattr(layers, "fused_weight_gradient_mlp_cuda", None), layers._grad_accum_fusion_available)
    layers.fused_weight_gradient_mlp_cuda = _FusedWeightGradientOnCPU
    layers._grad_accum_fusion_available = True
    try:
        yield
    finally:
        layers.fused_weight_gradient_mlp_cuda, layers._grad_accum_fusion_available = saved
