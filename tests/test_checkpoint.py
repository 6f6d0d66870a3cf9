"""Sharded checkpoints: resharding across world sizes and HSDP layouts, and refusing partial or corrupt ones."""

from __future__ import annotations

import os
import re
from typing import Dict, List

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import vescale_zero as vz
from tests.distributed import run_cases_on_ranks, run_on_ranks
from tests.models import AwkwardLM, assemble, local_pieces, make_batches, rank_slice
from vescale_zero import checkpoint

GLOBAL_BATCH = 12


def _steps(model, opt, batches, rank, world_size):
    for batch in batches:
        x, y = rank_slice(batch, rank, world_size)
        model(x, y).backward()
        vz.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()


def _build(seed, granularity, mp_policy=None, mesh=None):
    model = AwkwardLM(seed=seed)
    for block in model.blocks:
        vz.fully_shard(block, granularity=granularity, mp_policy=mp_policy, mesh=mesh)
    vz.fully_shard(model, granularity=granularity, mp_policy=mp_policy, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _phase(rank, world_size, path, phase, granularity):
    batches = make_batches(6, GLOBAL_BATCH)
    model, opt = _build(0 if phase != "resume" else 5, granularity)
    if phase == "first":
        _steps(model, opt, batches[:3], rank, world_size)
        checkpoint.save(path, model, opt, extra={"step": 3})
    elif phase == "resume":
        assert checkpoint.load(path, model, opt) == {"step": 3}
        _steps(model, opt, batches[3:], rank, world_size)
    else:
        _steps(model, opt, batches, rank, world_size)
    return local_pieces(model)


RESHARD_CASES = [(2, 3, ("row", "element")), (3, 1, ("element", "3rows")), (1, 4, ("row", "row"))]


@pytest.mark.parametrize("save_ranks,load_ranks,granularities", RESHARD_CASES)
@pytest.mark.slow
def test_reshard_on_load_then_continue(spawned, save_ranks, load_ranks, granularities):
    case = f"reshard {save_ranks}->{load_ranks}"
    resumed = assemble(spawned[f"{case} resume"])
    straight = assemble(spawned[f"{case} full"])
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=1e-6, atol=1e-7,
                                   msg=lambda m, name=name: f"{case}, {name}: {m}")


HSDP_CASES = [  # (save world, save mesh, load world, load mesh, granularities); a mesh is (replicas, shard)
    ("flat 2->2x2", 2, None, 4, (2, 2), ("row", "element")),
    ("2x2->flat 3", 4, (2, 2), 3, None, ("row", "row")),
    ("2x2->2x2", 4, (2, 2), 4, (2, 2), ("element", "element")),
]


def _hsdp_phase(rank, world_size, path, phase, granularity, mesh_shape):
    """:func:`_phase` on a 2-D (replicas x shard) mesh, or flat (``mesh_shape`` None); every
    rank trains on its own slice of the global batch; returns the full state dict."""
    mesh = None if mesh_shape is None else init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    batches = make_batches(6, GLOBAL_BATCH)
    model, opt = _build(0 if phase != "resume" else 5, granularity, mesh=mesh)
    if phase == "first":
        _steps(model, opt, batches[:3], rank, world_size)
        checkpoint.save(path, model, opt, extra={"step": 3})
    elif phase == "resume":
        assert checkpoint.load(path, model, opt) == {"step": 3}
        _steps(model, opt, batches[3:], rank, world_size)
    else:
        _steps(model, opt, batches, rank, world_size)
    return vz.full_state_dict(model)


def _pieces_per_name(path):
    """``{saved key: [(start, end), ...]}`` over every rank file of checkpoint ``path``."""
    meta = checkpoint.format.read_metadata(path)
    out: Dict[str, list] = {}
    for r in checkpoint.format.written_ranks(meta):
        f = checkpoint.format.read_rank_file(path, r, meta["sha256"][r])
        for key, (_, s, e, _) in list(f["params"].items()) + list(f["optim_states"].items()):
            out.setdefault(key, []).append((s, e))
    return out


