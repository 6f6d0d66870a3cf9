"""``examples/megatron/pretrain_gpt.py @configs/megatron/gpt_vescale.args``, as README gives it.

The argument file holds one flag and its value per line; the example must read it as the
same arguments given on the command line, and start and train with it under torchrun (on
CPU through the test-only CUDA shim, made tiny by flags after the file, which override it).
Parity with megatron-core's DDP is tests/test_megatron.py's; this is the user's command line,
and Megatron-LM's flags on it: the learning-rate schedule (megatron-core's
OptimizerParamScheduler), the MoE aux-loss flags (both beside megatron-core DDP with the same
flags, bit-exact: two data-parallel ranks, two addends per sum), --save/--load (a resumed run
equals the uninterrupted one bit for bit), --fp16 over the file's --bf16, and Megatron-LM's
training_log fields. One spawn of 2 ranks runs the distributed cases.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from types import SimpleNamespace
from typing import Any, Dict, List

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is a test dependency (pip install -e '.[test]')")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = "examples/megatron/pretrain_gpt.py"
ARGS_FILE = "configs/megatron/gpt_vescale.args"
TINY = ["--tensor-model-parallel-size", "1", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "128", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-2"]


from tests.distributed import run_cases_on_ranks  # noqa: E402
from tests.test_megatron import SMALL, _megatron_job  # noqa: E402

# dp=2: one micro-batch of 2 per rank; no clipping (its norm sums in another order than DDP's)
ARGV = SMALL + ["--global-batch-size", "4", "--clip-grad", "0"]
# Megatron-LM's schedule flags: warmup over the first iteration, cosine decay to --min-lr over 3
SCHEDULE = ["--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--lr-decay-iters", "3", "--min-lr", "1e-3",
            "--train-iters", "4"]
MOE = ["--num-experts", "2", "--train-iters", "2", "--lr-decay-style", "constant"]


def _parser():
    spec = importlib.util.spec_from_file_location("pretrain_gpt", os.path.join(ROOT, EXAMPLE))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


def test_argument_file_reads_as_its_flags_on_the_command_line(tmp_path):
    """``@FILE`` parses to what its tokens give on the command line; later flags override it;
    comments and blank lines are ignored."""
    parser = _parser()
    path = os.path.join(ROOT, ARGS_FILE)
    with open(path) as f:
        tokens = shlex.split(f.read(), comments=True)
    from_file = parser.parse_args(["@" + path])
    assert from_file == parser.parse_args(tokens)
    assert (from_file.num_layers, from_file.lr, from_file.bf16, from_file.use_vescale_fsdp) == (8, 3e-4, True, True)
    assert parser.parse_args(["@" + path, "--num-layers", "2"]).num_layers == 2
    commented = tmp_path / "commented.args"
    commented.write_text("# a tiny model\n--num-layers 3   # three layers\n\n--lr 0.5\n")
    args = parser.parse_args(["@" + str(commented)])
    assert (args.num_layers, args.lr) == (3, 0.5)


@pytest.mark.slow  # ~20 s: torchrun and two megatron-core imports
def test_readme_command_trains_on_two_ranks():
    """README's ``torchrun ... pretrain_gpt.py @configs/megatron/gpt_vescale.args`` on 2 CPU
    ranks: it starts, trains with the file's ``--use-vescale-fsdp`` (the flags after the file
    only shrink the model), and the loss falls."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tests.megatron_example_on_cpu", EXAMPLE, "@" + ARGS_FILE, *TINY]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "unrecognized arguments" not in out
    done = re.search(r"done: RaggedFSDP \(ragged\), tp=1 pp=1 dp=2, loss ([\d.]+) -> ([\d.]+)", out)
    assert done, out[-4000:]
    assert float(done.group(2)) < float(done.group(1)), done.group(0)
    assert len(re.findall(r" iteration +\d+/ +3 \| consumed samples: ", out)) == 3, out[-4000:]


def test_fp16_after_the_file_overrides_its_bf16():
    """The file sets --bf16; --fp16 after it wins (and --bf16 after --fp16), as on Megatron-LM's
    command line, where the two together are refused."""
    parser = _parser()
    path = os.path.join(ROOT, ARGS_FILE)
    args = parser.parse_args(["@" + path, "--fp16"])
    assert (args.fp16, args.bf16) == (True, False)
    args = parser.parse_args(["--fp16", "--bf16"])
    assert (args.fp16, args.bf16) == (False, True)
    assert (parser.parse_args([]).fp16, parser.parse_args([]).bf16) == (False, False)


