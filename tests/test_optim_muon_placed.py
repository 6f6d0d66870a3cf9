"""Muon on the optimizer-aware plan: matrices placed whole move nothing, the results equal
single-process Muon, and the step hidden in backward equals the plain step.

Every matrix is compared with single-process Muon fed the same gradients (the sharded run's,
assembled). A matrix whole on one rank is orthogonalised from a tensor made exactly as the
single process makes it: the same bits (fp32 and bf16). A matrix in pieces is joined on its root
into a new tensor, and the CPU's matmul kernels may add in another order for another memory
alignment: 1e-6 relative in fp32 (tests/test_optim_muon.py), and in bf16 masters that fp32
difference can round the new weight to the neighbouring bf16 value: at most one bf16 step
(2**-7 of the value, 7 mantissa bits) per optimizer step, relative to the tensor's largest value.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import vescale_zero as vz
from tests.comm_spy import CommSpy
from tests.distributed import run_cases_on_ranks
from tests.models import local_pieces
from tests.sweeps import sweep
from tests.test_optim_8bit import _full_grads
from vescale_zero.api.fully_shard import groups_of
from vescale_zero.api.optimizer_aware import OptimizerAware, whole_matrices
from vescale_zero.optim import Muon
from vescale_zero.primitives.planner import (
    OptimizerUnits,
    StepTraffic,
    TensorSpec,
    optimizer_aware_plan,
    plan,
    unit_pieces,
)
from vescale_zero.testing import GPT, GPTConfig, SyntheticCorpus

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)
STEPS = 3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---- the cost model (pure) -------------------------------------------------------------
def _three(traffic: StepTraffic):
    """A (4 elements), B (6), C (4), each one matrix, on 2 ranks."""
    specs = [TensorSpec(4, 1, "A"), TensorSpec(6, 1, "B"), TensorSpec(4, 1, "C")]
    units = [OptimizerUnits(n, float(n)) for n in (4, 6, 4)]
    return optimizer_aware_plan(specs, units, 2, traffic)


def test_cost_model_weighs_padding_against_moves():
    """Bytes per rank per step, by hand. The piecewise plan: S = 7, B cut 3|3. B made whole:
    the planner lays B first (another order, as it does when that pads less), S = 7, A cut 1|3.
    Every matrix whole: S = 8 (B, A | C). A rank receives (m-1)*S*(gathers*2 + reduce-scatters*4)
    and the mean of the moves, 2 moves * elements moved * 4 bytes / 2 ranks:
    piecewise 7*8 + 12 = 68, B whole 7*8 + 4 = 60, all whole 8*8 = 64."""
    bf16 = _three(StepTraffic(gather_itemsize=2, reduce_itemsize=4))
    assert (bf16.choice, bf16.plan.shard_size, bf16.whole) == ("placed where cut (1 tensor)", 7, (False, True, True))
    assert (bf16.step_bytes.all_gather, bf16.step_bytes.reduce_scatter, bf16.step_bytes.optimizer) == (28, 28, 4.0)
    assert bf16.piecewise_bytes.total == 68 and bf16.granularities == (1, 6, 1)
    assert bf16.plan == plan([TensorSpec(4, 1, "A"), TensorSpec(6, 6, "B"), TensorSpec(4, 1, "C")], 2)
    # no collectives: every byte is the optimizer's, so every matrix goes whole
    moves_only = _three(StepTraffic(gather_itemsize=2, reduce_itemsize=4, gathers=0, reduce_scatters=0))
    assert moves_only.choice == "placed" and moves_only.plan.shard_size == 8 and all(moves_only.whole)
    assert moves_only.step_bytes.total == 0 and moves_only.piecewise_bytes.total == 12.0
    # moves that cost nothing: 56 for the piecewise plan and for B whole, a tie the piecewise plan keeps
    free_moves = _three(StepTraffic(gather_itemsize=2, reduce_itemsize=4, unit_moves=0))
    assert free_moves.choice == "piecewise" and free_moves.step_bytes.total == 56
    # forced: that plan whatever it costs
    placed = optimizer_aware_plan([TensorSpec(4, 1, "A"), TensorSpec(6, 1, "B"), TensorSpec(4, 1, "C")],
                                  [OptimizerUnits(n) for n in (4, 6, 4)], 2, StepTraffic(2, 4), force="placed")
    assert placed.choice == "placed" and placed.granularities == (4, 6, 4)
    assert placed.step_bytes.total == 64 and placed.unit_cost == (0.0, 0.0)
    assert [unit_pieces(bf16.plan, i, n) for i, n in enumerate((4, 6, 4))] == [[[(0, 1), (1, 3)]], [[(0, 6)]],
                                                                               [[(1, 4)]]]
    assert bf16.unit_cost == (6.0, 8.0)  # B on rank 0; A's largest piece and C on rank 1


def test_cost_model_on_real_layers():
    """Llama-3-8B's layer on 64 ranks: whole matrices would pad ~94% of every gather, so the
    piecewise plan stays; units of heads (a sub-matrix unit) are checked and accepted."""
    from vescale_zero.tools.model_shapes import layer_groups

    layer = layer_groups("llama3-8b")["decoder_layer"]
    specs = [TensorSpec(math.prod(s), 1, n) for n, s in layer]
    units = [OptimizerUnits(math.prod(s)) if len(s) == 2 else None for _, s in layer]
    choice = optimizer_aware_plan(specs, units, 64, StepTraffic(2, 4), align=8)
    assert choice.choice == "piecewise" and choice.step_bytes == choice.piecewise_bytes
    placed = optimizer_aware_plan(specs, units, 64, StepTraffic(2, 4), align=8, force="placed")
    assert placed.plan.padding_ratio > 0.9 and placed.step_bytes.optimizer == 0
    heads = [OptimizerUnits(128 * 4096) if n.endswith(("q_proj.weight", "k_proj.weight")) else None for n, _ in layer]
    assert optimizer_aware_plan(specs, heads, 8, StepTraffic(2, 4), align=8).plan.shard_size > 0
    with pytest.raises(ValueError, match="divide the tensor"):
        optimizer_aware_plan(specs, [OptimizerUnits(7)] + units[1:], 8, StepTraffic(2, 4))
    with pytest.raises(ValueError, match="force"):
        OptimizerAware(force="somewhere")


# ---- on ranks ----------------------------------------------------------------------------
def _expected_sent(model) -> int:
    """Elements all ranks together send in Muon's moves, from the sharded parameters' placements
    (independent of the optimizer): every matrix on more than one rank goes to a rank holding
    its largest piece and comes back."""
    total = 0
    for p in model.parameters():
        if p.requires_grad and p.dim() >= 2:
            sizes = [p.ragged_placement.local_numel(r) for r in range(p.ragged_placement.world_size)]
            if sum(1 for n in sizes if n) > 1:
                total += 2 * (sum(sizes) - max(sizes))
    return total


def _train(rank, world_size, dtype_name, optimizer_aware, hidden, mesh_shape=None):
    """Sharded Muon (``optimizer_aware``, ``hidden``) against single-process Muon for STEPS steps:
    the worst relative error, the bytes Muon's moves sent (the spy's), what the placements predict."""
    dtype = DTYPES[dtype_name]
    torch.manual_seed(0)
    reference = GPT(CFG).to(dtype)
    model = GPT(CFG).to(dtype)
    model.load_state_dict(reference.state_dict())
    ref_params = {n: p for n, p in reference.named_parameters() if p.requires_grad}
    ref_opt = Muon(ref_params.values(), lr=0.02, weight_decay=0.1, adamw_lr=1e-3)
    mesh = None if mesh_shape is None else init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    vz.fully_shard_layers(model, mesh=mesh, optimizer_aware=optimizer_aware)
    opt = Muon([p for p in model.parameters() if p.requires_grad], lr=0.02, weight_decay=0.1, adamw_lr=1e-3,
               hide_in_backward=hidden)
    data_ranks = world_size if mesh_shape is None else mesh_shape[0] * mesh_shape[1]
    corpus = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
    spy, worst, hidden_counts = CommSpy(), 0.0, []
    for step in range(STEPS):
        with spy.installed():  # the hidden step's moves run from backward until step() returns
            model(*corpus.batch(step, 12, rank, data_ranks)).backward()
            grads = _full_grads(model)
            opt.step()
        for name, p in ref_params.items():
            p.grad = grads[name].to(p.dtype)  # the sharded run's gradients, exactly (bf16 -> fp32 -> bf16)
        hidden_counts.append(opt.last_step_stats.get("hidden"))
        ref_opt.step()
        opt.zero_grad()
        for name, (_shape, s, e, values) in local_pieces(model).items():
            if name in ref_params and e > s:
                ref = ref_params[name].detach().view(-1)[s:e].float()
                worst = max(worst, ((values.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item())
    sent = sum(c[2] for c in spy.calls if c[0] == "all_to_all")
    moves = sum(1 for c in spy.calls if c[0] == "all_to_all")
    choices = [g.placement.choice for g in groups_of(model)] if optimizer_aware else []
    report = vz.sharding_report(model)
    shown = [(p.choice, p.optimizer_bytes, p.whole_tensors, p.tensors) for p in report.placements]
    return {"report": (shown, "optimizer-aware groups" in str(report)), "worst": worst, "sent": sent,
            "moves": moves, "expected_per_step": _expected_sent(model),
            "moving": sum(opt._layout.moving), "matrices": len(opt._layout.moving), "choices": choices,
            "hidden": hidden_counts}


PLACED = Muon.optimizer_aware(force="placed")
PIECEWISE = Muon.optimizer_aware(force="piecewise")


def _check(results, hidden=False):
    for case, per_rank in results.items():
        dtype, layout = case[:2]
        bound = 0.0 if layout == "placed" else 1e-6 if dtype == "fp32" else STEPS * 2.0 ** -7
        assert max(r["worst"] for r in per_rank) <= bound, (case, [r["worst"] for r in per_rank])
        for r in per_rank:  # vz.sharding_report shows each group's choice
            shown, printed = r["report"]
            assert printed and [c for c, *_ in shown] == r["choices"], (case, r["report"])
        if layout == "placed":
            assert all(r["choices"] and set(r["choices"]) == {"placed"} for r in per_rank), (case, per_rank[0])
            assert all(b == 0 and whole == n > 0 for r in per_rank for _, b, whole, n in r["report"][0]), case
            assert all(r["moves"] == 0 and r["sent"] == 0 and r["moving"] == 0 for r in per_rank), (case, per_rank)
        else:
            expected = per_rank[0]["expected_per_step"] * STEPS
            assert expected > 0 and sum(r["sent"] for r in per_rank) == expected, (case, expected, per_rank)
        if hidden:  # every step's matrices came from backward
            assert all(r["hidden"] == [r["matrices"]] * STEPS for r in per_rank), (case, per_rank[0]["hidden"])


@pytest.mark.parametrize("world_size", sweep([2, 3, 4], quick=3))
def test_placed_muon_equals_single_process_and_moves_nothing(world_size):
    """At 2, 3 and 4 ranks, fp32 and bf16 masters: with every matrix placed whole
    (``optimizer_aware`` forced to "placed") no all_to_all runs at all -- the spy on Muon's moves
    counts none -- and every step equals single-process Muon bit for bit. The piecewise plan
    beside it moves exactly what its placements say (so the spy is not blind)."""
    _check(run_cases_on_ranks({
        ("fp32", "placed"): (_train, ("fp32", PLACED, False)),
        ("bf16", "placed"): (_train, ("bf16", PLACED, False)),
        ("fp32", "piecewise"): (_train, ("fp32", PIECEWISE, False)),
    }, world_size, timeout=600))


@pytest.mark.slow
def test_hidden_muon_equals_single_process():
    """The step hidden in backward, placed and piecewise, fp32 and bf16 masters, and under HSDP
    (2 replicas x 2 shards): every matrix's update came from backward, the results are single
    process Muon's, the placed matrices moved nothing."""
    _check(run_cases_on_ranks({
        ("fp32", "placed", "hidden"): (_train, ("fp32", PLACED, True)),
        ("bf16", "piecewise", "hidden"): (_train, ("bf16", PIECEWISE, True)),
    }, 2, timeout=600), hidden=True)
    _check(run_cases_on_ranks({("fp32", "placed", "hsdp"): (_train, ("fp32", PLACED, True, (2, 2)))}, 4,
                              timeout=600), hidden=True)


