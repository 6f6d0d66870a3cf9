"""HSDP: ``fully_shard`` on a 2-D ``("replicate", "shard")`` mesh.

One spawn of 4 gloo ranks (a 2 x 2 mesh: shard groups {0,1} {2,3}, replicas {0,2} {1,3})
runs every check, each rank training on its own quarter of the global batch:

* fp32 AdamW with gradient accumulation (``set_requires_gradient_sync(False)`` on the first
  micro-batch) and clipping equals DDP over the 4 ranks (``no_sync``, torch's clip) and flat
  ``fully_shard`` over the 4 ranks within 1e-6 (not bit-exact: HSDP sums each gradient as
  ``(a + b)/2`` then ``(. + .)/2``, DDP and the flat reduce-scatter as one sum of four);
  the clip's total norm equals DDP's at every step.
* a communication spy: all-gathers and reduce-scatters run on groups of 2 (the shard
  group), and a synced step runs exactly one all-reduce per FSDP group, on the replicate
  group, of the group's shard size; the accumulating micro-batch runs none.
* bf16 compute and reduce (``MixedPrecisionPolicy``) equals flat ``fully_shard`` with the
  same policy within 2e-2 (bf16 reductions in another order), and fp32 DDP within 5e-2.
* Muon (communicates inside the group its parameters are sharded over) equals flat
  ``fully_shard`` with Muon within 1e-6.
* the FP8 all-gather (e4m3 tiles, gathered in the shard group) equals flat ``fully_shard``
  with the same tiles within 1e-6, and differs from the fp32 gather (it is applied).
* the block-wise optimizers (8-bit AdamW, Shampoo; granularity = their 13-element blocks)
  equal flat ``fully_shard`` with the same optimizer within 1e-6 (their own tests are
  bit-exact against the unsharded optimizer given equal gradients; HSDP's gradients differ
  from flat's by rounding).
* a gradient divide factor (3, not the world size) gives SUM / 3 over all 4 ranks: SGD
  equals flat ``fully_shard`` and DDP with gradients x 4/3 within 1e-6.
* beside tensor parallelism (a (2, 1, 2) world mesh ``("tp", "replicate", "shard")``), the
  ``["replicate", "shard"]`` slice is accepted and equals 1-D sharding over its shard group.
* a full state dict loads bit-exactly (each rank its shard group's ranges) and gathers back.
* a sharded checkpoint (model and AdamW state) is written by the first replica's shard group
  only (ranks 0 and 1: two rank files) and loads back bit-exactly into fresh HSDP models on
  every replica; resharding it to other layouts is tests/test_checkpoint.py's.
* bad meshes (3-D, unknown names, not covering the world) raise clear errors; FSDP2's
  dimension names are accepted; a shard size whose pieces split the block-wise optimizers'
  blocks (element granularity) is refused at the optimizer's first step, on every rank,
  naming the HSDP shard dimension and the granularity to use.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import vescale_zero as vz
from tests.comm_spy import CommSpy
from tests.distributed import run_on_ranks
from tests.models import AwkwardLM, make_batches, rank_slice
from vescale_zero.api.fully_shard import groups_of
from vescale_zero.optim import AdamW8bit, Muon, Shampoo

WORLD, REPLICAS, SHARD = 4, 2, 2
STEPS, ACCUM, CLIP, LR = 3, 2, 0.05, 1e-2
BLOCK = 13  # the block-wise optimizers' block (as their own tests): splits AwkwardLM's tensors unevenly
DIVIDE = 3.0  # a gradient divide factor that is not the world size
FP8_TILE = 4  # FP8 all-gather tiles (as tests/test_fp8_gather.py): AwkwardLM's odd shapes give edge tiles


def _hsdp_mesh():
    return init_device_mesh("cpu", (REPLICAS, SHARD), mesh_dim_names=("replicate", "shard"))


def _shard(mesh, mp_policy=None, granularity=None, fp8_tile=None):
    model = AwkwardLM(seed=3)
    kwargs = dict(mesh=mesh, mp_policy=mp_policy, granularity=granularity, fp8_all_gather_tile=fp8_tile)
    for block in model.blocks:
        vz.fully_shard(block, **kwargs)
    return vz.fully_shard(model, **kwargs)


def _micro(rank):
    """This rank's micro-batches of every step (its share of the global batch, in ACCUM)."""
    world = dist.get_world_size()
    return [[tuple(t.chunk(ACCUM)[i] for t in rank_slice(b, rank, world)) for i in range(ACCUM)]
            for b in make_batches(STEPS, global_batch=4 * world, seed=5)]


