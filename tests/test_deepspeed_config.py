"""``"stage": "ragged"`` wherever DeepSpeed parses a config, not only in ``deepspeed.initialize``.

The entry points besides ``initialize`` that parse the same config: ``DeepSpeedConfig`` (what
other libraries build), ``deepspeed.checkpointing.configure`` (it trains in
test_deepspeed_checkpointing) and ``deepspeed.zero.Init`` (it trains in test_deepspeed_zero_init;
here: its options that contradict ragged sharding are refused however the config is given).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("deepspeed")  # the [test] extra installs it; without it these tests cannot run

from tests.distributed import run_on_ranks  # noqa: E402
from tests.models import AwkwardLM  # noqa: E402
from tests.test_deepspeed import _deepspeed, ds_config  # noqa: E402
from vescale_zero.integrations.deepspeed.deepspeed_compat import (  # noqa: E402
    PRECISION_MODELS,
    READS_GRADIENT_ALLREDUCE_OP,
    bf16_section,
)

CHECKPOINTING = {"partition_activations": False, "number_checkpoints": 3, "profile": False}


# what the installed DeepSpeed reads ([Note: one door to DeepSpeed's releases])
needs_precision_models = pytest.mark.skipif(not PRECISION_MODELS, reason="DeepSpeed 0.16 reads bf16 / fp16 with "
                                            "getters that take any non-empty string as true, and has no "
                                            "bfloat16_config: stage 'ragged' reads them with the same getters")
needs_allreduce_op = pytest.mark.skipif(not READS_GRADIENT_ALLREDUCE_OP, reason="this DeepSpeed does not read "
                                        "gradient_allreduce_op (it always averages, as stage 'ragged' does)")
needs_bf16_masters = pytest.mark.skipif(not hasattr(bf16_section({}), "bf16_master_weights_and_grads"),
                                        reason="DeepSpeed before 0.18 has no bf16 master weights to refuse")


def _ragged_config(**section):
    """A whole config for this one process (world size 1), with bf16 and activation checkpointing."""
    cfg = ds_config("ragged", 1, bf16={"enabled": True}, activation_checkpointing=CHECKPOINTING)
    cfg["zero_optimization"].update(section)
    return cfg


@pytest.mark.parametrize("as_path", [False, True])
@needs_precision_models
def test_deepspeed_config_parses_ragged_as_stage_0(tmp_path, as_path):
    """DeepSpeed sees ZeRO off (its engine does no ZeRO work; ours shards) and every other
    section as usual; our options ride along; the user's dict keeps "ragged"."""
    _deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    from vescale_zero.integrations.deepspeed import RaggedZeroConfig, is_ragged_config

    cfg = _ragged_config(granularity="row", overlap_comm=False)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    parsed = DeepSpeedConfig(str(path) if as_path else cfg)
    assert is_ragged_config(parsed) and isinstance(parsed.zero_config, RaggedZeroConfig)
    assert parsed.zero_optimization_stage == 0 and parsed.zero_enabled is False
    assert parsed.zero_config.ragged.granularity == "row" and parsed.zero_config.ragged.prefetch is False
    assert parsed.bfloat16_config.enabled is True
    assert parsed.activation_checkpointing_config.number_checkpoints == 3
    assert parsed._param_dict["zero_optimization"]["stage"] == "ragged"
    assert not is_ragged_config(DeepSpeedConfig(ds_config(3, 1)))
    assert DeepSpeedConfig(ds_config(3, 1)).zero_optimization_stage == 3


def test_deepspeed_config_ragged_section_errors_are_ours():
    _deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    with pytest.raises(ValueError, match="unknown key 'stage4_magic' for stage 'ragged'. Our keys: fp8_all_gather"):
        DeepSpeedConfig(_ragged_config(stage4_magic=1))
    with pytest.raises(ValueError, match=r"offload_param \(device 'nvme'\) with offload_optimizer \(device 'none'\)"):
        DeepSpeedConfig(_ragged_config(offload_param={"device": "nvme", "nvme_path": "/local_nvme"}))
    offloaded = DeepSpeedConfig(_ragged_config(offload_optimizer={"device": "cpu"})).zero_config  # .offload's choice
    assert offloaded.ragged.offload.device == "cpu" and offloaded.offload_optimizer.device == "cpu"