# ---- the hidden step keeps the plain step's meaning ------------------------------------
def _hidden_vs_plain(rank, world_size):
    """Two sharded models from the same weights on the same batches, one stepping plainly and
    one hidden in backward, through clipping that clips and that does not, a non-finite step
    skipped, accumulation over two synced backwards, and a backward thrown away: the weights
    stay bit for bit equal, and the hidden work is used where nothing changed."""
    offloaded = vz.fully_shard_layers(GPT(CFG), offload_policy=vz.CPUOffloadPolicy())
    try:
        Muon(offloaded.parameters(), hide_in_backward=True)
        refused = None
    except ValueError as e:
        refused = str(e)
    torch.manual_seed(0)
    models = [GPT(CFG) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts, skippers = [], []
    for model, hidden in zip(models, (False, True)):
        vz.fully_shard_layers(model, optimizer_aware=True)
        opts.append(Muon([p for p in model.parameters() if p.requires_grad], lr=0.02, weight_decay=0.1,
                         adamw_lr=1e-3, hide_in_backward=hidden))
        skippers.append(vz.skip_nonfinite_steps(model, opts[-1]))
    corpus = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
    log, batch = {}, 0
    for what in ("plain", "clip, not clipping", "clip, clipping", "non-finite", "accumulate", "thrown away"):
        for model, opt, skipper in zip(models, opts, skippers):
            def backward(b, model=model):
                model(*corpus.batch(b, 6, rank, world_size)).backward()
            backward(batch)
            if what == "accumulate":
                backward(batch + 100)
            if what == "thrown away":
                opt.zero_grad()
                backward(batch + 200)
            if what.startswith("clip"):
                vz.clip_grad_norm_(model, 1e6 if what.endswith("not clipping") else 1e-3)
            if what == "non-finite" and rank == 0:
                next(p for p in model.parameters() if p.grad is not None and p.grad.to_local().numel()) \
                    .grad.to_local()[0] = math.inf
            opt.step()
            opt.zero_grad()
            log.setdefault(what, []).append((opt.last_step_stats.get("hidden"), skipper.last_step_skipped))
        batch += 1
        same = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(models[0].parameters(),
                                                                           models[1].parameters()))
        log[what].append(same)
    return {"log": log, "refused": refused}


