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

CHECKPOINTING = {"partition_activations": False, "number_checkpoints": 3, "profile": False}


def _ragged_config(**section):
    """A whole config for this one process (world size 1), with bf16 and activation checkpointing."""
    cfg = ds_config("ragged", 1, bf16={"enabled": True}, activation_checkpointing=CHECKPOINTING)
    cfg["zero_optimization"].update(section)
    return cfg


@pytest.mark.parametrize("as_path", [False, True])
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
    with pytest.raises(ValueError, match=r"offload_optimizer \(device 'cpu'\) is not implemented"):
        DeepSpeedConfig(_ragged_config(offload_optimizer={"device": "cpu"}))


@pytest.mark.parametrize("key, closest", [
    ("granularty", "granularity"), ("sharded_module", "sharded_modules"), ("sharded-modules", "sharded_modules"),
    ("granular", "granularity"), ("reduce_bucket_sise", "reduce_bucket_size"),
    ("offload_optimiser", "offload_optimizer"), ("stage4_magic", None),
])
def test_unknown_ragged_key_suggests_the_closest(key, closest):
    """A typo in the ragged section names the key it was probably meant to be; the list that
    follows is our seven keys, not the fifty ZeRO-3 keys accepted for compatibility."""
    _deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    with pytest.raises(ValueError) as e:
        DeepSpeedConfig(_ragged_config(**{key: 1}))
    message = str(e.value)
    assert message.startswith(f"zero_optimization: unknown key {key!r} for stage 'ragged'."), message
    assert (f"Did you mean {closest!r}?" in message) if closest else ("Did you mean" not in message), message
    ours = message.split("Our keys: ")[1].split(";")[0].split(", ")
    assert ours == ["fp8_all_gather_tile", "granularity", "prefetch", "reduce_dtype", "reshard_after_forward",
                    "shard_group_size", "sharded_modules"], message


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