@pytest.mark.parametrize("case,save_ranks,save_mesh,load_ranks,load_mesh,granularities", HSDP_CASES)
@pytest.mark.slow
def test_hsdp_checkpoint_is_written_once_and_loads_at_any_layout(spawned, case, save_ranks, save_mesh, load_ranks,
                                                                  load_mesh, granularities):
    """A checkpoint saved on a 2 x 2 (replicate x shard) mesh loads flat at 3 ranks and on
    2 x 2; one saved flat at 2 loads on 2 x 2: fp32 AdamW training resumed from it equals an
    uninterrupted run at the loading layout within 1e-6 (bit-exact from 2 x 2 to 2 x 2, where
    every step runs the same sums). Under HSDP only the first replica's shard group writes:
    ranks 2 and 3 write no file, and every element of every parameter and of its AdamW
    state is on disk exactly once; ``consolidate`` joins the files into the saved model."""
    resumed, straight = spawned[f"hsdp {case} resume"], spawned[f"hsdp {case} full"]
    for rank in range(load_ranks):  # every replica holds the same model
        assert all(torch.equal(resumed[rank][k], resumed[0][k]) for k in resumed[0]), (case, rank)
    diff = {k: (resumed[0][k] - straight[0][k]).abs().max().item() for k in straight[0]}
    if save_mesh == load_mesh:
        assert all(v == 0 for v in diff.values()), (case, {k: v for k, v in diff.items() if v})
    else:
        assert max(diff.values()) <= 1e-6, (case, {k: v for k, v in diff.items() if v > 1e-6})
    path = spawned.paths[f"hsdp {case}"]
    writers = save_ranks if save_mesh is None else save_mesh[1]
    assert sorted(os.listdir(path)) == ["common.pt", "metadata.json"] + [f"rank{r:05d}.pt" for r in range(writers)]
    meta = checkpoint.format.read_metadata(path)
    assert [d is not None for d in meta["sha256"]] == [r < writers for r in range(save_ranks)], meta["sha256"]
    numel = {k: v.numel() for k, v in straight[0].items()}
    pieces = _pieces_per_name(path)
    params = {name for name, _ in AwkwardLM().named_parameters()}  # the head's weight (tied) is the embedding's
    assert {k.split("::")[0] for k in pieces} == params, params ^ {k.split("::")[0] for k in pieces}
    assert {k.split("::")[1] for k in pieces if "::" in k} == {"exp_avg", "exp_avg_sq"}
    for key, ranges in pieces.items():
        covered = torch.zeros(numel[key.split("::")[0]], dtype=torch.int32)
        for s, e in ranges:
            covered[s:e] += 1
        assert torch.all(covered == 1), (case, key, covered.tolist())
    saved, joined = spawned[f"hsdp {case} first"][0], checkpoint.consolidate(path)  # offline, from the files
    assert saved.keys() == joined.keys() and all(torch.equal(joined[k], saved[k]) for k in saved), case


def _load_only(rank, world_size, path):
    model, opt = _build(0, "row")
    checkpoint.load(path, model, opt)