def test_hidden_step_keeps_the_plain_steps_meaning():
    """Bit for bit the plain step's weights after each case; the hidden work stands where
    nothing changed the gradients after their reduce-scatter (no clipping, accumulation's last
    backward, the backward after a thrown-away one) and is computed again where clipping scaled
    them; a non-finite step is skipped by both."""
    results = run_cases_on_ranks({"log": (_hidden_vs_plain, ())}, 3, timeout=600)["log"]
    assert all("offloaded" in r["refused"] for r in results), results[0]["refused"]  # and an offloaded model refused
    for rank_log in (r["log"] for r in results):
        for what, ((_, plain_skipped), (hidden, skipped), same) in rank_log.items():
            assert same, (what, rank_log)
            assert skipped == plain_skipped == (what == "non-finite"), (what, rank_log)
            stood = what in ("plain", "clip, not clipping", "accumulate", "thrown away")
            assert (hidden > 0) == stood, (what, hidden, rank_log)


def test_optimizer_aware_argument():
    """True means Muon's whole matrices; anything else but an OptimizerAware is refused."""
    from vescale_zero.api.optimizer_aware import resolve_optimizer_aware

    assert resolve_optimizer_aware(True) == OptimizerAware() and resolve_optimizer_aware(False) is None
    assert OptimizerAware().units is whole_matrices
    with pytest.raises(TypeError, match="optimizer_aware"):
        resolve_optimizer_aware("muon")
    w = torch.nn.Parameter(torch.zeros(3, 4, 5))
    assert whole_matrices("w", w) == OptimizerUnits(60, float(3 * 20 * 3))
    assert whole_matrices("b", torch.nn.Parameter(torch.zeros(4))) is None
    assert dist.is_available()


