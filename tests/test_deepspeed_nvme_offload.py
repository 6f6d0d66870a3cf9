"""``"offload_optimizer": {"device": "nvme", ...}`` under ``"stage": "ragged"`` (integrations/deepspeed/
nvme_offload.py): the optimizer state in files trains exactly like the same config without it.

The reference is stage "ragged" in memory, not ZeRO-3 with the same nvme config: ZeRO-3's nvme
path needs DeepSpeed's async I/O op, which does not build here (no libaio:
``AsyncIOBuilder().is_compatible()`` is False), and "ragged" in memory equals ZeRO-3 (tests/test_deepspeed.py).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("deepspeed")  # the [test] extra installs it; without it these tests cannot run

from tests.distributed import run_cases_on_ranks  # noqa: E402
from tests.models import AwkwardLM, local_pieces, make_batches  # noqa: E402
from tests.test_deepspeed import GLOBAL_BATCH, _deepspeed, _train_steps, ds_config  # noqa: E402

STEPS = 4


def _shared_dir(base: str) -> str:
    path = [tempfile.mkdtemp(prefix="nvme-", dir=base) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def _engine(world_size, base, nvme, pipeline_read=False):
    deepspeed = _deepspeed()
    cfg = ds_config("ragged", world_size)
    if nvme:
        cfg["zero_optimization"]["offload_optimizer"] = {
            "device": "nvme", "nvme_path": _shared_dir(base), "buffer_count": 4, "pin_memory": True,
            "pipeline_read": pipeline_read, "fast_init": False}
    engine, *_ = deepspeed.initialize(model=AwkwardLM(seed=0), config=cfg)
    return engine


def _weights(engine):
    return {n: v for n, (_, _, _, v) in local_pieces(engine.module).items()}


def _run(rank, world_size, base, nvme, pipeline_read=False):
    os.environ["LOCAL_RANK"] = str(rank)
    engine = _engine(world_size, base, nvme, pipeline_read)
    losses = _train_steps(engine, make_batches(STEPS, GLOBAL_BATCH), rank, world_size)
    files = engine.optimizer_state_files
    held = len(engine.optimizer.state._resident) if files is not None else None
    # deepspeed.utils' setters reach the state in files too (a read outside a step is a copy)
    from deepspeed.utils import safe_get_full_optimizer_state, safe_set_full_optimizer_state
    param = next(p for p in engine.module.parameters() if p.requires_grad)
    written = torch.arange(param.numel(), dtype=torch.float32).view(param.shape)
    safe_set_full_optimizer_state(param, written, "exp_avg")
    set_seen = torch.equal(safe_get_full_optimizer_state(param, "exp_avg"), written)
    return {"losses": losses, "weights": _weights(engine), "in_files": files is not None, "held": held,
            "set_seen": set_seen}


def _resume(rank, world_size, base):
    """2 steps with the state in files, engine.save_checkpoint, a fresh engine (new files) loads it, 2 more."""
    os.environ["LOCAL_RANK"] = str(rank)
    batches = make_batches(STEPS, GLOBAL_BATCH)
    engine = _engine(world_size, base, True)
    _train_steps(engine, batches[:2], rank, world_size)
    ckpt = _shared_dir(base)
    engine.save_checkpoint(ckpt, tag="two")
    resumed = _engine(world_size, base, True)
    resumed.load_checkpoint(ckpt, tag="two")
    losses = _train_steps(resumed, batches[2:], rank, world_size)
    return {"losses": losses, "weights": _weights(resumed)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("nvme-offload"))
    return run_cases_on_ranks({"memory": (_run, (base, False)), "nvme": (_run, (base, True)),
                               "nvme_read_ahead": (_run, (base, True, True)), "resume": (_resume, (base,))}, 2,
                              timeout=400)


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("case", ["nvme", "nvme_read_ahead"])
def test_nvme_offload_trains_like_ragged_in_memory_bit_for_bit(runs, case):
    for mem, got in zip(runs["memory"], runs[case]):
        assert got["in_files"] and not mem["in_files"] and got["held"] == 0
        assert got["losses"] == mem["losses"]
        assert _equal(got["weights"], mem["weights"])
        assert got["set_seen"] and mem["set_seen"]


def test_nvme_offload_save_and_resume_equal_an_uninterrupted_run(runs):
    for mem, got in zip(runs["memory"], runs["resume"]):
        assert got["losses"] == mem["losses"][2:]
        assert _equal(got["weights"], mem["weights"])


def test_nvme_offload_config_errors():
    _deepspeed()
    from vescale_zero.integrations.deepspeed import split_ragged_config

    def error(offload, *fragments):
        cfg = ds_config("ragged", 2)
        cfg["zero_optimization"]["offload_optimizer"] = offload
        with pytest.raises(ValueError) as e:
            split_ragged_config(cfg)
        for f in fragments:
            assert f in str(e.value), (f, str(e.value))

    error({"device": "nvme"}, "offload_optimizer", "needs nvme_path")
    error({"device": "nvme", "nvme_path": "/tmp", "ratio": 0.5}, "ratio 0.5 is not implemented")
    error({"device": "nvme", "nvme_path": "/tmp", "buffer_count": -1}, "buffer_count")  # DeepSpeed's own check
    cfg = ds_config("ragged", 2)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": "/tmp", "pipeline_write": True}
    nvme = split_ragged_config(cfg)[1].optimizer_nvme
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig

    pinned = DeepSpeedZeroOffloadOptimizerConfig.model_fields["pin_memory"].default  # 0.16: False, later: True
    assert (nvme.nvme_path, nvme.read_ahead, nvme.pin_memory) == ("/tmp", True, pinned)
