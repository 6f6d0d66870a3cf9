"""What the GPU check runs: its sections, in order, and the sizes of each run (full on CUDA,
tiny in the CPU dry mode)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch

from ...testing import GPTConfig

__all__ = ["Sizes", "FULL", "DRY", "Section", "SECTIONS", "Context"]


@dataclass(frozen=True)
class Sizes:
    """How big each run is. ``gpt``: the main job's model (``steps`` steps of ``global_batch``
    sequences); ``big_gpt``: the ~1B-parameter model of the step times (``big_batch`` sequences,
    ``warmup`` then ``timed`` steps per system); ``llama``: the Llama-3-8B-shaped stack of the
    memory section (``llama_layers`` layers, one sequence of ``llama_seq`` tokens) at the fake
    world sizes ``fake_worlds``; ``copy_*``: the copy kernels (``copy_scale`` None: the smallest
    that fits the device); ``megatron``: megatron-core ``GPTModel`` dims."""

    gpt: GPTConfig
    global_batch: int
    steps: int
    parity_steps: int
    sanitizer_steps: int
    big_gpt: GPTConfig
    big_batch: int
    warmup: int
    timed: int
    llama: Dict[str, int]
    llama_layers: int
    llama_seq: int
    fake_worlds: Tuple[int, ...]
    copy_model: str
    copy_scale: Optional[int]
    copy_ranks: Tuple[int, ...]
    copy_reps: int
    megatron: Dict[str, int] = field(default_factory=dict)


FULL = Sizes(
    gpt=GPTConfig(vocab_size=256, seq_len=256, d_model=256, n_layers=4, n_heads=8), global_batch=16, steps=30,
    parity_steps=5, sanitizer_steps=2,
    big_gpt=GPTConfig(vocab_size=512, seq_len=1024, d_model=2048, n_layers=20, n_heads=16),  # 1.01e9 parameters
    big_batch=8, warmup=3, timed=10,
    llama=dict(hidden=4096, ffn=14336, heads=32, kv_heads=8), llama_layers=4, llama_seq=2048, fake_worlds=(8, 64),
    copy_model="llama3-70b", copy_scale=None, copy_ranks=(8, 64), copy_reps=5,
    megatron=dict(layers=2, hidden=256, heads=8, seq=128, vocab=512, micro_batch=4, steps=10),
)
DRY = Sizes(
    gpt=GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_layers=2, n_heads=4), global_batch=8, steps=15,
    parity_steps=3, sanitizer_steps=2,
    big_gpt=GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_layers=2, n_heads=4), big_batch=4, warmup=1, timed=2,
    llama=dict(hidden=64, ffn=128, heads=4, kv_heads=2), llama_layers=2, llama_seq=8, fake_worlds=(8, 64),
    copy_model="llama3-70b", copy_scale=256, copy_ranks=(8, 64), copy_reps=2,
    megatron=dict(layers=2, hidden=64, heads=4, seq=32, vocab=128, micro_batch=2, steps=8),
)


@dataclass(frozen=True)
class Section:
    """One part of the check, run in a process of its own ([Note: one process per section]).

    ``function``: ``module:function`` under ``vescale_zero.tools.gpu_check``, called with a
    :class:`Context`, returning an ``Outcome``. ``needs``: modules that must be importable, else
    the section is skipped saying which. ``cuda_only``: why it is skipped on another device
    ("": it runs everywhere). ``timeout_s``: its limit on CUDA (the dry mode has its own).
    ``env``: set in its process only. ``least_s``: the time it needs at the least; with less left
    in the budget it is skipped, saying so."""

    name: str
    function: str
    needs: Tuple[str, ...] = ()
    cuda_only: str = ""
    timeout_s: float = 120.0
    env: Tuple[Tuple[str, str], ...] = ()
    least_s: float = 20.0


SECTIONS = (
    Section("main_job", "jobs:main_job", timeout_s=90),
    Section("checkpoint", "jobs:checkpoint", timeout_s=90),
    Section("sync_debug", "jobs:sync_debug", timeout_s=90,
            cuda_only="torch.cuda.set_sync_debug_mode watches CUDA synchronisations only"),
    Section("memory", "measure:memory", timeout_s=150),
    Section("step_time", "measure:step_time", timeout_s=150),
    Section("copies", "measure:copies", timeout_s=120),
    Section("deepspeed", "hosts:deepspeed_torch_adam", needs=("deepspeed", "vescale_zero.integrations"),
            timeout_s=120),
    Section("megatron", "hosts:megatron", needs=("megatron.core", "vescale_zero.integrations"), timeout_s=120),
    Section("sanitizer", "jobs:sanitizer", timeout_s=150, env=(("TORCH_CUDA_SANITIZER", "1"),),
            cuda_only="TORCH_CUDA_SANITIZER analyses CUDA kernels and streams only"),
    Section("deepspeed_fused_adam", "hosts:deepspeed_fused_adam", needs=("deepspeed", "vescale_zero.integrations"),
            timeout_s=240, least_s=120, cuda_only="DeepSpeed's FusedAdam is a CUDA kernel (built on first use, "
            "~1 min); the dry mode's deepspeed section runs torch's Adam, as our tests do"),
)


@dataclass(frozen=True)
class Context:
    """What a section gets: its device, the sizes, a scratch directory of its own (removed
    afterwards) and its time limit (also its process group's timeout)."""

    device: torch.device
    sizes: Sizes
    workdir: str
    timeout_s: float
