"""torch's own utilities on ``fully_shard`` parameters mean what they mean on FSDP2 or DDP.

A sharded parameter is a DTensor (``RaggedDTensor``: global shape, RaggedShard placement,
its local tensor a view of the group's shard), so a loop written for FSDP2 or DDP trains
and saves the same thing here: torch's ``clip_grad_norm_``, parameter groups by ``p.ndim``,
``requires_grad_()`` after sharding, ``load_state_dict(assign=True)``, ``p.data = t``,
``torch.distributed.checkpoint`` with ``get_state_dict`` / ``set_state_dict`` at another world
size and granularity, and from / to FSDP2's own checkpoints. Each case compares with the
unsharded model trained on the whole batch (DDP's numbers) or with the saved values.

Tolerances: SGD's update is ``lr * (g + wd * w)`` plus momentum ``m`` (linear in the past
gradients), so a sharded run differs from the unsharded one only through the gradients'
summation order across ranks: each gradient element within a few ulps of fp32 (eps = 1.2e-7)
of its magnitude (|g| < 1 here). Over ``s`` steps a weight moves by at most
``lr * s * (1 + m + m^2 ...) * err``: 0.1 * 3 * 2.71 * 8 * eps = 7.7e-7, so atol 1e-6 (with
rtol 1e-6 for the larger weights). A real error (a rank's local norm, a missing weight decay, a
frozen parameter trained) moves weights by >= 1e-4 (measured on the broken code: see the note).
Loading is a copy: bit-exact.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

import vescale_zero as vz
from tests.distributed import run_cases_on_ranks
from tests.models import AwkwardLM, make_batches, rank_slice
from vescale_zero.optim import AdamW8bit, Shampoo

GLOBAL_BATCH = 12  # divisible by 1, 2, 3, 4 ranks
RTOL, ATOL = 1e-6, 1e-6


def _sharded(seed: int = 0, granularity="row") -> torch.nn.Module:
    model = AwkwardLM(seed=seed)
    for block in model.blocks:
        vz.fully_shard(block, granularity=granularity)
    return vz.fully_shard(model, granularity=granularity)


def _fsdp2(seed: int = 0) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = AwkwardLM(seed=seed)
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def _values(model: torch.nn.Module) -> dict:
    """Every parameter's whole value (a collective for sharded ones)."""
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def _single_thread(fn):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def _sgd_loop(model, batches, rank, world, shard, make_opt, clip=None, before_step=None):
    opt = make_opt(model)
    norms = []
    for step, batch in enumerate(batches):
        x, y = rank_slice(batch, rank, world) if shard else batch
        model(x, y).backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
            norms.append(norm.item())  # as training loops log it
        if before_step is not None:
            before_step(model, step)
        opt.step()
        opt.zero_grad()
    return norms


def _compare(rank, world, make_opt, clip=None, before_step=None, steps=3):
    batches = make_batches(steps, GLOBAL_BATCH)
    ref = AwkwardLM(seed=0)
    ref_norms = _single_thread(lambda: _sgd_loop(ref, batches, rank, world, False, make_opt, clip, before_step))
    model = _sharded()
    norms = _sgd_loop(model, batches, rank, world, True, make_opt, clip, before_step)
    return {"norms": norms, "ref_norms": ref_norms, "values": _values(model), "ref": _values(ref)}


# ---- the cases -------------------------------------------------------------------------------
def _sgd(model):
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


def _clip_case(rank, world):
    """torch.nn.utils.clip_grad_norm_ on the model's parameters: the global norm, on every rank."""
    return _compare(rank, world, _sgd, clip=0.05)


def _ndim_groups(model):
    """nanoGPT / torchtitan: weight decay on matrices only, split by p.ndim."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    other = [p for p in params if p.ndim < 2]
    return torch.optim.SGD([{"params": decay, "weight_decay": 0.5}, {"params": other, "weight_decay": 0.0}],
                           lr=0.1)


def _ndim_case(rank, world):
    out = _compare(rank, world, _ndim_groups)
    model = _sharded()
    out["shapes"] = sorted(tuple(p.shape) for p in model.parameters())
    out["ref_shapes"] = sorted(tuple(p.shape) for p in AwkwardLM(seed=0).parameters())
    return out


def _all_params_sgd(model):
    return torch.optim.SGD(list(model.parameters()), lr=0.1)


def _staged_freezing(model, step):
    """After the first step: freeze fc1 of block 0, unfreeze block 1's gate (frozen when built)."""
    if step == 0:
        model.blocks[0].fc1.weight.requires_grad_(False)
        model.blocks[1].gate.requires_grad_(True)


def _requires_grad_case(rank, world):
    batches = make_batches(3, GLOBAL_BATCH)
    ref = AwkwardLM(seed=0)
    model = _sharded()

    def loop(m, shard):
        opt = _all_params_sgd(m)
        for step, batch in enumerate(batches):
            x, y = rank_slice(batch, rank, world) if shard else batch
            m(x, y).backward()
            opt.step()
            opt.zero_grad()
            _staged_freezing(m, step)

    _single_thread(lambda: loop(ref, False))
    loop(model, True)
    return {"values": _values(model), "ref": _values(ref), "start": _values(AwkwardLM(seed=0))}


