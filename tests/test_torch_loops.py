"""Training loops written for PyTorch FSDP2 or DDP keep their meaning on ``fully_shard`` (issue 25).

Every case runs the sharded model (each rank its slice of the global batch) beside the
unsharded model (the whole batch, in the same process) through the same loop and
compares this rank's piece of every parameter with the unsharded tensor (fp32, <= 1e-6):

  eval_between_backward_and_step   forward+backward, an evaluation forward (no_grad, or with
                                   grad and never differentiated), optimizer.step(), forward:
                                   the next forward computes with the stepped weights
                                   (runtime [Note: nothing stays gathered after forward])
  sanity_forward_then_optimizer    after a forward without backward, model.parameters() shows
                                   the root's full parameters if it ran with grad (FSDP2's
                                   registration); an optimizer built from them is refused at its
                                   first step (stale_params [Note: an optimizer over replaced parameters]),
                                   one built after model.reshard() trains; parameter counts and
                                   state-dict shapes do not depend on whether a forward ran
  surgery_after_eval_forward       gathered_parameters(modifier_rank=0) edits after an
                                   evaluation forward reach training
  inplace_on_view_output           a block returns a view, the caller modifies it in place
                                   (runtime [Note: output views])
  kept_grad_after_set_to_none      a ``.grad`` kept across zero_grad(set_to_none=True) is not
                                   overwritten by the next backward
                                   (grad_shard [Note: a kept gradient stays the caller's])
  order_changes                    the blocks run in another order from the second iteration:
                                   prefetch and the group kept for backward follow it
                                   (runtime [Note: orders])
  deepcopy                         copy.deepcopy / AveragedModel give a clear error
"""

from __future__ import annotations

import copy
from typing import Dict, List

import pytest
import torch
from torch import nn

import vescale_zero as vz
from tests.distributed import run_cases_on_ranks
from tests.models import AwkwardBlock, AwkwardLM, local_pieces, make_batches, rank_slice
from vescale_zero.api.full_parameters import is_sharded_param
from vescale_zero.runtime.hooks import in_backward_pass
from vescale_zero.runtime.param_group import GroupState, ParamGroup

GLOBAL_BATCH = 12  # splits evenly over 2 and 3 ranks
TOL = 1e-6


class ViewBlock(AwkwardBlock):
    """Returns its output as a view (of the residual sum)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).view(x.shape)


class LoopLM(AwkwardLM):
    """AwkwardLM with blocks run in ``self.order``; ``inplace`` modifies each block's output in place."""

    def __init__(self, n_blocks: int = 3, view_blocks: bool = False) -> None:
        super().__init__(seed=0, n_blocks=n_blocks)
        if view_blocks:
            torch.manual_seed(1)
            self.blocks = nn.ModuleList(ViewBlock() for _ in range(n_blocks))
        self.order = list(range(n_blocks))
        self.inplace = False

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos
        for i in self.order:
            h = self.blocks[i](h)
            if self.inplace:
                h.mul_(0.5)
        logits = self.head(self.norm(h))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _pair(rank: int, world_size: int, reshard_after_forward: bool = True, **kwargs) -> tuple:
    """``(sharded model, unsharded reference, its optimizer maker)`` of one LoopLM."""
    model = LoopLM(**kwargs)
    ref = copy.deepcopy(model)
    for block in model.blocks:
        vz.fully_shard(block, granularity="row", reshard_after_forward=reshard_after_forward)
    vz.fully_shard(model, granularity="row")
    return model, ref


def _opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


def _max_diff(model: nn.Module, ref: nn.Module, grads: bool = False) -> float:
    """Largest difference between this rank's pieces (of the parameters or their gradients)
    and the reference's tensors."""
    full = dict(ref.named_parameters())
    worst = 0.0
    for name, (_, start, end, values) in local_pieces(model).items():
        theirs = full[name]
        if grads:
            group, index = _slot(model, name)
            mine = group.sharded_params[index].grad
            mine = None if mine is None else mine.to_local()  # the DTensor gradient's piece
            theirs = theirs.grad
            if mine is None or theirs is None:
                assert mine is None and theirs is None, f"{name}: gradient on one side only"
                continue
            values = mine
        worst = max(worst, (values - theirs.detach().reshape(-1)[start:end]).abs().max().item() if end > start else 0.0)
    return worst


