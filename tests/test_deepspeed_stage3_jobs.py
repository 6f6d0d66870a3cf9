"""A job written for ZeRO-3 runs as it is with ``"stage": "ragged"`` (gloo, CPU, 2 ranks).

What DeepSpeed's own ZeRO-3 unit tests do (``benchmarks/deepspeed_unit_tests.py`` runs them with
"ragged" in place of 3), each against the same job at stage 3 in the same spawn:

* ``"reduce_scatter": false``: every group's gradients reduced by one all-reduce, each rank keeping
  its range (no reduce-scatter runs); losses and weights equal stage 3's with the same key;
* ``safe_get_full_optimizer_state`` / ``safe_get_local_optimizer_state`` / ``safe_set_*`` with the
  optimizers DeepSpeed builds: FusedAdam (config Adam), DeepSpeedCPUAdam (Adam with offload),
  torch's Adagrad, DeepSpeedCPUAdagrad (Adagrad with offload); the values equal stage 3's, and the
  step after a write lands where stage 3's lands;
* ``offload_param`` alone (ZeRO-Infinity's parameter offload): the master and gradient shards in
  host memory, the optimizer DeepSpeed picks without offload, stepping on the device; trains as
  stage 3 with the key;
* a model built under a stage-3 ``zero.Init`` (no config; a stage-3 config with bf16) migrates at
  ``initialize``: fp32 masters, computing in the dtype it was built in, as stage 3 on the same model;
* a second ``deepspeed.initialize`` on the model of an engine (DeepSpeed's "load and immediately
  save"): as at stage 3, a checkpoint loads into it and training goes on where the first stopped;
* ZeRO++'s qwZ (``zero_quantized_weights``): weights gathered as FP8 tiles.

One micro-batch a step, no clipping: two ranks' gradients averaged in any order are the same floats
((a + b) / 2 rounds as a / 2 + b / 2), so fp32 runs are held to stage 3 bit for bit (16-bit runs
to the tolerance of tests/test_deepspeed.py's bf16 comparison).
"""

from __future__ import annotations

import os
import traceback
import zlib

import pytest
import torch

pytest.importorskip("deepspeed")  # the [test] extra installs it; without it these tests cannot run

from tests.distributed import run_cases_on_ranks  # noqa: E402
from tests.models import make_batches, rank_slice  # noqa: E402
from tests.test_deepspeed import GLOBAL_BATCH, _deepspeed, ds_config  # noqa: E402
from tests.test_deepspeed_utils import EvenLM, _local_slice  # noqa: E402

pytestmark = pytest.mark.slow  # one spawn for the module: about 20 engines, several minutes on 2 shared cores

WORLD, STEPS = 2, 3
STAGES = (3, "ragged")


