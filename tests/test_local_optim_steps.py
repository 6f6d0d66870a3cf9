"""torch's element-wise optimizers step the local pieces of ragged parameters (local_optim_steps
[Note: torch's optimizers step the local pieces]): each of torch's optimizers and kernels (per-tensor,
foreach, fused) gives, on ragged parameters alone and with a plain one mixed in, the bits of the same
step on plain tensors and of the op-by-op dispatch path, keeps its state in the parameters' layout
(SGD's momentum, made inside the functional, included), bumps the parameters' version counters where
plain tensors' are bumped, and sends no op of a step through the ragged dispatch; an
optimizer that is not element-wise (Adafactor) is refused, not stepped on pieces. 2 and 3 ranks (3:
a rank holds an empty piece)."""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
from torch import nn

from tests.distributed import run_on_ranks
from tests.test_ragged_ops import _refusal

OPTIMIZERS = {
    "AdamW default": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "AdamW amsgrad maximize": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, maximize=True),
    "AdamW foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "Adam L2 foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=1e-2),
    "SGD nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
    "SGD momentum foreach": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
    "SGD momentum fused": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, foreach=True),
    "RMSprop centered momentum": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.9, centered=True),
    "Adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2, foreach=True),
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1),
    "RAdam": lambda ps: torch.optim.RAdam(ps, lr=1e-2, foreach=True),
    "Adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0),
    "ASGD": lambda ps: torch.optim.ASGD(ps, lr=1e-2, t0=1.0),
    "Rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2, foreach=True),
}
STEPS = 3


@contextlib.contextmanager
def _dispatch_path():
    """torch's functionals as torch ships them: every op of a step meets the ragged dispatch."""
    from vescale_zero.local_optim_steps import wrapped_functionals

    saved = []
    for name in wrapped_functionals():
        module_name, fn = name.rsplit(".", 1)
        module = importlib.import_module(module_name)
        saved.append((module, fn, getattr(module, fn)))
        setattr(module, fn, getattr(module, fn).__wrapped__)
    try:
        yield
    finally:
        for module, fn, wrapper in saved:
            setattr(module, fn, wrapper)


@contextlib.contextmanager
def _count_dispatches(counter: list):
    from vescale_zero.ragged_tensor import RaggedDTensor

    original = RaggedDTensor.__dict__["__torch_dispatch__"]

    def counting(cls, func, types, args=(), kwargs=None):
        counter.append(str(func))
        return original.__func__(cls, func, types, args, kwargs)

    RaggedDTensor.__torch_dispatch__ = classmethod(counting)
    try:
        yield
    finally:
        RaggedDTensor.__torch_dispatch__ = original


def _steps(rank: int, world: int) -> dict:
    import vescale_zero as vz
    from vescale_zero.ragged_tensor import RaggedDTensor, like_param, local_piece

    torch.manual_seed(0)
    model = vz.fully_shard(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3)))
    base = list(model.parameters())
    extra = torch.randn(5)  # a plain parameter beside the ragged ones, in the same optimizer

    def ragged_copies():
        return [RaggedDTensor.from_piece(local_piece(p).detach().clone(), p._spec, requires_grad=True) for p in base]

    result = {}
    for kind, make in OPTIMIZERS.items():
        fast, only, slow = ragged_copies() + [nn.Parameter(extra.clone())], ragged_copies(), ragged_copies()
        plain = [nn.Parameter(local_piece(p).detach().clone()) for p in base] + [nn.Parameter(extra.clone())]
        # fast: ragged and plain parameters in one optimizer; only: ragged ones alone (what a sharded model gives);
        # dispatch: ragged ones alone, op by op (it refuses a plain one mixed in)
        runs = {"fast": (fast, make(fast)), "only": (only, make(only)), "dispatch": (slow, make(slow)),
                "plain": (plain, make(plain))}
        changed = {name: [] for name in runs}
        dispatched: list = []
        refused = ""
        for step in range(STEPS):
            grads = [torch.randn(local_piece(p).shape, generator=torch.Generator().manual_seed(100 * step + i))
                     for i, p in enumerate(fast)]
            for name, (params, opt) in runs.items():
                for p, g in zip(params, grads):
                    p.grad = like_param(g.clone(), p)
                before = [p._version for p in params]
                path = _dispatch_path() if name == "dispatch" else contextlib.nullcontext()
                counted = name in ("fast", "only") and step
                counting = _count_dispatches(dispatched) if counted else contextlib.nullcontext()
                with path, counting:
                    if name == "dispatch":  # op by op: it may refuse an op (Rprop's masked writes), never err silently
                        refused = refused or _refusal(opt.step).replace("no error", "")
                    else:
                        opt.step()
                changed[name].append([p._version != v for p, v in zip(params, before)])
        pieces = {name: [local_piece(p).detach() for p in params] for name, (params, _) in runs.items()}
        state_layouts = [isinstance(v, RaggedDTensor) and v._spec.placements == p._spec.placements
                         for name in ("fast", "only") for p in runs[name][0] if type(p) is RaggedDTensor
                         for v in runs[name][1].state[p].values() if torch.is_tensor(v) and v.dim() > 0]
        result[kind] = {
            "fast == plain": all(torch.equal(a, b) for a, b in zip(pieces["fast"], pieces["plain"])),
            "only == plain": all(torch.equal(a, b) for a, b in zip(pieces["only"], pieces["plain"])),
            "dispatch == plain": bool(refused) or all(torch.equal(a, b)
                                                      for a, b in zip(pieces["dispatch"], pieces["plain"])),
            "dispatch refused": refused,
            "state in the layout": bool(state_layouts) and all(state_layouts) if "SGD" != kind else not state_layouts,
            # a parameter written where plain tensors' counters move, but never the other way (fused kernels bump none)
            "versions": all(f or not p for name in ("fast", "only")
                            for fs, ps in zip(changed[name], changed["plain"]) for f, p in zip(fs, ps)),
            "dispatched after the first step": dispatched,
        }
    result["Adafactor"] = _refusal(lambda: _adafactor_step(ragged_copies()))
    return result


def _adafactor_step(params: list) -> None:
    opt = torch.optim.Adafactor(params, lr=1e-2)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def results(request) -> list:
    return run_on_ranks(_steps, request.param)


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_torch_optimizer_steps_local_pieces_as_plain_tensors(results, kind):
    for rank, res in enumerate(results):
        got = res[kind]
        assert got["fast == plain"] and got["only == plain"] and got["dispatch == plain"], (rank, kind, got)
        assert not got["dispatch refused"] or "not supported on a ragged-sharded tensor" in got["dispatch refused"]
        assert got["state in the layout"], (rank, kind, got)
        assert got["versions"], (rank, kind, got)
        assert got["dispatched after the first step"] == [], (rank, kind, got["dispatched after the first step"][:5])


def test_an_optimizer_that_is_not_element_wise_is_refused(results):
    for res in results:
        assert "is not supported on a ragged-sharded tensor" in res["Adafactor"], res["Adafactor"]
