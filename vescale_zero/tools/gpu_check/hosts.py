"""Sections that run our adapters inside their hosts, at world size 1, in bf16.

* ``deepspeed``: the main job's GPT through ``deepspeed.initialize`` with
  ``"zero_optimization": {"stage": "ragged"}`` and torch's AdamW (``"torch_adam": true``, as
  our CPU tests run it).
* ``deepspeed_fused_adam``: the same with the config's AdamW left to DeepSpeed: its FusedAdam,
  a CUDA kernel JIT-built on first use (for this device's architecture only, into the section's
  scratch directory); the build time is part of the ``initialize`` figure.
* ``megatron``: megatron-core's ``GPTModel`` (local layer spec, ``Float16Module``) under
  ``RaggedFSDP`` with ``get_vescale_optimizer``, trained through megatron-core's
  forward-backward schedule and ``finalize_model_grads``, as
  ``examples/megatron/pretrain_gpt.py`` does. megatron-core calls CUDA unconditionally: off
  CUDA it runs only behind the test-only shim, which a test harness applies through the
  check's ``--prelude`` (``tests/megatron_shim.py``); without it the section is skipped.
"""

from __future__ import annotations

import os
import statistics
import time
from datetime import timedelta
from typing import Dict, List

import torch
import torch.distributed as dist

from ... import host_patches
from ...testing import GPT
from .device import synchronize, world_of_one
from .jobs import LR, batches, trained
from .plan import Context
from .report import Outcome

__all__ = ["deepspeed_torch_adam", "deepspeed_fused_adam", "megatron"]


def _optimizer_chain(engine) -> List[str]:
    """The class names from the engine's optimizer inwards (wrappers hold theirs as ``.optimizer``)."""
    names, opt = [], getattr(engine, "optimizer", None)
    while opt is not None and len(names) < 6:
        names.append(type(opt).__name__)
        opt = getattr(opt, "optimizer", None)
    basic = getattr(engine, "basic_optimizer", None)
    if basic is not None and type(basic).__name__ not in names:
        names.append(type(basic).__name__)
    return names


def _jit_build_missing() -> str:
    """What a CUDA extension's JIT build needs and this machine lacks ("" if nothing)."""
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if not home or not os.path.exists(os.path.join(home, "bin", "nvcc")):
        return f"this machine has no nvcc (CUDA_HOME: {home or 'unset'})"
    if not cpp_extension.is_ninja_available():
        return "this machine has no ninja"
    return ""


def _deepspeed(ctx: Context, name: str, fused: bool) -> Outcome:
    if ctx.device.type != "cuda":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    elif fused:  # the JIT build: this device's architecture only, into this section's own directory
        missing = _jit_build_missing()
        if missing:
            return Outcome(name, "SKIP", f"DeepSpeed's FusedAdam is built on first use and {missing}")
        # Always this device's own "major.minor": DeepSpeed 0.19.8 parses the list itself and fails on
        # arch-specific entries such as "9.0a" that CUDA containers set (ValueError: '0a'; H200, 2026-11-27)
        major, minor = torch.cuda.get_device_capability(ctx.device)
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
        os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(ctx.workdir, "torch_extensions")
    import deepspeed

    import vescale_zero.integrations.deepspeed  # noqa: F401  (registers the stage "ragged")

    if ctx.device.type != "cuda":
        # host patch deepspeed.ops.__compatible_ops__: checked against deepspeed 0.16.9-0.19.8
        host_patches.assign("deepspeed.ops.__compatible_ops__", False, key="deepspeed_shm_comm")  # a 40 s CPU build
    s = ctx.sizes
    deepspeed.init_distributed(dist_backend="nccl" if ctx.device.type == "cuda" else "gloo",
                               timeout=timedelta(seconds=ctx.timeout_s))
    try:
        cfg = {"train_batch_size": s.global_batch, "train_micro_batch_size_per_gpu": s.global_batch,
               "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
               "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1, "torch_adam": not fused}},
               "zero_optimization": {"stage": "ragged"}, "bf16": {"enabled": True}, "steps_per_print": 10 ** 9}
        t0 = time.perf_counter()
        engine, *_ = deepspeed.initialize(model=GPT(s.gpt), config=cfg)
        init_s = time.perf_counter() - t0
        chain = _optimizer_chain(engine)
        batch = batches(s.gpt, s.global_batch, engine.device)
        losses = []
        t0 = time.perf_counter()
        for i in range(s.steps):
            x, y = batch(i)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        synchronize(ctx.device)
        ms = 1e3 * (time.perf_counter() - t0) / s.steps
        values = [v.item() for v in losses]
    finally:
        dist.destroy_process_group()
    why = trained(values)
    if fused and not any("FusedAdam" in n for n in chain):
        why = (why + "; " if why else "") + f"the optimizer is not DeepSpeed's FusedAdam: {' > '.join(chain)}"
    figures = {"losses": values, "optimizer": chain, "initialize_s": init_s, "ms_per_step": ms}
    summary = (f"loss {values[0]:.3f} -> {statistics.mean(values[-3:]):.3f} (last 3) in {s.steps} steps; "
               f"optimizer {' > '.join(chain)}; initialize {init_s:.1f} s; {ms:.1f} ms/step"
               + (f"; FAIL: {why}" if why else ""))
    return Outcome(name, "FAIL" if why else "PASS", summary, [], figures)