def _slot(model: nn.Module, name: str) -> tuple:
    for prefix, module in model.named_modules():
        group = getattr(module, "vescale_group", None) if isinstance(module, vz.RaggedFSDPModule) else None
        if group is None:
            continue
        for i, m in enumerate(group.managed):
            if (f"{prefix}.{m.fqn}" if prefix else m.fqn) == name:
                return group, i
    raise KeyError(name)


def _batches(rank: int, world_size: int, steps: int, seed: int = 1) -> List[tuple]:
    """``[(local batch, global batch)]``."""
    return [(rank_slice(b, rank, world_size), b) for b in make_batches(steps, GLOBAL_BATCH, seed=seed)]


def _train_step(model, batch, opt) -> None:
    model(*batch).backward()
    opt.step()
    opt.zero_grad()


# ---- item 7: a forward without backward between backward and step ----------------------------
def eval_between_backward_and_step(rank, world_size, grad_enabled: bool, reshard_after_forward: bool):
    model, ref = _pair(rank, world_size, reshard_after_forward)
    opt, ref_opt = _opt(model), _opt(ref)
    batches = _batches(rank, world_size, 4)
    diffs = []
    for (local, whole), (eval_local, eval_whole) in zip(batches[:2], batches[2:]):
        model(*local).backward()
        ref(*whole).backward()
        with torch.set_grad_enabled(grad_enabled):  # evaluation: its output is never differentiated
            model(*eval_local)
            ref(*eval_whole)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        diffs.append(_max_diff(model, ref))
    # the next forward+backward reads the stepped weights: its gradients show it
    model(*batches[0][0]).backward()
    ref(*batches[0][1]).backward()
    diffs.append(_max_diff(model, ref, grads=True))
    return diffs


# ---- items 8 and 9: what the model shows outside forward/backward -----------------------------
def _counts(model: nn.Module) -> tuple:
    params = list(model.parameters())
    return (sum(p.numel() for p in params), all(is_sharded_param(p) for p in params),
            tuple((k, tuple(v.shape)) for k, v in model.state_dict().items()))


def sanity_forward_then_optimizer(rank, world_size, grad_enabled: bool, reshard_after_forward: bool):
    model, ref = _pair(rank, world_size, reshard_after_forward)
    batches = _batches(rank, world_size, 3)
    before = _counts(model)
    with torch.set_grad_enabled(grad_enabled):  # a sanity forward before training
        model(*batches[0][0])
        ref(*batches[0][1])
    shown_sharded = all(is_sharded_param(p) for p in model.parameters())
    refused = None
    if not shown_sharded:  # the root's full parameters, registered until backward or reshard()
        try:
            _opt(model).step()
        except RuntimeError as e:
            refused = str(e)
        for module in model.modules():  # reshard() is not recursive (FSDP2's)
            if isinstance(module, vz.RaggedFSDPModule):
                module.reshard()
    after = _counts(model)
    opt, ref_opt = _opt(model), _opt(ref)  # built after the forward, from model.parameters()
    for local, whole in batches:
        _train_step(model, local, opt)
        _train_step(ref, whole, ref_opt)
    return {"counts_equal": before == after and _counts(model) == before, "all_sharded": after[1],
            "shown_sharded": shown_sharded, "refused": refused, "numel": (before[0], after[0]),
            "diff": _max_diff(model, ref)}


def surgery_after_eval_forward(rank, world_size, grad_enabled: bool):
    model, ref = _pair(rank, world_size)
    opt, ref_opt = _opt(model), _opt(ref)
    batches = _batches(rank, world_size, 3)
    _train_step(model, batches[0][0], opt)
    _train_step(ref, batches[0][1], ref_opt)
    with torch.set_grad_enabled(grad_enabled):
        model(*batches[1][0])
    with vz.gathered_parameters(list(model.parameters()), modifier_rank=0), torch.no_grad():
        if rank == 0:
            model.norm.weight.mul_(-2.0)  # the root's group
            model.blocks[1].fc1.weight.add_(0.5)
    with torch.no_grad():
        ref.norm.weight.mul_(-2.0)
        ref.blocks[1].fc1.weight.add_(0.5)
    for local, whole in batches[1:]:
        _train_step(model, local, opt)
        _train_step(ref, whole, ref_opt)
    return _max_diff(model, ref)