def _config(stage, **zero):
    """One micro-batch a step (see the module docstring), no clipping, torch's AdamW."""
    cfg = ds_config(stage, WORLD, gradient_clipping=0.0, gradient_accumulation_steps=1,
                    train_micro_batch_size_per_gpu=GLOBAL_BATCH // WORLD)
    cfg["zero_optimization"].update(zero)
    return cfg


def _gathered(deepspeed, engine):
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {n: p.data.detach().float().clone() for n, p in params.items()}


def _train(engine, rank, batches):
    losses = []
    for batch in batches:
        loss = engine(*rank_slice(batch, rank, WORLD))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _guarded(fn):
    """A case whose exception is returned (and asserted on by its test) rather than ending the spawn."""
    def case(rank, world_size, *args):
        try:
            return fn(rank, world_size, *args)
        except Exception:  # noqa: BLE001 - reported by the test that reads this case
            return {"error": traceback.format_exc()}
    case.__name__, case.__qualname__, case.__module__ = fn.__name__, fn.__qualname__, fn.__module__  # pickled by name
    return case


def _ok(results):
    for r in results:
        assert "error" not in r, r["error"]
    return results


# ---- "reduce_scatter": false ----------------------------------------------------------------


@_guarded
def _reduce_scatter_false(rank, world_size, stage):
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed = _deepspeed()
    engine, *_ = deepspeed.initialize(model=EvenLM(), config=_config(stage, reduce_scatter=False))
    out = {"losses": _train(engine, rank, make_batches(STEPS, GLOBAL_BATCH)), "params": _gathered(deepspeed, engine)}
    if stage == "ragged":
        from vescale_zero.hosts import groups_of

        groups = groups_of(engine.module)
        out["reduce_scatters"] = sum(g.stats.reduce_scatters for g in groups)
        out["all_reduces"] = sum(g.stats.all_reduces for g in groups)
        out["groups"] = len(groups)
    return out


def test_reduce_scatter_false_all_reduces_and_trains_as_stage3(runs):
    """No reduce-scatter runs: one all-reduce per group and step; losses and weights equal stage 3's
    with the same key, bit for bit (both divide each rank's gradients by 2 and sum)."""
    ref, ours = _ok(runs["reduce_scatter false 3"]), _ok(runs["reduce_scatter false ragged"])
    for r in ours:
        assert r["reduce_scatters"] == 0 and r["all_reduces"] == STEPS * r["groups"], r
    assert ours[0]["losses"] == ref[0]["losses"]
    for name, value in ref[0]["params"].items():
        assert torch.equal(ours[0]["params"][name], value), (name, (ours[0]["params"][name] - value).abs().max())


# ---- safe_get_* / safe_set_* optimizer state with DeepSpeed's optimizers ----------------------

OPTIMIZERS = {  # name: (config optimizer, offload_optimizer, the optimizer class, its per-element state keys)
    "FusedAdam": ({"type": "Adam", "params": {"lr": 1e-2}}, False, "FusedAdam", ("exp_avg", "exp_avg_sq")),
    "DeepSpeedCPUAdam": ({"type": "Adam", "params": {"lr": 1e-2}}, True, "DeepSpeedCPUAdam",
                         ("exp_avg", "exp_avg_sq")),
    "Adagrad": ({"type": "Adagrad", "params": {"lr": 1e-2}}, False, "Adagrad", ("sum",)),
    "DeepSpeedCPUAdagrad": ({"type": "Adagrad", "params": {"lr": 1e-2}}, True, "DeepSpeedCPUAdagrad",
                            ("exp_avg_sq",)),
}


def _value(name, shape, salt):
    g = torch.Generator().manual_seed(zlib.crc32(f"{name} {salt}".encode()))
    return torch.randn(shape, generator=g).abs() * 0.1  # >= 0: a valid second moment / Adagrad sum too


@_guarded
def _optimizer_state(rank, world_size, stage, which):
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed = _deepspeed()
    from deepspeed import utils as du

    optimizer, offload, _, keys = OPTIMIZERS[which]
    zero = {"offload_optimizer": {"device": "cpu"}} if offload else {}
    cfg = {**_config(stage, **zero), "optimizer": optimizer}
    engine, *_ = deepspeed.initialize(model=EvenLM(), config=cfg)
    named = {n: p for n, p in engine.module.named_parameters() if p.requires_grad}
    shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in named.items()}
    batches = make_batches(2, GLOBAL_BATCH)
    out = {"optimizer": type(engine.basic_optimizer).__name__}
    _train(engine, rank, batches[:1])
    for key in keys:
        out[f"full {key}"] = {n: du.safe_get_full_optimizer_state(p, key).clone() for n, p in named.items()}
        out[f"local {key}"] = {n: du.safe_get_local_optimizer_state(p, key).clone() for n, p in named.items()}
    for n, p in named.items():  # a full write of the first key, a local write of the last (its range of a value)
        du.safe_set_full_optimizer_state(p, _value(n, shapes[n], 1), keys[0])
        local = du.safe_get_local_optimizer_state(p, keys[-1])
        du.safe_set_local_optimizer_state(p, _local_slice(_value(n, shapes[n], 2), local.numel()), keys[-1])
    out["written"] = {key: {n: du.safe_get_full_optimizer_state(p, key).clone() for n, p in named.items()}
                      for key in keys}
    out["losses"] = _train(engine, rank, batches[1:])
    out["params"] = {n: du.safe_get_full_fp32_param(p).clone() for n, p in named.items()}
    return out


