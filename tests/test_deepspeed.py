"""DeepSpeed with ``"stage": "ragged"`` trains exactly like DeepSpeed ZeRO-3 (gloo, CPU)."""

from __future__ import annotations

import os
import pathlib
import re
from typing import Dict

import pytest
import torch

pytest.importorskip("deepspeed")  # the [test] extra installs it; without it these tests cannot run

from tests.device_guard import strict_collectives  # noqa: E402
from tests.distributed import run_cases_on_ranks, run_on_ranks  # noqa: E402
from tests.models import AwkwardLM, assemble, local_pieces, make_batches, rank_slice  # noqa: E402
from tests.numerics import (  # noqa: E402
    adam_divergence_bound,
    assert_reduced_like,
    grad_pieces,
    local_reference,
    reduction_order_bound,
)

STEPS, GLOBAL_BATCH, ACCUM = 10, 12, 2


def ds_config(stage, world_size, **extra):
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // (world_size * ACCUM),
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    cfg.update(extra)
    return cfg


def _deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skip a 40 s JIT build on CPU
    import vescale_zero.integrations.deepspeed  # noqa: F401  (registers stage "ragged")

    return deepspeed


def _train_steps(engine, batches, rank, world_size, grads_of=None):
    """ACCUM micro-batches per global batch through the engine; the last micro-loss of each.
    With ``grads_of`` (the engine's stage): ``(losses, the first step's full reduced gradients)``."""
    losses, grads = [], None
    for step, batch in enumerate(batches):
        x, y = rank_slice(batch, rank, world_size)
        for i in range(ACCUM):
            loss = engine(x.chunk(ACCUM)[i], y.chunk(ACCUM)[i])
            engine.backward(loss)
            if grads_of is not None and step == 0 and i == ACCUM - 1:
                grads = _first_step_grads(engine, grads_of)
            engine.step()
        losses.append(loss.item())
    return losses if grads_of is None else (losses, grads)


def _assert_grads_within(grads, ref_grads, sums, world_size, case=""):
    """Two engines' first-step reduced gradients: means of the same world_size * ACCUM per-rank
    micro-batch gradients (``sums``: their magnitudes, :func:`_local_grad_magnitudes`) summed in
    two orders: within reduction_order_bound (tests/numerics.py)."""
    assert grads.keys() <= ref_grads.keys() and len(grads) >= 10, (case, sorted(grads))
    for name, value in grads.items():
        excess = (value - ref_grads[name]).abs() - reduction_order_bound(sums[name], world_size, ACCUM)
        assert excess.max() <= 0, f"{case} {name}: gradient {excess.max().item():.3e} past the summation-order bound"


def _full_params(engine, stage):
    if stage == "ragged":
        return local_pieces(engine.module)
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _first_step_grads(engine, stage):
    """The full reduced gradients of the step about to be taken (after the boundary backward)."""
    if stage == "ragged":
        from tests.test_optim_8bit import _full_grads

        return _full_grads(engine.module)
    from deepspeed.utils import safe_get_full_grad

    grads = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
    return {n: g.detach().clone() for n, g in grads.items() if g is not None}


def _local_grad_magnitudes(rank, world_size):
    """sum over ranks and micro-batches of |a_rk|, a_rk = the gradient of micro-batch k's loss / ACCUM
    on rank r at the initial weights (what DeepSpeed's backward scales it by): the terms of the
    first step's reduced gradients, by the unsharded model."""
    model = AwkwardLM(seed=0)
    x, y = rank_slice(make_batches(STEPS, GLOBAL_BATCH)[0], rank, world_size)
    sums = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for i in range(ACCUM):
        model.zero_grad()
        (model(x.chunk(ACCUM)[i], y.chunk(ACCUM)[i]) / ACCUM).backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                sums[n] += p.grad.abs()
    for total in sums.values():
        torch.distributed.all_reduce(total)
    return sums


def _train(rank, world_size, stage, extra):
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed = _deepspeed()
    extra = dict(extra)
    first_grads = extra.pop("first_grads", False)  # also return the first step's reduced gradients
    engine, *_ = deepspeed.initialize(model=AwkwardLM(seed=0), config=ds_config(stage, world_size, **extra))
    losses, grads = train_steps(engine, stage, rank, world_size, STEPS, first_grads=first_grads)
    out = {"losses": losses, "params": _full_params(engine, stage), "steps": engine.global_steps,
           "optimizer": type(engine.basic_optimizer).__name__}
    if first_grads:
        out["grads"] = grads
        out["local_sums"] = _local_grad_magnitudes(rank, world_size)
    return out


def train_steps(engine, stage, rank, world_size, steps, *, first_grads=False):
    """``steps`` engine steps of ACCUM micro-batches each: ``(the mean loss of every step over
    all ranks, the first step's reduced gradients if first_grads else None)``."""
    losses, grads = [], None
    for step, batch in enumerate(make_batches(steps, GLOBAL_BATCH)):
        x, y = rank_slice(batch, rank, world_size)
        total = torch.zeros(())
        for i in range(ACCUM):
            loss = engine(x.chunk(ACCUM)[i], y.chunk(ACCUM)[i])
            engine.backward(loss)
            if first_grads and step == 0 and i == ACCUM - 1:
                grads = _first_step_grads(engine, stage)
            engine.step()
            total += loss.detach().float() / ACCUM
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.AVG)
        losses.append(total.item())
    return losses, grads


def run(world_size, stage, *, optimizer_class=None, **extra):
    """Train STEPS steps on ``world_size`` ranks: ``(losses, full parameters)``; with
    ``optimizer_class``, check that every rank stepped that optimizer class."""
    return _joined(run_on_ranks(_train, world_size, stage, extra, timeout=400), stage, optimizer_class)