@pytest.mark.parametrize("key, closest", [
    ("granularty", "granularity"), ("sharded_module", "sharded_modules"), ("sharded-modules", "sharded_modules"),
    ("granular", "granularity"), ("reduce_bucket_sise", "reduce_bucket_size"),
    ("offload_optimiser", "offload_optimizer"), ("stage4_magic", None),
])
def test_unknown_ragged_key_suggests_the_closest(key, closest):
    """A typo in the ragged section names the key it was probably meant to be; the list that
    follows is our eight keys, not the fifty ZeRO-3 keys accepted for compatibility."""
    _deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    with pytest.raises(ValueError) as e:
        DeepSpeedConfig(_ragged_config(**{key: 1}))
    message = str(e.value)
    assert message.startswith(f"zero_optimization: unknown key {key!r} for stage 'ragged'."), message
    assert (f"Did you mean {closest!r}?" in message) if closest else ("Did you mean" not in message), message
    ours = message.split("Our keys: ")[1].split(";")[0].split(", ")
    assert ours == ["fp8_all_gather_tile", "granularity", "optimizer_aware", "prefetch", "reduce_dtype",
                    "reshard_after_forward", "shard_group_size", "sharded_modules"], message


@pytest.mark.parametrize("stage", ["raged", "Ragged", 4, "zero3"])
def test_typo_in_stage_gets_a_clear_error(stage):
    _deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = ds_config(stage, 1)
    with pytest.raises(ValueError) as e:
        DeepSpeedConfig(cfg)
    message = str(e.value)
    assert message.startswith(f"zero_optimization.stage {stage!r} is not a stage"), message
    assert "0, 1, 2, 3" in message and "'ragged'" in message and "vescale_zero.integrations.deepspeed" in message


