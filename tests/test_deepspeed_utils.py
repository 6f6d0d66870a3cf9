"""DeepSpeed's utilities under "ragged" do what they do at ZeRO-3 (gloo, CPU, 2 ranks).

* ``deepspeed.utils.safe_get_*`` / ``safe_set_*`` (full and local): the same values, and a
  step after the same writes lands on the same weights;
* ``save_checkpoint(exclude_frozen_parameters=True)`` (a LoRA-like model): the frozen base is not
  written, and a resume from it, with the base taken from the model, trains on as ZeRO-3 does;
* ``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` and the
  ``zero_to_fp32.py`` / ``zero_to_torch.py`` in the checkpoint directory give the full weights.

Every case runs in one spawn of 2 ranks (``runs``); one micro-batch a step, so that the two
ranks' gradients averaged in any order are the same floats ((a + b) / 2 rounds as a / 2 + b / 2)
and ragged can be held to ZeRO-3 bit for bit.
"""

from __future__ import annotations

import os
import pathlib
import runpy
import subprocess
import sys
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("deepspeed")  # the [test] extra installs it; without it these tests cannot run

from tests.distributed import run_cases_on_ranks  # noqa: E402
from tests.models import make_batches, rank_slice  # noqa: E402
from tests.test_deepspeed import GLOBAL_BATCH, _deepspeed, ds_config  # noqa: E402

pytestmark = pytest.mark.slow  # one spawn for the module: 6 engines, 35-55 s on 2 shared cores

WORLD = 2
STAGES = (3, "ragged")


