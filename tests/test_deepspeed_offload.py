"""``offload_optimizer`` / ``offload_param`` to the CPU under ``"stage": "ragged"``, beside ZeRO-3 with
the same keys (gloo, CPU; integrations/deepspeed/offload.py [Note: offload under ragged]).

The offload configs users have: Hugging Face's ``ds_config_zero3.json`` (both keys to the CPU, pinned,
a config AdamW and WarmupLR), ZeRO-Offload's optimizer-only form, DeepSpeed's documented offload
example with device cpu (its NVMe-only sub-keys warned and ignored) and the deprecated
``cpu_offload: true``. Each is switched to "ragged" and run beside the same config at stage 3: both
step DeepSpeed's CPU Adam. On this CPU machine host and device are one, so the offload copies are the
same code path as on a GPU with nothing to move.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

pytest.importorskip("deepspeed")  # the [test] extra installs it; without it these tests cannot run

from tests.distributed import run_cases_on_ranks  # noqa: E402
from tests.models import AwkwardLM, assemble, local_pieces, make_batches, rank_slice  # noqa: E402
from tests.numerics import adam_divergence_bound  # noqa: E402
from tests.test_deepspeed import (  # noqa: E402
    ACCUM,
    GLOBAL_BATCH,
    _assert_grads_within,
    _deepspeed,
    _full_params,
    _local_grad_magnitudes,
    _moment_pieces,
    ds_config,
    train_steps,
)

LR, STEPS = 1e-2, 4
ADAMW = {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}}

HF_ZERO3 = {  # Hugging Face's docs ds_config_zero3.json, its "auto" values as the Trainer fills them
    "optimizer": ADAMW,
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": LR, "warmup_num_steps": 2}},
    "zero_optimization": {
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": 169,
        "stage3_prefetch_bucket_size": 152, "stage3_param_persistence_threshold": 130,
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}
OPTIMIZER_ONLY = {  # ZeRO-Offload: the optimizer's half on the host, a config Adam (AdamW mode by default)
    "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.1}},
    "zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": False}},
}
DEEPSPEED_DOCS = {  # DeepSpeed's config-json offload example with device cpu: its NVMe sub-keys do nothing
    "optimizer": ADAMW,
    "zero_optimization": {
        "offload_optimizer": {"device": "cpu", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 4,
                              "fast_init": False},
        "offload_param": {"device": "cpu", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 5,
                          "buffer_size": 1e8, "max_in_cpu": 1e9},
    },
}
LEGACY = {"optimizer": ADAMW, "zero_optimization": {"cpu_offload": True}}  # DeepSpeed's deprecated spelling
CONFIGS = {"hf_zero3": HF_ZERO3, "optimizer_only": OPTIMIZER_ONLY, "deepspeed_docs": DEEPSPEED_DOCS, "legacy": LEGACY}
COMPARED = ["hf_zero3", "optimizer_only", "deepspeed_docs"]  # run beside stage 3 (legacy: read like optimizer_only)
NO_OFFLOAD = {"optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1, "torch_adam": True}},
              "zero_optimization": {}}  # torch's AdamW, no offload: the other side of the resumes across offload


def offload_config(stage, world_size, which, **extra):
    """``CONFIGS[which]`` at ``stage`` (3 or "ragged"), fp32, ACCUM micro-batches, clipping at 1.0."""
    cfg = ds_config(stage, world_size, **extra)
    given = copy.deepcopy(NO_OFFLOAD if which == "none" else CONFIGS[which])
    cfg["zero_optimization"].update(given.pop("zero_optimization"))
    cfg.update(given)
    return cfg


def _engine(rank, world_size, cfg, model=None, **kwargs):
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed = _deepspeed()
    model = model if model is not None else AwkwardLM(seed=0)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, **kwargs)
    return engine


def _offloaded(engine):
    from vescale_zero.api.fully_shard import groups_of

    return sorted({str(g.offload.device) if g.offload is not None else "None" for g in groups_of(engine.module)})


def _train(rank, world_size, stage, which, steps=STEPS, extra=None):
    """``steps`` steps of CONFIGS[which] at ``stage``: the first step's reduced gradients, the mean
    loss of every step, the full weights, the optimizer class (and, for ragged, where the shards live)."""
    engine = _engine(rank, world_size, offload_config(stage, world_size, which, **(extra or {})))
    losses, grads = train_steps(engine, stage, rank, world_size, steps, first_grads=True)
    return {"losses": losses, "grads": grads, "params": _full_params(engine, stage),
            "optimizer": type(engine.basic_optimizer).__name__,
            "offloaded": _offloaded(engine) if stage == "ragged" else None,
            "local_sums": _local_grad_magnitudes(rank, world_size) if stage == 3 else None}


def _steps(engine, batches, rank, world_size):
    """One engine step of ACCUM micro-batches per batch; the last micro-batch's loss of each."""
    losses = []
    for batch in batches:
        x, y = rank_slice(batch, rank, world_size)
        for i in range(ACCUM):
            loss = engine(x.chunk(ACCUM)[i], y.chunk(ACCUM)[i])
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return losses


