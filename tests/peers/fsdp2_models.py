"""Small models and helpers for the FSDP2 scenario tests (tests/peers/test_fsdp2_*.py).

The models are rewritten from the *scenarios* of PyTorch FSDP2's own test suite
(``test/distributed/_composable/fsdp/test_fully_shard_*.py``): an MLP stack, a tiny
transformer with optional weight tying, a two-output ``DoubleLinear``, containers between
modules. Every comparison is against unsharded training on the same global batch: the
reference steps on the mean over ranks of every rank's local loss (``zerotest.reference_step``).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from zerotest import Pair, assert_close, batches, build, mse, rank_world, reference_step

import zerodp

SGD_TOL = 1e-6  # fp32 relative parity, SGD (tests/dist/zerotest.py)
ADAM_TOL = 1e-5  # fp32 relative parity, Adam/AdamW (tests/dist/test_hf_models.py)
STAGES = (0, 1, 2, 3)


def cfg(
    stage: int,
    units: tuple[str, ...] = (),
    precision: str | zerodp.Precision = "fp32",
    bucket_bytes: int = 128,
    **stage3: Any,
) -> zerodp.ZeroConfig:
    """Small buckets (parameters cut across buckets); stage 3: ``units`` are the units, and
    ``stage3`` other fields of ``Stage3``."""
    if stage == 3 and units:
        stage3["unit_classes"] = units
    return zerodp.ZeroConfig(
        stage=stage, bucket_bytes=bucket_bytes, precision=precision, stage3=zerodp.Stage3(**stage3)
    )


def pair(
    factory: Callable[[], nn.Module],
    make_opt: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    config: zerodp.ZeroConfig,
    unit_policy: Callable[[str, nn.Module], bool] | None = None,
    seed: int = 0,
) -> Pair:
    """``zerotest.make_pair`` plus a stage-3 ``unit_policy``."""
    ref, model = build(factory, seed), build(factory, seed)
    ref_opt = make_opt([p for p in ref.parameters() if p.requires_grad])
    opt = make_opt([p for p in model.parameters() if p.requires_grad])
    policy = unit_policy if config.stage == 3 else None
    model, zopt = zerodp.initialize(model, opt, config, unit_policy=policy)
    return Pair(model, zopt, ref, ref_opt)


def adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


class MLPBlock(nn.Module):
    """FSDP2's ``MLP``: in_proj -> relu -> out_proj (+ an optional buffer)."""

    def __init__(self, dim: int, mult: int = 2, bias: bool = True) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, mult * dim, bias=bias)
        self.out_proj = nn.Linear(mult * dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(F.relu(self.in_proj(x)))


def mlp_stack(dim: int = 8, n: int = 3) -> nn.Module:
    return nn.Sequential(*[MLPBlock(dim) for _ in range(n)])


class Block(nn.Module):
    """A pre-norm transformer-ish block (no attention: enough for sharding)."""

    def __init__(self, dim: int, ckpt: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(2 * dim, dim)
        self.ckpt = ckpt

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ckpt:
            return checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)


class Stack(nn.Module):
    """FSDP2's ``Transformer`` in miniature: token embedding, blocks, final norm, head,
    optionally tied to the embedding."""

    def __init__(
        self, vocab: int = 13, dim: int = 8, n_layers: int = 3, tie: bool = False, ckpt=False
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, ckpt) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def token_batches(step: int, world: int, per_rank: int = 2, seq: int = 6, vocab: int = 13):
    g = torch.Generator().manual_seed(500 + step)
    idx = torch.randint(0, vocab, (world * per_rank, seq), generator=g)
    tgt = torch.randint(0, vocab, (world * per_rank, seq), generator=g)
    return [
        (idx[r * per_rank : (r + 1) * per_rank], tgt[r * per_rank : (r + 1) * per_rank])
        for r in range(world)
    ]


def lm_loss(data: list) -> Callable[[nn.Module, int], torch.Tensor]:
    def loss(m: nn.Module, r: int) -> torch.Tensor:
        idx, tgt = data[r]
        logits = m(idx).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))

    return loss


class DoubleLinear(nn.Module):
    """FSDP2's ``DoubleLinear``: two outputs, or one (``lin2`` then never runs)."""

    def __init__(self, dim: int = 8, use_second_linear: bool = True) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)
        self.use_second_linear = use_second_linear

    def forward(self, x: torch.Tensor) -> Any:
        if self.use_second_linear:
            return F.relu(self.lin1(x)), F.relu(self.lin2(x))
        return F.relu(self.lin1(x))


# -- containers between modules (FSDP2 test_nontensor_activations, test_structured_...) --------

NT = collections.namedtuple("NT", "x y")


@dataclasses.dataclass
class DC:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Outer:
    inner: DC
    z: torch.Tensor


CONTAINERS = ("list", "tuple", "namedtuple", "dict", "dataclass", "nested_dataclass")


def pack(kind: str, x: torch.Tensor, y: torch.Tensor) -> Any:
    return {
        "list": lambda: [x, y],
        "tuple": lambda: (x, y),
        "namedtuple": lambda: NT(x, y),
        "dict": lambda: {"x": x, "y": y},
        "dataclass": lambda: DC(x, y),
        "nested_dataclass": lambda: Outer(DC(x, y), x * y),
    }[kind]()


def unpack(kind: str, v: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if kind in ("list", "tuple", "namedtuple"):
        return v[0], v[1]
    if kind == "dict":
        return v["x"], v["y"]
    if kind == "dataclass":
        return v.x, v.y
    return v.inner.x, v.inner.y + v.z


class ToContainer(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> Any:
        return pack(self.kind, x, x.clone())


class ContainerLayer(nn.Module):
    """Applies its linear layers to each tensor of a container and returns the same kind."""

    def __init__(self, kind: str, dim: int) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(dim, dim)
        self.other = nn.Linear(dim, dim)

    def forward(self, v: Any) -> Any:
        x, y = unpack(self.kind, v)
        return pack(self.kind, torch.tanh(self.lin(x)), torch.tanh(self.other(y)))


class FromContainer(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, v: Any) -> torch.Tensor:
        x, y = unpack(self.kind, v)
        return x + y


def container_model(kind: str, dim: int = 8) -> nn.Module:
    return nn.Sequential(
        ToContainer(kind),
        ContainerLayer(kind, dim),
        ContainerLayer(kind, dim),
        ContainerLayer(kind, dim),
        FromContainer(kind),
    )


# -- FSDP2's training loop ---------------------------------------------------------------------


def train(p, losses_for_step, steps: int, tol: float, what: str, start: int = 0) -> float:
    """FSDP2's loop: zero_grad(set_to_none alternating), forward/backward, step; parity after
    every step."""
    rank, world = rank_world()
    worst = 0.0
    for step in range(start, start + steps):
        none = step % 2 == 0
        p.ref_opt.zero_grad(set_to_none=none)
        p.opt.zero_grad(set_to_none=none)
        losses = losses_for_step(step)
        reference_step(p, losses, world, step=False)
        p.ref_opt.step()
        losses(p.model, rank).backward()
        p.opt.step()
        worst = max(worst, assert_close(p.model, p.ref, tol, f"{what} step {step}"))
    return worst


def mse_steps(d_in: int, d_out: int, per_rank: int = 2):
    _, world = rank_world()
    return lambda step: mse(batches(step, world, per_rank, [(d_in,), (d_out,)]))


def lm_steps(step: int):
    return lm_loss(token_batches(step, rank_world()[1]))