@pytest.mark.parametrize("how", ["dict", "path", "module", "deprecated_config_kwarg"])
def test_zero_init_refuses_offload_with_ragged(tmp_path, how):
    """zero.Init with "ragged" partitions as for ZeRO-3 (test_deepspeed_zero_init), but parameter
    offload contradicts ragged sharding: refused, naming the option and the fix, before it
    touches the model, however the config reaches zero.Init."""
    deepspeed = _deepspeed()
    cfg = _ragged_config()
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    model = AwkwardLM(seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    kwargs = {"dict": {"config_dict_or_path": cfg}, "path": {"config_dict_or_path": str(path)},
              "module": {"module": model, "config_dict_or_path": cfg}, "deprecated_config_kwarg": {"config": cfg}}[how]
    with pytest.raises(ValueError) as e:
        deepspeed.zero.Init(remote_device="cpu", **kwargs)
    message = str(e.value)
    for fragment in ("deepspeed.zero.Init(remote_device='cpu')", '"ragged"', "remove remote_device", "stage 3"):
        assert fragment in message, (fragment, message)
    for name, p in model.named_parameters():
        assert not hasattr(p, "ds_id") and torch.equal(p, before[name]), name


def _engine_without_our_initialize(rank, world_size):
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed = _deepspeed()
    from vescale_zero.integrations import deepspeed as ours

    original = deepspeed.initialize.__wrapped__  # as if bound by `from deepspeed import initialize` before our import
    with pytest.raises(ValueError) as e:
        original(model=AwkwardLM(seed=0), config=ds_config("ragged", world_size))
    engine, *_ = ours.initialize(model=AwkwardLM(seed=0), config=ds_config("ragged", world_size))
    return {"error": str(e.value), "ragged": isinstance(engine, ours.RaggedDeepSpeedEngine)}


def test_deepspeed_engine_refuses_a_ragged_config_that_bypassed_our_initialize():
    """DeepSpeed's own engine would run a ragged config unsharded (stage 0): refused."""
    (result,) = run_on_ranks(_engine_without_our_initialize, 1, timeout=300)
    assert "reached DeepSpeed's own engine" in result["error"], result["error"]
    assert "import vescale_zero.integrations.deepspeed" in result["error"], result["error"]
    assert result["ragged"]


# ---- a ZeRO-3 job's config means under "ragged" what it means at stage 3 (issue 26) ---------
# Each check reads the same job at "stage": 3 through DeepSpeed's own path beside "ragged".


def _both(zero=None, **top):
    """The same job at stage 3 and at "ragged" (one rank): ``(stage-3 config, ragged config)``."""
    out = []
    for stage in (3, "ragged"):
        cfg = ds_config(stage, 1, **top)
        cfg["zero_optimization"].update(zero or {})
        out.append(cfg)
    return tuple(out)


def _ragged_parses(cfg):
    """Ragged through both of its parses: ``deepspeed.initialize``'s split and ``DeepSpeedConfig``:
    ``(options, precision)`` of the first, checking the second agrees on the options."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from vescale_zero.integrations.deepspeed import split_ragged_config

    _, options, precision = split_ragged_config(cfg)
    assert DeepSpeedConfig(cfg).zero_config.ragged == options
    return options, precision


def _ragged_refuses(cfg, *fragments):
    """Both ragged parses refuse ``cfg`` with a ValueError containing every fragment; its message."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from vescale_zero.integrations.deepspeed import split_ragged_config

    for parse in (split_ragged_config, DeepSpeedConfig):
        with pytest.raises(ValueError) as e:
            parse(cfg)
        for fragment in fragments:
            assert fragment in str(e.value), (parse.__name__, fragment, str(e.value))
    return str(e.value)


@pytest.mark.parametrize("section", ["bf16", "fp16"])
@pytest.mark.parametrize("value", ["auto", "false"])
@needs_precision_models
def test_precision_enabled_strings_mean_what_deepspeed_reads(section, value):
    """Issue 26 item 3: ``"enabled": "auto"`` (Hugging Face's placeholder, in a config reused in
    a plain script) and ``"false"``: DeepSpeed reads both as disabled at stage 3 (it drops
    "auto" values: the default), so the job trains fp32; "ragged" too (before: truthy strings
    turned bf16 / fp16 on). The running engines: test_precision_strings_train_as_stage3."""
    _deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    zero3, ragged = _both(**{section: {"enabled": value}})
    parsed = DeepSpeedConfig(zero3)
    assert parsed.bfloat16_config.enabled is False and parsed.float16_config.enabled is False
    assert _ragged_parses(ragged)[1].dtype is None


def test_zero3_keys_are_validated_as_deepspeed_validates_them():
    """Issue 26 item 7: the ZeRO-3 keys "ragged" does not use are still validated by
    DeepSpeed's own ZeRO model (before: any value accepted, with a warning that it is ignored)."""
    _deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    for key, value in (("reduce_bucket_size", -5), ("stage3_max_live_parameters", "lots")):
        zero3, ragged = _both({key: value})
        with pytest.raises(Exception, match=key):  # pydantic's ValidationError at stage 3
            DeepSpeedConfig(zero3)
        _ragged_refuses(ragged, f"zero_optimization (stage 'ragged'): {key} {value!r}", "DeepSpeed refuses",
                        "remove the key")


BAD_VALUES = {  # each of our keys, and the ZeRO-3 / offload keys "ragged" reads, with a value it refuses
    "granularity": [1], "sharded_modules": "GPTBlock", "reshard_after_forward": "maybe", "prefetch": "maybe",
    "reduce_dtype": "fp8", "fp8_all_gather_tile": 0, "shard_group_size": 0, "optimizer_aware": "maybe",
    "overlap_comm": "maybe", "offload_optimizer": {"device": "gpu"}, "offload_param": {"device": "gpu"},
    "reduce_bucket_size": -5,
}


@pytest.mark.parametrize("key", sorted(BAD_VALUES))
def test_every_key_refuses_a_bad_value_in_one_line(key):
    """Issue 38: a refused value of any key of the ragged section is one line naming the key, the
    value and what the key accepts (``shard_group_size: 0`` and ``prefetch: "maybe"`` gave
    pydantic's four-line report, the key on its second line)."""
    _deepspeed()
    from vescale_zero.integrations.deepspeed.config import ACCEPTED

    value = BAD_VALUES[key]
    _, ragged = _both({key: value})
    shown = next(iter(value.values())) if isinstance(value, dict) else value
    accepted = ACCEPTED.get(key, "")
    message = _ragged_refuses(ragged, key, repr(shown), accepted)
    assert "\n" not in message, message


def test_overlap_comm_is_read_as_deepspeed_reads_it():
    """Issue 26 item 7: ``overlap_comm: "false"`` is False at stage 3 (pydantic's bool); under
    "ragged" it maps to prefetch, which ``bool("false")`` turned on."""
    _deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    for value, prefetch in (("false", False), ("true", True), (False, False)):
        zero3, ragged = _both({"overlap_comm": value})
        assert DeepSpeedConfig(zero3).zero_config.overlap_comm is prefetch
        assert _ragged_parses(ragged)[0].prefetch is prefetch, value
    zero3, ragged = _both({"reduce_bucket_size": "auto", "overlap_comm": "auto"})  # "auto": DeepSpeed's default
    DeepSpeedConfig(zero3)
    assert _ragged_parses(ragged)[0].prefetch is True


# Issue 26 item 7: top-level keys about the data-parallel layer, which "ragged" ignored without a
# word: each means what it means at stage 3, or is refused naming the fix.


def test_communication_data_type_is_the_reduce_dtype():
    """The dtype ZeRO-3 reduces gradients in: our reduce_dtype (the engines:
    test_communication_data_type_reduces_as_stage3)."""
    _deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    zero3, ragged = _both(communication_data_type="bf16")
    assert DeepSpeedConfig(zero3).communication_data_type == torch.bfloat16
    assert _ragged_parses(ragged)[0].reduce_torch_dtype == torch.bfloat16
    _, ragged = _both({"reduce_dtype": "fp32"}, communication_data_type="bf16")
    _ragged_refuses(ragged, "communication_data_type 'bf16' and zero_optimization.reduce_dtype 'fp32' disagree")


@needs_allreduce_op
def test_gradient_allreduce_op_sum_is_refused_as_at_stage3():
    """ZeRO-3 refuses "sum"; "ragged" averaged."""
    _deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    zero3, ragged = _both(gradient_allreduce_op="sum")
    with pytest.raises(ValueError, match="not supported with ZeRO stage 3"):
        DeepSpeedConfig(zero3)
    _ragged_refuses(ragged, 'gradient_allreduce_op "sum" is not supported', 'set "mean"')
    assert _ragged_parses(_both(gradient_allreduce_op="mean")[1])[0].reduce_dtype is None


@needs_bf16_masters
def test_bf16_master_weights_are_refused():
    """ZeRO-3 keeps bf16 masters / optimizer states; ours are fp32 ("ragged" ignored the keys)."""
    _deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    for extra in ({"bf16_master_weights_and_grads": True},
                  {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}):
        zero3, ragged = _both(bf16={"enabled": True, **extra})
        assert DeepSpeedConfig(zero3).bfloat16_config.bf16_master_weights_and_grads is True
        _ragged_refuses(ragged, *(f"bf16.{k}" for k in extra), "fp32 master shards", "use stage 3")


def test_grad_accum_dtype_must_be_the_reduce_dtype():
    """We accumulate in the reduce dtype: grad_accum_dtype other than it is refused (before:
    "fp32" ignored, "bf16" DeepSpeed's stage-0 "unsupported mix" error, not naming the fix)."""
    _deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    from vescale_zero.integrations.deepspeed import split_ragged_config

    for accum, zero in (("fp32", {}), ("bf16", {"reduce_dtype": "bf16"})):
        top = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": accum}}
        (zero3, _), (_, ragged) = _both(**top), _both(zero, **top)  # reduce_dtype: ours
        assert DeepSpeedConfig(zero3).grad_accum_dtype == accum
        ds, options, _ = split_ragged_config(ragged)
        assert "grad_accum_dtype" not in ds["data_types"]  # DeepSpeed at stage 0 would see an fp32 model
    _, ragged = _both(bf16={"enabled": True}, data_types={"grad_accum_dtype": "bf16"})
    _ragged_refuses(ragged, "data_types.grad_accum_dtype 'bf16'", "accumulates gradients in the dtype it reduces them "
                    "in (fp32 here)", "zero_optimization.reduce_dtype: 'bf16'")


# ---- the same jobs running: stage 3 beside "ragged", in one spawn -----------------------


def _one_step_config(stage, **extra):
    """One micro-batch per step, one rank, no clipping."""
    return ds_config(stage, 1, train_batch_size=6, train_micro_batch_size_per_gpu=6, gradient_accumulation_steps=1,
                     gradient_clipping=0.0, **extra)


def _weights(engine, stage):
    from tests.test_deepspeed import _full_params

    params = _full_params(engine, stage)
    return {n: (v[3] if stage == "ragged" else v).float().clone() for n, v in params.items()}


def _engine(stage, **extra):
    deepspeed = _deepspeed()
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True  # DeepSpeed's CPU accelerator refuses fp16 at stage 3
    engine, *_ = deepspeed.initialize(model=AwkwardLM(seed=0), config=_one_step_config(stage, **extra))
    return engine


def _batch():
    from tests.models import make_batches

    x, y = make_batches(1, 6)[0]
    return x, y


def _compute_dtypes(rank, world_size, stage):
    """The dtype the embedding computes in, per precision section."""
    os.environ["LOCAL_RANK"] = str(rank)
    out = {}
    for section in ("bf16", "fp16"):
        for value in ("auto", "false", True):
            engine = _engine(stage, **{section: {"enabled": value}})
            seen = []
            engine.module.embed.register_forward_hook(lambda m, i, o, seen=seen: seen.append(o.dtype))
            engine(*_batch())
            out[f"{section}={value}"] = seen[0]
    return out


def _reduce_dtypes(rank, world_size, stage):
    """The dtype gradients are reduced in, with ``communication_data_type: "bf16"`` (fp32 model)."""
    os.environ["LOCAL_RANK"] = str(rank)
    engine = _engine(stage, communication_data_type="bf16")
    if stage == 3:
        return {engine.optimizer.communication_data_type}
    from vescale_zero.api.fully_shard import groups_of

    return {group.reduce_dtype for group in groups_of(engine.module)}


def _overflow_at_min_scale(rank, world_size, stage):
    """fp16 with the dynamic scale at its minimum (initial 2^0 = min_loss_scale 1, hysteresis 1),
    then an overflow: what step() does."""
    os.environ["LOCAL_RANK"] = str(rank)
    engine = _engine(stage, fp16={"enabled": True, "initial_scale_power": 0, "min_loss_scale": 1, "hysteresis": 1})
    engine.backward(engine(*_batch()) * float("inf"))
    try:
        engine.step()
    except Exception as e:  # noqa: BLE001 - what each stage raises is the observation
        return str(e)
    return None


def _static_loss_scale(rank, world_size, stage):
    """fp16 with ``loss_scale: 128``: a normal step, then an overflow."""
    os.environ["LOCAL_RANK"] = str(rank)
    engine = _engine(stage, fp16={"enabled": True, "loss_scale": 128})
    scale = (lambda: engine.optimizer.loss_scale) if stage == 3 else (lambda: engine.loss_scale)
    out = {"scales": [scale()], "changed": [], "skipped": [], "losses": []}
    for overflow in (False, True):
        before = _weights(engine, stage)
        loss = engine(*_batch())
        out["losses"].append(loss.item())
        engine.backward(loss * float("inf") if overflow else loss)
        engine.step()
        after = _weights(engine, stage)
        out["changed"].append(any(not torch.equal(before[n], after[n]) for n in after))
        out["skipped"].append(engine.skipped_steps)
        out["scales"].append(scale())
    return out


def _model_in_16_bits(rank, world_size, stage):
    """A model already in bf16 / fp16 (``model.to(...)`` before ``deepspeed.initialize``) with that
    section enabled: the dtypes of the optimizer's parameters (the master weights) and of its
    state after one step, and the first loss."""
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed = _deepspeed()
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True  # DeepSpeed's CPU accelerator refuses fp16 at stage 3
    out = {}
    for dtype, section in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        model = AwkwardLM(seed=0).to(dtype)
        precision = {"enabled": True, "initial_scale_power": 8} if section == "fp16" else {"enabled": True}
        engine, *_ = deepspeed.initialize(model=model, config=_one_step_config(stage, **{section: precision}))
        loss = engine(*_batch())
        engine.backward(loss)
        engine.step()
        opt = engine.basic_optimizer
        masters = engine.optimizer.fp32_partitioned_groups_flat if stage == 3 else [  # ZeRO-3's flat partitions
            p for g in opt.param_groups for p in g["params"]]
        out[section] = {"masters": {p.dtype for p in masters}, "skipped": engine.skipped_steps, "loss": loss.item(),
                        "state": {v.dtype for st in opt.state.values() for k, v in st.items() if k != "step"}}
    return out


def _observing(rank, world_size, fn, stage):
    """``fn``'s result, or what it raised (one case's error then fails its own test, not the spawn)."""
    try:
        return fn(rank, world_size, stage)
    except Exception as e:  # noqa: BLE001 - reported to the test that reads this case
        return f"raised {type(e).__name__}: {e}"


@pytest.fixture(scope="module")
def running():
    """Every engine case below at stage 3 and at "ragged", in one spawn of one rank."""
    from tests.distributed import run_cases_on_ranks

    engines = {"dtypes": _compute_dtypes, "reduce": _reduce_dtypes, "min scale": _overflow_at_min_scale,
               "static": _static_loss_scale, "16-bit model": _model_in_16_bits}
    cases = {f"{name} {stage}": (_observing, (fn, stage)) for name, fn in engines.items() for stage in (3, "ragged")}
    return {name: results[0] for name, results in run_cases_on_ranks(cases, 1, timeout=600).items()}


@needs_precision_models
def test_precision_strings_train_as_stage3(running):
    """Issue 26 item 3, running: "auto" / "false" compute in fp32 at stage 3 and under "ragged";
    ``true`` in bf16 / fp16 (the observation works)."""
    assert running["dtypes ragged"] == running["dtypes 3"], (running["dtypes ragged"], running["dtypes 3"])
    assert running["dtypes 3"] == {"bf16=auto": torch.float32, "bf16=false": torch.float32, "bf16=True": torch.bfloat16,
                                   "fp16=auto": torch.float32, "fp16=false": torch.float32, "fp16=True": torch.float16}


def test_communication_data_type_reduces_as_stage3(running):
    """Issue 26 item 7, running: ``communication_data_type: "bf16"`` reduces gradients in bf16 at
    stage 3 and under "ragged" (which reduced fp32 gradients in fp32)."""
    assert running["reduce 3"] == {torch.bfloat16}, running["reduce 3"]
    assert running["reduce ragged"] == running["reduce 3"]


def test_fp16_overflow_at_min_loss_scale_stops_as_stage3(running):
    """Issue 26 item 5: ZeRO-3's dynamic scaler stops the run when an overflow finds the scale at
    ``min_loss_scale`` (hysteresis spent); "ragged" did skip such steps forever."""
    assert running["min scale 3"] is not None and "Current loss scale already at minimum" in running["min scale 3"]
    assert running["min scale ragged"] == running["min scale 3"]


def test_fp16_static_loss_scale_as_stage3(running):
    """Issue 26 item 13: ``fp16.loss_scale: 128`` (static; "ragged" refused it): the scale stays
    128, a step with an overflow is skipped (weights unchanged, skipped_steps counts it) and
    does not stop the run, as at stage 3. The first loss, on identical fp16 weights: bit-exact."""
    ref, ours = running["static 3"], running["static ragged"]
    assert isinstance(ours, dict), ours
    assert ref["scales"] == [128, 128, 128] and ref["changed"] == [True, False] and ref["skipped"] == [0, 1], ref
    assert ours["scales"] == ref["scales"] and ours["changed"] == ref["changed"] and ours["skipped"] == ref["skipped"]
    assert ours["losses"][0] == ref["losses"][0]


def test_a_model_already_in_16_bits_keeps_fp32_masters_as_stage3(running):
    """Issue 26 item 2: ``model.to(torch.bfloat16)`` (or fp16) before ``deepspeed.initialize``
    with that section enabled: ZeRO-3 keeps fp32 master weights and Adam states (the 16-bit
    weights are the compute copy); "ragged" kept the 16-bit parameters as masters, so updates
    below their resolution vanished. The first loss (the same 16-bit weights): bit-exact."""
    ref, ours = running["16-bit model 3"], running["16-bit model ragged"]
    assert isinstance(ours, dict), ours
    for section in ("bf16", "fp16"):
        assert ref[section]["masters"] == ref[section]["state"] == {torch.float32}, (section, ref)
        assert ref[section]["skipped"] == ours[section]["skipped"] == 0, (section, ref, ours)
        assert ours[section]["masters"] == ref[section]["masters"], (section, ours)
        assert ours[section]["state"] == ref[section]["state"], (section, ours)
        assert ours[section]["loss"] == ref[section]["loss"], section