@pytest.mark.slow
def test_partial_or_corrupt_checkpoints_are_refused(spawned):
    path = spawned.paths["corrupt"]  # saved by 2 ranks ("corrupt first")
    rank1 = os.path.join(path, "rank00001.pt")
    good = open(rank1, "rb").read()

    def refused(*fragments):
        with pytest.raises(AssertionError) as e:
            run_on_ranks(_load_only, 2, path)
        for f in fragments:
            assert f in str(e.value), (f, str(e.value)[-2000:])

    with open(rank1, "wb") as f:
        f.write(good[: len(good) // 2])  # truncated
    refused("CheckpointError", "rank00001.pt", "sha256")
    with open(rank1, "wb") as f:
        f.write(good[:-1] + bytes([good[-1] ^ 1]))  # one flipped bit
    refused("rank00001.pt", "corrupt")
    os.remove(rank1)
    refused("rank00001.pt", "missing")
    with open(rank1, "wb") as f:
        f.write(good)
    common = os.path.join(path, "common.pt")
    good_common = open(common, "rb").read()
    with open(common, "wb") as f:
        f.write(good_common[:-1] + bytes([good_common[-1] ^ 1]))
    refused("common.pt", "corrupt")
    with open(common, "wb") as f:
        f.write(good_common)
    os.remove(os.path.join(path, "metadata.json"))  # as if the writer died before publishing
    refused("metadata.json", "partial checkpoint")


def _load_after_forward(rank, world_size, path):
    """For fp32 and for bf16 compute: train 2 steps, save; then the output of the next
    batch from fresh models that loaded the checkpoint (a) before any forward, (b) after a
    forward with grad enabled and no backward, (c) after a forward under no_grad."""
    x, y = rank_slice(make_batches(3, GLOBAL_BATCH)[2], rank, world_size)
    bf16 = vz.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out = {}
    for precision, mp in (("fp32", None), ("bf16", bf16)):
        model, opt = _build(0, "row", mp)
        _steps(model, opt, make_batches(2, GLOBAL_BATCH), rank, world_size)
        checkpoint.save(f"{path}-{precision}", model, opt)
        for before in ("nothing", "forward", "no_grad forward"):
            fresh, _ = _build(7, "row", mp)  # other weights than the saved ones
            if before == "forward":
                fresh(x, y)
            elif before == "no_grad forward":
                with torch.no_grad():
                    fresh(x, y)
            checkpoint.load(f"{path}-{precision}", fresh)
            out[precision, before] = fresh(x, y).detach()
    return out


def test_load_after_a_forward_computes_with_the_loaded_weights(spawned):
    """Defect 1: the root group stays gathered after a forward without backward (and a
    bf16 group keeps its cast), so a load after a forward must not leave the next forward
    computing with the weights from before the load: its output equals, bit for bit, that
    of a model that loaded before any forward (fp32 and bf16 compute, 2 ranks)."""
    for rank, out in enumerate(spawned["load after forward"]):
        wrong = [(precision, before, out[precision, before].item(), out[precision, "nothing"].item())
                 for precision in ("fp32", "bf16") for before in ("forward", "no_grad forward")
                 if not torch.equal(out[precision, before], out[precision, "nothing"])]
        assert not wrong, (rank, wrong)


STRUCTURED_CFG = dict(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)


def _structured(name: str, block: int = 16, granularity=None):
    """A GPT sharded with the granularity the optimizer ``name`` needs, and the optimizer."""
    from vescale_zero.optim import AdamW8bit, Muon, Shampoo
    from vescale_zero.testing import GPT, GPTConfig

    model = GPT(GPTConfig(**STRUCTURED_CFG))
    if granularity is None:
        by_optimizer = {"adamw8bit": AdamW8bit.granularity(block), "shampoo": Shampoo.granularity(block)}
        granularity = by_optimizer.get(name, "row")
    vz.fully_shard_layers(model, granularity=granularity)
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "adamw8bit":
        return model, AdamW8bit(params, lr=1e-2, block=block)
    if name == "shampoo":
        return model, Shampoo(params, lr=1e-2, weight_decay=0.1, block=block, update_freq=2)
    return model, Muon(params, lr=0.02, weight_decay=0.1, adamw_lr=1e-3)


def _structured_phase(rank, world_size, name, path, phase, block=16, granularity=None):
    """'first': 2 steps, save at ``path``. 'resume': load it, save it again at ``path``+'.again'
    (no step in between), 2 more steps. 'full': 4 steps."""
    from vescale_zero.testing import SyntheticCorpus

    torch.manual_seed(0)
    model, opt = _structured(name, block, granularity)
    corpus = SyntheticCorpus(STRUCTURED_CFG["vocab_size"], STRUCTURED_CFG["seq_len"])
    steps = {"first": range(2), "resume": range(2, 4), "full": range(4)}[phase]
    if phase == "resume":
        try:
            checkpoint.load(path, model, opt)
        except checkpoint.CheckpointError as e:
            return str(e)
        checkpoint.save(path + ".again", model, opt)
    for step in steps:
        model(*corpus.batch(step, 12, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()
    if phase == "first":
        checkpoint.save(path, model, opt)
    return local_pieces(model)


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


STRUCTURED_CASES = [("adamw8bit", 2, 3), ("shampoo", 2, 3), ("muon", 3, 2), ("adamw8bit", 3, 1)]


@pytest.mark.parametrize("name,save_ranks,load_ranks", STRUCTURED_CASES)
@pytest.mark.slow
def test_structured_optimizer_state_reshards(spawned, name, save_ranks, load_ranks):
    """8-bit AdamW's codes and per-block scales, Shampoo's per-tile preconditioners and
    Muon's momentum, saved at one world size and loaded at another: the state the new ranks
    hold, saved again, consolidates to exactly the saved state (every code, scale and
    preconditioner), and training continues like an uninterrupted run at the new size.
    Stated tolerance: the first steps ran at another world size, whose gradient sums round
    differently (~1e-7). Muon's fp32 state keeps that at 1e-6; an 8-bit code or a Shampoo
    eigenvector can flip on it, moving a few elements by up to ~lr/20: at most 5e-4 and
    on at most 1% of the elements."""
    case = f"{name} {save_ranks}->{load_ranks}"
    path = spawned.paths[case]
    resumed = assemble(spawned[f"{case} resume"])
    before = checkpoint.consolidate(path, with_optimizer=True)
    after = checkpoint.consolidate(path + ".again", with_optimizer=True)
    assert before.keys() == after.keys(), case
    optimizer_keys = {k.split("::")[1] for k in before if "::" in k}
    expected = {"adamw8bit": {"exp_avg", "exp_avg_absmax", "exp_avg_sq", "exp_avg_sq_absmax"},
                "shampoo": {"momentum", "L", "Li", "R", "Ri", "exp_avg", "exp_avg_sq"},
                "muon": {"momentum_buffer", "exp_avg", "exp_avg_sq"}}[name]
    assert optimizer_keys == expected, (case, optimizer_keys)
    for key in before:
        assert _same(before[key], after[key]), (case, key)
    straight = assemble(spawned[f"{case} full"])
    d = STRUCTURED_CFG["d_model"]
    for param in [p for p in straight if p.endswith("qkv.bias")]:
        # The K bias's gradient is zero up to rounding (softmax ignores a shift of all
        # logits), and Adam scales that noise to full-size steps: it is left out here (its
        # state was compared exactly above).
        resumed[param], straight[param] = (torch.cat([t[:d], t[2 * d :]]) for t in (resumed[param], straight[param]))
    diffs = torch.cat([(resumed[p] - straight[p]).abs().flatten() for p in straight])
    if name == "muon":
        for param in straight:
            torch.testing.assert_close(resumed[param], straight[param], rtol=1e-6, atol=1e-6,
                                       msg=lambda m, param=param: f"{case}, {param}: {m}")
    else:
        assert diffs.max().item() <= 5e-4 and (diffs > 1e-6).float().mean().item() <= 0.01, (
            case, diffs.max().item(), (diffs > 1e-6).float().mean().item())


def test_per_block_state_on_pieces_that_split_its_blocks_is_refused(spawned):
    """8-bit AdamW state saved with blocks of 16, loaded at 3 ranks sharded by element (the
    pieces split blocks): refused on every rank, naming the parameter and the granularity
    that fixes it (never a block's scale given to two ranks)."""
    messages = spawned["per-block refused resume"]
    assert all(isinstance(m, str) for m in messages), ("every rank must refuse, not only some", messages)
    assert any("exp_avg" in m and "AdamW8bit.granularity(16)" in m for m in messages), messages


def test_consolidate_gives_the_unsharded_state_dict(tmp_path, spawned):
    """``vescale-zero consolidate`` joins the pieces of 3 ranks into the state dict of the
    unsharded model: it loads strictly into a plain AwkwardLM, with the trained values."""
    from vescale_zero.tools.cli import main

    path, out = spawned.paths["consolidate"], str(tmp_path / "full.pt")
    trained = assemble(spawned["consolidate first"])
    assert main(["consolidate", path, out, "--optimizer"]) == 0
    state = torch.load(out, weights_only=True)
    plain = AwkwardLM(seed=5)
    plain.load_state_dict({k: v for k, v in state.items() if "::" not in k}, strict=True)
    for name, value in trained.items():
        assert torch.equal(state[name], value), name
    assert {k.split("::")[1] for k in state if "::" in k} == {"exp_avg", "exp_avg_sq"}
    assert state["blocks.0.fc1.weight::exp_avg"].shape == state["blocks.0.fc1.weight"].shape
    from safetensors.torch import load_file

    st_out = str(tmp_path / "full.safetensors")
    assert main(["consolidate", path, st_out]) == 0
    tensors = load_file(st_out)
    plain.load_state_dict(tensors, strict=True)
    assert all(torch.equal(tensors[k], state[k]) for k in tensors)


# ---- migrating PyTorch FSDP2 (DCP) checkpoints ------------------------------------------


def _plain_steps(model, opt, batches, rank, world_size):
    for batch in batches:
        x, y = rank_slice(batch, rank, world_size)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()


def _fsdp2_then_ours(rank, world_size, src, phase):
    """'fsdp2': PyTorch FSDP2 trains 3 steps, saves with DCP (the torchtitan layout), and
    trains 3 more. 'ours': ``checkpoint.load`` of that DCP directory into ``fully_shard``
    at another world size (converted on the fly), then the same 3 more steps."""
    batches = make_batches(6, GLOBAL_BATCH)
    if phase == "fsdp2":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
        from torch.distributed.fsdp import fully_shard

        model = AwkwardLM(seed=0)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        _plain_steps(model, opt, batches[:3], rank, world_size)
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=src)
        saved = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        _plain_steps(model, opt, batches[3:], rank, world_size)
        final = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        return {"saved": {k: v.clone() for k, v in saved.items()}, "final": {k: v.clone() for k, v in final.items()}}
    model, opt = _build(99, "row")
    checkpoint.load(src, model, opt)
    loaded = local_pieces(model)
    moments = sum(1 for state in opt.state.values() if "exp_avg" in state)
    _plain_steps(model, opt, batches[3:], rank, world_size)
    return {"loaded": loaded, "final": local_pieces(model), "moments": moments}


def test_fsdp2_dcp_checkpoint_loads_and_training_continues(tmp_path, spawned):
    """An FSDP2 DCP checkpoint of 2 ranks loads into ``fully_shard`` on 3: the weights
    exactly, Adam's moments and steps, and the next 3 steps match FSDP2's own continuation
    (1e-6: another world size sums gradients in another order). The offline
    ``vescale-zero convert --from fsdp2`` writes the same checkpoint."""
    from vescale_zero.tools.cli import main

    src = spawned.paths["fsdp2"]
    theirs = spawned["fsdp2 fsdp2"][0]
    ours = spawned["fsdp2 ours"]
    loaded, final = assemble([r["loaded"] for r in ours]), assemble([r["final"] for r in ours])
    assert sum(r["moments"] for r in ours) > 0
    for name, value in loaded.items():
        assert torch.equal(value, theirs["saved"][name]), name
        torch.testing.assert_close(final[name], theirs["final"][name], rtol=1e-6, atol=1e-7,
                                   msg=lambda m, name=name: f"{name}: {m}")
    offline = str(tmp_path / "offline")
    assert main(["convert", "--from", "fsdp2", src, offline]) == 0
    a, b = (checkpoint.consolidate(p, with_optimizer=True) for p in (src + ".vescale", offline))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {k.split("::")[1] for k in a if "::" in k} == {"exp_avg", "exp_avg_sq"}
    assert main(["convert", "--from", "fsdp2", str(tmp_path), str(tmp_path / "x")]) == 2  # not a DCP directory
    assert main(["convert", "--from", "fsdp2", src, offline]) == 2  # the target exists


# ---- the spawned runs of the tests above, six spawns in all ----------------------------


class _Spawned(dict):
    """``{"<case> <phase>": [per-rank results]}``, with ``paths[case]``: its checkpoint."""

    paths: Dict[str, str]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> _Spawned:
    """Every spawned run of this file's tests but the refused loads, in six
    spawns of ranks instead of 37 (one per world size, in an order that puts each save
    before its load; muon saves at 3 and loads at 2, so 2 comes twice, and HSDP saves at 4 and
    loads at 3, so 3 comes twice). Each phase runs as
    it did in its own spawn; a failing one names its case (``run_cases_on_ranks``)."""
    root = tmp_path_factory.mktemp("spawned")
    paths = {case: str(root / re.sub(r"\W+", "_", case)) for case in
             [f"reshard {s}->{ld}" for s, ld, _ in RESHARD_CASES]
             + [f"{n} {s}->{ld}" for n, s, ld in STRUCTURED_CASES]
             + [f"hsdp {case}" for case, *_ in HSDP_CASES]
             + ["per-block refused", "consolidate", "fsdp2", "corrupt", "load after forward"]}
    # -2, -3: the second spawns at 2 and 3 (after 4, which saves what they load)
    phases: Dict[int, List[tuple]] = {ws: [] for ws in (2, 3, 1, 4, -2, -3)}
    for save, load, (g_save, g_load) in RESHARD_CASES:
        case = f"reshard {save}->{load}"
        phases[save].append((f"{case} first", _phase, (paths[case], "first", g_save)))
        phases[load].append((f"{case} resume", _phase, (paths[case], "resume", g_load)))
        phases[load].append((f"{case} full", _phase, (paths[case], "full", g_load)))
    for name, save, load in STRUCTURED_CASES:
        case = f"{name} {save}->{load}"
        phases[save].append((f"{case} first", _structured_phase, (name, paths[case], "first")))
        for phase in ("resume", "full"):
            phases[-load if (save, load) == (3, 2) else load].append(
                (f"{case} {phase}", _structured_phase, (name, paths[case], phase)))
    for case, save, save_mesh, load, load_mesh, (g_save, g_load) in HSDP_CASES:
        path = paths[f"hsdp {case}"]
        phases[save].append((f"hsdp {case} first", _hsdp_phase, (path, "first", g_save, save_mesh)))
        for phase in ("resume", "full"):
            phases[-load if (save, load) == (4, 3) else load].append(
                (f"hsdp {case} {phase}", _hsdp_phase, (path, phase, g_load, load_mesh)))
    path = paths["per-block refused"]
    phases[2].append(("per-block refused first", _structured_phase, ("adamw8bit", path, "first")))
    phases[3].append(("per-block refused resume", _structured_phase, ("adamw8bit", path, "resume", 16, "element")))
    phases[3].append(("consolidate first", _phase, (paths["consolidate"], "first", "row")))
    phases[2].append(("fsdp2 fsdp2", _fsdp2_then_ours, (paths["fsdp2"], "fsdp2")))
    phases[3].append(("fsdp2 ours", _fsdp2_then_ours, (paths["fsdp2"], "ours")))
    phases[2].append(("corrupt first", _phase, (paths["corrupt"], "first", "row")))
    phases[2].append(("load after forward", _load_after_forward, (paths["load after forward"],)))
    out = _Spawned()
    out.paths = paths
    for ws, cases in phases.items():
        out.update(run_cases_on_ranks({key: (fn, args) for key, fn, args in cases}, abs(ws), timeout=500))
    return out
