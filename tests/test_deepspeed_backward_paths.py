"""DeepSpeed's other ways to run backward and step, under ``"stage": "ragged"`` beside ZeRO-3
(issue 26, items 1, 10, 11): the caller-owned accumulation boundary
(``"managed_gradient_accumulation": false``), ``loss.backward()`` and
``engine.scale(loss).backward()`` instead of ``engine.backward(loss)``, and what
``get_global_grad_norm()`` reports (fp16 overflow steps included). Every case runs DeepSpeed's
own loop (``deepspeed.initialize``, the engine's forward, backward and ``step()``) at stage 3
and at "ragged", all in one spawn of 2 gloo ranks."""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("deepspeed")  # the [test] extra installs it; without it these tests cannot run

from tests.distributed import run_cases_on_ranks  # noqa: E402
from tests.models import AwkwardLM, assemble, make_batches, rank_slice  # noqa: E402
from tests.numerics import FP32_UNIT_ROUNDOFF, adam_divergence_bound, gamma  # noqa: E402
from tests.test_deepspeed import _deepspeed, _full_params, ds_config  # noqa: E402
from vescale_zero.integrations.deepspeed.deepspeed_compat import BACKWARD_HOOKS, CALLER_OWNED_BOUNDARY  # noqa: E402

# what the installed DeepSpeed has of these ways ([Note: one door to DeepSpeed's releases])
needs_backward_hooks = pytest.mark.skipif(not BACKWARD_HOOKS, reason="DeepSpeed before 0.18 runs backward through "
                                          "engine.backward(loss) only: no loss.backward() / engine.scale()")
needs_caller_owned = pytest.mark.skipif(not CALLER_OWNED_BOUNDARY, reason="DeepSpeed before 0.19.4 has no "
                                        "managed_gradient_accumulation: the engine owns the boundary")

WORLD, STEPS, GLOBAL_BATCH, ACCUM, LR = 2, 4, 12, 2, 1e-2
MICRO_BATCHES = [2, 1, 3, 2]  # caller-owned boundary: the backwards before each step() (any number)
OVERFLOW_STEP = 2


def _backward(engine, loss, how):
    if how == "engine":
        engine.backward(loss)
    elif how == "loss":
        loss.backward()
    else:
        engine.scale(loss).backward()


