"""``fully_shard(..., offload_policy=CPUOffloadPolicy())``: the persistent shards in host memory.

Offload moves where the master shard, the gradient shard and so the optimizer state live; it
changes no arithmetic: every gather copies (casts) the same master values into the same slot
and the reduce-scatter's result is copied, not recomputed. So an offloaded run equals the run
without offload bit for bit in fp32 and under bf16 mixed precision (the same cast of the same
fp32 master), with AdamW (foreach, fused), our 8-bit AdamW and Muon, with accumulation without
sync and clipping. Beside PyTorch FSDP2 with its own ``CPUOffloadPolicy`` the gradients differ
only in summation order (gloo's reduce-scatter against ours), which AdamW's normalised step
turns into at most ``adam_divergence_bound`` (tests/numerics.py).

On a CPU the host is the device: what differs is which *buffers* hold what, which the
buffer-placement case proves by data pointers (vescale_zero.runtime.offload's diagram).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

import vescale_zero as vz
from tests.distributed import run_cases_on_ranks
from tests.models import AwkwardLM, assemble, local_pieces, make_batches, rank_slice
from tests.numerics import adam_divergence_bound
from tests.sweeps import sweep
from vescale_zero.api.fully_shard import groups_of
from vescale_zero.optim.adamw8bit import AdamW8bit
from vescale_zero.optim.muon import Muon

STEPS, GLOBAL_BATCH, LR = 4, 12, 1e-2
BF16 = vz.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# pin_memory=False: pinning needs an accelerator (ours skips it on a CPU-only process; FSDP2 fails)
OFFLOAD = CPUOffloadPolicy(pin_memory=False)
# every optimizer in fp32; under bf16 (where the gather also casts) the two AdamW kernels
KINDS = {"fp32": ("foreach", "fused", "adamw8bit", "muon"), "bf16": ("foreach", "fused")}


def _sharded(offload, mp=None, seed=0, meta=False, granularity=None):
    if meta:
        with torch.device("meta"):
            model = AwkwardLM(seed=seed)
    else:
        model = AwkwardLM(seed=seed)
    for block in model.blocks:
        vz.fully_shard(block, mp_policy=mp, offload_policy=offload, granularity=granularity)
    vz.fully_shard(model, mp_policy=mp, offload_policy=offload, granularity=granularity)
    if meta:  # FSDP2's recipe: to_empty onto the compute device (the shards go to the host), then load
        model.to_empty(device="cpu")
        reference = AwkwardLM(seed=seed)
        vz.load_full_state_dict(model, reference.state_dict())
    return model


def _optimizer(kind, model):
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "muon":
        return Muon(params, lr=0.02, weight_decay=0.1, adamw_lr=1e-3)
    if kind == "adamw8bit":
        return AdamW8bit(params, lr=LR, weight_decay=0.1, block=16)
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, **{kind: True})


def _train(rank, world, offload, mp=None, kind="foreach", accumulate=1, clip=None, meta=False):
    """STEPS steps of ``accumulate`` micro-batches (sync only on the last), clipping the global
    norm to ``clip``; the losses, norms, and this rank's pieces."""
    model = _sharded(offload, mp, meta=meta, granularity=AdamW8bit.granularity(16) if kind == "adamw8bit" else None)
    opt = _optimizer(kind, model)
    batches = make_batches(STEPS * accumulate, GLOBAL_BATCH)
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(accumulate):
            model.set_requires_gradient_sync(micro == accumulate - 1)
            loss = model(*rank_slice(batches[step * accumulate + micro], rank, world)) / accumulate
            loss.backward()
            losses.append(loss.item())
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms, "pieces": local_pieces(model)}


def _fsdp2(rank, world):
    from torch.distributed.fsdp import fully_shard
    model = AwkwardLM(seed=0)
    for block in model.blocks:
        fully_shard(block, offload_policy=OFFLOAD)
    fully_shard(model, offload_policy=OFFLOAD)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=True)
    losses = []
    for batch in make_batches(STEPS, GLOBAL_BATCH):
        loss = model(*rank_slice(batch, rank, world))
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    devices = {p.to_local().device.type for p in model.parameters()}
    return {"losses": losses, "full": {n: p.full_tensor() for n, p in model.named_parameters()}, "devices": devices}


def _storage_of(t):
    return t.untyped_storage().data_ptr()