def _train_fsdp(model, opt, rank, clip=True, spy=None):
    norms = []
    for step, micro in enumerate(_micro(rank)):
        for i, (x, y) in enumerate(micro):
            model.set_requires_gradient_sync(i == ACCUM - 1)
            with spy.window(step, i) if spy is not None else contextlib.nullcontext():
                (model(x, y) / ACCUM).backward()
        if clip:
            norms.append(vz.clip_grad_norm_(model, CLIP).item())
        opt.step()
        opt.zero_grad()
    return vz.full_state_dict(model), norms


def _train_ddp(rank):
    model = DDP(AwkwardLM(seed=3))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)
    norms = []
    for micro in _micro(rank):
        for i, (x, y) in enumerate(micro):
            with model.no_sync() if i < ACCUM - 1 else contextlib.nullcontext():
                (model(x, y) / ACCUM).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}, norms


def _train_ddp_sgd(rank, scale):
    """DDP (the mean over the ranks) with SGD on gradients times ``scale``."""
    model = DDP(AwkwardLM(seed=3))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    for micro in _micro(rank):
        for i, (x, y) in enumerate(micro):
            with model.no_sync() if i < ACCUM - 1 else contextlib.nullcontext():
                (model(x, y) / ACCUM).backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def _adam_state(opt):
    """Every tensor of ``opt``'s AdamW state, in parameter order."""
    return [opt.state[p][k] for g in opt.param_groups for p in g["params"] for k in ("step", "exp_avg", "exp_avg_sq")]


def _close(a, b, tol):
    return {k: (a[k].float() - b[k].float()).abs().max().item() for k in b if k in a and (a[k].float() - b[k].float())
            .abs().max().item() > tol}


def _expect_error(fn, *needles):
    try:
        fn()
    except (ValueError, NotImplementedError) as e:
        missing = [n for n in needles if n not in str(e)]
        assert not missing, f"error {e!r} lacks {missing}"
        return
    raise AssertionError(f"no error; expected one naming {needles}")


