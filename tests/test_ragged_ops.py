"""Element-wise ops on ragged-sharded tensors (ragged_tensor [Note: ops on ragged tensors]): they run
on the local pieces with the layout kept, and what has no meaning on pieces is refused, naming the
problem: tensors of different layouts, a plain tensor that is not a number, an op that needs the
whole tensor. Both the direct path (positional and keyword arguments) and the pytree path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.distributed import run_on_ranks


def _refusal(fn) -> str:
    try:
        fn()
    except NotImplementedError as e:
        return str(e)
    return "no error"


def _ops(rank: int, world: int) -> dict:
    import vescale_zero as vz
    from vescale_zero.primitives.ragged_tensor import RaggedDTensor, local_piece

    torch.manual_seed(0)
    model = vz.fully_shard(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3)))
    w1, b1, w2 = model[0].weight, model[0].bias, model[1].weight
    g = torch.zeros_like(w1)
    with torch.no_grad():
        g.copy_(w1 * 3.0 + 1.0)  # element-wise, out of place: the same layout comes back
    out: dict = {"layout kept": type(g) is RaggedDTensor and g._spec.placements == w1._spec.placements
                 and g.shape == w1.shape}
    a, piece_a, piece_g = w1.detach().clone(), local_piece(w1).clone(), local_piece(g).clone()
    with torch.no_grad():
        same = a.addcmul_(g, g, value=0.5)  # keyword argument, in place
        piece_a.addcmul_(piece_g, piece_g, value=0.5)
        out["in place returns its argument"] = same is a
        out["keyword op on pieces"] = torch.equal(local_piece(a), piece_a)
        step = torch.tensor(3.0)  # a 0-dim plain tensor (Adam's step) joins as it is
        out["0-dim plain"] = torch.equal(local_piece(a / step), piece_a / step)
        cond = a > 0  # where(cond, a, g): three ragged tensors of one layout
        out["where"] = torch.equal(local_piece(torch.where(cond, a, g)),
                                   torch.where(local_piece(cond), piece_a, piece_g))
        out["different layouts"] = _refusal(lambda: w1 + w2)
        out["different layouts, keyword"] = _refusal(lambda: w1.clone().add_(b1, alpha=2.0))
        out["plain tensor"] = _refusal(lambda: w1 * torch.ones(6, 4))
        out["plain tensor, keyword"] = _refusal(lambda: w1.clone().add_(torch.ones(6, 4), alpha=2.0))
        out["matmul"] = _refusal(lambda: w1 @ w1.t())
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_element_wise_ops_keep_the_layout_and_refuse_what_pieces_cannot_mean(world):
    for res in run_on_ranks(_ops, world):
        for key in ("layout kept", "in place returns its argument", "keyword op on pieces", "0-dim plain", "where"):
            assert res[key] is True, (key, res)
        for key in ("different layouts", "different layouts, keyword"):
            assert "ragged tensors of different layouts" in res[key], (key, res[key])
        for key in ("plain tensor", "plain tensor, keyword"):
            assert "combined with a plain tensor" in res[key] and ".to_local()" in res[key], (key, res[key])
        assert "full_tensor()" in res["matmul"], res["matmul"]