def _placement(rank, world):
    """Which buffer each tensor lives in, by data pointers, after a forward (seen from a hook),
    a backward and an optimizer step of an offloaded bf16 model."""
    model = _sharded(OFFLOAD, BF16)
    groups = groups_of(model)
    seen = {}

    def look(module, _args):  # inside the forward: the unsharded parameters the module computes with
        group = module.vescale_group
        seen[id(group)] = [(_storage_of(p), p.dtype) for p in group.unsharded_params]
    for block in model.blocks:
        block.register_forward_pre_hook(look)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    model(*rank_slice(make_batches(1, GLOBAL_BATCH)[0], rank, world)).backward()
    out = []
    for group in groups:
        master = _storage_of(group.master.local)
        grad = group.sharded_grad.live
        out.append({
            "host": (group.host_device.type, group.host_copies is not None),
            "compute_has_no_local": group.compute.local is None,
            "params_in_master": all(_storage_of(vz.local_piece(p)) == master for p in group.sharded_params),
            "grads_in_shard": grad is not None and all(_storage_of(vz.local_piece(p.grad)) == _storage_of(grad)
                                                       for p in group.sharded_params if p.grad is not None),
            "grad_shard_not_full": grad is not None and _storage_of(grad) != _storage_of(group.grads.full.full),
            "gathered": seen.get(id(group)),
            "compute_full": _storage_of(group.compute.full),
            "master": master,
        })
    opt.step()
    state_on_host = all(v.device == groups[0].host_device for st in opt.state.values() for v in st.values()
                        if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"groups": out, "state_on_host": state_on_host}


