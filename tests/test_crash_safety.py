"""Crash safety: a rank killed (SIGKILL) in the middle of a save leaves the previous
checkpoint loadable and ``latest`` unchanged; the half-written one is refused by name.

Each case: 2 ranks train, save checkpoint A (``latest`` -> A, every rank's pieces kept
aside), train on, and save B, during which one rank kills itself half-way through writing a
file. The survivor must raise (a dead peer), not hang. A fresh launch then loads ``latest``
and must hold exactly A's pieces; loading B, or what B's save left behind, must fail with a
:class:`~vescale_zero.checkpoint.CheckpointError`.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tests.distributed import run_on_ranks, run_with_a_killed_rank
from tests.models import AwkwardLM, assemble, local_pieces, make_batches
from tests.test_checkpoint import GLOBAL_BATCH, _build, _steps
from vescale_zero import checkpoint
from vescale_zero.checkpoint import sharded


def _die_half_way(write, victim_file):
    """``write`` (a writer of ``vescale_zero.checkpoint.sharded``), then the file it wrote
    cut to half its bytes, then SIGKILL: a process killed while writing that file."""

    def dying(ckpt, *args, **kwargs):
        out = write(ckpt, *args, **kwargs)
        path = os.path.join(ckpt, victim_file) if victim_file else out
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        os.kill(os.getpid(), signal.SIGKILL)

    return dying


KILLS = {  # victim rank, the writer it dies in, the file it leaves half-written
    "rank file of rank 1": (1, "write_rank_file", None),
    "metadata of rank 0 (publishing)": (0, "write_metadata", checkpoint.format.METADATA_FILE),
}


def _save_a_then_die_in_b(rank, world_size, directory, kill):
    victim, writer, file = KILLS[kill]
    model, opt = _build(0, "row")
    _steps(model, opt, make_batches(1, GLOBAL_BATCH), rank, world_size)
    checkpoint.save(os.path.join(directory, "A"), model, opt, extra={"step": 1})
    if rank == 0:
        checkpoint.write_latest(directory, "A")
    torch.save(local_pieces(model), os.path.join(directory, f"pieces-A-{rank}.pt"))
    _steps(model, opt, make_batches(2, GLOBAL_BATCH)[1:], rank, world_size)
    if rank == victim:
        setattr(sharded, writer, _die_half_way(getattr(sharded, writer), file))
    try:
        checkpoint.save(os.path.join(directory, "B"), model, opt, extra={"step": 2})
        if rank == 0:
            checkpoint.write_latest(directory, "B")
    except Exception as e:  # noqa: BLE001 - the survivor's collective with the dead rank
        return f"{type(e).__name__}: {e}"
    return "saved B"


def _refusal(fn) -> str:
    try:
        fn()
    except checkpoint.CheckpointError as e:
        return str(e)
    return "loaded"


def check_only_a_survives(directory: str, world_size: int) -> None:
    """Offline (no process group): ``latest`` names A; A is whole and checksummed and
    holds exactly the pieces its ranks had; B was never published, and what its save left
    (a temporary directory) is refused as partial."""
    assert checkpoint.read_latest(directory) == "A"
    saved = checkpoint.consolidate(os.path.join(directory, "A"))
    pieces = assemble([torch.load(os.path.join(directory, f"pieces-A-{r}.pt")) for r in range(world_size)])
    assert pieces and all(torch.equal(saved[name], value) for name, value in pieces.items())
    leftovers = sorted(n for n in os.listdir(directory) if n.startswith("B"))
    assert leftovers and all(n.startswith("B.tmp-") for n in leftovers), leftovers
    assert "no checkpoint at" in _refusal(lambda: checkpoint.consolidate(os.path.join(directory, "B")))
    for name in leftovers:
        refusal = _refusal(lambda name=name: checkpoint.consolidate(os.path.join(directory, name)))
        assert "partial checkpoint" in refusal or "is corrupt" in refusal, refusal


@pytest.mark.parametrize("kill", sorted(KILLS))
def test_a_rank_killed_mid_save_leaves_the_last_checkpoint(tmp_path, kill):
    """Killed half-way through its rank file (rank 1), or through the metadata that
    publishes the checkpoint (rank 0): the survivor raises at once (gloo: connection closed
    by peer); A stays ``latest``, whole and exact. (The DeepSpeed case below also loads the
    surviving checkpoint on fresh ranks through the same ``checkpoint.load``.)"""
    directory = str(tmp_path)
    victim = KILLS[kill][0]
    survivors = run_with_a_killed_rank(_save_a_then_die_in_b, 2, victim, directory, kill, collective_timeout=30)
    for rank, outcome in survivors.items():
        assert outcome != "saved B", (rank, outcome)  # it saw the dead peer and raised
    check_only_a_survives(directory, 2)


# ---- DeepSpeed's engine.save_checkpoint under stage "ragged" ---------------------------------


def _engine(rank, world_size, seed):
    from tests.test_deepspeed import _deepspeed, ds_config

    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed = _deepspeed()
    engine, *_ = deepspeed.initialize(model=AwkwardLM(seed=seed), config=ds_config("ragged", world_size))
    return engine


def _ds_save_a_then_die_in_b(rank, world_size, directory):
    from tests.test_deepspeed import GLOBAL_BATCH as DS_BATCH
    from tests.test_deepspeed import _train_steps

    engine = _engine(rank, world_size, 0)
    batches = make_batches(2, DS_BATCH)
    _train_steps(engine, batches[:1], rank, world_size)
    engine.save_checkpoint(directory, tag="A", client_state={"epoch": 1})
    torch.save(local_pieces(engine.module), os.path.join(directory, f"pieces-A-{rank}.pt"))
    _train_steps(engine, batches[1:], rank, world_size)
    if rank == 1:
        sharded.write_rank_file = _die_half_way(sharded.write_rank_file, None)
    try:
        engine.save_checkpoint(directory, tag="B", client_state={"epoch": 2})
    except Exception as e:  # noqa: BLE001 - the survivor's collective with the dead rank
        return f"{type(e).__name__}: {e}"
    return "saved B"


def _ds_load_latest(rank, world_size, directory):
    engine = _engine(rank, world_size, 99)
    path, client = engine.load_checkpoint(directory)
    want = torch.load(os.path.join(directory, f"pieces-A-{rank}.pt"))
    got = local_pieces(engine.module)
    engine.save_16bit_model(os.path.join(directory, "whole"))  # the 16-bit (here fp32) whole model
    return {"path": path, "client": client, "steps": engine.global_steps, "names": sorted(want),
            "equal": sorted(k for k in want if torch.equal(want[k][3], got[k][3])),
            "refusal": _refusal(lambda: engine.load_checkpoint(directory, tag="B"))}


@pytest.mark.slow  # ~20 s on 2 cores
def test_a_rank_killed_in_deepspeed_save_checkpoint_leaves_latest(tmp_path):
    """DeepSpeed's ``engine.save_checkpoint`` (stage "ragged", 2 ranks): rank 1 killed
    half-way through its file of tag B. The survivor raises; ``latest`` still names A, which
    ``engine.load_checkpoint(dir)`` on 2 fresh ranks loads with its exact pieces, client
    state and step count; ``load_checkpoint(dir, tag="B")`` is refused by name. Its
    ``save_16bit_model`` (``full_state_dict`` streamed, rank 0 only) then writes A's values."""
    pytest.importorskip("deepspeed")
    directory = str(tmp_path)
    survivors = run_with_a_killed_rank(_ds_save_a_then_die_in_b, 2, 1, directory, collective_timeout=30)
    assert survivors[0] != "saved B", survivors
    check_only_a_survives(directory, 2)
    for rank, r in enumerate(run_on_ranks(_ds_load_latest, 2, directory, timeout=300)):
        assert r["path"].endswith(os.sep + "A") and r["client"] == {"epoch": 1} and r["steps"] == 1, (rank, r)
        assert r["equal"] == r["names"] and r["names"], (rank, sorted(set(r["names"]) - set(r["equal"])))
        assert "no checkpoint at" in r["refusal"] and os.path.join(directory, "B") in r["refusal"], r["refusal"]
    whole = torch.load(os.path.join(directory, "whole", "pytorch_model.bin"))
    pieces = assemble([torch.load(os.path.join(directory, f"pieces-A-{r}.pt")) for r in range(2)])
    assert pieces and all(torch.equal(whole[name], value) for name, value in pieces.items())


def test_a_resave_killed_between_its_renames_names_the_previous_checkpoint(tmp_path):
    """Re-saving a tag moves the old checkpoint to ``TAG.old-<id>`` and the new one in: a
    kill between the two renames leaves no ``TAG``, and loading it names the old one and the
    rename that restores it (offline: no process group)."""
    from vescale_zero.checkpoint.format import write_whole

    path = str(tmp_path / "A")
    write_whole(path, {"w": torch.arange(6.0)})
    os.replace(path, path + ".old-123")  # the first rename, then the kill
    with pytest.raises(checkpoint.CheckpointError, match=r"no checkpoint at .*A\.old-123.* rename that back to 'A'"):
        checkpoint.consolidate(path)
    os.replace(path + ".old-123", path)
    assert torch.equal(checkpoint.consolidate(path)["w"], torch.arange(6.0))