def run_both(world_size, **extra):
    """:func:`run` of ZeRO stage 3 and of "ragged", in one spawn: ``((losses, params) of
    stage 3, (losses, params) of ragged)``."""
    runs = run_cases_on_ranks({f"{stage} at {world_size} ranks": (_train, (stage, extra)) for stage in (3, "ragged")},
                              world_size, timeout=600)
    return tuple(_joined(results, stage, None, case) for stage, (case, results) in zip((3, "ragged"), runs.items()))


def _joined(results, stage, optimizer_class, case=""):
    assert all(r["steps"] == STEPS for r in results), case
    assert optimizer_class is None or all(r["optimizer"] == optimizer_class for r in results), (
        case, results[0]["optimizer"])
    params = assemble([r["params"] for r in results]) if stage == "ragged" else results[0]["params"]
    return results[0]["losses"], params


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_ragged_matches_stage3_fp32(world_size):
    """What the math guarantees (tests/numerics.py [Note: comparing runs that sum in another order]):
    the same first loss; the first step's reduced gradients within the bound of two
    summation orders of the world_size * ACCUM per-rank micro-batch gradients (ZeRO-3 reduces
    each micro-batch, we reduce their local sum once); the trained weights within what STEPS
    AdamW steps can move two runs apart."""
    runs = run_cases_on_ranks({f"{stage} at {world_size} ranks": (_train, (stage, {"first_grads": True}))
                               for stage in (3, "ragged")}, world_size, timeout=600)
    ref, ours = runs.values()
    assert ours[0]["losses"][0] == ref[0]["losses"][0]
    grads, ref_grads, sums = ours[0]["grads"], ref[0]["grads"], ref[0]["local_sums"]
    assert grads.keys() <= ref_grads.keys() and len(grads) >= 10, sorted(grads)
    for name, value in grads.items():
        excess = (value - ref_grads[name]).abs() - reduction_order_bound(sums[name], world_size, ACCUM)
        assert excess.max() <= 0, f"{name}: gradient {excess.max().item():.3e} past the summation-order bound"
    params = assemble([r["params"] for r in ours])
    assert set(params) == set(ref[0]["params"])
    for name, value in params.items():
        torch.testing.assert_close(value, ref[0]["params"][name], rtol=0, atol=adam_divergence_bound(1e-2, STEPS),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_bf16_tracks_stage3_bf16():
    """bf16 compute on both sides. Stated tolerance as in test_fully_shard's bf16 test:
    losses within 1e-2 relative, parameters within 1e-3 on average."""
    (ref_losses, ref_params), (losses, params) = run_both(2, bf16={"enabled": True})
    assert losses == pytest.approx(ref_losses, rel=1e-2)
    diffs = torch.cat([(params[n].float() - ref_params[n].float()).abs().flatten() for n in params])
    assert diffs.mean().item() <= 1e-3


@pytest.mark.slow
def test_bf16_with_deepspeeds_own_adam_tracks_stage3():
    """The optimizer DeepSpeed users get by default: a config AdamW without ``torch_adam``,
    i.e. DeepSpeed's FusedAdam (on this CPU accelerator its own C++ kernel, built on first
    use), which writes the fp32 master through its kernel, not through torch ops. Same
    optimizer and config on both sides, 2 ranks, 10 steps, bf16.

    Tolerance as test_bf16_tracks_stage3_bf16: losses within 1e-2 relative, parameters within
    1e-3 mean absolute difference. Both sides compute in bf16 (unit roundoff 2^-8 = 3.9e-3)
    but round in different places (ZeRO-3 keeps bf16 parameters and gradient buckets, we
    reduce in fp32), so gradients differ at bf16 level, and Adam's normalised step turns a
    small gradient difference into up to lr = 1e-2 per step for a near-zero component:
    single parameters may move apart by ~2e-2, the mean stays small. Measured with torch's
    AdamW on both sides: losses 1.3e-3, parameters 6.9e-4 mean (2.1e-2 max). Stale bf16
    compute weights (the master changed, the compute copy not) show as losses that stop
    falling: 0.51 relative, parameters 1.6e-2 mean."""
    adam = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": False}}
    ref_losses, ref_params = run(2, 3, optimizer_class="FusedAdam", bf16={"enabled": True}, optimizer=adam)
    losses, params = run(2, "ragged", optimizer_class="FusedAdam", bf16={"enabled": True}, optimizer=adam)
    assert losses == pytest.approx(ref_losses, rel=1e-2)
    diffs = torch.cat([(params[n].float() - ref_params[n].float()).abs().flatten() for n in params])
    assert diffs.mean().item() <= 1e-3


def _fp16_overflow_on_one_rank(rank, world_size):
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed = _deepspeed()
    from vescale_zero.api.fully_shard import groups_of

    cfg = ds_config("ragged", world_size, fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})
    engine, *_ = deepspeed.initialize(model=AwkwardLM(seed=0), config=cfg)
    check = engine._unscale_and_check_overflow

    def strict_check(scale):  # its all-reduce on the model's device (tests/device_guard.py)
        with strict_collectives(groups_of(engine.module)[0].device):
            return check(scale)

    engine._unscale_and_check_overflow = strict_check
    scales, skipped, changed = [], [], []
    for step, batch in enumerate(make_batches(4, GLOBAL_BATCH)):
        x, y = rank_slice(batch, rank, world_size)
        before = {n: t[3].clone() for n, t in local_pieces(engine.module).items()}
        for i in range(ACCUM):
            engine.backward(engine(x.chunk(ACCUM)[i], y.chunk(ACCUM)[i]))
            if step == 2 and i == ACCUM - 1 and rank == 0:
                groups_of(engine.module)[0].sharded_grad.local[0] = float("inf")  # only rank 0 overflows
            scales.append(engine.loss_scale)
            engine.step()
        after = {n: t[3] for n, t in local_pieces(engine.module).items()}
        changed.append(any(not torch.equal(before[n], after[n]) for n in after if after[n].numel()))
        skipped.append(engine.skipped_steps)
    return {"skipped": skipped, "changed": changed, "scales": scales}