def _train_client_cpu_adam(rank, world_size):
    """Ragged without offload, stepping a client DeepSpeedCPUAdam: the same kernel and reduction order as
    ragged with offload_optimizer (OPTIMIZER_ONLY)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    model = AwkwardLM(seed=0)
    cfg = ds_config("ragged", world_size)
    del cfg["optimizer"]
    engine = _engine(rank, world_size, cfg, model, optimizer=DeepSpeedCPUAdam(model.parameters(), lr=LR,
                                                                             weight_decay=0.1))
    losses = _steps(engine, make_batches(STEPS, GLOBAL_BATCH), rank, world_size)
    return {"losses": losses, "params": local_pieces(engine.module), "offloaded": _offloaded(engine)}


def _presharded(rank, world_size, offload_in_config):
    """A model the user sharded with fully_shard (with CPU offload when the config has none, and the
    reverse): refused, naming both sides."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    import vescale_zero as vz

    model = AwkwardLM(seed=0)
    policy = {} if offload_in_config else {"offload_policy": CPUOffloadPolicy(pin_memory=False)}
    vz.fully_shard_layers(model, ["AwkwardBlock"], **policy)
    cfg = offload_config("ragged", world_size, "optimizer_only" if offload_in_config else "none")
    try:
        _engine(rank, world_size, cfg, model)
    except ValueError as e:
        return str(e)
    return None


def _client_optimizer(rank, world_size, force):
    """A client torch AdamW with offload_optimizer: refused as ZeRO-3 refuses it, unless
    ``zero_force_ds_cpu_optimizer`` is false; then it steps on the host."""
    model = AwkwardLM(seed=0)
    cfg = offload_config("ragged", world_size, "optimizer_only", zero_force_ds_cpu_optimizer=force)
    del cfg["optimizer"]
    try:
        engine = _engine(rank, world_size, cfg, model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR))
    except Exception as e:  # noqa: BLE001 - DeepSpeed's own refusal, compared by the test
        return {"error": f"{type(e).__name__}: {e}"}
    x, y = rank_slice(make_batches(1, GLOBAL_BATCH)[0], rank, world_size)
    engine.backward(engine(x.chunk(ACCUM)[0], y.chunk(ACCUM)[0]))
    return {"optimizer": type(engine.basic_optimizer).__name__, "offloaded": _offloaded(engine)}


@pytest.mark.slow
@pytest.mark.parametrize("which", COMPARED)
def test_offload_config_matches_stage3(runs, which):
    """What the math guarantees (tests/numerics.py [Note: comparing runs that sum in another order]),
    with DeepSpeed's CPU Adam on both sides: the first loss bit for bit; the first step's reduced
    gradients (ZeRO-3 reduces each micro-batch, ragged their local sum once) within the bound of two
    summation orders; the weights within what STEPS Adam steps can move two runs apart."""
    ref, ours = runs[f"{which} 3"], runs[f"{which} ragged"]
    assert ours[0]["optimizer"] == ref[0]["optimizer"] == "DeepSpeedCPUAdam", (ours[0]["optimizer"], which)
    assert all(r["offloaded"] == ["cpu"] for r in ours), (which, [r["offloaded"] for r in ours])
    assert ours[0]["losses"][0] == ref[0]["losses"][0], (which, ours[0]["losses"], ref[0]["losses"])
    _assert_grads_within(ours[0]["grads"], ref[0]["grads"], ref[0]["local_sums"], 2, which)
    params = assemble([r["params"] for r in ours])
    assert set(params) == set(ref[0]["params"]), which
    for name, value in params.items():
        torch.testing.assert_close(value, ref[0]["params"][name], rtol=0, atol=adam_divergence_bound(LR, STEPS),
                                   msg=lambda m, name=name: f"{which} {name}: {m}")


