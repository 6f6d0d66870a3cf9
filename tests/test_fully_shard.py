"""fully_shard trains like the unsharded model, at world sizes 1-4 (gloo, CPU).

Every rank returns its local pieces of each parameter with their flat ranges; the
parent re-assembles full tensors (checking that the pieces cover every element exactly
once) and compares them with a single-process run on the same global batch: bit for bit
at one rank, elsewhere by what the math guarantees across summation orders
(:func:`_assert_trains_like_unsharded`, tests/numerics.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import vescale_zero as vz
from tests.distributed import run_cases_on_ranks, run_on_ranks
from tests.models import SEQ, VOCAB, AwkwardLM, assemble, local_pieces, make_batches, rank_slice, train_reference
from tests.numerics import adam_divergence_bound, assert_reduced_like, full_grads, local_reference

STEPS, GLOBAL_BATCH = 4, 12  # 12 samples split evenly over 1, 2, 3 and 4 ranks


def _shard(model, granularity, mp_policy=None, reshard_after_forward=True):
    """``granularity``: one policy for every group, or ``(blocks' policy, root's policy)``."""
    block_policy, root_policy = granularity if isinstance(granularity, tuple) else (granularity, granularity)
    for block in model.blocks:
        vz.fully_shard(block, granularity=block_policy, mp_policy=mp_policy,
                       reshard_after_forward=reshard_after_forward)
    vz.fully_shard(model, granularity=root_policy, mp_policy=mp_policy)
    return model


def _train(rank, world_size, granularity, clip, accum, mp, reshard_after_forward):
    mp_policy = vz.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp else None
    model = _shard(AwkwardLM(seed=0), granularity, mp_policy, reshard_after_forward)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    losses, first = [], {}
    for step, batch in enumerate(make_batches(STEPS, GLOBAL_BATCH)):
        local = rank_slice(batch, rank, world_size)
        micro = [tuple(t.chunk(accum)[i] for t in local) for i in range(accum)]
        total = torch.zeros(())
        for i, (x, y) in enumerate(micro):
            model.set_requires_gradient_sync(i == accum - 1)
            loss = model(x, y) / accum
            loss.backward()
            total += loss.detach().float()
            if step == 0:
                first.setdefault("local_losses", []).append(loss.item())
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        if step == 0 and not mp:  # the first step's reduced gradients (before clipping), and the unsharded model's
            first["grads"] = full_grads(model)
            first["reference"] = local_reference(AwkwardLM(seed=0), micro)
        if clip is not None:
            vz.clip_grad_norm_(model, clip)
        opt.step()
        opt.zero_grad()
        losses.append(total.item())
    return {"losses": losses, "pieces": local_pieces(model), "first": first}


def run_sharded(world_size, granularity=None, clip=None, accum=1, mp=False, reshard_after_forward=True):
    return _joined(run_on_ranks(_train, world_size, granularity, clip, accum, mp, reshard_after_forward))


def _joined(results, case=""):
    """``(losses, full parameters, per-rank first-step records)`` of one run's per-rank results."""
    for r in results[1:]:
        assert r["losses"] == results[0]["losses"], f"{case}: ranks disagree on the loss"
    return results[0]["losses"], assemble([r["pieces"] for r in results]), [r["first"] for r in results]


def run_sharded_granularities(world_size, granularities) -> list:
    """:func:`run_sharded` (fp32, no clipping) of each granularity, all in one spawn."""
    cases = {f"granularity {g!r} at {world_size} ranks": (_train, (g, None, 1, False, True)) for g in granularities}
    return [_joined(results, case) for case, results in run_cases_on_ranks(cases, world_size).items()]


def _assert_trains_like_unsharded(run, ref, accum=1, case=""):
    """What the math guarantees (tests/numerics.py [Note: comparing runs that sum in another order])
    between a sharded run and the unsharded full-batch reference:

    * the first step's local forward: the same weights, data and ops as the unsharded model on
      the rank's micro-batches, so every rank's local losses are bit-identical to that model's;
    * the first step's reduced gradients (before clipping): the mean of the same world_size *
      accum per-rank micro-batch gradients as the unsharded model's, summed in another order
      (reduce-scatter vs all-reduce): within reduction_order_bound;
    * the trained weights: within adam_divergence_bound(lr, STEPS) of the reference (which sums
      each gradient over the whole batch in one backward: another order again). Clipping rescales
      a gradient, which Adam's bound does not depend on.

    Later losses come from those weights and are not compared by value."""
    _, params, firsts = run
    world_size = len(firsts)
    for rank, first in enumerate(firsts):
        assert first["local_losses"] == first["reference"]["losses"], (case, rank, first["local_losses"])
    assert_reduced_like(firsts[0]["grads"], firsts[0]["reference"], world_size, accum, case)
    _assert_close(params, ref["params"], rtol=0, atol=adam_divergence_bound(1e-2, STEPS), case=case)


