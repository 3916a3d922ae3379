"""Helpers for multi-rank tests: small models, and an unsharded reference trained in-process.

The reference is what data parallelism must reproduce: one model whose loss is the mean over
ranks of every rank's local loss (for equal local batches: the loss of the concatenated global
batch), stepped by a plain torch optimizer. Every rank trains its own copy of the reference on
the global batch, so each rank can compare its zerodp model to it without communication.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerodp

TOL = 1e-6  # relative error bound for fp32 parity (issue 2)
NONFINITE_RAISE = (  # ZeroConfig.precision.nonfinite='raise': what every rank raises
    "zerodp: step {step}: non-finite {what} on at least one rank; no parameter was updated "
    "(ZeroConfig.precision.nonfinite='raise'). The run diverged or a batch is bad: lower the "
    "learning rate or clip gradients (opt.clip_grad_norm_), check the data and the loss, or "
    "pass ZeroConfig(precision=Precision(..., nonfinite='skip')) to skip such steps on every "
    "rank"
)


class MLP(nn.Module):
    """Odd sizes on purpose: 7x13 weights are not divisible by 2, 3 or 4."""

    def __init__(self, d_in: int = 7, hidden: int = 13, d_out: int = 5) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class OddSizes(nn.Module):
    """Parameters smaller than N, of size zero, and not divisible by N."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 3)  # 15 + 3
        self.scalar = nn.Parameter(torch.tensor([0.5]))  # 1 element < N
        self.empty = nn.Parameter(torch.empty(0))  # size zero
        self.pair = nn.Parameter(torch.tensor([0.1, -0.2]))  # 2 elements < 3, 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scalar + self.pair.sum() + self.empty.sum()


class Tied(nn.Module):
    """An embedding reused as the output projection (one Parameter, two uses)."""

    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.emb(idx))))


class Branchy(nn.Module):
    """``never`` is unused everywhere; ``sometimes`` only when the forward is told to."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.sometimes = nn.Linear(4, 4)
        self.never = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_branch: bool = False) -> torch.Tensor:
        y = torch.tanh(self.fc(x))
        if use_branch:
            y = y + self.sometimes(y)
        return y


def build(factory: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return factory()


def rank_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


@dataclass
class Pair:
    """A zerodp model/optimizer and its unsharded reference."""

    model: nn.Module
    opt: zerodp.ZeroOptimizer
    ref: nn.Module
    ref_opt: torch.optim.Optimizer


def make_pair(
    factory: Callable[[], nn.Module],
    make_opt: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    config: zerodp.ZeroConfig,
    process_group: Any = None,
    seed: int = 0,
) -> Pair:
    ref = build(factory, seed)
    model = build(factory, seed)
    ref_opt = make_opt(list(ref.parameters()))
    model, opt = zerodp.initialize(
        model, make_opt(list(model.parameters())), config, process_group=process_group
    )
    return Pair(model, opt, ref, ref_opt)


def reference_step(
    pair: Pair, losses: Callable[[nn.Module, int], torch.Tensor], world: int, step: bool = True
) -> torch.Tensor:
    """Backward the mean over ranks of each rank's local loss on the reference model."""
    total = sum(losses(pair.ref, r) for r in range(world)) / world
    assert isinstance(total, torch.Tensor)
    total.backward()
    if step:
        pair.ref_opt.step()
        pair.ref_opt.zero_grad()
    return total


def mse(data: list) -> Callable[[nn.Module, int], torch.Tensor]:
    """Rank r's loss on ``data[r] = (x, y)`` (fp32, whatever the model's output dtype)."""

    def loss(m: nn.Module, r: int) -> torch.Tensor:
        x, y = data[r]
        return F.mse_loss(m(x).float(), y)

    return loss


def synced_step(
    pair: Pair, losses: Callable[[nn.Module, int], torch.Tensor], world: int, rank: int
) -> None:
    """One step of the zerodp model on this rank's loss and of the reference on the mean."""
    reference_step(pair, losses, world)
    losses(pair.model, rank).backward()
    pair.opt.step()
    pair.opt.zero_grad()


def full(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Read access to a model's full parameters: stage 3 gathers them (a collective: call on
    every rank); any other model is left as it is."""
    if isinstance(model, zerodp.ZeroModule):
        return zerodp.full_parameters(model, writeback=False)
    return contextlib.nullcontext()


def max_rel_error(a: nn.Module, b: nn.Module) -> float:
    """Max over parameters of ||a - b|| / ||b|| (absolute where b is zero)."""
    worst = 0.0
    with full(a), full(b):
        for (_, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            diff = (p.detach() - q.detach()).norm().item()
            scale = q.detach().norm().item()
            worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def assert_close(a: nn.Module, b: nn.Module, tol: float = TOL, what: str = "") -> float:
    err = max_rel_error(a, b)
    assert err <= tol, f"{what}: max relative error {err:.3e} > {tol:.0e}"
    return err


def batches(seed: int, world: int, per_rank: int, shapes: Sequence[tuple[int, ...]]) -> list:
    """A global batch split by rank: ``out[r]`` is a tuple of tensors for rank r."""
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(world * per_rank, *s, generator=g) for s in shapes]
    return [tuple(t[r * per_rank : (r + 1) * per_rank] for t in full) for r in range(world)]


def adamw_two_groups(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """Decay / no-decay groups with different learning rates, plus an empty group."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "lr": 1e-2, "weight_decay": 0.1},
            {"params": no_decay, "lr": 3e-3, "weight_decay": 0.0},
            {"params": [], "lr": 1.0},
        ]
    )


def sgd_momentum(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)