@pytest.mark.slow
def test_bf16_offload_tracks_stage3_bf16(runs):
    """bf16 compute on both sides, fp32 masters on the host stepped by CPU Adam. Stated tolerance as
    test_deepspeed's bf16 tests: losses within 1e-2 relative, parameters within 1e-3 on average (both
    compute in bf16, unit roundoff 2^-8, rounding in different places: ZeRO-3 keeps bf16 parameters
    and gradient buckets, ragged reduces in fp32)."""
    ref, ours = runs["hf_zero3 bf16 3"], runs["hf_zero3 bf16 ragged"]
    assert ours[0]["optimizer"] == ref[0]["optimizer"] == "DeepSpeedCPUAdam"
    assert all(r["offloaded"] == ["cpu"] for r in ours), [r["offloaded"] for r in ours]
    assert ours[0]["losses"] == pytest.approx(ref[0]["losses"], rel=1e-2)
    params = assemble([r["params"] for r in ours])
    diffs = torch.cat([(params[n].float() - ref[0]["params"][n].float()).abs().flatten() for n in params])
    assert diffs.mean().item() <= 1e-3, diffs.mean().item()


@pytest.mark.slow
def test_model_sharded_before_initialize_agrees_with_the_config(runs):
    for case, sharded, config in (("presharded offloaded", "with offload_policy=CPUOffloadPolicy(...)",
                                   "has no offload_optimizer"),
                                  ("presharded plain", "without offload_policy", "sets offload_optimizer")):
        for message in runs[case]:
            assert f"fully_shard {sharded} and the config {config}: make them agree" in (message or ""), (
                case, message)


@pytest.mark.slow
def test_offload_is_cpu_adam_on_the_same_shards(runs):
    """Ragged with offload_optimizer equals ragged without offload stepping a client DeepSpeedCPUAdam
    bit for bit: the same kernel on the same shards in the same reduction order; offload moves the
    shards, never their values."""
    ours, twin = runs["optimizer_only ragged"], runs["client cpu adam"]
    assert all(r["offloaded"] == ["None"] for r in twin), [r["offloaded"] for r in twin]
    got, want = assemble([r["params"] for r in ours]), assemble([r["params"] for r in twin])
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.slow
def test_client_optimizer_with_offload(runs):
    forced, allowed = runs["client adamw forced"], runs["client adamw allowed"]
    for r in forced:
        assert r["error"].startswith("ZeRORuntimeException: You are using ZeRO-Offload with a client provided "
                                     "optimizer"), r
    assert all(r == {"optimizer": "AdamW", "offloaded": ["cpu"]} for r in allowed), allowed


# ---- config: keys that do not apply, contradictions (no processes) ---------------------------


def _split(which=None, **section):
    _deepspeed()
    from vescale_zero.integrations.deepspeed import split_ragged_config

    cfg = offload_config("ragged", 2, which) if which else ds_config("ragged", 2)
    cfg["zero_optimization"].update(section)
    return split_ragged_config(cfg)


