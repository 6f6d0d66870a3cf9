"""Optimizer state in files, stepped group by group (vescale_zero/optim/state_files.py), beside
the same optimizer with its state in memory: the weights and the state are equal bit for bit
(the step is element-wise, and each group's parameters step exactly as in one call:
[Note: stepping group by group]); save / resume; the tracker's peak state bytes; corrupt files."""

from __future__ import annotations

import gc
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist

import vescale_zero as vz
from tests.distributed import run_cases_on_ranks
from tests.models import AwkwardLM, local_pieces, make_batches, rank_slice
from vescale_zero.optim import AdamW8bit, StateFileError, offload_state_to_files
from vescale_zero.ragged_tensor import local_piece
from vescale_zero.testing.live_bytes import LiveBytes

BLOCK = 13  # AdamW8bit's block: several per AwkwardLM tensor (as tests/test_optim_8bit.py)


def _shared_dir(base: str) -> str:
    """A fresh directory under ``base``, the same on every rank (each writes its own files in it)."""
    path = [tempfile.mkdtemp(prefix="state-", dir=base) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def _model_and_opt(kind: str):
    model = AwkwardLM(seed=0)
    if kind == "8bit":
        vz.fully_shard_layers(model, granularity=AdamW8bit.granularity(BLOCK))
        params = [p for p in model.parameters() if p.requires_grad]
        return model, AdamW8bit(params, lr=1e-2, weight_decay=0.1, block=BLOCK)
    vz.fully_shard_layers(model)
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **{kind: True})


def _batches(rank, world_size, steps=5):
    return [rank_slice(b, rank, world_size) for b in make_batches(steps, 12)]


def _train(model, opt, batches):
    for x, y in batches:
        model(x, y).backward()
        opt.step()
        opt.zero_grad()


def _weights(model):
    return {name: values for name, (_, _, _, values) in local_pieces(model).items()}


def _same_weights(a, b) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)


def _same_state_dict(a: dict, b: dict) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    for i, sa in a["state"].items():
        sb = b["state"][i]
        if sa.keys() != sb.keys():
            return False
        for k, va in sa.items():
            vb = sb[k]
            if torch.is_tensor(va):
                if type(va) is not type(vb) or not torch.equal(local_piece(va), local_piece(vb)):
                    return False
            elif va != vb:
                return False
    return True


def _parity(rank, world_size, base, kind, buffer_count):
    """In memory vs in files, same optimizer, 5 steps: weights and state_dict() equal."""
    batches = _batches(rank, world_size)
    ref_model, ref_opt = _model_and_opt(kind)
    _train(ref_model, ref_opt, batches)
    model, opt = _model_and_opt(kind)
    files = offload_state_to_files(opt, model, _shared_dir(base), buffer_count=buffer_count)
    _train(model, opt, batches)
    held = len(opt.state._resident) + len(opt.state._pending)  # state tensors held between steps
    out = {"weights": _same_weights(ref_model, model), "state": _same_state_dict(ref_opt.state_dict(),
                                                                                 opt.state_dict()),
           "held": held,
           "files": len([f for f in os.listdir(files.files.directory) if f.startswith(f"rank{rank:05d}-")])}
    files.close()
    out["closed_state"] = _same_state_dict(ref_opt.state_dict(), opt.state_dict())  # back in memory
    return out


def _resume(rank, world_size, base, kind):
    """2 steps in files, vz.checkpoint save / load into a fresh model whose optimizer state is
    in files, 3 more; and the same through opt.state_dict() / load_state_dict(): both equal 5
    uninterrupted steps in memory."""
    batches = _batches(rank, world_size)
    ref_model, ref_opt = _model_and_opt(kind)
    _train(ref_model, ref_opt, batches)
    model, opt = _model_and_opt(kind)
    offload_state_to_files(opt, model, _shared_dir(base))
    _train(model, opt, batches[:2])
    path = os.path.join(_shared_dir(base), "ckpt")
    vz.checkpoint.save(path, model, opt)
    torch_sd = opt.state_dict()

    resumed, resumed_opt = _model_and_opt(kind)
    offload_state_to_files(resumed_opt, resumed, _shared_dir(base))
    vz.checkpoint.load(path, resumed, resumed_opt)
    _train(resumed, resumed_opt, batches[2:])

    again, again_opt = _model_and_opt(kind)  # torch's own state dict, loaded into files
    vz.checkpoint.load(path, again)  # the weights only
    offload_state_to_files(again_opt, again, _shared_dir(base))
    again_opt.load_state_dict(torch_sd)
    _train(again, again_opt, batches[2:])
    return {"checkpoint": _same_weights(ref_model, resumed), "state_dict": _same_weights(ref_model, again),
            "state": _same_state_dict(ref_opt.state_dict(), resumed_opt.state_dict())}


