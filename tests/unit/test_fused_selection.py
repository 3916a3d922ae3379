"""zerodp switches to torch's fused optimizer kernel only where the user left the choice open."""

from __future__ import annotations

import torch

from zerodp.optim.pieces import select_fused


def _params(n: int = 2) -> list[torch.Tensor]:
    return [torch.zeros(4) for _ in range(n)]


def test_unset_groups_become_fused_explicit_choices_stay():
    opt = torch.optim.AdamW(
        [
            {"params": _params()},
            {"params": _params(), "foreach": True},
            {"params": _params(), "fused": False},
            {"params": []},
        ]
    )
    assert select_fused(opt) == [0]
    assert [g["fused"] for g in opt.param_groups] == [True, None, False, None]


def test_optimizers_without_a_fused_kernel_are_left_alone():
    opt = torch.optim.RMSprop(_params())
    assert select_fused(opt) == []
    assert "fused" not in opt.param_groups[0]


def test_fused_sgd_matches_foreach():
    a, b = torch.randn(100), None
    b = a.clone()
    fa = torch.optim.SGD([a], lr=0.1, momentum=0.9)
    fb = torch.optim.SGD([b], lr=0.1, momentum=0.9)
    assert select_fused(fb) == [0]
    for _ in range(3):
        g = torch.randn(100)
        a.grad, b.grad = g.clone(), g.clone()
        fa.step()
        fb.step()
    assert torch.allclose(a, b, rtol=0, atol=1e-6)