def _train(rank, world_size, stage, how, managed=True, fp16=False, overflow=False):
    """STEPS steps of DeepSpeed's own loop, each backward run ``how`` ("engine":
    ``engine.backward(loss)``, "loss": ``loss.backward()``, "scale": ``engine.scale(loss).backward()``).
    Managed: ACCUM micro-batches, ``step()`` after each; ``managed=False``: the caller owns the
    boundary, MICRO_BATCHES[step] backwards then one ``step()``. ``overflow``: step OVERFLOW_STEP's
    last loss times inf (fp16). Per step: the last loss, ``get_global_grad_norm()``, skipped
    steps, global samples; the weights at the end. No clipping: the optimizer steps on the
    reduced gradients themselves. Returns what it raised instead, if it raised."""
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed = _deepspeed()
    from deepspeed.accelerator import get_accelerator

    extra = {"gradient_clipping": 0.0, "wall_clock_breakdown": how != "engine"}  # timers: the epilogue must run
    if not managed:
        extra["managed_gradient_accumulation"] = False
    if fp16:
        get_accelerator().is_fp16_supported = lambda: True  # DeepSpeed's CPU accelerator refuses fp16 at stage 3
        extra["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    engine, *_ = deepspeed.initialize(model=AwkwardLM(seed=0), config=ds_config(stage, world_size, **extra))
    out = {"losses": [], "norms": [], "skipped": [], "samples": []}
    try:
        for step, batch in enumerate(make_batches(STEPS, GLOBAL_BATCH)):
            x, y = rank_slice(batch, rank, world_size)
            count = ACCUM if managed else MICRO_BATCHES[step]
            for i in range(count):
                loss = engine(x.chunk(ACCUM)[i % ACCUM], y.chunk(ACCUM)[i % ACCUM])
                if overflow and step == OVERFLOW_STEP and i == count - 1:
                    loss = loss * float("inf")
                _backward(engine, loss, how)
                if managed:
                    engine.step()
            if not managed:
                engine.step()
            norm = engine.get_global_grad_norm()
            out["losses"].append(loss.item())
            out["norms"].append(None if norm is None else float(norm))
            out["skipped"].append(engine.skipped_steps)
            out["samples"].append(engine.global_samples)
    except Exception as e:  # noqa: BLE001 - what a stage raises is the observation
        return f"raised {type(e).__name__}: {e}"
    out["params"] = _full_params(engine, stage)
    return out


CASES = {  # name: (how, options, stages); ragged-only cases are compared with ragged runs bit for bit
    "engine": ("engine", {}, ("ragged",)),
    "loss.backward": ("loss", {}, (3, "ragged")),
    "scale": ("scale", {}, ("ragged",)),
    "engine fp16": ("engine", {"fp16": True}, ("ragged",)),
    "scale fp16": ("scale", {"fp16": True}, (3, "ragged")),
    "loss.backward fp16": ("loss", {"fp16": True}, (3, "ragged")),
    "caller-owned": ("engine", {"managed": False}, (3, "ragged")),
    "caller-owned loss.backward": ("loss", {"managed": False}, ("ragged",)),
    "overflow fp16 caller-owned": ("engine", {"fp16": True, "overflow": True, "managed": False}, (3, "ragged")),
}


def _case(rank, world_size, stage, how, options):
    return _train(rank, world_size, stage, how, **options)


@pytest.fixture(scope="module")
def runs():
    """``{"<case> <stage>": rank 0's result, with "params" the full weights}``: every case, in
    one spawn of WORLD ranks."""
    cases = {f"{name} {stage}": (_case, (stage, how, options))
             for name, (how, options, stages) in CASES.items() for stage in stages}
    out = {}
    for key, results in run_cases_on_ranks(cases, WORLD, timeout=600).items():
        out[key] = results[0]
        if isinstance(results[0], dict) and key.endswith("ragged"):
            out[key]["params"] = assemble([r["params"] for r in results])
    return out


def _trained(runs, key):
    assert isinstance(runs[key], dict), f"{key}: {runs[key]}"
    return runs[key]


def _assert_same_bits(got, want, case):
    assert got["losses"] == want["losses"], (case, got["losses"], want["losses"])
    assert got["norms"] == want["norms"], (case, got["norms"], want["norms"])
    assert got["skipped"] == want["skipped"], case
    assert got["params"].keys() == want["params"].keys(), case
    for name, value in want["params"].items():
        assert torch.equal(got["params"][name], value), (case, name)


def _norm_bound():
    """Relative distance of two fp32 2-norms of the same gradients computed in two orders: each
    sums N squares (one rounding each, N - 1 additions, the ranks' partial sums added), so it is
    within gamma(N + WORLD) of the exact sum of squares; the square root halves that and rounds
    once more, and the result may be rounded to fp32 once more: two norms within
    gamma(N + WORLD) + 4 u of each other, relative. N: the trainable elements."""
    numel = sum(p.numel() for p in AwkwardLM().parameters() if p.requires_grad)
    return gamma(numel + WORLD) + 4 * FP32_UNIT_ROUNDOFF


def _assert_norms_close(got, want, case):
    bound = _norm_bound()
    assert None not in got and len(got) == len(want) == STEPS, (case, got)
    for g, w in zip(got, want):
        assert math.isinf(g) if math.isinf(w) else abs(g - w) <= bound * w, (case, got, want, bound)


@pytest.mark.slow  # ~30 s on 2 cores
@needs_caller_owned
def test_caller_owned_boundary_trains_as_stage3(runs):
    """Item 1: ``"managed_gradient_accumulation": false`` (DeepSpeed 0.19: ``step()`` is the
    boundary, any number of backwards before it). "ragged" did not train at all (it synced
    gradients only at a boundary no backward sees). Bit for bit as stage 3, by the math: in this
    mode both reduce every backward's gradients (a mean of 2 ranks' terms: one addition,
    correctly rounded in any order, and an exact halving) and add them into the fp32 shard in
    the same order, so the optimizer sees the same bits. The reported norm within
    :func:`_norm_bound` (computed in another order); samples counted as DeepSpeed counts them
    (6 per ``engine.backward``). ``loss.backward()`` in this mode is the same computation: the
    same bits as ``engine.backward`` (DeepSpeed counts no samples for it, at stage 3 too)."""
    ref, ours = _trained(runs, "caller-owned 3"), _trained(runs, "caller-owned ragged")
    assert ours["samples"] == ref["samples"] == [12, 18, 36, 48], (ours["samples"], ref["samples"])
    assert ours["losses"] == ref["losses"], (ours["losses"], ref["losses"])
    for name, value in ref["params"].items():
        assert torch.equal(ours["params"][name], value), (name, (ours["params"][name] - value).abs().max().item())
    _assert_norms_close(ours["norms"], ref["norms"], "caller-owned")
    _assert_same_bits(_trained(runs, "caller-owned loss.backward ragged"), ours, "caller-owned loss.backward")


@needs_backward_hooks
def test_loss_backward_and_engine_scale_train_as_stage3(runs):
    """Item 11: ``loss.backward()`` and ``engine.scale(loss).backward()`` (DeepSpeed 0.19 supports
    both under ZeRO; "ragged" refused them naming "ZeRO stage 0"), with wall-clock timers on
    (the engine's backward epilogue must close them). Under "ragged" each is the same
    computation as ``engine.backward(loss)`` (DeepSpeed's hook divides the loss's gradient by
    the accumulation steps where engine.backward divides the loss: the same power-of-two
    scaling), fp16 included: bit for bit. Beside stage 3's own ``loss.backward()`` /
    ``engine.scale(loss).backward()`` as test_deepspeed compares the engines: the first loss bit
    for bit, the fp32 weights within what STEPS AdamW steps can move two runs apart
    (tests/numerics.py [Note: comparing runs that sum in another order]), no fp16 step skipped."""
    for case in ("loss.backward", "scale", "scale fp16"):
        baseline = "engine fp16 ragged" if "fp16" in case else "engine ragged"
        _assert_same_bits(_trained(runs, f"{case} ragged"), _trained(runs, baseline), case)
    ref, ours = _trained(runs, "loss.backward 3"), runs["loss.backward ragged"]
    assert ours["losses"][0] == ref["losses"][0], (ours["losses"], ref["losses"])
    for name, value in ref["params"].items():
        torch.testing.assert_close(ours["params"][name], value, rtol=0, atol=adam_divergence_bound(LR, STEPS),
                                   msg=lambda m, name=name: f"{name}: {m}")
    ref, ours = _trained(runs, "scale fp16 3"), runs["scale fp16 ragged"]
    assert ours["losses"][0] == ref["losses"][0] and ours["skipped"] == ref["skipped"] == [0] * STEPS


@needs_backward_hooks
def test_unscaled_fp16_loss_backward_is_refused_naming_the_supported_calls(runs):
    """Item 11, fp16: a bare ``loss.backward()`` cannot work (the step divides the gradients by
    a loss scale they never had); stage 3 refuses it, and so does "ragged", naming the calls
    that work, not a stage the user never set."""
    assert runs["loss.backward fp16 3"].startswith("raised RuntimeError: Loss scaling is required")
    ours = runs["loss.backward fp16 ragged"]
    assert ours.startswith("raised RuntimeError"), ours
    assert "engine.backward(loss)" in ours and "engine.scale(loss).backward()" in ours, ours
    assert "stage 0" not in ours, ours


@needs_caller_owned
def test_global_grad_norm_as_stage3(runs):
    """Item 10: ``get_global_grad_norm()`` after each step. fp32 without clipping ("ragged"
    reported None; ZeRO-3 computes it every step): within :func:`_norm_bound` of stage 3's, on
    the gradients the first test shows bit-identical. fp16 with an overflow (caller-owned
    boundary, whose skipped step must also count its samples as DeepSpeed does): the overflow
    step reports inf as stage 3 (not None or the previous step's) and is skipped on both; the
    other steps report their own norm, within 1e-2 relative of stage 3's, the tolerance of the
    16-bit comparisons in test_deepspeed (both compute in fp16 but round in different places:
    ZeRO-3 reduces fp16 gradients, we reduce in fp32)."""
    _assert_norms_close(_trained(runs, "caller-owned ragged")["norms"], runs["caller-owned 3"]["norms"], "fp32")
    ref, ours = _trained(runs, "overflow fp16 caller-owned 3"), _trained(runs, "overflow fp16 caller-owned ragged")
    assert math.isinf(ref["norms"][OVERFLOW_STEP]) and math.isinf(ours["norms"][OVERFLOW_STEP]), (ours, ref)
    assert ours["skipped"] == ref["skipped"] == [0, 0, 1, 1], (ours["skipped"], ref["skipped"])
    assert ours["samples"] == ref["samples"] == [12, 18, 36, 48], (ours["samples"], ref["samples"])
    for step in set(range(STEPS)) - {OVERFLOW_STEP}:
        assert ours["norms"][step] == pytest.approx(ref["norms"][step], rel=1e-2), (step, ours["norms"], ref["norms"])