def _assert_close(params, ref, rtol, atol=0.0, case=""):
    assert set(params) == set(ref), (case, sorted(params), sorted(ref))
    for name, value in params.items():
        torch.testing.assert_close(value, ref[name], rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{case} {name}: {m}".lstrip())


@pytest.fixture(scope="module")
def reference_clip():
    return train_reference(AwkwardLM(seed=0), make_batches(STEPS, GLOBAL_BATCH), lr=1e-2, clip=1.0, accum=1)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fp32_matches_unsharded(world_size, reference_clip):
    _assert_trains_like_unsharded(run_sharded(world_size, granularity="row", clip=1.0), reference_clip)


@pytest.fixture(scope="module")
def reference_plain():
    return train_reference(AwkwardLM(seed=0), make_batches(STEPS, GLOBAL_BATCH), lr=1e-2, clip=None, accum=1)


def _callable_policy(name, param):
    return "row" if param.dim() == 2 else "element"


GRANULARITIES = [
    "element",
    "row",
    "3rows",
    ({"fc1.weight": 29 * 13, "fc2.weight": 29}, {"pos": 13, "embed.weight": 13}),
    _callable_policy,
]


@pytest.mark.slow
def test_every_granularity_gives_the_same_numbers(reference_plain):
    """No clipping: after the reduce, every step is element-wise, so the layout cannot
    change a number as long as the reduction itself is layout-independent. At 2 ranks it
    is (a + b == b + a exactly), so every preset must agree bit for bit; at 3 ranks a ring
    reduce-scatter sums each chunk starting at its owner, so presets agree to rounding."""
    runs = run_sharded_granularities(2, GRANULARITIES)
    for (losses, params, _), g in zip(runs[1:], GRANULARITIES[1:]):
        assert losses == runs[0][0], g
        for name in params:
            assert torch.equal(params[name], runs[0][1][name]), (g, name)
    _assert_trains_like_unsharded(runs[0], reference_plain, case="element at 2 ranks")
    at_3 = ("element", GRANULARITIES[3])
    for g, run in zip(at_3, run_sharded_granularities(3, at_3)):
        _assert_trains_like_unsharded(run, reference_plain, case=f"granularity {g!r} at 3 ranks")


def test_world_size_1_is_bit_exact(reference_plain):
    """One rank: AVG over one rank and accumulation into a zeroed buffer are exact."""
    losses, params, _ = run_sharded(1, granularity="row")
    assert losses == reference_plain["losses"]
    for name, value in params.items():
        assert torch.equal(value, reference_plain["params"][name]), name


@pytest.mark.parametrize("world_size", [2, 3])
def test_gradient_accumulation_and_keep_gathered(world_size):
    """2 micro-batches without sync then one synced reduce, params kept after forward."""
    ref = train_reference(AwkwardLM(seed=0), make_batches(STEPS, GLOBAL_BATCH), lr=1e-2, clip=1.0, accum=2)
    run = run_sharded(world_size, granularity="row", clip=1.0, accum=2, reshard_after_forward=False)
    _assert_trains_like_unsharded(run, ref, accum=2)


def test_bf16_mixed_precision_tracks_fp32(reference_clip):
    """bf16 compute and gathers, fp32 reduce and fp32 master shards, vs the fp32 reference.

    Stated tolerance (measured: the same at 1, 2 and 3 ranks, so it is bf16, not sharding):
    losses within 1e-2 relative (measured 2e-3); parameters within 1e-3 on average
    (measured 1.8e-4); any single element within 2*lr*steps, the most AdamW's sign-like
    update can move it when bf16 noise flips the sign of a tiny gradient (measured 0.0205).
    A missing or mis-scaled reduction moves the mean by orders of magnitude more."""
    losses, params, _ = run_sharded(2, granularity="row", clip=1.0, mp=True)
    assert losses == pytest.approx(reference_clip["losses"], rel=1e-2)
    for name, value in params.items():
        assert value.dtype == torch.float32, f"{name}: master shard must stay fp32"
    diffs = torch.cat([(params[n] - reference_clip["params"][n]).abs().flatten() for n in params])
    assert diffs.mean().item() <= 1e-3
    assert diffs.max().item() <= 2 * 1e-2 * STEPS


# ---- zero-copy, by data pointers --------------------------------------------------------


def _ptr_range(t: torch.Tensor):
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # the StorageImpl: the same object across free/allocate


def _zero_copy(rank, world_size, mp):
    import vescale_zero.dbuffer as dbuffer_module

    calls = []
    real_ag, real_rs = dbuffer_module.all_gather, dbuffer_module.reduce_scatter
    mp_policy = vz.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp else None
    model = _shard(AwkwardLM(seed=0), "row", mp_policy)
    groups = [m.vescale_group for m in (model.blocks[0], model.blocks[1], model)]

    def spy_ag(output, shard, group, stats=None, async_op=False, *rest):
        # Pointers are recorded while the collective runs: a freed buffer's data_ptr() is 0.
        g = next(g for g in groups if _storage(g.compute.full) == _storage(output))
        itemsize = output.element_size()
        views = [(up.data_ptr(), output.data_ptr() + off * itemsize)
                 for up, off in zip(g.unsharded_params, g.plan.offsets)]
        calls.append(("ag", g, output.data_ptr(), shard.data_ptr(), async_op, views))
        return real_ag(output, shard, group, stats, async_op, *rest)

    def spy_rs(shard, full, *a, **k):
        g = next(g for g in groups if _storage(full) == _storage(g.grads.full.full))
        calls.append(("rs", g, full.data_ptr(), shard.data_ptr()))
        return real_rs(shard, full, *a, **k)

    dbuffer_module.all_gather, dbuffer_module.reduce_scatter = spy_ag, spy_rs
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step, batch in enumerate(make_batches(2, GLOBAL_BATCH)):
        calls.clear()
        x, y = rank_slice(batch, rank, world_size)
        model(x, y).backward()
        for g in groups:
            S = g.plan.shard_size
            # sharded params are views into the master shard, grads into the grad shard
            for i, m in enumerate(g.managed):
                start, end, off = g.plan.local_slices(rank)[i]
                # a sharded parameter is a DTensor of the global shape whose local tensor is the view
                sp = g.sharded_params[i]
                assert isinstance(sp, DTensor) and sp.shape == m.shape, (m.fqn, type(sp), sp.shape)
                assert sp.to_local().shape == (end - start,), m.fqn
                if end > start:
                    local = sp.to_local()
                    assert local.data_ptr() == g.master.local.data_ptr() + off * g.master.local.element_size(), m.fqn
                    assert local.data_ptr() % 16 == 0, (m.fqn, "a rank's piece must start on 16 bytes")
                    if m.requires_grad:
                        grad = sp.grad.to_local()
                        assert isinstance(sp.grad, DTensor) and sp.grad.shape == m.shape, m.fqn
                        assert (grad.data_ptr()
                                == g.sharded_grad.local.data_ptr() + off * grad.element_size()), m.fqn
            ags = [c for c in calls if c[0] == "ag" and c[1] is g]
            assert ags, "the group was never gathered"
            for _, _, out_ptr, in_ptr, _, views in ags:
                # the all-gather writes straight into the buffer the unsharded params view,
                # and every tensor starts on 16 bytes (fully_shard's align_bytes)
                assert all(param_ptr == want for param_ptr, want in views), views
                assert all(param_ptr % 16 == 0 for param_ptr, _ in views), views
                if mp:  # the cast goes into this rank's own slot: the gather runs in place
                    assert in_ptr == out_ptr + rank * S * 2
                else:  # the gather input is the optimizer's shard itself
                    assert g.compute.local is g.master.local and in_ptr == g.master.local.data_ptr()
            rss = [c for c in calls if c[0] == "rs" and c[1] is g]
            assert len(rss) == 1
            if not mp:
                assert rss[0][3] == g.sharded_grad.local.data_ptr(), "reduce-scatter must land in the grad shard"
            assert not g.compute.is_allocated and not g.grads.full.is_allocated, "buffers must be freed after backward"
        n_ag = sum(1 for c in calls if c[0] == "ag")
        n_rs = sum(1 for c in calls if c[0] == "rs")
        # blocks gather twice (forward, backward), the root once; one reduce-scatter each.
        # The last block stays gathered from its forward into its backward, from the first
        # step on (runtime [Note: orders]: the group kept for backward): one gather fewer.
        assert (n_ag, n_rs) == (4, 3), (step, n_ag, n_rs)
        # block 0 is prefetched asynchronously in backward by block 1 (runtime
        # [Note: backward prefetch order]); from the second step on, once a forward order is
        # known, blocks 0 (by the root) and 1 (by block 0) are prefetched in forward too
        n_async = sum(1 for c in calls if c[0] == "ag" and c[4])
        assert n_async == (3 if step else 1), (step, n_async)
        # reduce-scatters run in backward order: block 1, block 0, root
        assert [c[1] for c in calls if c[0] == "rs"] == [groups[1], groups[0], groups[2]]
        # while gathered by hand, every full parameter is a view into the full buffer
        for g, module in zip(groups, (model.blocks[0], model.blocks[1], model)):
            module.unshard()
            lo, _ = _ptr_range(g.compute.full)
            for i, m in enumerate(g.managed):
                up = g.unsharded_params[i]
                assert up.data_ptr() == lo + g.plan.offsets[i] * up.element_size(), m.fqn
                owner, attr = m.owners[0]
                assert owner._parameters[attr] is up
            module.reshard()
            assert not g.compute.is_allocated
        opt.step()
        opt.zero_grad()
    return True


@pytest.mark.parametrize("mp", [False, True])
def test_zero_copy_by_data_pointers(mp):
    assert run_on_ranks(_zero_copy, 2, mp) == [True, True]


# ---- bad input ----------------------------------------------------------------------------


def _bad_inputs(rank, world_size):
    errors = {}

    def expect(key, fn, *fragments):
        try:
            fn()
        except (ValueError, KeyError, TypeError) as e:
            msg = str(e)
            missing = [f for f in fragments if f not in msg]
            errors[key] = missing or "ok"
            return
        errors[key] = "no error raised"

    expect("int not dividing", lambda: vz.fully_shard(AwkwardLM().blocks[0], granularity=2),
           "gate", "(13,)", "does not divide", "Valid choices")
    expect("split block", lambda: vz.fully_shard(AwkwardLM().blocks[0], granularity={"fc1.weight": 29 * 13 + 1}),
           "fc1.weight", "(29, 13)", "block would be split")
    expect("unknown name", lambda: vz.fully_shard(AwkwardLM().blocks[0], granularity={"fc9.weight": 1}),
           "fc9.weight", "valid names")
    expect("bad preset", lambda: vz.fully_shard(AwkwardLM().blocks[0], granularity="diagonal"),
           "diagonal", "valid presets")
    block = AwkwardLM().blocks[0]
    vz.fully_shard(block)
    expect("twice", lambda: vz.fully_shard(block), "already applied")
    from torch.distributed.device_mesh import init_device_mesh

    if world_size % 2 == 0:
        mesh2d = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("a", "b"))
        expect("2-D mesh, unknown names", lambda: vz.fully_shard(AwkwardLM().blocks[0], mesh=mesh2d),
               "('a', 'b')", "('replicate', 'shard')", "HSDP")
    # a parameter tied across two groups
    tied = AwkwardLM()
    tied.blocks[1].fc1.weight = tied.blocks[0].fc1.weight
    vz.fully_shard(tied.blocks[0])
    expect("tied across groups", lambda: vz.fully_shard(tied.blocks[1]), "fc1.weight", "already managed", "tied")
    return errors