def _state(model) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}


def _ddp_and_ours(pg, args) -> Dict[str, Any]:
    """megatron-core DDP + Megatron's FP32 step and RaggedFSDP + its optimizer, each driven by
    the example's OptimizerParamScheduler: per-step losses, learning rates, final weights."""
    from tests.megatron_shim import MegatronFP32Step

    args.use_vescale_fsdp = False
    pg.seed(args)
    config = pg.transformer_config(args)
    ddp = pg.build_model(args, config)
    ref_opt = MegatronFP32Step(ddp, pg.optimizer_config(args))
    ref = pg.train_loop(args, ddp, ref_opt, config, scheduler=pg.optimizer_param_scheduler(args, ref_opt))
    ref_final = _state(ddp)
    del ddp
    args.use_vescale_fsdp = True
    model, optimizer, config = pg.build(args)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        ours = pg.train_loop(args, model, optimizer, config, scheduler=pg.optimizer_param_scheduler(args, optimizer))
    final = _state(model)
    return {"ref": (ref["losses"], ref["learning_rates"]), "ours": (ours["losses"], ours["learning_rates"]),
            "differ": sorted(k for k in ref_final if not torch.equal(final[k], ref_final[k])),
            "final": final, "log": log.getvalue()}


def _schedule(rank: int, world_size: int) -> Dict[str, Any]:
    with _megatron_job(ARGV + SCHEDULE) as (pg, args):
        out = _ddp_and_ours(pg, args)
        out.pop("final")
        return out