# ---- the hosts ---------------------------------------------------------------------------
DS_STEPS = 3


def _deepspeed_muon(rank, world_size, section, params):
    """DS_STEPS steps of a "ragged" engine with a config Muon (``params`` beside lr and weight
    decay) and ``section`` in zero_optimization: the full weights, each group's plan choice,
    the matrices Muon computed in backward."""
    import os

    from tests.models import AwkwardLM, make_batches
    from tests.test_deepspeed import ACCUM, GLOBAL_BATCH, _deepspeed, _train_steps, ds_config

    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed = _deepspeed()
    cfg = ds_config("ragged", world_size, gradient_clipping=0.0)
    cfg["zero_optimization"].update(section)
    cfg["optimizer"] = {"type": "Muon", "params": {"lr": 1e-2, "weight_decay": 0.1, **params}}
    try:
        engine, *_ = deepspeed.initialize(model=AwkwardLM(seed=0), config=cfg)
    except ValueError as e:
        return {"error": str(e)}
    hidden = []
    for batch in make_batches(DS_STEPS, GLOBAL_BATCH):
        _train_steps(engine, [batch], rank, world_size)
        hidden.append(engine.basic_optimizer.last_step_stats.get("hidden"))
    assert ACCUM > 1  # the micro-batches accumulate without sync: one reduce-scatter per step
    return {"params": vz.full_state_dict(engine.module), "hidden": hidden,
            "choices": [getattr(g, "placement", None) and g.placement.choice for g in groups_of(engine.module)]}


