"""Full state dicts streamed one group at a time: ``full_state_dict`` with ``rank0_only`` /
``cpu_offload``, and ``load_full_state_dict(..., broadcast_from_rank0=True)``.

Values: one gloo launch per world size does every case; the tests compare what it
returned. The model is an AwkwardLM with 4 blocks sharded per block (5 groups), whose
unsharded twin (same seed) is the exact reference.

Memory: :class:`tests.memory.TransientBytes` gives the most bytes alive at once among what
the call allocates and frees again (the gather or broadcast buffers: on a GPU, the extra
device memory of the call). It is measured in this process on torch's fake process group
(collectives that move nothing, as any rank of any world size): on gloo a worker thread
drops its reference to a collective's buffer a moment after the call returns, so a buffer
can outlive the call by a scheduling delay, which would make a peak flaky.
"""

from __future__ import annotations

import pytest
import torch

import vescale_zero as vz
from tests.distributed import run_on_ranks
from tests.memory import TransientBytes
from tests.models import AwkwardLM, local_pieces
from vescale_zero.api.fully_shard import groups_of

N_BLOCKS = 4
OPTIONS = [(False, False), (False, True), (True, False), (True, True)]  # (rank0_only, cpu_offload)


def _sharded(seed: int) -> torch.nn.Module:
    model = AwkwardLM(seed=seed, n_blocks=N_BLOCKS)
    for block in model.blocks:
        vz.fully_shard(block, granularity="row")
    vz.fully_shard(model, granularity="row")
    return model


def _reference() -> dict:
    """The unsharded model's state dict, with buffers that differ from a fresh model's."""
    model = AwkwardLM(seed=0, n_blocks=N_BLOCKS)
    for n, block in enumerate(model.blocks):
        block.scale.fill_(n + 1.5)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _error(fn) -> str:
    try:
        fn()
    except (KeyError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _streamed(rank, world_size):
    reference = _reference()
    model = _sharded(0)
    model.load_state_dict({k: v for k, v in reference.items() if k.endswith("scale")}, strict=False)
    out = {}
    for rank0_only, cpu_offload in OPTIONS:
        state = vz.full_state_dict(model, rank0_only=rank0_only, cpu_offload=cpu_offload)
        out["save", rank0_only, cpu_offload] = {
            "keys": sorted(state),
            "equal": sorted(k for k in state if torch.equal(state[k], reference[k])),
            "devices": sorted({str(v.device) for v in state.values()}),
            "storages": len({v.untyped_storage().data_ptr() for v in state.values()}),
        }
        del state

    # Load: rank 0 alone holds the dict; the result must equal loading it on every rank.
    everywhere = _sharded(7)
    vz.load_full_state_dict(everywhere, reference)
    target = _sharded(7)
    vz.load_full_state_dict(target, reference if rank == 0 else (None if rank == 2 else {}), broadcast_from_rank0=True)
    expected, got = local_pieces(everywhere), local_pieces(target)
    out["load_equal"] = sorted(k for k in expected if torch.equal(expected[k][3], got[k][3]))
    out["load_pieces"] = sorted(expected)
    out["buffers_equal"] = all(torch.equal(b, dict(everywhere.named_buffers())[n]) for n, b in target.named_buffers())
    out["buffers_loaded"] = [b.item() for n, b in target.named_buffers() if n.endswith("scale")]

    # Strict errors reach every rank (none hangs in a broadcast), and the group stays usable.
    bad = dict(reference)
    del bad["norm.weight"]
    out["missing"] = _error(lambda: vz.load_full_state_dict(target, bad if rank == 0 else {},
                                                            broadcast_from_rank0=True))
    wrong = dict(reference, **{"blocks.1.fc1.weight": torch.zeros(3, 3)})
    out["shape"] = _error(lambda: vz.load_full_state_dict(target, wrong if rank == 0 else {},
                                                          broadcast_from_rank0=True))
    extra = dict(reference, stray=torch.zeros(1))
    out["unexpected"] = _error(lambda: vz.load_full_state_dict(target, extra if rank == 0 else {},
                                                               broadcast_from_rank0=True))
    # strict=False: the keys rank 0 holds are loaded, the others keep this rank's values.
    partial = _sharded(9)
    vz.load_full_state_dict(partial, bad if rank == 0 else None, strict=False, broadcast_from_rank0=True)
    fresh, loaded = local_pieces(_sharded(9)), local_pieces(partial)
    out["partial_kept"] = torch.equal(loaded["norm.weight"][3], fresh["norm.weight"][3])
    out["partial_loaded"] = torch.equal(loaded["blocks.0.fc1.weight"][3], expected["blocks.0.fc1.weight"][3])
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"{ws}ranks")
def streamed(request):
    return request.param, run_on_ranks(_streamed, request.param)


def test_full_state_dict_values_and_placement(streamed):
    """Every option gives the unsharded model's state dict exactly (buffers included);
    ``rank0_only`` gives ``{}`` on the other ranks; ``cpu_offload`` puts every tensor on
    the CPU in a storage of its own (serialisers refuse views of one buffer)."""
    _, results = streamed
    keys = sorted(_reference())
    for rank, r in enumerate(results):
        for rank0_only, cpu_offload in OPTIONS:
            got = r["save", rank0_only, cpu_offload]
            if rank0_only and rank != 0:
                assert got["keys"] == [], (rank, rank0_only, cpu_offload)
                continue
            assert got["keys"] == keys and got["equal"] == keys, (rank, rank0_only, cpu_offload, got)
            if cpu_offload:
                assert got["devices"] == ["cpu"] and got["storages"] == len(keys) - 1  # the tied head: one tensor