@pytest.mark.parametrize("which", list(OPTIMIZERS))
def test_optimizer_state_accessors_with_deepspeeds_optimizers_as_stage3(runs, which):
    """The optimizer DeepSpeed builds at stage 3 (the same class under ragged); every per-element
    state read full equals stage 3's, bit for bit; read local, the ranks' pieces join into it; a
    full write and a local write read back as written, and the step after them lands on stage 3's
    weights. FusedLamb has no CPU kernel (DeepSpeed's CPU accelerator builds none): its state is
    the same two moments as Adam's, read through the same path
    ([Note: per-element optimizer state of a ragged parameter])."""
    ref, ours = _ok(runs[f"{which} 3"]), _ok(runs[f"{which} ragged"])
    assert ours[0]["optimizer"] == ref[0]["optimizer"] == OPTIMIZERS[which][2]
    keys = OPTIMIZERS[which][3]
    for rank in range(WORLD):
        for key in [f"full {k}" for k in keys] + ["params"]:
            for name, value in ref[rank][key].items():
                got = ours[rank][key][name]
                assert got.shape == value.shape and torch.equal(got, value), (rank, key, name)
        for key in keys:
            for name, value in ref[rank]["written"][key].items():
                assert torch.equal(ours[rank]["written"][key][name], value), (rank, key, name)
    for key in keys:
        for name, full in ours[0][f"full {key}"].items():
            joined = torch.cat([r[f"local {key}"][name].reshape(-1) for r in ours])
            assert all(r[f"local {key}"][name].dim() == 1 for r in ours)
            assert torch.equal(joined, full.reshape(-1)), (key, name)
    assert ours[0]["losses"] == ref[0]["losses"]


# ---- offload_param alone ---------------------------------------------------------------------