def _scheduled(rank, world_size, base):
    """An LR scheduler made before or after the state goes to files (both wrap ``opt.step``):
    the same weights as in memory, and no "scheduler stepped before the optimizer" warning."""
    batches = _batches(rank, world_size, steps=3)
    out = {}
    for when in ("memory", "before", "after"):
        model, opt = _model_and_opt("foreach")
        if when == "after":
            offload_state_to_files(opt, model, _shared_dir(base))
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        if when == "before":
            offload_state_to_files(opt, model, _shared_dir(base))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x, y in batches:
                model(x, y).backward()
                opt.step()
                scheduler.step()
                opt.zero_grad()
        out[when] = (_weights(model), [str(w.message) for w in caught if "lr_scheduler" in str(w.message)])
    same = {when: all(torch.equal(out["memory"][0][n], v) for n, v in out[when][0].items())
            for when in ("before", "after")}
    return {"same": same, "warnings": [w for _, ws in out.values() for w in ws]}


def _state_locals(opt):
    return [local_piece(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]


def _step_under_tracker(model, opt, batch):
    model(*batch).backward()
    gc.collect()
    with LiveBytes() as tracker:
        opt.step()
    opt.zero_grad()
    return tracker


def _tracker(rank, world_size, base):
    """LiveBytes over the third step: the state bytes alive at the peak are every group's in
    memory, the largest group's (the staging buffer) with files, and the whole peak drops by
    at least the difference."""
    batches = _batches(rank, world_size, steps=3)
    model, opt = _model_and_opt("foreach")
    _train(model, opt, batches[:2])
    state = _state_locals(opt)
    total = sum(t.numel() * t.element_size() for t in state)
    mem = _step_under_tracker(model, opt, batches[2])
    mem_state = mem.split({k: "state" for k in mem.keys_of(state)}).get("state", 0)
    del model, opt, state

    model, opt = _model_and_opt("foreach")
    files = offload_state_to_files(opt, model, _shared_dir(base))
    _train(model, opt, batches[:2])
    on_disk = files.payload_bytes()
    hosts = files.staging_buffers()
    ours = _step_under_tracker(model, opt, batches[2])
    files_state = ours.split({k: "state" for k in ours.keys_of(hosts)}).get("state", 0)
    return {"total": total, "mem_state": mem_state, "files_state": files_state, "largest": max(on_disk.values()),
            "sum_on_disk": sum(on_disk.values()), "buffer": files.buffer_bytes(), "mem_peak": mem.peak,
            "files_peak": ours.peak}


def _corrupt(rank, world_size, base):
    """A truncated file, then an overwritten header: each a clear error, not garbage state."""
    batches = _batches(rank, world_size, steps=3)
    model, opt = _model_and_opt("foreach")
    files = offload_state_to_files(opt, model, _shared_dir(base))
    _train(model, opt, batches[:2])
    messages = []
    path = files.files.path(1)
    size = os.path.getsize(path)
    os.truncate(path, size - 8)
    model(*batches[2]).backward()
    try:
        opt.step()
    except StateFileError as e:
        messages.append(str(e))
    os.truncate(path, size)  # the right size again, its last bytes zero: only the header can tell now
    with open(files.files.path(0), "r+b") as f:
        f.write(b"garbage!")
    try:
        opt.state_dict()
    except StateFileError as e:
        messages.append(str(e))
    return messages


def _directories(rank, world_size, base):
    """A missing directory, a file for a directory, and two optimizers sharing one (not writable: the
    tests run as root, whom permissions do not stop)."""
    model, opt = _model_and_opt("foreach")
    base = _shared_dir(base)
    errors = []
    for bad in (os.path.join(base, "missing"), __file__):
        try:
            offload_state_to_files(opt, model, bad)
        except (FileNotFoundError, NotADirectoryError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    first = offload_state_to_files(opt, model, base)
    other_model, other_opt = _model_and_opt("foreach")
    try:
        offload_state_to_files(other_opt, other_model, base)
    except RuntimeError as e:
        errors.append(str(e))
    first.close()
    offload_state_to_files(other_opt, other_model, base)  # free again once the first one closed
    del other_model, other_opt
    gc.collect()  # ... or once its optimizer is gone
    offload_state_to_files(opt, model, base)
    return errors


_CASES = {
    "foreach": (_parity, ("foreach", 1)),
    "fused": (_parity, ("fused", 1)),
    "8bit": (_parity, ("8bit", 1)),
    "foreach_read_ahead": (_parity, ("foreach", 2)),
    "resume": (_resume, ("foreach",)),
    "resume_8bit": (_resume, ("8bit",)),
}
_TWO_RANKS_ONLY = {"tracker": (_tracker, ()), "corrupt": (_corrupt, ()), "directories": (_directories, ()),
                   "scheduler": (_scheduled, ())}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"{ws}ranks")
def results(request, tmp_path_factory):
    base = str(tmp_path_factory.mktemp(f"state-files-{request.param}ranks"))
    cases = dict(_CASES, **(_TWO_RANKS_ONLY if request.param == 2 else {}))
    return request.param, run_cases_on_ranks({name: (fn, (base, *args)) for name, (fn, args) in cases.items()},
                                             request.param)


@pytest.mark.parametrize("case", ["foreach", "fused", "8bit", "foreach_read_ahead"])
def test_state_in_files_equals_state_in_memory_bit_for_bit(results, case):
    _, got = results
    for r in got[case]:
        assert r["weights"] and r["state"] and r["closed_state"], r
        assert r["held"] == 0  # between steps, no state is in memory
        assert r["files"] == 4  # this rank's: three groups' files and its lock


@pytest.mark.parametrize("case", ["resume", "resume_8bit"])
def test_save_and_resume_equal_an_uninterrupted_run(results, case):
    _, got = results
    for r in got[case]:
        assert r == {"checkpoint": True, "state_dict": True, "state": True}, r


@pytest.mark.parametrize("results", [2], indirect=True, ids=["2ranks"])
def test_tracker_peak_state_is_the_largest_group_not_the_sum(results):
    _, got = results
    for r in got["tracker"]:
        assert r["mem_state"] == r["total"]  # in memory: every group's state alive at the peak
        assert r["files_state"] == r["buffer"] == r["largest"] < r["sum_on_disk"]  # files: one group's
        assert r["largest"] < r["total"]
        # the whole step's peak drops by at least the state not held (the rest is the optimizer's
        # temporaries, which shrink from all parameters' to one group's)
        assert r["files_peak"] <= r["mem_peak"] - (r["total"] - r["largest"]), r


@pytest.mark.parametrize("results", [2], indirect=True, ids=["2ranks"])
def test_truncated_or_corrupt_state_file_is_a_clear_error(results):
    _, got = results
    for messages in got["corrupt"]:
        assert len(messages) == 2, messages
        assert "group00001.state" in messages[0] and "expected" in messages[0] and "truncated" in messages[0]
        assert "header that does not match" in messages[1] and "corrupt" in messages[1]


@pytest.mark.parametrize("results", [2], indirect=True, ids=["2ranks"])
def test_bad_or_shared_directory_is_refused(results):
    _, got = results
    for errors in got["directories"]:
        assert len(errors) == 3, errors
        assert errors[0].startswith("FileNotFoundError") and "does not exist" in errors[0]
        assert errors[1].startswith("NotADirectoryError")
        assert "in use by another optimizer" in errors[2] and "its own directory" in errors[2]


@pytest.mark.parametrize("results", [2], indirect=True, ids=["2ranks"])
def test_lr_scheduler_made_before_or_after_wraps_the_stepping(results):
    _, got = results
    for r in got["scheduler"]:
        assert r == {"same": {"before": True, "after": True}, "warnings": []}, r