def _assign_case(rank, world):
    """load_state_dict(full state dict, assign=True) into the sharded model, then train: as the
    unsharded model that loaded it; p.data = t and model.to(dtype) after sharding."""
    source = AwkwardLM(seed=5)
    batches = make_batches(2, GLOBAL_BATCH)
    model = _sharded()
    opt = _sgd(model)  # built before the load: it must train the loaded weights
    model.load_state_dict(copy.deepcopy(source.state_dict()), assign=True)
    loaded = _values(model)
    for batch in batches:
        model(*rank_slice(batch, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    ref = copy.deepcopy(source)
    _single_thread(lambda: _sgd_loop(ref, batches, rank, world, False, _sgd))
    out = {"loaded": loaded, "source": _values(source), "values": _values(model), "ref": _values(ref)}
    # p.data = t: the next forward computes with t
    new = torch.full(tuple(model.norm.weight.shape), 2.0)
    model.norm.weight.data = new
    out["data_set"] = model.norm.weight.full_tensor()
    try:
        model.to(torch.bfloat16)
        out["to_bf16"] = "no error"
    except ValueError as e:
        out["to_bf16"] = str(e)
    return out


def _hook_case(rank, world):
    """A forward hook reading a sharded block's weight, and the parameter count, before and after
    forwards (with and without grad): always the whole tensor's shape and values."""
    batch = make_batches(1, GLOBAL_BATCH)[0]
    out = {}
    for name, model in (("ours", _sharded()), ("ref", AwkwardLM(seed=0))):
        seen = []
        model.blocks[0].register_forward_hook(
            lambda m, _i, _o, seen=seen: seen.append((tuple(m.fc1.weight.shape), m.fc1.weight.norm().item())))
        counts = [sum(p.numel() for p in model.parameters())]
        model(*batch)
        counts.append(sum(p.numel() for p in model.parameters()))
        with torch.no_grad():
            model(*batch)
        counts.append(sum(p.numel() for p in model.parameters()))
        out[name] = {"seen": seen, "counts": counts}
    return out


BLOCK = 16  # 8-bit AdamW's quantization blocks; Shampoo's preconditioner blocks are BLOCK // 4 rows
STRUCTURED = {  # ours with block-wise optimizer state: (optimizer, the granularity that keeps its blocks whole)
    "ours-8bit": (lambda ps: AdamW8bit(ps, lr=1e-2, block=BLOCK), AdamW8bit.granularity(BLOCK)),
    "ours-shampoo": (lambda ps: Shampoo(ps, lr=1e-2, block=BLOCK // 4), Shampoo.granularity(BLOCK // 4)),
}


def _optimizer(kind, model):
    if kind in STRUCTURED:
        return STRUCTURED[kind][0](model.parameters())
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _model(kind, seed, granularity):
    if kind == "fsdp2":
        return _fsdp2(seed=seed)
    return _sharded(seed=seed, granularity=STRUCTURED[kind][1] if kind in STRUCTURED else granularity)


def _dcp_save(rank, world, kind, path):
    """Train 2 AdamW steps, save with DCP's get_state_dict; return what was saved (whole values)."""
    model = _model(kind, 0, "row")
    opt = _optimizer(kind, model)
    for batch in make_batches(2, GLOBAL_BATCH):
        model(*rank_slice(batch, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    moments = {n: {k: v.full_tensor() for k, v in st.items() if isinstance(v, DTensor)}
               for n, st in optim_sd["state"].items()}
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"values": _values(model), "moments": moments, "full": full}


def _dcp_load(rank, world, kind, path):
    """A fresh model (another seed) and optimizer resume from ``path``; then one more step."""
    model = _model(kind, 7, "element")
    opt = _optimizer(kind, model)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    model_sd, optim_sd = get_state_dict(model, opt)
    moments = {n: {k: v.full_tensor() for k, v in st.items() if isinstance(v, DTensor)}
               for n, st in optim_sd["state"].items()}
    values = _values(model)
    batch = make_batches(3, GLOBAL_BATCH)[2]
    model(*rank_slice(batch, rank, world)).backward()
    opt.step()
    return {"values": values, "moments": moments, "after": _values(model)}


# ---- the tests ---------------------------------------------------------------------------------
def _close(got: dict, want: dict, case: str, rtol=RTOL, atol=ATOL) -> None:
    assert set(got) == set(want), (case, sorted(set(got) ^ set(want)))
    for name, value in got.items():
        torch.testing.assert_close(value, want[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{case} {n}: {m}")


@pytest.mark.parametrize("world", [2, 3])
def test_torch_utilities_on_sharded_parameters(world):
    cases = {"clip": (_clip_case, ()), "ndim": (_ndim_case, ()), "requires_grad": (_requires_grad_case, ()),
             "assign": (_assign_case, ()), "hook": (_hook_case, ())}
    results = run_cases_on_ranks(cases, world)

    for r in results["clip"]:  # the global norm on every rank, clipping active
        assert all(n > 0.05 for n in r["ref_norms"]), r["ref_norms"]
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(r["ref_norms"]), rtol=RTOL, atol=0)
        _close(r["values"], r["ref"], "clip_grad_norm_")

    for r in results["ndim"]:
        assert r["shapes"] == r["ref_shapes"]  # parameters report their global shapes
        _close(r["values"], r["ref"], "p.ndim groups")

    for r in results["requires_grad"]:
        _close(r["values"], r["ref"], "requires_grad_ after sharding")
        frozen, unfrozen = "blocks.0.fc1.weight", "blocks.1.gate"
        assert not torch.equal(r["values"][unfrozen], r["start"][unfrozen]), "the unfrozen gate never trained"
        assert not torch.equal(r["values"][frozen], r["start"][frozen])  # it trained in step 1, then stopped

    for r in results["assign"]:
        _close(r["loaded"], r["source"], "assign=True load", rtol=0, atol=0)
        _close(r["values"], r["ref"], "training after assign=True")
        assert torch.equal(r["data_set"], torch.full_like(r["data_set"], 2.0))
        assert "mp_policy=MixedPrecisionPolicy" in r["to_bf16"], r["to_bf16"]

    for r in results["hook"]:
        assert r["ours"]["counts"] == r["ref"]["counts"], (r["ours"]["counts"], r["ref"]["counts"])
        assert [s for s, _ in r["ours"]["seen"]] == [s for s, _ in r["ref"]["seen"]]
        torch.testing.assert_close([n for _, n in r["ours"]["seen"]], [n for _, n in r["ref"]["seen"]],
                                   rtol=RTOL, atol=0)


@pytest.mark.slow
def test_dcp_checkpoints_move_between_world_sizes_and_fsdp2(tmp_path):
    """DCP save at 2 ranks (ours, row granularity; FSDP2), load at 3 (ours at element
    granularity; FSDP2) in every direction, and ours from 3 ranks back to 2: the loaded weights
    and Adam moments are the saved ones bit for bit, and the next step trains from them as the
    source system does. Block-wise state (8-bit AdamW's uint8 codes and fp32 absmax per block;
    Shampoo's preconditioners per block) comes back bit for bit, dtypes kept, at 3 ranks whose
    pieces hold other blocks."""
    paths = {kind: os.fspath(tmp_path / kind) for kind in ("ours", "fsdp2", *STRUCTURED)}
    saved = run_cases_on_ranks({kind: (_dcp_save, (kind, paths[kind])) for kind in paths}, 2)
    loads = {f"{src}->{dst}": (_dcp_load, (dst, paths[src])) for src in ("ours", "fsdp2") for dst in ("ours", "fsdp2")}
    loads.update({f"{kind}->{kind}": (_dcp_load, (kind, paths[kind])) for kind in STRUCTURED})  # per-block state
    three = os.fspath(tmp_path / "ours-at-3")
    loads["save at 3"] = (_dcp_save, ("ours", three))  # and back from 3 ranks to 2
    loaded = run_cases_on_ranks(loads, 3)
    saved_at_3 = loaded.pop("save at 3")[0]
    back = run_cases_on_ranks({"ours@3->ours@2": (_dcp_load, ("ours", three))}, 2)["ours@3->ours@2"]
    for r in back:
        _close(r["values"], saved_at_3["values"], "3 -> 2", rtol=0, atol=0)
        for name, moments in saved_at_3["moments"].items():
            _close(r["moments"][name], moments, f"3 -> 2 optimizer state of {name}", rtol=0, atol=0)
    per_block = {"ours-8bit": {"exp_avg_absmax", "exp_avg_sq_absmax"}, "ours-shampoo": {"L", "Li", "R", "Ri"}}
    for kind, keys in per_block.items():  # the per-block state is among what was compared
        states = saved[kind][0]["moments"]
        assert any(keys <= set(m) for m in states.values()), (kind, states.keys())
    for case, results in loaded.items():
        src = case.split("->")[0]
        want = saved[src][0]
        for r in results:
            _close(r["values"], want["values"], case, rtol=0, atol=0)
            for name, moments in want["moments"].items():
                _close(r["moments"][name], moments, f"{case} optimizer state of {name}", rtol=0, atol=0)
    # the next step from the same state: ours and FSDP2 agree (AdamW, same gradients up to summation order)
    for src in ("ours", "fsdp2"):
        _close(loaded[f"{src}->ours"][0]["after"], loaded[f"{src}->fsdp2"][0]["after"], f"step after {src}",
               rtol=1e-5, atol=1e-6)
    # the full state dict (full_state_dict + cpu_offload) is the whole model on rank 0, as FSDP2 gives it
    for kind in paths:
        first, *others = saved[kind]
        assert set(first["full"]) >= set(first["values"]), (kind, sorted(set(first["values"]) - set(first["full"])))
        _close({k: first["full"][k] for k in first["values"]}, first["values"], f"{kind} full_state_dict", rtol=0,
               atol=0)
        assert all(r["full"] == {} for r in others), kind