@_guarded
def _offload_param(rank, world_size, stage):
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed = _deepspeed()
    cfg = {**_config(stage, offload_param={"device": "cpu", "pin_memory": False}),
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    engine, *_ = deepspeed.initialize(model=EvenLM(), config=cfg)
    stepped = []  # ragged: what the optimizer steps (after OptimizerOnDevice's pre-hook): twins, not the model's
    if stage == "ragged":
        from vescale_zero.hosts import slot_of

        engine.basic_optimizer.register_step_pre_hook(lambda opt, *_: stepped.append(
            [slot_of(p) is None for g in opt.param_groups for p in g["params"]]))
    out = {"optimizer": type(engine.basic_optimizer).__name__,
           "losses": _train(engine, rank, make_batches(STEPS, GLOBAL_BATCH)), "params": _gathered(deepspeed, engine)}
    if stage == "ragged":
        from vescale_zero import local_piece
        from vescale_zero.hosts import groups_of

        out["stepped_twins"] = stepped

        groups = groups_of(engine.module)
        out["offloaded"] = [g.offload is not None for g in groups]
        state = engine.basic_optimizer.state
        out["state_keys"] = sorted({k for p in engine.basic_optimizer.param_groups[0]["params"]
                                    for k in state.get(p, {})})
        out["state_is_the_params"] = all(slot_of(p) is not None for g in engine.basic_optimizer.param_groups
                                         for p in g["params"] if p in state)
        out["state_on_device"] = all(local_piece(v).device == slot_of(p)[0].device
                                     for p, s in state.items() for k, v in s.items() if k != "step")
    return out


def test_offload_param_alone_trains_as_stage3(runs):
    """The optimizer stage 3 builds with offload_param alone (FusedAdam: the optimizer stays on
    the device), every group offloaded; every step steps device twins of the parameters
    ([Note: the optimizer steps on the device]: on this CPU machine host and device are one, so the
    twins are what shows the path was taken), and between steps the optimizer's state is keyed by
    the model's parameters, on the compute device; losses and weights equal stage 3's, bit for bit."""
    ref, ours = _ok(runs["offload_param 3"]), _ok(runs["offload_param ragged"])
    assert ours[0]["optimizer"] == ref[0]["optimizer"] == "FusedAdam"
    for r in ours:
        assert r["offloaded"] and all(r["offloaded"]), r["offloaded"]
        assert len(r["stepped_twins"]) == STEPS and all(all(s) and s for s in r["stepped_twins"]), r["stepped_twins"]
        assert r["state_keys"] == ["exp_avg", "exp_avg_sq", "step"] and r["state_is_the_params"]
        assert r["state_on_device"]
    assert ours[0]["losses"] == ref[0]["losses"]
    for name, value in ref[0]["params"].items():
        assert torch.equal(ours[0]["params"][name], value), name


# ---- a model built under stage 3's zero.Init --------------------------------------------------


@_guarded
def _stage3_zero_init(rank, world_size, stage, how):
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed = _deepspeed()
    deepspeed.init_distributed(dist_backend="gloo")
    bf16 = how == "stage-3 config, bf16"
    cfg = _config(stage)
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if how == "no config":
        with deepspeed.zero.Init():
            model = EvenLM()
    else:
        with deepspeed.zero.Init(config_dict_or_path={**_config(3), "bf16": {"enabled": True}}):
            model = EvenLM()
    built = {p.dtype for p in model.parameters()}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    out = {"built": built, "losses": _train(engine, rank, make_batches(STEPS, GLOBAL_BATCH)),
           "params": _gathered(deepspeed, engine)}
    if stage == "ragged":
        from vescale_zero import local_piece

        out["masters"] = {local_piece(p).dtype for p in engine.module.parameters()}
        out["zero3_left"] = sorted({k for p in engine.module.parameters() for k in vars(p) if k.startswith("ds_")}
                                   - {"ds_status", "ds_shape", "ds_numel"})
    return out


ZERO_INIT = ("no config", "stage-3 config, bf16")


@pytest.mark.parametrize("how", ZERO_INIT)
def test_a_model_built_under_stage3_zero_init_migrates_at_initialize(runs, how):
    """Built by stage 3's ``zero.Init`` in 16 bits (without a config it builds fp16, or bf16 where the
    accelerator has no fp16, as here; under a bf16 stage-3 config, bf16), given to an fp32 or a bf16
    config: ragged converts it group by group into fp32 master shards (no ZeRO-3 attribute left
    beyond the three it answers) and computes in the 16-bit dtype, as stage 3 does with the same
    model and config. Stage 3 keeps 16-bit parameters and reduces in 16 bits where ragged reduces
    in fp32, so they round in different places: losses within 1e-2 relative, weights within 1e-3
    mean absolute difference (as tests/test_deepspeed.py's bf16 comparison)."""
    ref, ours = _ok(runs[f"zero.Init {how} 3"]), _ok(runs[f"zero.Init {how} ragged"])
    assert ours[0]["built"] == ref[0]["built"] and ours[0]["built"] <= {torch.bfloat16, torch.float16}
    for r in ours:
        assert r["masters"] == {torch.float32} and r["zero3_left"] == [], (r["masters"], r["zero3_left"])
    assert ours[0]["losses"] == pytest.approx(ref[0]["losses"], rel=1e-2)
    diffs = torch.cat([(ours[0]["params"][n] - v).abs().flatten() for n, v in ref[0]["params"].items()])
    assert diffs.mean().item() <= 1e-3


# ---- a second deepspeed.initialize on an engine's model ---------------------------------------


@_guarded
def _second_initialize(rank, world_size, stage, ckpt_dir):
    """DeepSpeed's test_load_immediate_save: engine 1 trains a step and saves; engine 2, built on the
    same model object with the same config, loads that and saves again at once. Stage 3 allows no
    more (its first engine's hooks are still on the model: a forward of engine 2 fails in its
    parameter coordinator), so its losses and weights come from an uninterrupted run; ragged's
    engine 2 trains on."""
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed = _deepspeed()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    cfg = {**_config(stage), "bf16": {"enabled": True}}  # as DeepSpeed's test on an accelerator with bf16
    batches = make_batches(STEPS, GLOBAL_BATCH)
    model = EvenLM()
    first, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses = _train(first, rank, batches[:1])
    first.save_checkpoint(ckpt_dir, tag="one")
    second, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    second.load_checkpoint(ckpt_dir, tag="one")
    second.save_checkpoint(ckpt_dir, tag="again")
    torch.distributed.barrier()
    out = {"saved": [get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, tag=tag) for tag in ("one", "again")]}
    if stage == "ragged":
        losses += _train(second, rank, batches[1:])
        out.update(losses=losses, params=_gathered(deepspeed, second), steps=second.global_steps)
        try:  # another sharding than the first engine's is refused, naming the difference
            deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(stage))
            out["other_sharding"] = None
        except ValueError as e:
            out["other_sharding"] = str(e)
        return out
    straight, *_ = deepspeed.initialize(model=EvenLM(), config=cfg)
    out.update(losses=_train(straight, rank, batches), params=_gathered(deepspeed, straight),
               steps=straight.global_steps)
    return out


