"""Issue 28 item 5: a loaded optimizer ``step`` lives where torch's ``load_state_dict`` puts it.

torch's fused and capturable AdamW read ``step`` on the parameter's device (fp32) and refuse a
CPU step for parameters on an accelerator; both loaders (``checkpoint.load`` and
``load_full_optimizer_state``) place it as torch does ([Note: where the step lives],
vescale_zero/api/state_dict.py). On our CPU machines the parameter's device *is* the CPU, so the
runs below check the values (save, load, step == the uninterrupted run) and the placement
policy is compared with torch's own for a parameter on another device (``meta``).
"""

from __future__ import annotations

import pytest
import torch

import vescale_zero as vz
from tests.distributed import run_cases_on_ranks
from tests.models import AwkwardLM, local_pieces, make_batches, rank_slice
from vescale_zero import checkpoint
from vescale_zero.api.state_dict import (
    full_optimizer_state,
    full_state_dict,
    load_full_optimizer_state,
    load_full_state_dict,
    restored_step,
)

KINDS = {"fused": dict(fused=True), "capturable": dict(capturable=True, foreach=False)}


def _allow_capturable_on_cpu() -> None:
    """torch runs ``capturable=True`` only on accelerators; its CPU kernels are the same
    for-loop code, so the test lets it run on the CPU (test-only, in the spawned process)."""
    import torch.optim.adam as adam

    supported = adam._get_capturable_supported_devices
    adam._get_capturable_supported_devices = lambda supports_xla=True: supported(supports_xla) + ["cpu"]


def _build(kind):
    model = AwkwardLM(seed=0)
    vz.fully_shard_layers(model, granularity="row")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1,
                            **KINDS[kind])
    return model, opt


def _steps(model, opt, batches, rank, world_size):
    for batch in batches:
        model(*rank_slice(batch, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()


def _save_load_step(rank, world_size, kind, how, path):
    _allow_capturable_on_cpu()
    batches = make_batches(4, 12)
    model, opt = _build(kind)
    _steps(model, opt, batches, rank, world_size)
    straight = local_pieces(model)

    model, opt = _build(kind)
    _steps(model, opt, batches[:2], rank, world_size)
    if how == "checkpoint":
        checkpoint.save(path, model, opt)
    else:
        weights, (state, step) = full_state_dict(model), full_optimizer_state(model, opt)
    model, opt = _build(kind)
    if how == "checkpoint":
        checkpoint.load(path, model, opt)
    else:
        load_full_state_dict(model, weights)
        load_full_optimizer_state(model, opt, state, step)
    placed = {(st["step"].device.type, st["step"].dtype) for st in opt.state.values()}
    _steps(model, opt, batches[2:], rank, world_size)
    resumed = local_pieces(model)
    same = all(torch.equal(straight[n][3], resumed[n][3]) for n in straight)
    return same, sorted(str(x) for x in placed)


@pytest.mark.parametrize("world_size", [2, 3])
def test_fused_and_capturable_adamw_resume_like_the_uninterrupted_run(tmp_path, world_size):
    cases = {f"{kind} {how}": (_save_load_step, (kind, how, str(tmp_path / f"{kind}-{how}")))
             for kind in KINDS for how in ("checkpoint", "full")}
    results = run_cases_on_ranks(cases, world_size)
    for name, per_rank in results.items():
        for same, placed in per_rank:
            assert same, name
            assert placed == ["('cpu', torch.float32)"], (name, placed)


@pytest.mark.parametrize("group", [dict(fused=True), dict(capturable=True), dict(), dict(foreach=True)])
def test_step_is_placed_as_torch_places_it(group):
    """Against torch's own policy, for a parameter on a device other than the step's (meta)."""
    param = torch.empty(3, device="meta")
    step = torch.tensor(7.0)
    ours = restored_step(step, param, {"params": [0], **group})
    theirs = torch.optim.Optimizer._process_value_according_to_param_policy(
        param, step, 0, [{"params": [0], **group}], "step")
    assert (ours.device, ours.dtype) == (theirs.device, theirs.dtype)
    assert restored_step(7, param, group) == 7  # our own optimizers count in Python ints