def _aux_loss(rank: int, world_size: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for coeff in ("0.1", "0"):
        with _megatron_job(ARGV + MOE + ["--moe-aux-loss-coeff", coeff]) as (pg, args):
            out[coeff] = _ddp_and_ours(pg, args)
    return {"differ": {c: r["differ"] for c, r in out.items()},
            "losses": {c: (r["ref"][0], r["ours"][0]) for c, r in out.items()},
            "coeff changes": sorted(k for k, v in out["0.1"]["final"].items()
                                    if not torch.equal(v, out["0"]["final"][k]))}


def _resume(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    """Uninterrupted 3 iterations; then 2 iterations saved every iteration (--save,
    --save-interval 1) and a new model loading them (--load) for the third, as main() does."""
    from megatron.core import parallel_state

    argv = ARGV + SCHEDULE[:-2] + ["--train-iters", "3", "--use-vescale-fsdp", "--clip-grad", "0.5"]
    with _megatron_job(argv) as (pg, args):
        model, optimizer, config = pg.build(args)
        whole = pg.train_loop(args, model, optimizer, config, scheduler=pg.optimizer_param_scheduler(args, optimizer))
        whole_final = _state(model)
        del model, optimizer

        args.train_iters, args.save, args.save_interval = 2, root, 1
        model, optimizer, config = pg.build(args)
        scheduler = pg.optimizer_param_scheduler(args, optimizer)
        pg.train_loop(args, model, optimizer, config, scheduler=scheduler, save=True)
        del model, optimizer
        with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
            tracker = f.read()
        saved = sorted(os.listdir(root))

        args.train_iters, args.save, args.load = 3, None, root
        model, optimizer, config = pg.build(args)
        scheduler = pg.optimizer_param_scheduler(args, optimizer)
        first, consumed = pg.load_checkpoint(args, model, optimizer, scheduler)
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            tail = pg.train_loop(args, model, optimizer, config, first, scheduler, consumed, save=True)
        final = _state(model)
        return {"tracker": tracker, "saved": saved, "first": (first, consumed), "tail": tail["losses"],
                "tail lr": tail["learning_rates"], "whole": (whole["losses"][2:], whole["learning_rates"][2:]),
                "differ": sorted(k for k in whole_final if not torch.equal(final[k], whole_final[k])),
                "log": log.getvalue(), "last": rank == parallel_state.get_data_parallel_world_size() - 1}


FUSION = ["--gradient-accumulation-fusion", "--global-batch-size", "8", "--train-iters", "2"]  # 2 micro-batches


def _fusion(rank: int, world_size: int, extra: List[str]) -> Dict[str, Any]:
    """--gradient-accumulation-fusion: megatron-core DDP + Megatron's FP32 step and RaggedFSDP,
    both through megatron-core's fused wgrad path (the test-only CPU kernel, counted): the first
    step's reduced gradients (main_grad) and the weights after 2 steps."""
    from tests.megatron_shim import MegatronFP32Step, _FusedWeightGradientOnCPU, fused_wgrad_on_cpu
    from tests.test_megatron import _ddp_grads, _FirstStepGrads, _our_grads

    calls = {"n": 0}
    kernel = _FusedWeightGradientOnCPU.wgrad_gemm_accum_fp32

    def counted(*a):
        calls["n"] += 1
        return kernel(*a)

    _FusedWeightGradientOnCPU.wgrad_gemm_accum_fp32 = staticmethod(counted)
    try:
        with fused_wgrad_on_cpu(), _megatron_job(ARGV + FUSION + extra) as (pg, args):
            args.use_vescale_fsdp = False
            pg.seed(args)
            config = pg.transformer_config(args)
            ddp = pg.build_model(args, config)
            ref_opt = _FirstStepGrads(MegatronFP32Step(ddp, pg.optimizer_config(args)), lambda d=ddp: _ddp_grads(d))
            ref = pg.train_loop(args, ddp, ref_opt, config)
            ref_final, ref_calls = _state(ddp), calls["n"]
            del ddp
            args.use_vescale_fsdp = True
            model, optimizer, config = pg.build(args)
            opt = _FirstStepGrads(optimizer, lambda: _our_grads(model))
            ours = pg.train_loop(args, model, opt, config)
            final = _state(model)
            return {"fusion": config.gradient_accumulation_fusion, "calls": (ref_calls, calls["n"] - ref_calls),
                    "grads differ": sorted(k for k, g in ref_opt.grads.items() if not torch.equal(opt.grads[k], g)),
                    "grad keys": sorted(ref_opt.grads) == sorted(opt.grads),
                    "losses": (ref["losses"], ours["losses"]),
                    "differ": sorted(k for k in ref_final if not torch.equal(final[k], ref_final[k]))}
    finally:
        _FusedWeightGradientOnCPU.wgrad_gemm_accum_fp32 = staticmethod(kernel)


def _fusion_bf16(rank: int, world_size: int) -> Dict[str, Any]:
    """The same with --bf16 --accumulate-allreduce-grads-in-fp32 (fp32 main_grad, bf16 inputs to the
    kernel): tests/test_megatron.py's bf16 comparison against DDP + Megatron's own optimizer."""
    from tests.megatron_shim import fused_wgrad_on_cpu
    from tests.test_megatron import _bf16_accumulation

    argv = ARGV + FUSION + ["--bf16", "--accumulate-allreduce-grads-in-fp32"]
    with fused_wgrad_on_cpu():
        res = _bf16_accumulation(rank, world_size, argv)
    ref, ours = res["grads"]
    return {"grad keys": sorted(ref) == sorted(ours), "grads differ": sorted(k for k in ref
                                                                            if not torch.equal(ours[k], ref[k])),
            "masters off": max(res["masters"].values())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Dict[str, List[Any]]:
    root = str(tmp_path_factory.mktemp("example_ckpt"))
    return run_cases_on_ranks({"schedule": (_schedule, ()), "aux": (_aux_loss, ()), "resume": (_resume, (root,)),
                               "fusion": (_fusion, ([],)), "fusion bf16": (_fusion_bf16, ())}, 2, timeout=300)


def _megatron_lm_learning_rates(iters: int, global_batch: int) -> List[float]:
    """What Megatron-LM's get_optimizer_param_scheduler builds from SCHEDULE's flags (lr 1e-2,
    steps in samples), stepped by a global batch after each iteration: each iteration's lr."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    groups = SimpleNamespace(param_groups=[{"params": [], "default_config": True}])
    scheduler = OptimizerParamScheduler(groups, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=global_batch,
                                        lr_decay_steps=3 * global_batch, lr_decay_style="cosine", start_wd=0.1,
                                        end_wd=0.1, wd_incr_steps=iters * global_batch, wd_incr_style="constant")
    lrs = []
    for _ in range(iters):
        lrs.append(groups.param_groups[0]["lr"])
        scheduler.step(increment=global_batch)
    return lrs


def test_learning_rate_schedule_is_megatron_lms(runs):
    """--lr-decay-style cosine --lr-warmup-iters 1 --lr-decay-iters 3 --min-lr: each step's
    learning rate is OptimizerParamScheduler's as Megatron-LM sets it up (warmup from 0, cosine
    to --min-lr, then --min-lr), and RaggedFSDP trains bit-identically to megatron-core DDP
    under the same schedule."""
    expected = _megatron_lm_learning_rates(4, 4)
    assert len(set(expected)) == 4, expected
    for res in runs["schedule"]:
        assert res["ours"][1] == expected, (res["ours"][1], expected)
        assert res["ref"] == res["ours"], res
        assert res["differ"] == [], res["differ"]


def test_moe_aux_loss_coefficient_takes_effect_like_megatron_ddp(runs):
    """--moe-aux-loss-coeff reaches megatron-core's router (no longer 0): the weights after a
    step change with it, and RaggedFSDP's equal megatron-core DDP's with the same flag."""
    for res in runs["aux"]:
        assert res["differ"] == {"0.1": [], "0": []}, res["differ"]
        for ref, ours in res["losses"].values():
            assert ref == ours, res["losses"]
        assert any("router" in k for k in res["coeff changes"]), res["coeff changes"]


def test_save_and_load_resume_bit_identically(runs):
    """--save --save-interval 1 writes iter_0000001, iter_0000002 and the tracker (Megatron-LM's
    layout); --load resumes at iteration 2 with the scheduler's state: the third step's loss,
    learning rate and the final weights equal the uninterrupted run's."""
    for res in runs["resume"]:
        assert res["tracker"] == "2", res["tracker"]
        assert res["saved"] == ["iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt"], res["saved"]
        assert res["first"] == (2, 8), res["first"]
        assert (res["tail"], res["tail lr"]) == res["whole"], res
        assert res["differ"] == [], res["differ"]


def test_log_line_has_megatron_lms_fields(runs):
    """The last rank prints Megatron-LM's training_log fields each iteration (grad norm only
    when clipping computes it, as Megatron's optimizers return none without --clip-grad)."""
    logs = [r["log"] for r in runs["schedule"] if r["log"]]
    assert len(logs) == 1, logs
    lines = [line for line in logs[0].splitlines() if " iteration " in line]
    assert len(lines) == 4, logs[0]
    fields = re.compile(r"iteration +(\d+)/ +4 \| consumed samples: +(\d+) \| .*learning rate: ([\d.E+-]+) \| "
                        r"global batch size: +4 \| lm loss: [\d.E+-]+ \| loss scale: 1\.0 \| "
                        r"number of skipped iterations: +0 \|")
    for i, line in enumerate(lines, 1):
        m = fields.search(line)
        assert m and int(m.group(1)) == i and int(m.group(2)) == 4 * i, line
    # the learning rate logged after iteration i is the one the scheduler set for the next
    assert float(fields.search(lines[0]).group(3)) == pytest.approx(_megatron_lm_learning_rates(4, 4)[1], rel=1e-6)
    resumed = [r["log"] for r in runs["resume"] if r["log"]]
    assert len(resumed) == 1 and re.search(r"iteration +3/ +3 \| consumed samples: +12 \|", resumed[0]), resumed
    assert re.search(r"\| loss scale: 1\.0 \| grad norm: \d+\.\d{3} \| number of skipped", resumed[0]), resumed


def test_gradient_accumulation_fusion_equals_megatron_ddp(runs):
    """--gradient-accumulation-fusion (Megatron-LM's default) under --use-vescale-fsdp: megatron-core's
    linear layers add each weight gradient into main_grad -- here the full-size view of the group's
    gradient buffer -- through the fused kernel (a CPU stand-in), over 2 micro-batches, the tied
    embedding's zero_out_wgrad included; the reduced gradients and the trained weights equal
    megatron-core DDP's with the same flag bit for bit (two data-parallel ranks: two addends),
    in fp32 and in bf16 with fp32 main_grad (fp32 masters after Megatron's own optimizer)."""
    for res in runs["fusion"]:
        assert res["fusion"] is True
        ref_calls, our_calls = res["calls"]
        assert ref_calls > 0 and our_calls == ref_calls, res["calls"]
        assert res["grad keys"] and res["grads differ"] == [], res["grads differ"]
        assert res["losses"][0] == res["losses"][1], res["losses"]
        assert res["differ"] == [], res["differ"]
    for res in runs["fusion bf16"]:
        assert res["grad keys"] and res["grads differ"] == [], res["grads differ"]
        assert res["masters off"] == 0.0, res["masters off"]