def _all_checks(rank, world, tmp):
    torch.manual_seed(0)
    mesh = _hsdp_mesh()
    out = {}

    # 1. fp32: HSDP vs DDP vs flat, accumulation + clipping, with the communication spy.
    spy = CommSpy()
    with spy.installed():
        hsdp = _shard(mesh)
        hsdp_opt = torch.optim.AdamW([p for p in hsdp.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)
        hsdp_state, hsdp_norms = _train_fsdp(hsdp, hsdp_opt, rank, spy=spy)
    flat = _shard(None)
    opt = torch.optim.AdamW([p for p in flat.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)
    flat_state, flat_norms = _train_fsdp(flat, opt, rank)
    ddp_state, ddp_norms = _train_ddp(rank)
    ddp_start = AwkwardLM(seed=3).state_dict()
    out["vs_ddp"] = _close(hsdp_state, ddp_state, 1e-6)
    out["vs_flat"] = _close(hsdp_state, flat_state, 1e-6)
    out["bit_exact_vs_flat"] = all(torch.equal(hsdp_state[k], flat_state[k]) for k in flat_state)
    out["norms"] = (hsdp_norms, ddp_norms, flat_norms)
    out["clipped"] = all(n > CLIP for n in ddp_norms)

    fresh = _shard(mesh)  # every rank loads its shard group's ranges of a full state dict
    vz.load_full_state_dict(fresh, ddp_state)
    out["load_full"] = _close(vz.full_state_dict(fresh), ddp_state, 0.0)

    # a sharded checkpoint, written once (by the first replica), read back on every replica
    path = os.path.join(tmp, "hsdp-ckpt")
    vz.checkpoint.save(path, hsdp, hsdp_opt, extra={"step": STEPS})
    out["ckpt_files"] = sorted(os.listdir(path))
    fresh = _shard(mesh)
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)
    out["ckpt_extra"] = vz.checkpoint.load(path, fresh, fresh_opt)
    out["ckpt_model"] = _close(vz.full_state_dict(fresh), hsdp_state, 0.0)
    saved, loaded = (_adam_state(o) for o in (hsdp_opt, fresh_opt))
    out["ckpt_optimizer"] = len(saved) == len(loaded) > 0 and all(torch.equal(a, b) for a, b in zip(saved, loaded))

    groups = groups_of(hsdp)
    replicate_ranks = dist.get_process_group_ranks(groups[0].replicate_group)
    shard_ranks = dist.get_process_group_ranks(groups[0].process_group)
    out["groups"] = (shard_ranks, replicate_ranks)
    calls = spy.calls
    bad_group = [c[:3] for c in calls if c[0] in ("all_gather", "reduce_scatter")
                 and dist.get_process_group_ranks(c[3]) != shard_ranks]
    bad_group += [c[:3] for c in calls
                  if c[0] == "all_reduce" and dist.get_process_group_ranks(c[3]) != replicate_ranks]
    out["bad_group"] = bad_group
    shard_sizes = sorted(g.plan.shard_size for g in groups)
    out["all_reduces_per_step"] = [
        sorted(c[2] for c in calls if c[0] == "all_reduce" and c[4] == step and c[5] == ACCUM - 1)
        for step in range(STEPS)]
    out["shard_sizes"] = shard_sizes
    out["accumulating_reductions"] = sum(1 for c in calls
                                         if c[0] != "all_gather" and c[5] is not None and c[5] < ACCUM - 1)
    out["reduce_scatters_per_step"] = len([c for c in calls if c[0] == "reduce_scatter"]) // STEPS
    out["stats"] = sum(g.stats.all_reduce_bytes for g in groups) == STEPS * 4 * sum(shard_sizes)

    # 2. bf16 compute and reduce.
    mp = vz.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    states = []
    for m in (mesh, None):
        model = _shard(m, mp)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)
        states.append(_train_fsdp(model, opt, rank)[0])
    out["bf16_vs_flat"] = _close(states[0], states[1], 2e-2)
    out["bf16_vs_ddp"] = _close(states[0], ddp_state, 5e-2)

    # 3. Muon.
    states = []
    for m in (mesh, None):
        model = _shard(m)
        opt = Muon([p for p in model.parameters() if p.requires_grad], lr=0.02, weight_decay=0.1, adamw_lr=1e-3)
        states.append(_train_fsdp(model, opt, rank, clip=False)[0])
    out["muon_vs_flat"] = _close(states[0], states[1], 1e-6)

    # 3b. FP8 all-gather (e4m3 tiles, gathered inside the shard group): HSDP equals flat with
    # the same tiles; both differ from the fp32 gather (the quantisation is really applied).
    states = []
    for m in (mesh, None):
        model = _shard(m, fp8_tile=FP8_TILE)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)
        states.append(_train_fsdp(model, opt, rank)[0])
    out["fp8_vs_flat"] = _close(states[0], states[1], 1e-6)
    out["fp8_vs_fp32"] = max((states[0][k] - hsdp_state[k]).abs().max().item() for k in hsdp_state)

    # 4. block-wise optimizers (granularity = their blocks), HSDP vs flat.
    for name, make, granularity in (
        ("adamw8bit", lambda ps: AdamW8bit(ps, lr=LR, weight_decay=0.1, block=BLOCK), AdamW8bit.granularity(BLOCK)),
        ("shampoo", lambda ps: Shampoo(ps, lr=LR, weight_decay=0.1, block=BLOCK, update_freq=2),
         Shampoo.granularity(BLOCK)),
    ):
        states = []
        for m in (mesh, None):
            model = _shard(m, granularity=granularity)
            states.append(_train_fsdp(model, make([p for p in model.parameters() if p.requires_grad]), rank)[0])
        out[f"{name}_vs_flat"] = _close(states[0], states[1], 1e-6)
        out[f"{name}_moved"] = sum(not torch.equal(states[0][k], ddp_start[k]) for k in ddp_start)

    # 5. a gradient divide factor (SUM / factor over all 4 ranks, not the mean): plain SGD
    # so that the scale shows in the weights.
    states = []
    for m in (mesh, None):
        model = _shard(m)
        model.set_gradient_divide_factor(DIVIDE, recurse=True)  # every group (FSDP2: the module's own)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
        states.append(_train_fsdp(model, opt, rank, clip=False)[0])
    out["divide_vs_flat"] = _close(states[0], states[1], 1e-6)
    out["divide_vs_ddp_sgd"] = _close(states[0], _train_ddp_sgd(rank, scale=WORLD / DIVIDE), 1e-6)

    # 6. beside tensor parallelism: the ("replicate", "shard") slice of a world mesh (here
    # tp 2 x 1 replica x shard 2: the slice covers 2 of the 4 ranks) equals 1-D sharding
    # over its shard group.
    world_mesh = init_device_mesh("cpu", (2, 1, SHARD), mesh_dim_names=("tp", "replicate", "shard"))
    states = []
    for m in (world_mesh["replicate", "shard"], world_mesh["shard"]):
        model = _shard(m)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)
        states.append(_train_fsdp(model, opt, rank)[0])
    out["sliced_vs_1d"] = _close(states[0], states[1], 0.0)


    # 7. bad input.
    # a shard size whose pieces split the optimizer's blocks: refused at the first step, on
    # every rank, naming the HSDP shard dimension and the fix
    element = _shard(mesh, granularity="element")
    x, y = _micro(rank)[0][0]
    element(x, y).backward()
    params = [p for p in element.parameters() if p.requires_grad]
    _expect_error(lambda: AdamW8bit(params, block=BLOCK).step(),
                  "would be split across ranks", "'shard' dimension (2 ranks", "AdamW8bit.granularity(13)")
    _expect_error(lambda: Shampoo(params, block=BLOCK).step(),
                  "would be split across ranks", "'shard' dimension (2 ranks", "Shampoo.granularity(13)")
    _expect_error(lambda: _shard(init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "replicate", "shard"))),
                  "3-D", "replicate")
    _expect_error(lambda: _shard(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))),
                  "('dp', 'tp')", "'replicate', 'shard'", "'dp_replicate', 'dp_shard'")
    _expect_error(lambda: _shard(DeviceMesh("cpu", [[0], [1]], mesh_dim_names=("replicate", "shard"))),
                  "covers 2 ranks", "multiply to the world size")
    # FSDP2's names are accepted too.
    fsdp2_named = _shard(init_device_mesh("cpu", (REPLICAS, SHARD), mesh_dim_names=("dp_replicate", "dp_shard")))
    out["fsdp2_names"] = dist.get_world_size(groups_of(fsdp2_named)[0].process_group)
    return out


