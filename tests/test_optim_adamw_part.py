"""The AdamW part of Muon and Shampoo (the parameters they do not precondition) is
torch.optim.AdamW's step bit for bit: vescale_zero/optim/adamw_part.py calls torch's functional
AdamW on each rank's pieces instead of a copy of its arithmetic."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vescale_zero.optim import Muon, Shampoo

STEPS, LR, BETAS, EPS, WD = 4, 1e-2, (0.9, 0.95), 1e-8, 0.1


class Net(nn.Module):
    """Matrices (preconditioned by Muon / Shampoo) and vectors (AdamW's)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(torch.relu(self.a(x)))).square().mean()


OPTIMIZERS = {
    "muon": lambda ps: Muon(ps, lr=0.02, weight_decay=WD, adamw_lr=LR, adamw_betas=BETAS, adamw_eps=EPS),
    "shampoo": lambda ps: Shampoo(ps, lr=0.02, weight_decay=WD, block=8, adamw_lr=LR, adamw_betas=BETAS,
                                  adamw_eps=EPS),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_adamw_part_equals_torch_adamw_bit_for_bit(name):
    """STEPS steps on the same gradients: every vector parameter (biases, norm) of the Muon /
    Shampoo model equals the same parameter stepped by ``torch.optim.AdamW`` (its default
    implementation for these tensors) with the same hyper-parameters, and so do the moments."""
    net, torch_net = Net(), Net()
    vectors = [n for n, p in net.named_parameters() if p.ndim == 1]
    opt = OPTIMIZERS[name](list(net.parameters()))
    reference = torch.optim.AdamW([p for n, p in torch_net.named_parameters() if n in vectors], lr=LR, betas=BETAS,
                                  eps=EPS, weight_decay=WD)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(6, 8, generator=g)
        net(x).backward()
        torch_net(x).backward()
        opt.step()
        reference.step()
        opt.zero_grad()
        reference.zero_grad()
        torch_net.load_state_dict({**torch_net.state_dict(),  # the matrices follow ours: the same next gradients
                                   **{n: p for n, p in net.state_dict().items() if n.split(".")[-1] == "weight"
                                      and p.ndim == 2}})
    ours, theirs = dict(net.named_parameters()), dict(torch_net.named_parameters())
    moved = max((ours[n] - Net().state_dict()[n]).abs().max().item() for n in vectors)
    assert moved > LR, f"AdamW hardly moved the vectors ({moved:.3g})"
    for n in vectors:
        assert torch.equal(ours[n], theirs[n]), (name, n, (ours[n] - theirs[n]).abs().max().item())
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[ours[n]][key], reference.state[theirs[n]][key]), (name, n, key)
        assert opt.state[ours[n]]["step"] == STEPS
