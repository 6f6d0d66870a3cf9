"""DeepSpeed activation checkpointing around sharded blocks: "ragged" trains like ZeRO-3.

The model's forward wraps every block call in ``deepspeed.checkpointing.checkpoint``
(reentrant, DeepSpeed's default) or ``non_reentrant_checkpoint``, configured by
``deepspeed.checkpointing.configure(None, deepspeed_config=<the ragged config>)``. One launch
per world size trains the four variants (ZeRO-3 / ragged x reentrant / non-reentrant); the
tests compare what it returned.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("deepspeed")  # the [test] extra installs it; without it these tests cannot run

from tests.distributed import run_on_ranks  # noqa: E402
from tests.models import VOCAB, AwkwardLM, assemble, make_batches  # noqa: E402
from tests.numerics import adam_divergence_bound  # noqa: E402
from tests.sweeps import sweep  # noqa: E402
from tests.test_deepspeed import (  # noqa: E402
    ACCUM,
    GLOBAL_BATCH,
    _assert_grads_within,
    _deepspeed,
    _full_params,
    _local_grad_magnitudes,
    _train_steps,
    ds_config,
)

STEPS = 4
WRAPS = ("checkpoint", "non_reentrant_checkpoint")
CHECKPOINTING = {"partition_activations": False, "contiguous_memory_optimization": False, "number_checkpoints": 2}


class CheckpointedLM(AwkwardLM):
    """AwkwardLM whose forward recomputes each block in backward through ``wrap``; counts the
    block calls (forward and recompute) to show the checkpointing is on."""

    def __init__(self, wrap, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.wrap, self.block_calls = wrap, 0

    def _run(self, block, h):
        self.block_calls += 1
        return block(h)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos
        for block in self.blocks:
            h = self.wrap(lambda x, block=block: self._run(block, x), h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


def _variants(rank, world_size):
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed = _deepspeed()
    deepspeed.init_distributed(dist_backend="gloo")  # configure reads DeepSpeed's comm
    ragged_cfg = ds_config("ragged", world_size, gradient_clipping=0.0, activation_checkpointing=CHECKPOINTING)
    deepspeed.checkpointing.configure(None, deepspeed_config=ragged_cfg)
    out = {"configured_layers": deepspeed.checkpointing.num_layers}
    for wrap in WRAPS:
        for stage in (3, "ragged"):
            model = CheckpointedLM(getattr(deepspeed.checkpointing, wrap))
            cfg = ds_config(stage, world_size, gradient_clipping=0.0, activation_checkpointing=CHECKPOINTING)
            engine, *_ = deepspeed.initialize(model=model, config=cfg)
            losses, grads = _train_steps(engine, make_batches(STEPS, GLOBAL_BATCH), rank, world_size, grads_of=stage)
            out[wrap, stage] = {"losses": losses, "params": _full_params(engine, stage), "calls": model.block_calls,
                                "grads": grads}
            del engine
    out["local_sums"] = _local_grad_magnitudes(rank, world_size)  # the first batch is make_batches(STEPS)'s
    return out


@pytest.fixture(scope="module", params=sweep([2, 3], quick=3), ids=lambda ws: f"{ws}ranks")
def trained(request):
    import inspect

    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.activation_checkpointing import checkpointing

    # deepspeed 0.16's checkpoint makes a transport stream, which its CPU accelerator lacks (stage 3 fails too)
    if get_accelerator().Stream is None and "transport_stream = " in inspect.getsource(checkpointing):
        pytest.skip("this DeepSpeed's activation checkpointing needs a Stream, which its CPU accelerator lacks")
    return request.param, run_on_ranks(_variants, request.param, timeout=500)


def _check(trained, wrap):
    world_size, results = trained
    n_blocks = len(AwkwardLM().blocks)
    for r in results:
        assert r["configured_layers"] == CHECKPOINTING["number_checkpoints"]  # configure read our ragged config
        for stage in (3, "ragged"):  # every block ran twice per micro-batch: forward and recompute
            assert r[wrap, stage]["calls"] == 2 * n_blocks * STEPS * ACCUM, (stage, r[wrap, stage]["calls"])
    ours = assemble([r[wrap, "ragged"]["params"] for r in results])
    ref = results[0][wrap, 3]["params"]
    assert set(ours) == set(ref)
    init = dict(AwkwardLM(seed=0).named_parameters())
    frozen = [n for n in ref if torch.equal(ours[n], init[n]) and not torch.equal(ref[n], init[n])]
    assert not frozen, f"trained by ZeRO-3, never by ragged: {frozen}"
    # What the math guarantees (tests/numerics.py [Note: comparing runs that sum in another order];
    # the recompute runs the same ops as the forward): each rank's first loss bit for bit; the first
    # step's reduced gradients within the summation-order bound of the world_size * ACCUM per-rank
    # micro-batch gradients (ZeRO-3 reduces each micro-batch, we their local sum); the weights within
    # what STEPS AdamW steps can move two runs apart.
    for rank, r in enumerate(results):  # each rank's last micro-batch loss per step
        assert r[wrap, "ragged"]["losses"][0] == r[wrap, 3]["losses"][0], rank
    _assert_grads_within(results[0][wrap, "ragged"]["grads"], results[0][wrap, 3]["grads"], results[0]["local_sums"],
                         world_size, wrap)
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=0, atol=adam_divergence_bound(1e-2, STEPS),
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_reentrant_deepspeed_checkpoint_matches_stage3(trained):
    """``deepspeed.checkpointing.checkpoint`` (reentrant: backward recomputes the block inside
    autograd's backward, outside the forward's hooks), fp32: by the derived bounds of _check."""
    _check(trained, "checkpoint")


def test_non_reentrant_deepspeed_checkpoint_matches_stage3(trained):
    """``deepspeed.checkpointing.non_reentrant_checkpoint`` (saved-tensor hooks), fp32: as above."""
    _check(trained, "non_reentrant_checkpoint")