class EvenLM(nn.Module):
    """Every tensor's size divisible by WORLD: ZeRO-3's full setters cut the value by its padded
    partition size (deepspeed 0.19.8 stage3.py set_fp32_grad_for_param / set_full_hp_param) and fail
    on a parameter it padded, so the reference needs none. A frozen gate, as a LoRA base."""

    VOCAB, DIM = 40, 16  # make_batches draws tokens below tests.models.VOCAB (37)

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(self.VOCAB, self.DIM)
        self.fc1 = nn.Linear(self.DIM, 2 * self.DIM)
        self.fc2 = nn.Linear(2 * self.DIM, self.DIM)
        self.gate = nn.Parameter(torch.rand(self.DIM) + 0.5, requires_grad=False)
        self.head = nn.Linear(self.DIM, self.VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.gate * self.fc2(F.gelu(self.fc1(h)))
        return F.cross_entropy(self.head(h).reshape(-1, self.VOCAB), targets.reshape(-1))


def _config(stage, world_size):
    """One micro-batch a step (see the module docstring), no clipping."""
    return ds_config(stage, world_size, gradient_clipping=0.0, gradient_accumulation_steps=1,
                     train_micro_batch_size_per_gpu=GLOBAL_BATCH // world_size)


def _gathered(deepspeed, engine):
    """Every parameter of the engine's model, full (ZeRO-3's or ragged: GatheredParameters takes both)."""
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {n: p.data.detach().clone() for n, p in params.items()}


# ---- safe_get_* / safe_set_* ------------------------------------------------------------------


def _value(name, shape, salt):
    """A deterministic tensor of ``shape`` for ``name`` (the same on every rank and stage)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name} {salt}".encode()))  # hash() differs per process
    return torch.randn(shape, generator=g) * 0.1


def _full_shape(p):
    return tuple(getattr(p, "ds_shape", p.shape))  # a ZeRO-3 parameter's own shape is its partition's


def _local_slice(full, local_numel):
    """This rank's partition of ``full`` when the partitions are ``local_numel`` long on each rank in
    rank order (ZeRO-3: equal, the last padded; ragged: this rank's range)."""
    sizes = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(sizes, local_numel)
    start = sum(sizes[: torch.distributed.get_rank()])
    flat = torch.cat([full.reshape(-1), full.new_zeros(max(0, sum(sizes) - full.numel()))])
    return flat[start : start + local_numel]


def _accessors(rank, world_size, stage):
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed = _deepspeed()
    from deepspeed import utils as du

    engine, *_ = deepspeed.initialize(model=EvenLM(), config=_config(stage, world_size))
    named = dict(engine.module.named_parameters())
    shapes = {n: _full_shape(p) for n, p in named.items()}
    batches = make_batches(2, GLOBAL_BATCH)

    def to_boundary(batch):  # forward and backward, not the step
        engine.backward(engine(*rank_slice(batch, rank, world_size)))

    def each(fn, *args):
        out = {}
        for n, p in named.items():
            v = fn(p, *args)
            out[n] = None if v is None else v.detach().clone()
        return out

    def local(fn, salt):  # this rank's partition of _value(name, salt), as the local getter ``fn`` sizes it
        return {n: _local_slice(_value(n, shapes[n], salt), fn(p).numel()) for n, p in named.items()
                if p.requires_grad}

    out = {"shapes": shapes}
    to_boundary(batches[0])
    out["grad"] = each(du.safe_get_full_grad)
    out["local_grad"] = each(du.safe_get_local_grad)
    out["param0"] = each(du.safe_get_full_fp32_param)
    out["local_param0"] = each(du.safe_get_local_fp32_param)
    for n, p in named.items():  # every input of the step, set: the same step on both stages
        du.safe_set_full_grad(p, _value(n, shapes[n], 1))
    out["grad_set"] = each(du.safe_get_full_grad)
    engine.step()
    out["param1"] = each(du.safe_get_full_fp32_param)
    out["exp_avg1"] = each(du.safe_get_full_optimizer_state, "exp_avg")
    out["local_exp_avg1"] = each(du.safe_get_local_optimizer_state, "exp_avg")
    for n, p in named.items():
        du.safe_set_full_fp32_param(p, _value(n, shapes[n], 2))
        du.safe_set_full_optimizer_state(p, _value(n, shapes[n], 3).abs(), "exp_avg_sq")
    to_boundary(batches[1])
    grads, moments = local(du.safe_get_local_grad, 4), local(du.safe_get_local_fp32_param, 5)
    for n, p in named.items():
        if p.requires_grad:
            du.safe_set_local_grad(p, grads[n])
            du.safe_set_local_optimizer_state(p, moments[n], "exp_avg")
    du.safe_update_full_grad_vectorized(list(named.values()), lambda grad, p: grad * 0.5 + 0.25)
    out["grad_updated"] = each(du.safe_get_full_grad)
    engine.step()
    out["param2"] = each(du.safe_get_full_fp32_param)
    out["exp_avg2"] = each(du.safe_get_full_optimizer_state, "exp_avg")
    out["exp_avg_sq2"] = each(du.safe_get_full_optimizer_state, "exp_avg_sq")
    weights = local(du.safe_get_local_fp32_param, 6)
    for n, p in named.items():
        if p.requires_grad:
            du.safe_set_local_fp32_param(p, weights[n])
    out["param3"] = each(du.safe_get_full_fp32_param)
    return out


def _joined_local(per_rank, name, numel):
    return torch.cat([r[name].reshape(-1) for r in per_rank])[:numel]


def test_safe_accessors_match_stage3(runs):
    """Full getters: the parameter's full shape and ZeRO-3's values, bit for bit (the same forward
    on each rank; two ranks' gradients averaged: (a + b) / 2 rounds as a / 2 + b / 2; AdamW on the
    same inputs). Setters, full and local: the step after them lands where ZeRO-3's lands, bit for
    bit. Local getters: 1-D pieces that join, in rank order, into the full tensor."""
    ref, ours = runs["accessors 3"], runs["accessors ragged"]
    frozen = [n for n, g in ref[0]["param0"].items() if g is None]
    assert frozen and ref[0]["param0"].keys() == ours[0]["param0"].keys(), frozen
    for rank in range(WORLD):
        for key in ("grad", "param0", "grad_set", "param1", "exp_avg1", "grad_updated", "param2", "exp_avg2",
                    "exp_avg_sq2", "param3"):
            r, o = ref[rank][key], ours[rank][key]
            for name, value in r.items():
                if value is None:
                    assert o[name] is None, (key, name)
                    continue
                assert o[name].shape == value.shape == ours[rank]["shapes"][name], (key, name, o[name].shape)
                assert torch.equal(o[name], value), (rank, key, name, (o[name] - value).abs().max().item())
    for run in (ref, ours):
        for local_key, full_key in (("local_grad", "grad"), ("local_param0", "param0"),
                                    ("local_exp_avg1", "exp_avg1")):
            for name, full in run[0][full_key].items():
                if full is None:
                    continue
                assert all(r[local_key][name].dim() == 1 for r in run), (local_key, name)
                assert torch.equal(_joined_local([r[local_key] for r in run], name, full.numel()),
                                   full.reshape(-1)), (local_key, name)


# ---- save_checkpoint(exclude_frozen_parameters=True) -------------------------------------------


class LoraLike(nn.Module):
    """A frozen base Linear (the pretrained weight, the same in every build) and a trainable
    low-rank adapter (``adapter_seed``), as a PEFT LoRA layer."""

    IN, OUT, RANK = 256, 256, 4

    def __init__(self, adapter_seed: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Linear(self.IN, self.OUT).requires_grad_(False)
        torch.manual_seed(adapter_seed)
        self.lora_a = nn.Linear(self.IN, self.RANK, bias=False)
        self.lora_b = nn.Linear(self.RANK, self.OUT, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.base(x) + self.lora_b(self.lora_a(x)), y)


LORA_STEPS, LORA_SAVE_AT = 4, 2


def _lora(rank, world_size, stage, ckpt_dir, phase):
    """phase 'full': LORA_STEPS steps, saving after LORA_SAVE_AT with and without the flag (a save
    changes nothing: this is also the uninterrupted run); 'resume': a model with other adapters
    loads the flagged checkpoint and goes on."""
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed = _deepspeed()
    model = LoraLike(adapter_seed=2 if phase == "resume" else 1)
    engine, *_ = deepspeed.initialize(model=model, config=_config(stage, world_size))
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(GLOBAL_BATCH, LoraLike.IN, generator=g),
                torch.randn(GLOBAL_BATCH, LoraLike.OUT, generator=g)) for _ in range(LORA_STEPS)]
    out, start = {}, 0
    if phase == "resume":
        try:  # as ZeRO-3, a strict load refuses a checkpoint without the frozen weights
            engine.load_checkpoint(ckpt_dir, tag="frozen_out")
        except (RuntimeError, ValueError) as e:
            out["strict"] = f"{type(e).__name__}: {e}"
        # what the Hugging Face Trainer passes for a PEFT model
        engine.load_checkpoint(ckpt_dir, tag="frozen_out", load_module_strict=False)
        assert engine.global_steps == LORA_SAVE_AT
        start = LORA_SAVE_AT
    for step in range(start, LORA_STEPS):
        engine.backward(engine(*rank_slice(batches[step], rank, world_size)))
        engine.step()
        if phase == "full" and step + 1 == LORA_SAVE_AT:
            engine.save_checkpoint(ckpt_dir, tag="frozen_out", exclude_frozen_parameters=True)
            engine.save_checkpoint(ckpt_dir, tag="frozen_in")
            out["saved"] = _gathered(deepspeed, engine)
    out["params"] = _gathered(deepspeed, engine)
    return out


def _size(path):
    return sum(f.stat().st_size for f in pathlib.Path(path).rglob("*") if f.is_file())


def test_exclude_frozen_parameters_leaves_the_base_out_and_resumes_like_stage3(runs):
    """The flagged checkpoint holds no frozen weight: smaller than the unflagged one by at least the
    base's fp32 bytes, on each stage (the base is 65792 of 67840 elements; the adapters' weights and
    two AdamW moments remain). A strict load refuses it on both stages, naming the base. Resumed
    from it non-strictly (the base from the model, the adapters from the checkpoint) each stage ends
    on its uninterrupted run's weights, and ragged on ZeRO-3's, bit for bit (same operations on the
    same floats)."""
    ratios, frozen_bytes = {}, 4 * (LoraLike.IN + 1) * LoraLike.OUT  # the fp32 base weight and bias
    for stage in STAGES:
        path = runs.paths[f"lora {stage}"]
        ratios[stage] = _size(path / "frozen_in") / _size(path / "frozen_out")
        assert _size(path / "frozen_in") - _size(path / "frozen_out") >= frozen_bytes, stage
        full, resumed = runs[f"lora {stage} full"][0]["params"], runs[f"lora {stage} resume"][0]["params"]
        assert "base.weight" in runs[f"lora {stage} resume"][0].get("strict", ""), stage
        assert full.keys() == resumed.keys() == {"base.weight", "base.bias", "lora_a.weight", "lora_b.weight"}
        for name in full:
            assert torch.equal(resumed[name], full[name]), (stage, name)
    ours, ref = runs["lora ragged full"][0]["params"], runs["lora 3 full"][0]["params"]
    for name in ref:
        assert torch.equal(ours[name], ref[name]), name
    print(f"checkpoint size without / with exclude_frozen_parameters: {ratios}")


# ---- zero_to_fp32 ------------------------------------------------------------------------------


def test_get_fp32_state_dict_from_zero_checkpoint_reads_ragged_like_stage3(runs):
    """DeepSpeed's own function on each stage's checkpoint (saved after LORA_SAVE_AT steps): the
    weights the engine held then, bit for bit (fp32 masters; ragged's equal ZeRO-3's), with and
    without the frozen base; a checkpoint saved without it gives the adapters."""
    deepspeed = _deepspeed()  # noqa: F841 - routes deepspeed.utils.zero_to_fp32 in this process
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    trainable = {"lora_a.weight", "lora_b.weight"}
    for stage in STAGES:
        path, saved = str(runs.paths[f"lora {stage}"]), runs[f"lora {stage} full"][0]["saved"]
        full = get_fp32_state_dict_from_zero_checkpoint(path, tag="frozen_in")
        assert full.keys() == saved.keys(), (stage, sorted(full))
        for name, value in saved.items():
            assert torch.equal(full[name], value), (stage, name)
        assert get_fp32_state_dict_from_zero_checkpoint(path, "frozen_in", exclude_frozen_parameters=True).keys() \
            == trainable, stage
        assert get_fp32_state_dict_from_zero_checkpoint(path, "frozen_out").keys() == trainable, stage


def test_zero_to_fp32_script_in_the_checkpoint_writes_the_weights(runs, tmp_path, monkeypatch):
    """``python CKPT/zero_to_fp32.py CKPT OUT -t TAG`` (DeepSpeed's command line, in a fresh process)
    writes what DeepSpeed's script writes: ``pytorch_model.bin`` with the fp32 weights (equal to the
    saved engine's). ``zero_to_torch.py --dtype bfloat16`` (DeepSpeed's, which imports the
    ``zero_to_fp32`` beside it; run here in-process) the same weights rounded to bf16."""
    path, saved = runs.paths["lora ragged"], runs["lora ragged full"][0]["saved"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # what an installed vescale-zero sees
    done = subprocess.run([sys.executable, str(path / "zero_to_fp32.py"), str(path), str(tmp_path / "fp32"),
                           "-t", "frozen_in"], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    monkeypatch.syspath_prepend(str(path))  # as `python CKPT/zero_to_torch.py` puts CKPT first
    monkeypatch.delitem(sys.modules, "zero_to_fp32", raising=False)
    monkeypatch.setattr(sys, "argv", ["zero_to_torch.py", str(path), str(tmp_path / "bf16"), "-t", "frozen_in",
                                      "--dtype", "bfloat16"])
    runpy.run_path(str(path / "zero_to_torch.py"), run_name="__main__")
    sys.modules.pop("zero_to_fp32", None)
    for out, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        weights = torch.load(tmp_path / out / "pytorch_model.bin", weights_only=True)
        assert weights.keys() == saved.keys(), (out, sorted(weights))
        for name, value in saved.items():
            assert torch.equal(weights[name], value.to(dtype)), (out, name)


class _Spawned(dict):
    """``{case: [per-rank results]}``, with ``paths[...]``: the checkpoint directories."""

    paths: dict


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> _Spawned:
    root = tmp_path_factory.mktemp("deepspeed_utils")
    out = _Spawned()
    out.paths = {f"lora {stage}": root / f"lora_{stage}" for stage in STAGES}
    cases = {f"accessors {stage}": (_accessors, (stage,)) for stage in STAGES}
    for stage in STAGES:
        for phase in ("full", "resume"):
            cases[f"lora {stage} {phase}"] = (_lora, (stage, str(out.paths[f"lora {stage}"]), phase))
    out.update(run_cases_on_ranks(cases, WORLD, timeout=500))
    return out
