"""FP8 all-gather: gathered weights equal the unsharded tile-wise quantize/dequantize,
bit for bit, at world sizes 1-4; about half the bytes of a bf16 gather; bad input refused."""

from __future__ import annotations

import pytest
import torch

import vescale_zero as vz
from tests.distributed import run_on_ranks
from tests.models import AwkwardLM, make_batches, rank_slice
from vescale_zero.fp8_gather import dequantize_tiles, quantize_tiles, tile_band_granularity

TILE = 4  # small, so AwkwardLM's prime-sized tensors have many tiles, bands and edge tiles


def _qdq(t: torch.Tensor, tile: int) -> torch.Tensor:
    """The unsharded reference: tile-wise quantize/dequantize of the whole tensor."""
    m = t.reshape(1, -1) if t.dim() < 2 else t.reshape(t.shape[0], -1)
    q, s = quantize_tiles(m, tile)
    return dequantize_tiles(q, s, tile, t.dtype).view(t.shape)


def _gathered_vs_qdq(rank, world_size):
    torch.manual_seed(0)
    model = AwkwardLM(seed=0)
    vz.fully_shard_layers(model, fp8_all_gather_tile=TILE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mismatches, losses = [], []
    for step, batch in enumerate(make_batches(3, 12)):
        x, y = rank_slice(batch, rank, world_size)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        # after the step: gather every group and compare with qdq of the full master
        full = vz.full_state_dict(model)
        for m in model.modules():
            if isinstance(m, vz.RaggedFSDPModule) and m.vescale_group is not None:
                g = m.vescale_group
                g.unshard()
                g.wait_for_unshard()
                prefix = next(n for n, mod in model.named_modules() if mod is m)
                for i, managed in enumerate(g.managed):
                    name = f"{prefix}.{managed.fqn}" if prefix else managed.fqn
                    if not torch.equal(g.compute.full_view(i), _qdq(full[name], TILE)):
                        mismatches.append((step, name))
                g.reshard()
    stats = [m.vescale_group.stats for m in model.modules() if isinstance(m, vz.RaggedFSDPModule) and m.vescale_group]
    gathered = sum(s.all_gather_bytes for s in stats)
    elements = sum(s.all_gathers // 2 * m.vescale_group.plan.global_size for s, m in
                   zip(stats, [m for m in model.modules() if isinstance(m, vz.RaggedFSDPModule) and m.vescale_group]))
    plain = AwkwardLM(seed=0)
    vz.fully_shard_layers(plain)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    plain_losses = []
    for batch in make_batches(3, 12):
        loss = plain(*rank_slice(batch, rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        plain_losses.append(loss.item())
    return {"mismatches": mismatches, "losses": (losses, plain_losses),
            "bytes_per_element": gathered / max(1, elements)}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_gathered_weights_equal_unsharded_tile_quantization(world_size):
    for res in run_on_ranks(_gathered_vs_qdq, world_size):
        assert not res["mismatches"], res["mismatches"][:5]
        fp8, plain = res["losses"]  # training on fp8-gathered weights follows the plain run to 1%
        assert all(abs(a - b) <= 0.01 * b for a, b in zip(fp8, plain)), res["losses"]
        # fp8 bytes + fp32 scales per gathered element: well under bf16's 2 bytes
        assert res["bytes_per_element"] < 1.6, res["bytes_per_element"]


def test_tile_bands_and_bad_input():
    assert tile_band_granularity((256, 64), 128) == 128 * 64  # a band of 128 rows
    assert tile_band_granularity((37, 13), 128) == 37 * 13  # rows not a multiple: whole tensor
    assert tile_band_granularity((512,), 128) == 128
    with pytest.raises(ValueError, match="positive"):
        tile_band_granularity((4, 4), 0)
    x = torch.randn(9, 10)
    q, s = quantize_tiles(x, 4)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 3)
    assert (dequantize_tiles(q, s, 4, torch.float32) - x).abs().max() <= x.abs().max() / 8  # e4m3: 3 mantissa bits


def _bad_granularity(rank, world_size):
    model = AwkwardLM(seed=0)
    try:
        vz.fully_shard(model.blocks[0], fp8_all_gather_tile=TILE, granularity="element")
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_granularity_that_cuts_tiles_is_refused():
    (msg,) = run_on_ranks(_bad_granularity, 1)
    assert "cuts its 4x4 tiles" in msg and "whole tile bands" in msg, msg