def test_load_broadcast_from_rank0_equals_loading_everywhere(streamed):
    """Rank 0 holds the full dict, the others pass ``{}`` or ``None``: every rank's shards
    and buffers equal those of loading the full dict on every rank, bit for bit."""
    _, results = streamed
    for rank, r in enumerate(results):
        assert r["load_equal"] == r["load_pieces"] and r["load_pieces"], rank
        assert r["buffers_equal"] and r["buffers_loaded"] == [n + 1.5 for n in range(N_BLOCKS)], rank


def test_load_broadcast_from_rank0_strict_errors_reach_every_rank(streamed):
    """Rank 0's missing, unexpected or misshapen tensor raises the same clear error on every
    rank (no rank waits in a broadcast); ``strict=False`` loads what rank 0 holds."""
    _, results = streamed
    for rank, r in enumerate(results):
        assert r["missing"].startswith("KeyError") and "missing keys ['norm.weight']" in r["missing"], r["missing"]
        assert r["unexpected"].startswith("KeyError") and "unexpected keys ['stray']" in r["unexpected"]
        assert r["shape"].startswith("ValueError") and "'blocks.1.fc1.weight'" in r["shape"], r["shape"]
        assert "(3, 3)" in r["shape"]
        assert r["partial_kept"] and r["partial_loaded"], rank


@pytest.fixture
def fake_rank(request):
    """This process as rank ``request.param`` of 3 on torch's fake process group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=request.param, world_size=3)
    try:
        yield request.param
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fake_rank", [0, 1], indirect=True, ids=lambda r: f"rank{r}")
def test_full_state_dict_holds_one_group_buffer_at_a_time(fake_rank):
    """With ``cpu_offload`` (and, with ``rank0_only``, on the ranks that keep nothing) the
    transient peak is the largest group's full buffer, never two groups' at once (5 groups,
    the largest 3.4 KB, all together 16 KB); without them the result is the group buffers
    themselves (kept, nothing transient). Rank 0's broadcast load also holds one group's
    buffer at a time."""
    model = _sharded(0)
    sizes = [g.plan.global_size * 4 for g in groups_of(model)]
    largest, two = max(sizes), sum(sorted(sizes)[-2:])
    for rank0_only, cpu_offload in OPTIONS:
        with TransientBytes() as tracker:
            state = vz.full_state_dict(model, rank0_only=rank0_only, cpu_offload=cpu_offload)
        streamed = cpu_offload or (rank0_only and fake_rank != 0)
        peak = tracker.peak()
        assert (largest <= peak < two) if streamed else peak == 0, (rank0_only, cpu_offload, peak, sizes)
        if rank0_only and fake_rank != 0:
            assert state == {} and tracker.kept() == 0
        del state
    if fake_rank == 0:  # the other ranks' header broadcast carries nothing on a fake group
        reference, target = _reference(), _sharded(7)
        with TransientBytes() as tracker:
            vz.load_full_state_dict(target, reference, broadcast_from_rank0=True)
        assert largest <= tracker.peak() < two and tracker.kept() == 0, (tracker.peak(), tracker.kept(), sizes)


def test_broadcast_from_rank0_refuses_groups_narrower_than_the_world():
    """Groups sharded over a sub-group (model parallelism, a sub-mesh) cannot take rank 0's
    broadcast: a clear error names the sizes and the fix, before any collective."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        model = AwkwardLM(seed=0, n_blocks=N_BLOCKS)
        vz.fully_shard(model, mesh=dist.new_group([0, 1]))
        with pytest.raises(ValueError, match=r"sharded over all 4 ranks; 1 group\(s\) are sharded over 2 .*every rank"):
            vz.load_full_state_dict(model, _reference(), broadcast_from_rank0=True)
    finally:
        dist.destroy_process_group()


def test_flat_range_boxes_tile_the_range():
    """``flat_range_boxes``: in order, contiguous, inside the tensor, at most 2 x ndim - 1 boxes,
    covering exactly ``[start, end)``, for every range of a few shapes."""
    import math

    from vescale_zero.api.state_dict import flat_range_boxes

    assert flat_range_boxes((4, 5), 7, 18) == [((1, 2), (1, 3), 7), ((2, 0), (1, 5), 10), ((3, 0), (1, 3), 15)]
    assert flat_range_boxes((), 0, 1) == [((), (), 0)] and flat_range_boxes((3, 2), 4, 4) == []
    for shape in [(3, 4, 5), (2, 1, 3), (7,), (2, 2, 2, 2)]:
        n = math.prod(shape)
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        for start in range(n):
            for end in range(start + 1, n + 1):
                boxes, pos = flat_range_boxes(shape, start, end), start
                assert len(boxes) <= 2 * len(shape) - 1
                for offsets, sizes, flat in boxes:
                    assert flat == pos == sum(o * s for o, s in zip(offsets, strides))
                    assert all(o + z <= d for o, z, d in zip(offsets, sizes, shape))
                    # contiguous: ones, then one partial dim, then whole dims
                    d = next((k for k, z in enumerate(sizes) if z != 1), len(shape) - 1)
                    assert tuple(sizes[d + 1:]) == tuple(shape[d + 1:]), (shape, start, end, boxes)
                    pos += math.prod(sizes)
                assert pos == end