@pytest.mark.slow
def test_hsdp_2x2_equals_ddp_and_flat_fully_shard(tmp_path):
    results = run_on_ranks(_all_checks, WORLD, str(tmp_path), timeout=240)
    for rank, out in enumerate(results):
        assert out["clipped"], "CLIP must be below the gradient norm, or clipping is not exercised"
        assert out["vs_ddp"] == {}, (rank, out["vs_ddp"])
        assert out["vs_flat"] == {}, (rank, out["vs_flat"])
        assert out["load_full"] == {}, (rank, out["load_full"])
        hsdp, ddp, flat = out["norms"]
        assert max(abs(a - b) for a, b in zip(hsdp, ddp)) <= 1e-6, (hsdp, ddp)
        assert max(abs(a - b) for a, b in zip(hsdp, flat)) <= 1e-6, (hsdp, flat)
        shard, replicate = out["groups"]
        assert shard == [rank // SHARD * SHARD + i for i in range(SHARD)], shard
        assert replicate == [rank % SHARD, rank % SHARD + SHARD], replicate
        assert out["bad_group"] == [], out["bad_group"]
        assert out["all_reduces_per_step"] == [out["shard_sizes"]] * STEPS, out
        assert out["accumulating_reductions"] == 0
        assert out["reduce_scatters_per_step"] == len(out["shard_sizes"])
        assert out["stats"]
        assert out["bf16_vs_flat"] == {}, out["bf16_vs_flat"]
        assert out["bf16_vs_ddp"] == {}, out["bf16_vs_ddp"]
        assert out["muon_vs_flat"] == {}, out["muon_vs_flat"]
        assert out["fp8_vs_flat"] == {}, out["fp8_vs_flat"]
        assert out["fp8_vs_fp32"] > 1e-3, out["fp8_vs_fp32"]
        for name in ("adamw8bit", "shampoo"):
            assert out[f"{name}_vs_flat"] == {}, (name, out[f"{name}_vs_flat"])
            assert out[f"{name}_moved"] > 0, name
        assert out["divide_vs_flat"] == {}, out["divide_vs_flat"]
        assert out["divide_vs_ddp_sgd"] == {}, out["divide_vs_ddp_sgd"]
        assert out["sliced_vs_1d"] == {}, out["sliced_vs_1d"]
        assert out["fsdp2_names"] == SHARD
        assert out["ckpt_files"] == ["common.pt", "metadata.json", "rank00000.pt", "rank00001.pt"], out["ckpt_files"]
        assert out["ckpt_extra"] == {"step": STEPS}
        assert out["ckpt_model"] == {}, (rank, out["ckpt_model"])
        assert out["ckpt_optimizer"], rank


def _three_by_two(rank, world):
    """HSDP 3 replicas x shard 2 at 6 ranks vs DDP: AdamW, accumulation, clipping."""
    torch.manual_seed(0)
    hsdp = _shard(init_device_mesh("cpu", (3, 2), mesh_dim_names=("replicate", "shard")))
    opt = torch.optim.AdamW([p for p in hsdp.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)
    hsdp_state, hsdp_norms = _train_fsdp(hsdp, opt, rank)
    ddp_state, ddp_norms = _train_ddp(rank)
    group = groups_of(hsdp)[0]
    return {"vs_ddp": _close(hsdp_state, ddp_state, 1e-6), "norms": (hsdp_norms, ddp_norms),
            "groups": (dist.get_process_group_ranks(group.process_group),
                       dist.get_process_group_ranks(group.replicate_group))}


@pytest.mark.slow
def test_hsdp_3x2_at_6_ranks_equals_ddp():
    """3 replicas x shard 2 (replicas of 3: the all-reduce across replicas sums three terms)
    equals DDP over the 6 ranks within 1e-6, clip norms too."""
    for rank, out in enumerate(run_on_ranks(_three_by_two, 6, timeout=240)):
        assert out["vs_ddp"] == {}, (rank, out["vs_ddp"])
        hsdp, ddp = out["norms"]
        assert all(n > CLIP for n in ddp) and max(abs(a - b) for a, b in zip(hsdp, ddp)) <= 1e-6, (hsdp, ddp)
        assert out["groups"] == ([rank // 2 * 2, rank // 2 * 2 + 1], [rank % 2, rank % 2 + 2, rank % 2 + 4]), out