def _checkpoint_round_trip(rank, world, path):
    """Train offloaded, save with torch DCP, load into a model without offload (and back; and
    with vz.checkpoint): the values, and one more step of each, equal those of the run that saved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    batches = [rank_slice(b, rank, world) for b in make_batches(STEPS + 1, GLOBAL_BATCH)]
    results = {}
    for src, dst, fmt in ((OFFLOAD, None, "dcp"), (None, OFFLOAD, "dcp"), (OFFLOAD, None, "vz")):
        model = _sharded(src)
        opt = _optimizer("foreach", model)
        for x, y in batches[:STEPS]:
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        way = f"{fmt} {'from' if src is not None else 'to'} offload"
        where = os.path.join(path, way.replace(" ", "_"))
        resumed = _sharded(dst, seed=1)
        ropt = _optimizer("foreach", resumed)
        if fmt == "vz":
            vz.checkpoint.save(where, model, opt)
            vz.checkpoint.load(where, resumed, ropt)
        else:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=where)
            dist.barrier()
            rmsd, rosd = get_state_dict(resumed, ropt)
            state = {"model": rmsd, "optim": rosd}
            dcp.load(state, checkpoint_id=where)
            set_state_dict(resumed, ropt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        loaded_equal = all(torch.equal(a[3], b[3]) for a, b in zip(local_pieces(model).values(),
                                                                    local_pieces(resumed).values()))
        for m, o in ((model, opt), (resumed, ropt)):
            m(*batches[STEPS]).backward()
            o.step()
            o.zero_grad()
        stepped_equal = all(torch.equal(a[3], b[3]) for a, b in zip(local_pieces(model).values(),
                                                                    local_pieces(resumed).values()))
        results[way] = (loaded_equal, stepped_equal)
    return results


def _cases(tmp):
    cases = {}
    for mp_name, mp in (("fp32", None), ("bf16", BF16)):
        for kind in KINDS[mp_name]:
            for name, offload in (("off", None), ("on", OFFLOAD)):
                cases[f"{mp_name}/{kind}/{name}"] = (_train, (offload, mp, kind))
    for name, offload in (("off", None), ("on", OFFLOAD)):
        cases[f"accumulate+clip/{name}"] = (_train, (offload, BF16, "foreach", 2, 0.5))
    cases["meta/on"] = (_train, (OFFLOAD, None, "foreach", 1, None, True))
    cases["fsdp2"] = (_fsdp2, ())
    cases["placement"] = (_placement, ())
    cases["checkpoint"] = (_checkpoint_round_trip, (tmp,))
    return cases


@pytest.fixture(scope="module", params=sweep([2, 3], quick=3))
def runs(request, tmp_path_factory):
    world = request.param
    return world, run_cases_on_ranks(_cases(os.fspath(tmp_path_factory.mktemp(f"offload{world}"))), world)


def _same(a, b, what):
    assert a["losses"] == b["losses"], (what, a["losses"], b["losses"])
    assert a["norms"] == b["norms"], (what, a["norms"], b["norms"])
    for name in a["pieces"]:
        assert torch.equal(a["pieces"][name][3], b["pieces"][name][3]), (what, name)


def test_offload_trains_bit_for_bit_as_without(runs):
    """fp32 (AdamW foreach and fused, 8-bit AdamW, Muon) and bf16 mixed precision (AdamW); accumulation
    without sync with clipping: offloaded equals not offloaded on every rank, bit for bit (the
    same arithmetic on the same values, only other buffers); built on meta too."""
    world, results = runs
    for mp in ("fp32", "bf16"):
        for kind in KINDS[mp]:
            for rank in range(world):
                _same(results[f"{mp}/{kind}/on"][rank], results[f"{mp}/{kind}/off"][rank], (mp, kind, rank))
    for rank in range(world):
        _same(results["accumulate+clip/on"][rank], results["accumulate+clip/off"][rank], ("accumulate", rank))
        _same(results["meta/on"][rank], results["fp32/foreach/off"][rank], ("meta", rank))
    assert results["accumulate+clip/on"][0]["norms"][0] > 0.5  # the clip did clip


def test_offload_matches_fsdp2_cpu_offload(runs):
    """Beside FSDP2 with CPUOffloadPolicy (its parameters on the CPU): first loss bit for bit
    (the same weights), every later loss and the weights within what STEPS AdamW steps can move
    two runs whose gradients differ in summation order apart (tests/numerics.py)."""
    world, results = runs
    fsdp2 = results["fsdp2"][0]
    assert results["fsdp2"][0]["devices"] == {"cpu"}
    ours = results["fp32/foreach/on"]
    assert ours[0]["losses"][0] == fsdp2["losses"][0]
    full = assemble([r["pieces"] for r in ours])
    bound = adam_divergence_bound(LR, STEPS)
    for name, value in fsdp2["full"].items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=bound, msg=lambda m, n=name: f"{n}: {m}")


def test_offloaded_buffers_are_the_host_ones(runs):
    """By data pointers: the sharded parameters view the host master shard, which is not the
    compute buffer (no compute shard aliases it, as it does without offload); the gathered
    parameters a forward computes with live in the device's full buffer, in the compute dtype;
    the sharded gradients view the host gradient shard, not the reduce-scatter's input; the
    optimizer's state is on the host device."""
    world, results = runs
    for rank, r in enumerate(results["placement"]):
        assert r["state_on_host"], rank
        for i, g in enumerate(r["groups"]):
            assert g["host"] == ("cpu", True), (rank, i, g)
            assert g["compute_has_no_local"] and g["params_in_master"], (rank, i, g)
            assert g["grads_in_shard"] and g["grad_shard_not_full"], (rank, i, g)
            if g["gathered"] is not None:  # the blocks (the root has no hook)
                assert all(s != g["master"] and d == torch.bfloat16 for s, d in g["gathered"]), (rank, i, g)


def test_offloaded_checkpoints_move_to_and_from_offload(runs):
    """torch DCP with get_state_dict / set_state_dict: an offloaded run resumes without offload
    and the reverse (and through vz.checkpoint); the loaded shards and one more step equal the
    run that saved, bit for bit."""
    world, results = runs
    for rank, r in enumerate(results["checkpoint"]):
        assert len(r) == 3, r
        for way, (loaded, stepped) in r.items():
            assert loaded and stepped, (rank, way, loaded, stepped)


def test_offload_policy_is_checked():
    """torch's OffloadPolicy() means no offload; anything else is refused naming what is taken."""
    from vescale_zero.runtime.offload import HostOffload, resolve_offload_policy
    assert resolve_offload_policy(None) is None and resolve_offload_policy(OffloadPolicy()) is None
    assert resolve_offload_policy(CPUOffloadPolicy(pin_memory=False)) == HostOffload(pin_memory=False)
    assert not HostOffload(pin_memory=True).pins(torch.device("cpu"))  # nothing to pin for on a CPU
    with pytest.raises(TypeError, match="CPUOffloadPolicy"):
        resolve_offload_policy("cpu")
