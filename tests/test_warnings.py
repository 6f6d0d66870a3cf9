"""Our code prints no deprecation warnings; ``vz.checkpoint`` is reachable from ``import vescale_zero``.

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (FutureWarning on
every call, in favour of ``all_gather_single`` / ``reduce_scatter_single``); torch's decorator
attributes the warning to its own logging wrapper, so a ``module=`` warnings filter cannot tell
whose call it was. Here every ``warnings.warn`` of a FutureWarning / DeprecationWarning is
recorded with its stack: one raised while a frame of ours (``vescale_zero``, its integrations)
is on the stack, or attributed to a file of ours, is ours.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import traceback
import warnings
from typing import Iterator, List

import pytest
import torch

from tests.distributed import run_on_ranks
from tests.models import AwkwardLM, make_batches, rank_slice, train_steps

DEPRECATIONS = (FutureWarning, DeprecationWarning, PendingDeprecationWarning)
GLOBAL_BATCH = 12  # splits evenly over 2 ranks x 2 micro-batches (tests/test_deepspeed.py's config)


def _our_dirs() -> List[str]:
    import vescale_zero
    import vescale_zero.integrations

    return [os.path.dirname(vescale_zero.__file__) + os.sep,
            *(os.path.abspath(p) + os.sep for p in vescale_zero.integrations.__path__)]


@contextlib.contextmanager
def deprecations_from_our_code() -> Iterator[List[str]]:
    """Yields a list that receives ``"category: message (from file:line)"`` for each
    deprecation warning our code caused inside the block (shown or not)."""
    ours, found = _our_dirs(), []
    original_warn = warnings.warn

    def ours_in(frames) -> str:
        return next((f"{f.filename}:{f.lineno}" for f in reversed(frames)
                     if any(f.filename.startswith(d) for d in ours)), "")

    def warn(message, category=None, stacklevel=1, source=None, **kwargs):
        cat = category or (type(message) if isinstance(message, Warning) else UserWarning)
        if issubclass(cat, DEPRECATIONS):
            where = ours_in(traceback.extract_stack()[:-1])
            if where:
                found.append(f"{cat.__name__}: {message} (from {where})")
        return original_warn(message, category, stacklevel + 1, source, **kwargs)

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        warnings.warn = warn
        try:
            yield found
        finally:
            warnings.warn = original_warn
    found.extend(f"{w.category.__name__}: {w.message} (at {w.filename}:{w.lineno})" for w in shown
                 if issubclass(w.category, DEPRECATIONS) and any(w.filename.startswith(d) for d in ours))


def _jobs(rank: int, world_size: int, path: str) -> dict:
    """In a fresh rank process: whether ``vz.checkpoint`` is there after ``import vescale_zero``
    alone (this module imports nothing else of ours), then the deprecation warnings of ours in
    (a) fully_shard, forward / backward / clip / step, a state dict, a report, save and load;
    (b) a ragged DeepSpeed engine's initialize and two steps (if DeepSpeed is installed)."""
    import vescale_zero as vz

    out = {"vz.checkpoint": all(callable(getattr(getattr(vz, "checkpoint", None), n, None))
                                for n in ("save", "load", "consolidate"))}
    batches = [rank_slice(b, rank, world_size) for b in make_batches(2, GLOBAL_BATCH)]
    with deprecations_from_our_code() as out["core"]:
        model = AwkwardLM(seed=0)
        for block in model.blocks:
            vz.fully_shard(block, granularity="row")
        vz.fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train_steps(model, opt, batches, after_backward=lambda: vz.clip_grad_norm_(model, 1.0))
        vz.full_state_dict(model)
        str(vz.sharding_report(model))
        vz.checkpoint.save(path, model, opt)
        vz.checkpoint.load(path, model, opt)
    if importlib.util.find_spec("deepspeed") is None:
        return out
    from tests.test_deepspeed import _deepspeed, ds_config

    os.environ["LOCAL_RANK"] = str(rank)
    with deprecations_from_our_code() as out["deepspeed"]:
        deepspeed = _deepspeed()
        engine, *_ = deepspeed.initialize(model=AwkwardLM(seed=0), config=ds_config("ragged", world_size))
        n = engine.gradient_accumulation_steps()
        for x, y in batches:
            for i in range(n):
                engine.backward(engine(x.chunk(n)[i], y.chunk(n)[i]))
                engine.step()
    return out


@pytest.mark.slow  # ~25 s on 2 busy cores: two ranks import DeepSpeed
def test_sharded_and_deepspeed_steps_raise_no_deprecation_warning_of_ours(tmp_path):
    """The DeepSpeed example printed 124 FutureWarning lines, attributed to torch's
    c10d_logger.py: they were our collectives' calls of the deprecated names. Also:
    ``import vescale_zero as vz; vz.checkpoint.save(...)`` works (the subpackage is exported)."""
    for rank, out in enumerate(run_on_ranks(_jobs, 2, str(tmp_path / "ckpt"), timeout=300)):
        assert out["vz.checkpoint"], f"rank {rank}: vescale_zero.checkpoint is not reachable as vz.checkpoint"
        for job in ("core", "deepspeed"):
            assert not out.get(job), f"rank {rank}, {job}:\n" + "\n".join(out[job])


def test_the_recorder_sees_a_deprecated_torch_call_made_by_our_code(monkeypatch):
    """The guard itself: a deprecated torch collective called from a module of ours is caught."""
    import vescale_zero.primitives.collectives as collectives

    if getattr(torch.distributed.all_gather_into_tensor, "__deprecated__", None) is None:  # 2.11, 2.12, 2.15
        pytest.skip("this torch does not deprecate all_gather_into_tensor: no deprecated collective to call")
    monkeypatch.setattr(collectives, "_all_gather_single", torch.distributed.all_gather_into_tensor)
    with deprecations_from_our_code() as found:
        with pytest.raises((ValueError, RuntimeError)):  # no process group: the call fails after warning
            collectives.all_gather(torch.empty(2), torch.empty(1), None)
    assert any("all_gather_into_tensor" in f and "collectives.py" in f for f in found), found
