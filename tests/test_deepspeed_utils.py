"""DeepSpeed's utilities under "ragged" do what they do at ZeRO-3 (gloo, CPU, 2 ranks).

* ``deepspeed.utils.safe_get_*`` / ``safe_set_*`` (full and local): the same values, and a
  step after the same writes lands on the same weights.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("deepspeed")  # the [test] extra installs it; without it these tests cannot run

from tests.distributed import run_cases_on_ranks  # noqa: E402
from tests.models import make_batches, rank_slice  # noqa: E402
from tests.test_deepspeed import GLOBAL_BATCH, _deepspeed, ds_config  # noqa: E402

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

    # one micro-batch a step: the 2 ranks' gradients averaged in any order are the same floats
    cfg = ds_config(stage, world_size, gradient_clipping=0.0, gradient_accumulation_steps=1,
                    train_micro_batch_size_per_gpu=GLOBAL_BATCH // world_size)
    engine, *_ = deepspeed.initialize(model=EvenLM(), config=cfg)
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


@pytest.fixture(scope="module")
def accessor_runs():
    return run_cases_on_ranks({stage: (_accessors, (stage,)) for stage in STAGES}, WORLD, timeout=300)


def _joined_local(per_rank, name, numel):
    return torch.cat([r[name].reshape(-1) for r in per_rank])[:numel]


def test_safe_accessors_match_stage3(accessor_runs):
    """Full getters: the parameter's full shape and ZeRO-3's values, bit for bit (the same forward
    on each rank; two ranks' gradients averaged: (a + b) / 2 rounds as a / 2 + b / 2; AdamW on the
    same inputs). Setters, full and local: the step after them lands where ZeRO-3's lands, bit for
    bit. Local getters: 1-D pieces that join, in rank order, into the full tensor."""
    ref, ours = accessor_runs[3], accessor_runs["ragged"]
    frozen = [n for n, g in ref[0]["param0"].items() if g is None]
    assert frozen and ref[0]["param0"].keys() == ours[0]["param0"].keys(), frozen
    for rank in range(WORLD):
        for key in ("grad", "param0", "grad_set", "param1", "exp_avg1", "param2", "exp_avg2", "exp_avg_sq2", "param3"):
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
