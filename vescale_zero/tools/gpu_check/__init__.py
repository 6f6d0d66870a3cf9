"""The GPU check: what to run, in one command, the first minutes a GPU is available.

    python -m vescale_zero.gpu_check --out DIR                  # on a GPU machine (cuda, NCCL)
    python -m vescale_zero.gpu_check --out DIR --device cpu     # the dry mode: tiny sizes, gloo

It runs with the machine's own torch; what is not installed (deepspeed, megatron-core) is
skipped with one line saying so. Sections, in this order, each in a process of its own
([Note: one process per section]), at world size 1 (NCCL on CUDA, gloo on the CPU):

==========================  ================================================================
section                     what it runs and reports
==========================  ================================================================
main_job                    the README's GPT, every block and the root under ``fully_shard``,
                            bf16 with fp32 master / reduce, ``AdamW(fused=True)``, clipping:
                            the loss falls and stays finite; the same model in fp32 against
                            the unsharded one (how far apart)
checkpoint                  ``vescale_zero.checkpoint.save`` / ``load`` into a fresh model:
                            every piece equal, the next loss equal; save / load seconds
sync_debug                  one step under ``torch.cuda.set_sync_debug_mode("warn")`` (host
                            syncs counted, with their callers) and one under ``"error"``
memory                      peak allocated / reserved per rank, Llama-3-8B-shaped layers in
                            bf16, fake world sizes 8 and 64, ours beside FSDP2, ratio
step_time                   a ~1B-parameter GPT in bf16, ours vs FSDP2 vs DDP: ms/step, ratios
copies                      the copies around the collectives (``benchmarks/copy_overhead.py``)
                            in GB/s against the device's nominal bandwidth
deepspeed                   ``"stage": "ragged"`` with torch's AdamW
megatron                    megatron-core ``GPTModel`` under ``RaggedFSDP``
sanitizer                   the main job's steps under ``TORCH_CUDA_SANITIZER=1``: reports counted
deepspeed_fused_adam        ``"stage": "ragged"`` with DeepSpeed's FusedAdam (JIT-built, ~1 min)
==========================  ================================================================

Each section reports PASS, FAIL (with the exception's type and first line) or SKIP (with why)
and its figures; ``DIR`` gets ``report.md`` (also printed), ``report.json`` and ``sections.log``.
Sizes: :data:`plan.FULL` on CUDA, sized to finish within ~6 minutes on one H100 (``--budget``,
330 s by default: a section that no longer fits is skipped, saying so); :data:`plan.DRY` on the
CPU. Exit status 1 if a section failed. ``--prelude MODULE:FUNCTION`` is for test harnesses:
``tests/test_gpu_check.py`` applies the test-only megatron CUDA shim with it.
"""

from .plan import DRY, FULL, SECTIONS, Section, Sizes
from .report import Outcome
from .runner import run_check

__all__ = ["run_check", "SECTIONS", "Section", "Sizes", "FULL", "DRY", "Outcome"]