def deepspeed_torch_adam(ctx: Context) -> Outcome:
    return _deepspeed(ctx, "deepspeed", fused=False)


def deepspeed_fused_adam(ctx: Context) -> Outcome:
    return _deepspeed(ctx, "deepspeed_fused_adam", fused=True)


def _megatron_cuda_reachable(device: torch.device) -> bool:
    """megatron-core can run here: on CUDA, or where a harness made ``torch.cuda`` answer for
    the CPU (the test-only shim sets ``torch.cuda.current_device`` to return ``"cpu"``)."""
    if device.type == "cuda":
        return True
    try:
        return torch.cuda.current_device() == "cpu"
    except (AssertionError, RuntimeError):
        return False


def megatron(ctx: Context) -> Outcome:
    if not _megatron_cuda_reachable(ctx.device):
        return Outcome("megatron", "SKIP", "megatron-core calls CUDA unconditionally; off CUDA it runs only behind "
                       "the test-only shim (tests/test_gpu_check.py applies it with --prelude)")
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from vescale_zero.integrations.megatron import RaggedFSDP, get_vescale_optimizer

    from ...testing import SyntheticCorpus

    m = ctx.sizes.megatron
    seq, mb = m["seq"], m["micro_batch"]
    with world_of_one(ctx.device, ctx.timeout_s):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        try:
            torch.manual_seed(1234)
            model_parallel_cuda_manual_seed(1234)
            config = TransformerConfig(
                num_layers=m["layers"], hidden_size=m["hidden"], num_attention_heads=m["heads"],
                params_dtype=torch.bfloat16, bf16=True, pipeline_dtype=torch.bfloat16,
                use_cpu_initialization=ctx.device.type != "cuda", hidden_dropout=0.0, attention_dropout=0.0)
            model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=m["vocab"],
                             max_sequence_length=seq).to(ctx.device)
            model = RaggedFSDP(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                Float16Module(config, model))
            opt = get_vescale_optimizer(OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.1, bf16=True,
                                                        clip_grad=1.0), [model])
            config.no_sync_func = model.no_sync
            config.finalize_model_grads_func = finalize_model_grads
            forward_backward = get_forward_backward_func()
            corpus = SyntheticCorpus(m["vocab"], seq)
            positions = torch.arange(seq, device=ctx.device).unsqueeze(0).expand(mb, seq)

            def loss_func(output: torch.Tensor):
                loss = output.float().mean()
                return loss, {"lm loss": loss.detach().clone()}  # the schedule divides ``loss`` in place

            def forward_step(data_iterator, chunk):
                tokens, labels = next(data_iterator)
                return chunk(tokens, positions, None, labels=labels), loss_func

            losses, norms = [], []
            for i in range(m["steps"]):
                model.zero_grad_buffer()
                opt.zero_grad()
                x, y = (t.to(ctx.device) for t in corpus.batch(i, mb, 0, 1))
                out = forward_backward(forward_step_func=forward_step, data_iterator=iter([(x, y)]), model=[model],
                                       num_microbatches=1, seq_length=seq, micro_batch_size=mb, forward_only=False)
                _, norm, _ = opt.step()
                losses.append(out[0]["lm loss"])
                norms.append(norm)
            values = [v.item() for v in losses]
        finally:
            parallel_state.destroy_model_parallel()
    why = trained(values)
    figures: Dict = {"losses": values, "grad_norms": norms, "groups": len(model.vescale_groups)}
    summary = (f"GPTModel {m['layers']}x{m['hidden']} under RaggedFSDP (bf16): loss {values[0]:.3f} -> "
               f"{statistics.mean(values[-3:]):.3f} (last 3) in {m['steps']} steps"
               + (f"; FAIL: {why}" if why else ""))
    return Outcome("megatron", "FAIL" if why else "PASS", summary, [], figures)