# ---- a view output modified in place -----------------------------------------------------------
def inplace_on_view_output(rank, world_size):
    model, ref = _pair(rank, world_size, view_blocks=True)
    model.inplace = ref.inplace = True
    opt, ref_opt = _opt(model), _opt(ref)
    diffs = []
    for local, whole in _batches(rank, world_size, 2):
        model(*local).backward()
        ref(*whole).backward()
        diffs.append(_max_diff(model, ref, grads=True))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    diffs.append(_max_diff(model, ref))
    return diffs


# ---- a .grad kept across zero_grad(set_to_none=True) ---------------------------------------------
def kept_grad_after_set_to_none(rank, world_size):
    model, ref = _pair(rank, world_size)
    params = [p for p in model.parameters() if p.requires_grad]
    (first, first_whole), (second, second_whole) = _batches(rank, world_size, 2)
    model(*first).backward()
    kept = [p.grad.to_local() for p in params]  # PCGrad / GradNorm keep each task's gradients (pieces)
    values = [g.clone() for g in kept]
    for p in params:
        p.grad = None  # what zero_grad(set_to_none=True) does
    model(*second).backward()
    ref(*second_whole).backward()
    changed = max((k - v).abs().max().item() if k.numel() else 0.0 for k, v in zip(kept, values))
    return {"kept_changed_by": changed, "new_grads_diff": _max_diff(model, ref, grads=True),
            "aliased": any(k.data_ptr() == p.grad.to_local().data_ptr() for k, p in zip(kept, params) if k.numel())}


# ---- forward order re-recorded each iteration ---------------------------------------------------
def _record_gathers(groups: List[ParamGroup]) -> tuple:
    """Patch ``ParamGroup.unshard`` to record ``(group index, prefetch, in backward)`` of every
    all-gather it issues; returns ``(records, restore)``."""
    real = ParamGroup.unshard
    records: List[tuple] = []

    def spy(self, async_op=False):
        if self.state is GroupState.SHARDED:
            records.append((groups.index(self), async_op, in_backward_pass()))
        return real(self, async_op)

    ParamGroup.unshard = spy
    return records, lambda: setattr(ParamGroup, "unshard", real)


def order_changes(rank, world_size):
    """Iteration 1 runs the blocks 0, 1, 2; iterations 2 and 3 run them 2, 0, 1."""
    model, ref = _pair(rank, world_size)
    groups = [b.vescale_group for b in model.blocks] + [model.vescale_group]
    root = len(groups) - 1
    opt, ref_opt = _opt(model), _opt(ref)
    records, restore = _record_gathers(groups)
    per_iteration, diffs = [], []
    try:
        for step, (local, whole) in enumerate(_batches(rank, world_size, 3)):
            model.order = ref.order = [0, 1, 2] if step == 0 else [2, 0, 1]
            del records[:]
            _train_step(model, local, opt)
            _train_step(ref, whole, ref_opt)
            per_iteration.append(list(records))
            diffs.append(_max_diff(model, ref))
    finally:
        restore()
    gathered_after = [g.state is not GroupState.SHARDED for g in groups]
    return {"gathers": per_iteration, "diffs": diffs, "root": root, "gathered_after": gathered_after}


# ---- deepcopy -----------------------------------------------------------------------------------
def deepcopy_errors(rank, world_size):
    model, _ = _pair(rank, world_size)
    messages = []
    for make in (copy.deepcopy, torch.optim.swa_utils.AveragedModel):
        try:
            make(model)
            messages.append(None)
        except Exception as e:  # noqa: BLE001 - the message is what is tested
            messages.append(f"{type(e).__name__}: {e}")
    return messages


def _cases() -> Dict[str, tuple]:
    cases: Dict[str, tuple] = {}
    for grad_enabled in (False, True):
        for raf in (True, False):
            cases[f"eval grad={grad_enabled} raf={raf}"] = (eval_between_backward_and_step, (grad_enabled, raf))
            cases[f"sanity grad={grad_enabled} raf={raf}"] = (sanity_forward_then_optimizer, (grad_enabled, raf))
        cases[f"surgery grad={grad_enabled}"] = (surgery_after_eval_forward, (grad_enabled,))
    cases["view"] = (inplace_on_view_output, ())
    cases["kept grad"] = (kept_grad_after_set_to_none, ())
    cases["order"] = (order_changes, ())
    cases["deepcopy"] = (deepcopy_errors, ())
    return cases


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def results(request) -> Dict[str, list]:
    return run_cases_on_ranks(_cases(), request.param, timeout=400)