def test_a_second_initialize_on_an_engines_model_rewraps_it_as_stage3(runs):
    """As at stage 3, engine 2 on engine 1's model (bf16, as DeepSpeed's test) loads its checkpoint
    and saves it again at once: the second save's fp32 weights are the first's, bit for bit, on
    both stages, and ragged's equal stage 3's to bf16's tolerance (as
    test_a_model_built_under_stage3_zero_init_migrates_at_initialize). Engine 2 then trains on to
    the losses and weights of stage 3's uninterrupted run, to the same tolerance. A config that
    would shard differently (fp32 here) is refused, naming the difference."""
    ref, ours = _ok(runs["second initialize 3"]), _ok(runs["second initialize ragged"])
    for run in (ref, ours):
        one, again = run[0]["saved"]
        assert one.keys() == again.keys() and all(torch.equal(one[n], again[n]) for n in one)
    one, ref_one = ours[0]["saved"][0], ref[0]["saved"][0]
    assert one.keys() == ref_one.keys()
    diffs = torch.cat([(one[n].float() - ref_one[n].float()).abs().flatten() for n in one])
    assert diffs.mean().item() <= 1e-3
    assert ours[0]["steps"] == ref[0]["steps"] == STEPS
    assert ours[0]["losses"] == pytest.approx(ref[0]["losses"], rel=1e-2)
    diffs = torch.cat([(ours[0]["params"][n] - v).abs().flatten() for n, v in ref[0]["params"].items()])
    assert diffs.mean().item() <= 1e-3
    assert "bf16/fp16: torch.bfloat16 -> None" in ours[0]["other_sharding"], ours[0]["other_sharding"]


# ---- ZeRO++ qwZ: zero_quantized_weights -------------------------------------------------------


@_guarded
def _quantized_weights(rank, world_size):
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed = _deepspeed()
    from vescale_zero.hosts import groups_of

    engine, *_ = deepspeed.initialize(model=EvenLM(), config=_config("ragged", zero_quantized_weights=True))
    losses = _train(engine, rank, make_batches(STEPS, GLOBAL_BATCH))
    return {"losses": losses, "tiles": {g._fp8_tile for g in groups_of(engine.module)}}


def test_zero_quantized_weights_gathers_fp8_tiles(runs):
    """qwZ maps to the block-wise FP8 gather, tiles of 128 ([Note: ZeRO++ quantized communication under ragged]):
    every group gathers float8 tiles, and the losses follow the unquantized run (stage 3's with
    reduce_scatter false: at 2 ranks the same floats as ragged's, see above) to 1%, without
    equalling them. Stage 3's own qwZ
    needs DeepSpeed's quantizer kernels, which its CPU accelerator does not build."""
    ours, plain = _ok(runs["qwZ ragged"]), _ok(runs["reduce_scatter false 3"])
    assert all(r["tiles"] == {128} for r in ours), [r["tiles"] for r in ours]
    assert all(abs(a - b) <= 0.01 * b for a, b in zip(ours[0]["losses"], plain[0]["losses"]))
    assert ours[0]["losses"] != plain[0]["losses"], "zero_quantized_weights changed nothing: was it applied?"


# ---- one spawn -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cases = {}
    for stage in STAGES:
        cases[f"reduce_scatter false {stage}"] = (_reduce_scatter_false, (stage,))
        for which in OPTIMIZERS:
            cases[f"{which} {stage}"] = (_optimizer_state, (stage, which))
        cases[f"offload_param {stage}"] = (_offload_param, (stage,))
        for how in ZERO_INIT:
            cases[f"zero.Init {how} {stage}"] = (_stage3_zero_init, (stage, how))
        cases[f"second initialize {stage}"] = (_second_initialize, (stage, str(tmp_path_factory.mktemp(f"s{stage}"))))
    cases["qwZ ragged"] = (_quantized_weights, ())
    return run_cases_on_ranks(cases, WORLD, timeout=1500)