@pytest.mark.slow
def test_deepspeed_config_muon_on_the_optimizer_aware_plan():
    """``"optimizer_aware": true`` with ``"optimizer": {"type": "Muon", "params": {"hide_in_backward":
    true}}`` under "ragged": every group is planned optimizer-aware, Muon's matrices come from
    backward, and the weights follow the plain config Muon within what Muon's steps can move two
    runs apart (only the order of float adds in Newton-Schulz differs: tests/test_deepspeed.py's
    _muon_divergence_bound); optimizer_aware with another optimizer is refused."""
    from tests.test_deepspeed import _muon_divergence_bound

    runs = run_cases_on_ranks({
        "plain": (_deepspeed_muon, ({}, {})),
        "aware": (_deepspeed_muon, ({"optimizer_aware": True}, {"hide_in_backward": True})),
    }, 2, timeout=600)
    bound = _muon_divergence_bound(1e-2, DS_STEPS, 3e-4, (0.9, 0.95))
    for plain, aware in zip(runs["plain"], runs["aware"]):
        assert aware["choices"] and None not in aware["choices"] and set(plain["choices"]) == {None}, aware
        assert all(h and h > 0 for h in aware["hidden"]), aware["hidden"]
        for name, value in plain["params"].items():
            assert (aware["params"][name] - value).abs().max().item() <= bound, name


def _megatron_muon(rank, world_size, aware):
    from tests.test_megatron import SMALL, _megatron_job

    argv = SMALL + ["--global-batch-size", "8", "--tensor-model-parallel-size", "2", "--use-vescale-fsdp",
                    "--vescale-optimizer", "muon"] + (["--vescale-optimizer-aware"] if aware else [])
    with _megatron_job(argv) as (pg, args):
        model, optimizer, config = pg.build(args)
        run = pg.train_loop(args, model, optimizer, config)
        return {"losses": run["losses"], "choices": [g.placement and g.placement.choice for g in model.vescale_groups],
                "params": {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}}


def _divergence_bound(lr, steps, shapes, betas):
    """tests/test_deepspeed.py's _muon_divergence_bound for matrices of ``shapes`` (Muon's scale
    of the tallest), with AdamW (lr, ``betas``) for the vectors."""
    from tests.numerics import adam_divergence_bound
    from vescale_zero.optim.muon import NS_COEFFICIENTS

    a, b, c = NS_COEFFICIENTS
    s = torch.linspace(0, 1, 100001, dtype=torch.float64)
    for _ in range(5):  # Muon's default ns_steps
        s = a * s + b * s ** 3 + c * s ** 5
    scale = max(max(1.0, rows / cols) ** 0.5 for rows, cols in shapes)
    return max(2 * lr * steps * 1.01 * s.abs().max().item() * scale, adam_divergence_bound(lr, steps, betas))


@pytest.mark.slow
def test_megatron_muon_on_the_optimizer_aware_plan():
    """``--vescale-optimizer muon --vescale-optimizer-aware`` at tp=2 x dp=2 (Muon on each TP
    piece): every group is planned optimizer-aware and the weights follow the plain flag's run
    within what Muon's steps can move two runs apart (the runs differ only in the order of float
    adds in Newton-Schulz; 3 steps at lr 1e-2, AdamW's betas for the vectors: Megatron's)."""
    runs = run_cases_on_ranks({"plain": (_megatron_muon, (False,)), "aware": (_megatron_muon, (True,))}, 4,
                              timeout=600)
    for plain, aware in zip(runs["plain"], runs["aware"]):
        assert aware["choices"] and None not in aware["choices"] and set(plain["choices"]) == {None}, aware["choices"]
        shapes = [(v.shape[0], v[0].numel()) for v in plain["params"].values() if v.dim() >= 2]
        bound = _divergence_bound(1e-2, 3, shapes, (0.9, 0.999))
        for name, value in plain["params"].items():
            assert (aware["params"][name].float() - value.float()).abs().max().item() <= bound, name