def test_fp16_overflow_on_one_shard_skips_the_step_everywhere():
    results = run_on_ranks(_fp16_overflow_on_one_rank, 2, timeout=400)
    for r in results:
        assert r["skipped"] == [0, 0, 1, 1], r  # step 2 skipped, on both ranks
        assert r["changed"][2] is False and r["changed"][3] is True, r
        assert r["scales"][-1] == r["scales"][0] / 2, r  # the scaler backed off once
    assert results[0]["scales"] == results[1]["scales"]


def _client_optimizer(rank, world_size, stage):
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed = _deepspeed()
    model = AwkwardLM(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    cfg = ds_config(stage, world_size)
    del cfg["optimizer"]
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                                   model_parameters=model.parameters(), config=cfg)
    losses, grads = _train_steps(engine, make_batches(5, GLOBAL_BATCH), rank, world_size, grads_of=stage)
    return {"losses": losses, "lr": scheduler.get_last_lr(), "params": _full_params(engine, stage), "grads": grads,
            "local_sums": _local_grad_magnitudes(rank, world_size)}  # the same first batch as make_batches(STEPS)


def test_client_optimizer_and_scheduler():
    both = run_cases_on_ranks({"stage 3": (_client_optimizer, (3,)), "ragged": (_client_optimizer, ("ragged",))}, 2,
                              timeout=400)
    ref, ours = both["stage 3"], both["ragged"]
    assert ours[0]["lr"] == ref[0]["lr"]
    # As test_ragged_matches_stage3_fp32 (tests/numerics.py
    # [Note: comparing runs that sum in another order]): the first loss bit for bit, the first
    # step's reduced gradients within the summation-order bound, the weights within what 5 AdamW
    # steps at lr <= 1e-2 (the schedule only lowers it) can move two runs apart.
    assert ours[0]["losses"][0] == ref[0]["losses"][0], (ours[0]["losses"], ref[0]["losses"])
    _assert_grads_within(ours[0]["grads"], ref[0]["grads"], ref[0]["local_sums"], 2, "client optimizer")
    params = assemble([r["params"] for r in ours])
    for name, value in params.items():
        torch.testing.assert_close(value, ref[0]["params"][name], rtol=0, atol=adam_divergence_bound(1e-2, 5))


# ---- config errors (no processes needed) ------------------------------------------------


def test_config_keys_mapped_noted_and_rejected():
    _deepspeed()
    from vescale_zero.integrations.deepspeed import split_ragged_config

    cfg = ds_config("ragged", 2)
    cfg["zero_optimization"].update(overlap_comm=False, reduce_bucket_size=5e8, granularity="row",
                                    stage3_param_persistence_threshold=1e4, contiguous_gradients=True)
    cfg["bf16"] = {"enabled": True}
    with pytest.warns(UserWarning, match="reduce_bucket_size has no effect"):
        ds, options, precision = split_ragged_config(cfg)
    assert ds["zero_optimization"] == {"stage": 0} and "bf16" not in ds
    assert options.prefetch is False and options.granularity == "row"
    assert precision.dtype == torch.bfloat16

    def error(section, *fragments):
        bad = ds_config("ragged", 2)
        bad["zero_optimization"].update(section)
        with pytest.raises(ValueError) as e:
            split_ragged_config(bad)
        for f in fragments:
            assert f in str(e.value), (f, str(e.value))

    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    error({"stage4_magic": 1}, "unknown key 'stage4_magic'", "Our keys:", "granularity", "overlap_comm")
    error({"zero_hpz_partition_size": 2, "reshard_after_forward": False}, "reshard_after_forward False and "
          "zero_hpz_partition_size 2 disagree")
    error({"zero_quantized_gradients": True}, "zero_quantized_gradients (ZeRO++ qgZ", "remove it")
    error({"zero_quantized_nontrainable_weights": True}, "zero_quantized_nontrainable_weights", "remove it")
    for section, read in [({"offload_param": {"device": "cpu"}}, lambda o: o.offload.optimizer is False),
                          ({"reduce_scatter": False}, lambda o: o.reduce_scatter is False),
                          ({"stage3_prefetch_bucket_size": 0, "overlap_comm": True}, lambda o: o.prefetch is False),
                          ({"zero_quantized_weights": True}, lambda o: o.fp8_all_gather_tile == 128),
                          ({"zero_quantized_weights": True, "fp8_all_gather_tile": 4},
                           lambda o: o.fp8_all_gather_tile == 4)] + (
            [({"enable_sanity_checks": "true"}, lambda o: o.zero_init == {"enable_sanity_checks": True})]
            if "enable_sanity_checks" in DeepSpeedZeroConfig.model_fields else []):  # a ZeRO-3 key of newer releases
        cfg = ds_config("ragged", 2)
        cfg["zero_optimization"].update(section)
        assert read(split_ragged_config(cfg)[1]), section
    error({"shard_group_size": 2, "mics_shard_size": 4}, "shard_group_size 2 and mics_shard_size 4 disagree")
    error({"mics_shard_size": 0}, "mics_shard_size 0 is not a group size")
    error({"shard_group_size": 0}, "shard_group_size")
    error({"reshard_after_forward": "sometimes"}, "reshard_after_forward")
    error({"fp8_all_gather_tile": 0}, "fp8_all_gather_tile")
    for section, size in [({"shard_group_size": 2}, 2), ({"mics_shard_size": 2}, 2), ({"mics_shard_size": -1}, None),
                          ({"shard_group_size": 2, "mics_shard_size": 2}, 2), ({"zero_hpz_partition_size": 1}, None)]:
        cfg = ds_config("ragged", 2)
        cfg["zero_optimization"].update(section)
        assert split_ragged_config(cfg)[1].shard_group_size == size, section
    static = split_ragged_config(ds_config("ragged", 2, fp16={"enabled": True, "loss_scale": 128}))[2]
    assert static.fp16.loss_scale == 128