def _each(results: Dict[str, list], prefix: str):
    return [(name, r) for name, per_rank in results.items() if name.startswith(prefix) for r in per_rank]


def test_eval_forward_between_backward_and_step_sees_the_step(results):
    for name, diffs in _each(results, "eval"):
        assert max(diffs) <= TOL, f"{name}: parameters/gradients off the unsharded model by {diffs}"


def test_optimizer_built_after_a_forward_gets_the_sharded_parameters(results):
    for name, r in _each(results, "sanity"):
        # FSDP2's registration: a forward with grad leaves the root's full parameters registered
        assert r["shown_sharded"] == ("grad=False" in name), f"{name}: parameters() after the forward"
        if not r["shown_sharded"]:
            assert r["refused"] and "no gradient reaches" in r["refused"], f"{name}: {r['refused']}"
        assert r["all_sharded"], f"{name}: model.parameters() after reshard() holds full parameters"
        assert r["counts_equal"], f"{name}: parameter count / state-dict shapes change with a forward: {r['numel']}"
        assert r["diff"] <= TOL, f"{name}: off the unsharded model by {r['diff']}"


def test_gathered_parameters_surgery_after_an_eval_forward_is_kept(results):
    for name, diff in _each(results, "surgery"):
        assert diff <= TOL, f"{name}: off the unsharded model by {diff}"


def test_a_view_output_modified_in_place_gives_the_right_gradients(results):
    for name, diffs in _each(results, "view"):
        assert max(diffs) <= TOL, f"{name}: gradients/parameters off the unsharded model by {diffs}"


def test_a_kept_grad_stays_the_callers(results):
    for name, r in _each(results, "kept grad"):
        assert r["kept_changed_by"] == 0.0 and not r["aliased"], f"{name}: the kept .grad was overwritten: {r}"
        assert r["new_grads_diff"] <= TOL, f"{name}: {r}"


def _expected_gathers(order: List[int], root: int, first: bool) -> tuple:
    """The all-gathers of one fwd+bwd when blocks run in ``order``: forward gathers the root, then
    prefetches each next block (from the second iteration: the first knows no order); backward
    keeps the last block and prefetches every other block, in reverse order."""
    forward = [(root, False, False)] + [(b, not first, False) for b in order]
    backward = [(b, True, True) for b in reversed(order[:-1])]
    return forward, backward


def test_prefetch_and_the_kept_group_follow_the_current_order(results):
    for name, r in _each(results, "order"):
        assert max(r["diffs"]) <= TOL, f"{name}: off the unsharded model by {r['diffs']}"
        assert not any(r["gathered_after"]), f"{name}: a group stays gathered after the step: {r['gathered_after']}"
        root = r["root"]
        for step, gathers in enumerate(r["gathers"]):
            order = [0, 1, 2] if step == 0 else [2, 0, 1]
            forward, backward = _expected_gathers(order, root, step == 0)
            got_bwd = [g for g in gathers if g[2]]
            got_fwd = [g for g in gathers if not g[2]]
            # backward follows this iteration's own order from its first iteration on
            assert got_bwd == backward, f"{name} iteration {step + 1}: backward gathers {got_bwd}, want {backward}"
            if step != 1:  # iteration 2 cannot know its new order before it runs: it may prefetch early
                assert got_fwd == forward, f"{name} iteration {step + 1}: forward gathers {got_fwd}, want {forward}"
            else:
                assert sorted(g[0] for g in got_fwd) == sorted(g[0] for g in forward), \
                    f"{name} iteration 2: each group is gathered once in forward: {got_fwd}"


def test_deepcopy_is_refused_with_a_clear_error(results):
    for name, messages in _each(results, "deepcopy"):
        for message in messages:
            assert message is not None and "deepcopy" in message and "full_state_dict" in message \
                and "before fully_shard" in message, f"{name}: {message}"