def test_ignored_and_refused_keys():
    """NVMe-only sub-keys with device cpu: one warning each, ignored (as ZeRO-3 ignores them there);
    the offload reaches DeepSpeed's stage-0 engine only as what its optimizer choice reads."""
    with pytest.warns(UserWarning) as caught:
        ds, options, _ = _split("deepspeed_docs")
    # only ours: DeepSpeed 0.16 warns of its own use of pydantic's deprecated model_fields on an instance
    said = sorted(str(w.message).split(" has no effect")[0] for w in caught if " has no effect" in str(w.message))
    assert said == ["zero_optimization.offload_optimizer.buffer_count", "zero_optimization.offload_optimizer.fast_init",
                    "zero_optimization.offload_optimizer.nvme_path", "zero_optimization.offload_param.buffer_count",
                    "zero_optimization.offload_param.buffer_size", "zero_optimization.offload_param.max_in_cpu",
                    "zero_optimization.offload_param.nvme_path"], said
    assert ds["zero_optimization"] == {"stage": 0, "offload_optimizer": {"device": "cpu"}}
    assert options.offload.device == "cpu" and options.offload.pin_memory is True
    assert _split("optimizer_only")[1].offload.pin_memory is False
    assert _split("legacy")[1].offload.device == "cpu"
    assert _split()[1].offload is None and _split()[0]["zero_optimization"] == {"stage": 0}
    assert _split(offload_optimizer={"device": "none"}, offload_param={"device": "none"})[1].offload is None

    def refused(section, *fragments):
        with pytest.raises(ValueError) as e:
            _split(**section)
        for f in fragments:
            assert f in str(e.value), (f, str(e.value))

    cpu = {"device": "cpu"}
    ds, options, _ = _split(offload_param=cpu)  # alone: the optimizer stays on the device (stage3_jobs)
    assert options.offload.optimizer is False and ds["zero_optimization"] == {"stage": 0}
    refused({"offload_optimizer": {"device": "cpu", "ratio": 0.3}}, "offload_optimizer.ratio 0.3",
            "remove ratio (or set 1.0)")
    refused({"offload_optimizer": {"device": "nvme"}}, "offload_optimizer: device 'nvme' needs nvme_path")
    pinned, unpinned = {"device": "cpu", "pin_memory": True}, {"device": "cpu", "pin_memory": False}
    refused({"offload_optimizer": pinned, "offload_param": unpinned},
            "offload_optimizer.pin_memory True and offload_param.pin_memory False disagree")
    nvme = {"device": "nvme", "nvme_path": "/local_nvme"}
    refused({"offload_optimizer": nvme, "offload_param": cpu}, "offload_param (device 'cpu') with offload_optimizer "
            "(device 'nvme') is not implemented", "remove offload_param")
    refused({"offload_param": nvme}, "offload_param (device 'nvme')", "set both devices to 'cpu'")
    ds, options, _ = _split(offload_optimizer=nvme)  # the optimizer state in files (test_deepspeed_nvme_offload)
    assert options.offload is None and options.optimizer_nvme.nvme_path == "/local_nvme"
    assert ds["zero_optimization"] == {"stage": 0}
    refused({"offload_optimizer": {"device": "disk"}}, "offload_optimizer.device 'disk'")  # DeepSpeed's own model


# ---- checkpoints ---------------------------------------------------------------------------


def _with_checkpoint(rank, world_size, ckpt, phase, which="hf_zero3", resume_which=None):
    """phase 'full': 6 steps straight; 'first': 3 steps then save; 'resume': load (into
    ``resume_which``'s config, default the same), 3 more."""
    cfg = offload_config("ragged", world_size, resume_which if phase == "resume" and resume_which else which)
    engine = _engine(rank, world_size, cfg, AwkwardLM(seed=0 if phase != "resume" else 99))
    batches = make_batches(6, GLOBAL_BATCH)
    loaded = None
    if phase == "resume":
        path, _ = engine.load_checkpoint(ckpt)
        assert path.endswith("global_step3") and engine.global_steps == 3, (path, engine.global_steps)
        batches = batches[3:]
        loaded = (local_pieces(engine.module), _moment_pieces(engine))
    elif phase == "first":
        batches = batches[:3]
    losses = _steps(engine, batches, rank, world_size)
    if phase == "first":
        engine.save_checkpoint(ckpt)
        loaded = (local_pieces(engine.module), _moment_pieces(engine))  # what was saved
    return {"losses": losses, "params": local_pieces(engine.module), "state": loaded,
            "optimizer": type(engine.basic_optimizer).__name__, "offloaded": _offloaded(engine)}