# ---- checkpoints ---------------------------------------------------------------------------


def _train_with_checkpoint(rank, world_size, ckpt_dir, phase):
    """phase 'full': 6 steps straight; 'first': 3 steps then save; 'resume': load, 3 more."""
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed = _deepspeed()
    model = AwkwardLM(seed=0 if phase != "resume" else 99)  # resume must not depend on the init
    engine, *_ = deepspeed.initialize(model=model, config=ds_config("ragged", world_size))
    batches = make_batches(6, GLOBAL_BATCH)
    if phase == "resume":
        with strict_collectives(next(engine.module.parameters()).device):  # see tests/device_guard.py
            path, client = engine.load_checkpoint(ckpt_dir)
        assert client == {"epoch": 7} and path.endswith("global_step3"), (path, client)
        assert engine.global_steps == 3
        batches = batches[3:]
    elif phase == "first":
        batches = batches[:3]
    loaded = (local_pieces(engine.module), _moment_pieces(engine)) if phase == "resume" else None
    losses = _train_steps(engine, batches, rank, world_size)
    if phase == "first":
        engine.save_checkpoint(ckpt_dir, client_state={"epoch": 7})
        loaded = (local_pieces(engine.module), _moment_pieces(engine))  # what was saved
    return {"losses": losses, "params": local_pieces(engine.module), "state": loaded}


def _moment_pieces(engine):
    """The ragged engine's AdamW moments, ``{"<param> <moment>": (shape, start, end, local piece)}``."""
    import vescale_zero as vz

    out = {}
    for name, (shape, start, end, _) in local_pieces(engine.module).items():
        module_name, _, leaf = name.rpartition(".")
        param = getattr(engine.module.get_submodule(module_name), leaf)
        for key, value in engine.optimizer.state.get(param, {}).items():
            if key in ("exp_avg", "exp_avg_sq"):
                out[f"{name} {key}"] = (shape, start, end, vz.local_piece(value).detach().clone())
    return out


SAVE_LOAD_CASES = [(2, 2), (2, 3)]


@pytest.mark.slow
@pytest.mark.parametrize("save_ranks,load_ranks", SAVE_LOAD_CASES)
def test_save_load_continue_matches_uninterrupted(checkpoint_runs, save_ranks, load_ranks):
    case = f"save {save_ranks} load {load_ranks}"
    full, resumed = checkpoint_runs[f"{case} full"], checkpoint_runs[f"{case} resume"]
    first = checkpoint_runs[f"{case} first"]
    assert checkpoint_runs.latest[case] == "global_step3", case  # as "first" left it
    # what was saved (at save_ranks) is what was loaded (at load_ranks): weights and moments, bit for bit
    for part in (0, 1):
        saved, loaded = (assemble([r["state"][part] for r in run]) for run in (first, resumed))
        assert saved.keys() == loaded.keys() and saved, case
        for name in saved:
            assert torch.equal(loaded[name], saved[name]), (case, name)
    assert sum(1 for name in saved if name.endswith(" exp_avg")) >= 10, (case, sorted(saved))
    want, got = assemble([r["params"] for r in full]), assemble([r["params"] for r in resumed])
    if save_ranks == load_ranks:
        # the same ranks, weights, moments, step counts and data: the continuation runs the same
        # operations on the same inputs as the uninterrupted run, so it is bit-exact
        assert resumed[0]["losses"] == full[0]["losses"][3:], case
        for name in want:
            assert torch.equal(got[name], want[name]), (case, name)
        return
    # at other ranks the uninterrupted run summed every gradient in another order (3 ranks, not 2,
    # for the first 3 steps): nothing bit-exact after the first step
    # (tests/numerics.py [Note: comparing runs that sum in another order]); within what 6 AdamW
    # steps can move two runs apart
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=adam_divergence_bound(1e-2, 6),
                                   msg=lambda m, name=name: f"{case}, {name}: {m}")


# ---- pipeline parallelism ------------------------------------------------------------------