def test_bad_input_gives_clear_errors():
    for errors in run_on_ranks(_bad_inputs, 2):
        bad = {k: v for k, v in errors.items() if v != "ok"}
        assert not bad, bad
        assert len(errors) >= 7


def _dropped_models(rank, world_size):
    """Build, shard and train one step, drop the model and its optimizer: every group, buffer
    and shard must be freed (param_group [Note: hooks hold their group weakly])."""
    import gc
    import weakref

    from tests.test_meta_init import gpt_init
    from vescale_zero.fully_shard import groups_of
    from vescale_zero.testing.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=16, n_layers=2, n_heads=2)  # `pos`: a root parameter

    def build(path):
        if path == "meta":
            with torch.device("meta"):
                model = GPT(cfg)
            vz.fully_shard_layers(model)
            vz.materialize(model, init_fn=gpt_init, device="cpu")
        else:
            model = GPT(cfg)
            vz.fully_shard_layers(model) if path == "eager, layers" else vz.fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(rank))
        model(tokens, tokens).backward()
        opt.step()
        groups = groups_of(model)
        refs = [weakref.ref(model)] + [weakref.ref(g) for g in groups]
        refs += [weakref.ref(p.data.untyped_storage()) for p in model.parameters()]
        return refs

    alive = {}
    for path in ("eager, root", "eager, layers", "meta"):
        refs = build(path)
        gc.collect()
        alive[path] = sum(r() is not None for r in refs), len(refs)
    return alive


def test_a_dropped_model_frees_its_groups():
    for alive in run_on_ranks(_dropped_models, 2):
        assert all(n == 0 for n, _ in alive.values()), f"objects still alive after the model was dropped: {alive}"