@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case of this file in two spawns: at 2 ranks every config at stage 3 and at ragged, the
    client optimizer cases, the saves (with offload and without) and their resumes at 2 ranks; at 3
    ranks the resume of the 2-rank offload save and its uninterrupted twin."""
    root = tmp_path_factory.mktemp("offload_ckpt")
    off, plain = str(root / "offload"), str(root / "plain")
    at2 = {f"{which} {stage}": (_train, (stage, which)) for which in COMPARED for stage in (3, "ragged")}
    at2.update({
        "hf_zero3 bf16 3": (_train, (3, "hf_zero3", STEPS, {"bf16": {"enabled": True}})),
        "hf_zero3 bf16 ragged": (_train, ("ragged", "hf_zero3", STEPS, {"bf16": {"enabled": True}})),
        "presharded offloaded": (_presharded, (False,)), "presharded plain": (_presharded, (True,)),
        "client cpu adam": (_train_client_cpu_adam, ()), "client adamw forced": (_client_optimizer, (True,)),
        "client adamw allowed": (_client_optimizer, (False,)),
        "full": (_with_checkpoint, (off, "full")), "first": (_with_checkpoint, (off, "first")),
        "resume": (_with_checkpoint, (off, "resume")),
        "resume without offload": (_with_checkpoint, (off, "resume", "hf_zero3", "none")),
        "plain first": (_with_checkpoint, (plain, "first", "none")),
        "plain full": (_with_checkpoint, (plain, "full", "none")),
        "plain resume with offload": (_with_checkpoint, (plain, "resume", "none", "hf_zero3"))})
    at3 = {"full at 3": (_with_checkpoint, (off, "full")), "resume at 3": (_with_checkpoint, (off, "resume"))}
    return {**run_cases_on_ranks(at2, 2, timeout=600), **run_cases_on_ranks(at3, 3, timeout=500)}


def _assert_loaded_as_saved(first, resumed, case):
    for part in (0, 1):  # weights, then Adam's moments
        saved, loaded = (assemble([r["state"][part] for r in run]) for run in (first, resumed))
        assert saved.keys() == loaded.keys() and saved, case
        for name in saved:
            assert torch.equal(loaded[name], saved[name]), (case, name)
    assert sum(1 for name in saved if name.endswith(" exp_avg")) >= 10, (case, sorted(saved))


@pytest.mark.slow
def test_resume_with_offload_equals_uninterrupted(runs):
    """The same ranks, weights, moments, step counts and data: the continuation runs the same
    operations on the same inputs as the uninterrupted run, so it is bit-exact."""
    full, first, resumed = (runs[k] for k in ("full", "first", "resume"))
    assert all(r["optimizer"] == "DeepSpeedCPUAdam" and r["offloaded"] == ["cpu"] for r in resumed), resumed[0]
    _assert_loaded_as_saved(first, resumed, "resume")
    assert resumed[0]["losses"] == full[0]["losses"][3:]
    want, got = assemble([r["params"] for r in full]), assemble([r["params"] for r in resumed])
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.slow
def test_resume_at_another_world_size(runs):
    """Saved at 2 ranks, resumed at 3: what was saved is what was loaded, bit for bit; the
    uninterrupted 3-rank run summed every gradient in another order for the first 3 steps, so the
    weights agree within what 6 Adam steps can move two runs apart."""
    first, resumed, full = runs["first"], runs["resume at 3"], runs["full at 3"]
    _assert_loaded_as_saved(first, resumed, "resume at 3")
    want, got = assemble([r["params"] for r in full]), assemble([r["params"] for r in resumed])
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=adam_divergence_bound(LR, 6),
                                   msg=lambda m, name=name: f"resume at 3, {name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("case, uninterrupted, first", [
    ("resume without offload", "full", "first"), ("plain resume with offload", "plain full", "plain first")])
def test_resume_across_offload(runs, case, uninterrupted, first):
    """An offload checkpoint (DeepSpeedCPUAdam's state: local pieces, an int step) resumes without
    offload (torch's AdamW: ragged state, a tensor step), and the reverse: loaded bit for bit, then
    3 steps of another Adam kernel from the same state, within what 3 Adam steps can move two runs
    apart."""
    resumed = runs[case]
    want_optimizer = "AdamW" if case == "resume without offload" else "DeepSpeedCPUAdam"
    assert all(r["optimizer"] == want_optimizer for r in resumed), (case, resumed[0]["optimizer"])
    _assert_loaded_as_saved(runs[first], resumed, case)
    want = assemble([r["params"] for r in runs[uninterrupted]])
    got = assemble([r["params"] for r in resumed])
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=adam_divergence_bound(LR, 3),
                                   msg=lambda m, name=name: f"{case}, {name}: {m}")