def _pipeline(rank, world_size, stage):
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed = _deepspeed()
    from deepspeed.pipe import PipelineModule
    from torch import nn

    deepspeed.init_distributed(dist_backend="gloo")  # PipelineModule needs DeepSpeed's comm up
    torch.manual_seed(0)
    layers = [nn.Linear(13, 29), nn.GELU(), nn.Linear(29, 31), nn.GELU(), nn.Linear(31, 29), nn.GELU(),
              nn.Linear(29, 7)]
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform")
    cfg = {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
           "gradient_clipping": 0.0, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True}},
           "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(engine.grid.data_parallel_id)
    data = [(torch.randn(3, 13, generator=g), torch.randn(3, 7, generator=g)) for _ in range(2 * 4)]
    it = iter(data)
    grads, step = [], engine.optimizer.step

    def first_grads_then_step(*args, **kwargs):  # this stage's reduced gradients of the first step
        if not grads:
            grads.append(grad_pieces(engine.module) if stage == "ragged" else {
                n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    engine.optimizer.step = first_grads_then_step
    losses = [engine.train_batch(data_iter=it).item() for _ in range(4)]
    pieces = local_pieces(engine.module) if stage == "ragged" else {
        n: p.detach().clone() for n, p in engine.module.named_parameters()}
    # the whole model unsharded, unpiped, on this data-parallel rank's first 2 micro-batches: the terms
    # every stage's first reduced gradients sum (the same layers, weights and ops per micro-batch)
    torch.manual_seed(0)
    whole = _PipedLoss(*[nn.Linear(13, 29), nn.GELU(), nn.Linear(29, 31), nn.GELU(), nn.Linear(31, 29), nn.GELU(),
                         nn.Linear(29, 7)])
    reference = local_reference(whole, data[:2], group=engine.grid.get_data_parallel_group())
    return {"losses": losses, "stage_id": engine.stage_id, "params": pieces, "grads": grads[0],
            "reference": reference}


class _PipedLoss(torch.nn.Sequential):
    """The pipeline's layers in one module, with its loss: ``forward(x, y)``."""

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(super().forward(x), y)


@pytest.mark.slow
def test_pipeline_2_stages_x_2_way_matches_stage0_pipeline():
    """Ragged under DeepSpeed's pipeline engine (each stage's parameters sharded over its
    data-parallel group of 2) vs stage 0 pipelines. What the math guarantees (tests/numerics.py
    [Note: comparing runs that sum in another order]): the first loss bit for bit (the same
    weights, data and ops, reduced by the same pipeline code); the first step's reduced
    gradients, means of the same 2 ranks x 2 micro-batches terms (stage 0 reduces their local
    sum once, we reduce each micro-batch: the pipeline does not mark the last one), within the
    summation-order bound; the weights within what 4 AdamW steps can move two runs apart."""
    both = run_cases_on_ranks({"stage 0": (_pipeline, (0,)), "ragged": (_pipeline, ("ragged",))}, 4, timeout=500)
    ref, ours = both["stage 0"], both["ragged"]
    for r, o in zip(ref, ours):
        assert o["losses"][0] == r["losses"][0], (o["losses"], r["losses"])
    for stage_id in (0, 1):
        got = assemble([o["params"] for o in ours if o["stage_id"] == stage_id])
        rank = next(i for i, r in enumerate(ref) if r["stage_id"] == stage_id)
        want = ref[rank]["params"]
        assert set(got) == set(want) and got
        grads = assemble([o["grads"] for o in ours if o["stage_id"] == stage_id])
        reference = ref[rank]["reference"]
        assert_reduced_like(grads, dict(reference, mean=ref[rank]["grads"]), 2, 2, f"stage {stage_id}")
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=adam_divergence_bound(1e-2, 4))


def _structured_from_config(rank, world_size, via, name):
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed = _deepspeed()
    import vescale_zero as vz
    from vescale_zero import optim

    cls = getattr(optim, name)
    batches = make_batches(3, GLOBAL_BATCH)
    if via == "deepspeed":
        cfg = ds_config("ragged", world_size)
        cfg["optimizer"] = {"type": name, "params": {"lr": 1e-2, "weight_decay": 0.1, **BLOCKS[name]}}
        engine, *_ = deepspeed.initialize(model=AwkwardLM(seed=0), config=cfg)
        assert isinstance(engine.optimizer, cls)
        _train_steps(engine, batches, rank, world_size)
        model = engine.module
    else:  # the same by hand: shard by the optimizer's blocks, accumulate, clip, step
        model = AwkwardLM(seed=0)
        vz.fully_shard_layers(model, granularity=cls.granularity(13) if BLOCKS[name] else None)
        opt = cls(model.parameters(), lr=1e-2, weight_decay=0.1, **BLOCKS[name])
        for batch in batches:
            x, y = rank_slice(batch, rank, world_size)
            for i in range(ACCUM):
                model.set_requires_gradient_sync(i == ACCUM - 1)
                (model(x.chunk(ACCUM)[i], y.chunk(ACCUM)[i]) / ACCUM).backward()
            vz.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
    # the planner kept the optimizer's blocks whole: every piece starts on a block boundary
    misaligned = (sum(p.sharded_range.start % 13 for p in model.parameters() if p.to_local().numel())
                  if BLOCKS[name] else 0)
    return {"misaligned": misaligned, "params": local_pieces(model)}


BLOCKS = {"AdamW8bit": {"block": 13}, "Shampoo": {"block": 13}, "Muon": {}}  # Muon needs no granularity


@pytest.fixture(scope="module")
def structured_runs():
    """Every run of the test below, for every optimizer, in one spawn of 3 ranks (instead
    of 6): ``{"<name> <via>": per-rank results}``; a run that fails names its case."""
    return run_cases_on_ranks({f"{name} {via}": (_structured_from_config, (via, name))
                               for name in sorted(BLOCKS) for via in ("deepspeed", "direct")}, 3, timeout=500)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_config_structured_optimizer_shards_by_its_blocks(structured_runs, name):
    via_ds, by_hand = structured_runs[f"{name} deepspeed"], structured_runs[f"{name} direct"]
    assert all(r["misaligned"] == 0 for r in via_ds), name
    # The same computation on both sides, so the same bits: the engine shards with
    # fully_shard_layers at the optimizer's granularity as the hand-written loop does (the same
    # groups and pieces, hence the same reduce-scatters in the same order), scales each
    # micro-batch's loss by 1 / ACCUM with the same division, syncs at the same micro-batch,
    # clips with the same vz.clip_grad_norm_ and steps the same optimizer on the same shards.
    got, want = assemble([r["params"] for r in via_ds]), assemble([r["params"] for r in by_hand])
    assert got.keys() == want.keys(), name
    for key in want:
        assert torch.equal(got[key], want[key]), (name, key, (got[key] - want[key]).abs().max().item())


# ---- migrating DeepSpeed checkpoints ---------------------------------------------------------


def _zero_then_ragged(rank, world_size, ckpt_dir, stage, phase):
    """'zero': 3 steps under ZeRO ``stage``, save, 3 more; 'ragged': load that checkpoint
    (weights and Adam state) into "ragged" and run the same 3 more steps."""
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed = _deepspeed()
    batches = make_batches(6, GLOBAL_BATCH)
    if phase == "zero":
        engine, *_ = deepspeed.initialize(model=AwkwardLM(seed=0), config=ds_config(stage, world_size))
        _train_steps(engine, batches[:3], rank, world_size)
        engine.save_checkpoint(ckpt_dir, client_state={"epoch": 2})
        saved = _full_params(engine, stage)
        from deepspeed.utils import safe_get_full_optimizer_state

        moments = {f"{n} {key}": safe_get_full_optimizer_state(p, key)  # None where ZeRO 1/2 in fp32
                   for n, p in engine.module.named_parameters() for key in ("exp_avg", "exp_avg_sq")}  # keep no map
        moments = {key: value.detach().clone() for key, value in moments.items() if value is not None}
        losses = _train_steps(engine, batches[3:], rank, world_size)
        return {"saved": saved, "moments": moments, "params": _full_params(engine, stage), "losses": losses}
    engine, *_ = deepspeed.initialize(model=AwkwardLM(seed=99), config=ds_config("ragged", world_size))
    refused = None
    path, client = engine.load_checkpoint(ckpt_dir)
    loaded = local_pieces(engine.module)
    moments = sum(1 for state in engine.optimizer.state.values() if "exp_avg" in state)
    loaded_moments = _moment_pieces(engine)
    adam_steps = sorted({float(state["step"]) for state in engine.optimizer.state.values() if "step" in state})
    losses = _train_steps(engine, batches[3:], rank, world_size)
    return {"loaded": loaded, "params": local_pieces(engine.module), "losses": losses, "client": client,
            "steps": engine.global_steps, "moments": moments, "refused": refused, "loaded_moments": loaded_moments,
            "adam_steps": adam_steps}


ZERO_STAGES = [1, 2, 3]


@pytest.mark.slow
@pytest.mark.parametrize("stage", ZERO_STAGES)
def test_zero_checkpoint_migrates_to_ragged_and_training_continues(checkpoint_runs, stage):
    """A ZeRO checkpoint written by 2 ranks loads into "ragged" on 3: the same fp32 weights
    (exactly), counters and client state, and Adam's moments and step (through DeepSpeed's
    universal conversion; stage 3's writes no step.pt, the step comes from its
    optimizer_state.pt): Adam's moments bit for bit as ZeRO saved them, and the next 3 steps
    within what AdamW can move two runs apart of ZeRO's own continuation (another world size
    sums in another order). The engine converts with
    the code of ``vescale-zero convert --from deepspeed``: the offline result is the same."""
    case = f"zero stage {stage}"
    tmp_path = checkpoint_runs.paths[case]
    zero, ours = checkpoint_runs[f"{case} zero"], checkpoint_runs[f"{case} ragged"]
    saved, loaded = zero[0]["saved"], assemble([r["loaded"] for r in ours])
    assert set(loaded) == set(saved), case
    for name in saved:
        assert torch.equal(loaded[name], saved[name].float()), (case, name)
    for r in ours:
        assert r["client"] == {"epoch": 2} and r["steps"] == 6, (case, r["client"])
    assert sum(r["moments"] for r in ours) > 0 and not any(r["refused"] for r in ours), case
    from vescale_zero import checkpoint
    from vescale_zero.tools.cli import main

    assert main(["convert", "--from", "deepspeed", str(tmp_path), str(tmp_path / "offline")]) == 0
    engine_side, offline = (checkpoint.consolidate(str(p), with_optimizer=True)
                            for p in (tmp_path / "global_step3_vescale", tmp_path / "offline"))
    assert engine_side.keys() == offline.keys() and all(torch.equal(engine_side[k], offline[k]) for k in offline), case
    # Adam's moments and step as ZeRO left them, bit for bit: the continuation then starts from
    # the same state; it runs at 3 ranks, ZeRO's at 2, so each gradient is summed in another
    # order and the weights are compared by what AdamW's steps 4-6 can move two runs apart
    # (tests/numerics.py [Note: comparing runs that sum in another order]).
    moments = assemble([r["loaded_moments"] for r in ours])
    if stage == 3:  # safe_get_full_optimizer_state reads stage 3's; stage 1/2 keep no per-parameter map in fp32
        assert moments.keys() == zero[0]["moments"].keys(), (case, sorted(moments))
    for key, value in zero[0]["moments"].items():
        assert torch.equal(moments[key], value.float().view_as(moments[key])), (case, key)
    assert all(r["adam_steps"] == [3.0] for r in ours), (case, [r["adam_steps"] for r in ours])
    bound = adam_divergence_bound(1e-2, 6) - adam_divergence_bound(1e-2, 3)  # 2 lr sum_{t=4..6} adam_step_bound(t)
    got, want = assemble([r["params"] for r in ours]), zero[0]["params"]
    for name in want:
        torch.testing.assert_close(got[name], want[name].float(), rtol=0, atol=bound,
                                   msg=lambda m, name=name: f"{case}, {name}: {m}")


def test_fp8_all_gather_key_trains_like_the_plain_gather():
    """``"fp8_all_gather_tile": 4`` in the ragged section: the engine gathers float8 tiles and
    the losses follow the plain ragged run to 1%."""
    runs = run_cases_on_ranks({"plain": (_train, ("ragged", {})), "fp8": (_train, (
        "ragged", {"zero_optimization": {"stage": "ragged", "fp8_all_gather_tile": 4}}))}, 2, timeout=400)
    (plain, _), (fp8, _) = (_joined(results, "ragged", None, case) for case, results in runs.items())
    assert all(abs(a - b) <= 0.01 * b for a, b in zip(fp8, plain)), (fp8, plain)
    assert fp8 != plain, "the fp8 key changed nothing: was it applied?"


# ---- shard groups (HSDP): shard_group_size and MiCS's mics_shard_size ----------------------

SHARD_GROUP_BATCH, SHARD_GROUP_STEPS = 16, 4


def _shard_groups(rank, world_size, section, ckpt_dir=None, phase="straight", optimizer=None):
    """SHARD_GROUP_STEPS steps of a ragged engine with ``section`` in its zero_optimization
    (and config ``optimizer`` type, if given), saving after half of them into ``ckpt_dir`` if
    given ('straight'), or resuming from it ('resume'); the full parameters, the ranks of every
    all-gather and of the replicate group."""
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed = _deepspeed()
    import torch.distributed as dist

    import vescale_zero as vz
    import vescale_zero.primitives.dbuffer as dbuffer_module
    from vescale_zero.api.fully_shard import groups_of

    cfg = ds_config("ragged", world_size, train_batch_size=SHARD_GROUP_BATCH,
                    train_micro_batch_size_per_gpu=SHARD_GROUP_BATCH // (world_size * ACCUM))
    cfg["zero_optimization"].update(section)
    if optimizer is not None:
        cfg["optimizer"] = {"type": optimizer, "params": {"lr": 1e-2, "weight_decay": 0.1}}
    try:
        engine, *_ = deepspeed.initialize(model=AwkwardLM(seed=0 if phase != "resume" else 99), config=cfg)
    except ValueError as e:
        return {"error": str(e)}
    gathers, real = [], dbuffer_module.all_gather

    def spy(*args, **kwargs):
        group = args[2] if len(args) > 2 else kwargs["group"]
        gathers.append(tuple(dist.get_process_group_ranks(group)))
        return real(*args, **kwargs)

    batches, half = make_batches(SHARD_GROUP_STEPS, SHARD_GROUP_BATCH), SHARD_GROUP_STEPS // 2
    dbuffer_module.all_gather = spy
    try:
        if phase == "resume":
            engine.load_checkpoint(ckpt_dir)
            losses = _train_steps(engine, batches[half:], rank, world_size)
        else:
            losses, grads = _train_steps(engine, batches[:half], rank, world_size, grads_of="ragged")
            if ckpt_dir is not None:
                engine.save_checkpoint(ckpt_dir)
            losses += _train_steps(engine, batches[half:], rank, world_size)
    finally:
        dbuffer_module.all_gather = real
    replicate = groups_of(engine.module)[0].replicate_group
    out = {"losses": losses, "params": vz.full_state_dict(engine.module), "gathers": set(gathers),
           "replicate": None if replicate is None else dist.get_process_group_ranks(replicate)}
    if phase == "straight":  # the first step's reduced gradients, and the terms they sum (unsharded)
        x, y = rank_slice(batches[0], rank, world_size)
        out["grads"] = grads
        out["reference"] = local_reference(AwkwardLM(seed=0), list(zip(x.chunk(ACCUM), y.chunk(ACCUM))))
    return out


def _muon_divergence_bound(lr, steps, adamw_lr, adamw_betas):
    """Per element, how far two runs of vescale_zero.optim.Muon from the same weights can be apart
    after ``steps`` steps, whatever their gradients. A matrix moves by lr * sqrt(max(1, rows /
    cols)) * O per step, O = Newton-Schulz(momentum); O's singular values are those of the
    Frobenius-normalised matrix (all in [0, 1]) put through the quintic p(s) = a s + b s^3 + c s^5
    ns_steps times, so |O_ij| <= ||O||_2 <= S, S the largest value the iterated p takes on [0, 1]
    (computed here on a fine grid, with 1% for the grid and fp32 rounding); decoupled weight decay
    does not widen a difference. The scale is largest for AwkwardLM's tallest matrix. Vectors
    take AdamW: adam_divergence_bound."""
    from vescale_zero.optim.muon import NS_COEFFICIENTS

    a, b, c = NS_COEFFICIENTS
    s = torch.linspace(0, 1, 100001, dtype=torch.float64)
    for _ in range(5):  # Muon's default ns_steps
        s = a * s + b * s ** 3 + c * s ** 5
    largest = 1.01 * s.abs().max().item()
    scale = max(max(1.0, p.shape[0] / p.shape[1]) ** 0.5 for p in AwkwardLM().parameters() if p.dim() == 2)
    return max(2 * lr * steps * largest * scale, adam_divergence_bound(adamw_lr, steps, adamw_betas))


@pytest.mark.slow
def test_shard_group_size_and_mics_shard_size_run_hsdp_like_the_flat_run(tmp_path):
    """``shard_group_size: 2`` (and MiCS's ``mics_shard_size: 2``) at 4 ranks: the engine
    shards on a 2 x 2 (replicate x shard) mesh -- every all-gather runs in the shard group
    {0, 1} or {2, 3}, replicas {r, r + 2} -- and trains like the flat ragged run (fp32, by the
    derived bounds below; not bit-exact: HSDP sums each gradient in two steps); the two keys give
    the same bits. A checkpoint saved with the key (two rank files: the first replica's) resumes
    to the same bits; a config Muon (talks within the shard group) follows flat Muon; a size that
    does not divide the world is refused, naming the divisors."""
    ckpt = str(tmp_path / "ckpt")
    runs = run_cases_on_ranks({
        "flat": (_shard_groups, ({},)),
        "key": (_shard_groups, ({"shard_group_size": 2}, ckpt)),
        "mics": (_shard_groups, ({"mics_shard_size": 2, "mics_hierarchical_params_gather": False},)),
        "resume": (_shard_groups, ({"shard_group_size": 2}, ckpt, "resume")),
        "muon flat": (_shard_groups, ({}, None, "straight", "Muon")),
        "muon key": (_shard_groups, ({"shard_group_size": 2}, None, "straight", "Muon")),
        "bad size": (_shard_groups, ({"shard_group_size": 3},)),
    }, 4, timeout=500)
    flat, key, mics, resume = (runs[case] for case in ("flat", "key", "mics", "resume"))
    # HSDP (shard groups of 2, replicas of 2) vs the flat run: each gradient is the mean of the same
    # 4 x ACCUM terms, summed in two steps instead of one
    # (tests/numerics.py [Note: comparing runs that sum in another order]): the first loss bit
    # for bit, the first step's reduced gradients within the summation-order bound, the weights
    # within what the optimizer's steps can move two runs apart (AdamW: adam_divergence_bound;
    # Muon: _muon_divergence_bound).
    assert key[0]["losses"][0] == flat[0]["losses"][0], (key[0]["losses"], flat[0]["losses"])
    for case in ("key", "muon key"):
        twin = runs["flat" if case == "key" else "muon flat"][0]
        assert_reduced_like(runs[case][0]["grads"], dict(twin["reference"], mean=twin["grads"]), 4, ACCUM, case)
    adam_bound = adam_divergence_bound(1e-2, SHARD_GROUP_STEPS)
    muon_bound = _muon_divergence_bound(1e-2, SHARD_GROUP_STEPS, 3e-4, (0.9, 0.95))  # Muon's AdamW defaults
    for rank in range(4):
        assert runs["muon key"][rank]["gathers"] == key[rank]["gathers"], rank  # sharded in shard groups here too
        muon = runs["muon key"][rank]["params"]
        for name, value in runs["muon flat"][rank]["params"].items():
            assert (muon[name] - value).abs().max().item() <= muon_bound, (rank, name)
        shard_group = (rank // 2 * 2, rank // 2 * 2 + 1)
        assert key[rank]["gathers"] == {shard_group} == mics[rank]["gathers"], (rank, key[rank]["gathers"])
        assert key[rank]["replicate"] == [rank % 2, rank % 2 + 2] == mics[rank]["replicate"], rank
        assert flat[rank]["gathers"] == {(0, 1, 2, 3)} and flat[rank]["replicate"] is None, rank
        want = key[rank]["params"]
        for name, value in flat[rank]["params"].items():
            assert (want[name] - value).abs().max().item() <= adam_bound, (rank, name)
        for other in (mics, resume):
            assert all(torch.equal(other[rank]["params"][k], want[k]) for k in want), rank
        assert resume[rank]["losses"] == key[rank]["losses"][SHARD_GROUP_STEPS // 2:], rank
        assert runs["bad size"][rank] == {"error": (
            "zero_optimization.shard_group_size 3 does not divide the data-parallel world size 4: shard groups must "
            "tile it; choose one of [1, 2, 4]")}, runs["bad size"][rank]
    tag = (tmp_path / "ckpt" / "latest").read_text()
    from vescale_zero.integrations.deepspeed.recovery_scripts import NOTICE  # for ds_to_universal

    assert sorted(os.listdir(tmp_path / "ckpt" / tag)) == sorted(["common.pt", "metadata.json", "rank00000.pt",
                                                                  "rank00001.pt", NOTICE])


# ---- the spawned runs of the checkpoint tests, two spawns in all ---------------------------


class _Spawned(dict):
    """``{"<case> <phase>": [per-rank results]}``, with ``paths[case]`` (its checkpoint
    directory) and ``latest[case]`` (its ``latest`` file as the save left it)."""

    paths: Dict[str, pathlib.Path]
    latest: Dict[str, str]


@pytest.fixture(scope="module")
def checkpoint_runs(tmp_path_factory) -> _Spawned:
    """The runs of the save/load and ZeRO-migration tests in two spawns (2 ranks, then 3)
    instead of 12: every save at 2 ranks, then every load at 3 (and the 2 -> 2 resume in
    the first spawn, after its save). Each phase runs as in its own spawn; a failing one
    names its case (``run_cases_on_ranks``)."""
    root = tmp_path_factory.mktemp("deepspeed_ckpt")
    out = _Spawned()
    out.paths = {case: root / re.sub(r"\W+", "_", case) for case in
                 [f"save {s} load {ld}" for s, ld in SAVE_LOAD_CASES] + [f"zero stage {st}" for st in ZERO_STAGES]}
    at: Dict[int, Dict[str, tuple]] = {2: {}, 3: {}}
    for save, load in SAVE_LOAD_CASES:
        case = f"save {save} load {load}"
        path = str(out.paths[case])
        at[load][f"{case} full"] = (_train_with_checkpoint, (path, "full"))
        at[save][f"{case} first"] = (_train_with_checkpoint, (path, "first"))
        at[load][f"{case} resume"] = (_train_with_checkpoint, (path, "resume"))
    for stage in ZERO_STAGES:
        case = f"zero stage {stage}"
        at[2][f"{case} zero"] = (_zero_then_ragged, (str(out.paths[case]), stage, "zero"))
        at[3][f"{case} ragged"] = (_zero_then_ragged, (str(out.paths[case]), stage, "ragged"))
    out.update(run_cases_on_ranks(at[2], 2, timeout=500))
    out.latest = {f"save {s} load {ld}": (out.paths[f"save {s} load {ld}"] / "latest").read_text()
                  for s, ld in SAVE_LOAD_CASES}
    out.update(run_cases_on_ranks(at[3], 3, timeout=500))
    return out
