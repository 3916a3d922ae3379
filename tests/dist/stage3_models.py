"""Small models for the stage-3 tests (importable by the worker processes)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


class Block(nn.Module):
    """A residual MLP layer."""

    def __init__(self, d: int = 8, hidden: int = 12) -> None:
        super().__init__()
        self.fc = nn.Linear(d, hidden)
        self.proj = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.tanh(self.fc(x)))


class Stack(nn.Module):
    """Every parameter is in a block (the root owns none), so the default policy (container
    elements) makes each block a unit and the traffic is exactly 3x the units. The blocks
    differ in size, so the largest unit is a real bound. ``order`` reorders or skips blocks."""

    def __init__(self, d: int = 8, hiddens: tuple[int, ...] = (12, 20, 16, 9)) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, h) for h in hiddens)

    def forward(self, x: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
        for i in order if order is not None else range(len(self.blocks)):
            x = self.blocks[i](x)
        return x


class Reuse(nn.Module):
    """``shared`` is called twice in one forward (weight reuse)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.shared = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))
        return self.out(h)


class TiedHead(nn.Module):
    """An output projection tied to the embedding, the two in different units."""

    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(idx))))


class Features(nn.Module):
    """Returns features; the loss applies ``model.head.weight`` outside any forward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(6, h) for h in (10, 7))
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


class Inner(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Outer(nn.Module):
    """A unit with parameters of its own around a nested unit."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.inner = Inner(d)
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(self.norm(x)) * self.gate


class Nested(nn.Module):
    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Outer(d) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@dataclass
class Out:
    y: torch.Tensor
    aux: torch.Tensor


class TupleUnit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        return torch.tanh(h), h.pow(2).mean(-1)


class DictUnit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 5)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        x, aux = pair
        return {"y": torch.tanh(self.fc(x)), "aux": aux + x.sum(-1)}


class DataclassUnit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 5)

    def forward(self, d: dict[str, torch.Tensor]) -> Out:
        return Out(self.fc(d["y"]), d["aux"] * 0.5)


class Structured(nn.Module):
    """Units whose outputs (and inputs) are a tuple, a dict and a dataclass."""

    def __init__(self) -> None:
        super().__init__()
        self.t = TupleUnit()
        self.d = DictUnit()
        self.c = DataclassUnit()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.c(self.d(self.t(x)))
        return out.y.sum(-1) + out.aux


class Gated(nn.Module):
    """``extra`` is used only when asked: unused on some ranks, inside a unit that runs on all."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 5)
        self.extra = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor, branch: bool) -> torch.Tensor:
        y = torch.tanh(self.fc(x))
        return y + self.extra(y) if branch else y


class GatedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Gated(), Gated(), Gated()])
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor, branch: bool = False) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, branch)
        return self.head(x)


class Shift(nn.Module):
    """Adds a learned bias: ``add`` saves nothing for its backward."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.linspace(-0.5, 0.5, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias


class Scale(nn.Module):
    """Multiplies by a learned vector: ``mul`` saves the parameter itself (a leaf)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class Recomputed(nn.Module):
    """Checkpoints a linear layer inside its own forward: the checkpoint keeps nothing of the
    parameters, and its recompute reads them in the backward."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        out = checkpoint(self.lin, x, use_reentrant=False)
        assert isinstance(out, torch.Tensor)
        return torch.tanh(out)


class Maybe(nn.Module):
    """Adds a bias, then multiplies by a scale only when told: whether its backward reads a
    parameter depends on the call (on the rank's data)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.linspace(-0.5, 0.5, d))
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x: torch.Tensor, scaled: bool) -> torch.Tensor:
        x = x + self.bias
        return x * self.scale if scaled else x


class Switch(nn.Module):
    """An embedding, a ``Maybe`` and a head: ``scaled`` picks the branch."""

    UNITS = ("Embedding", "Maybe")

    def __init__(self, vocab: int = 13, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.maybe = Maybe(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor, scaled: bool = False) -> torch.Tensor:
        return self.head(torch.tanh(self.maybe(self.emb(ids), scaled)))


class Parts(nn.Module):
    """Units whose backward reads their parameters and units whose backward does not
    ([Note: backward without parameters] in zerodp/params/saved.py): an embedding, a shift, a
    scale, a linear checkpointed inside its unit and an MLP block; the head is in the root."""

    UNITS = ("Embedding", "Shift", "Scale", "Recomputed", "Block")

    def __init__(self, vocab: int = 13, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.shift = Shift(d)
        self.scale = Scale(d)
        self.inner = Recomputed(d)
        self.block = Block(d, 12)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.block(self.inner(self.scale(self.shift(self.emb(ids)))))
        return self.head(h)


class PackedScale(Scale):
    """``Scale`` whose forward pushes ``save_on_cpu`` itself: on the CPU its pack hook returns
    the parameter object (``tensor.cpu()`` of a CPU tensor is the tensor)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.save_on_cpu():
            return x * self.weight


class Packed(nn.Module):
    """An embedding, then ``PackedScale``; the head is in the root."""

    UNITS = ("Embedding", "PackedScale")

    def __init__(self, vocab: int = 13, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.scale = PackedScale(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.scale(self.emb(ids)))


class HookedScale(Scale):
    """``Scale`` whose forward pushes saved-tensor hooks that keep the parameter object itself
    and hand it back unchanged: no reference count shows it and no torch function reads it
    when the backward unpacks it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return x * self.weight


class Hooked(Packed):
    """``Packed`` with ``HookedScale``."""

    UNITS = ("Embedding", "HookedScale")

    def __init__(self, vocab: int = 13, d: int = 8) -> None:
        super().__init__(vocab, d)
        self.scale = HookedScale(d)


def untied_gpt() -> nn.Module:
    """Our GPT, tiny, its token embedding and head separate parameters."""
    from zerodp.apps.models.gpt import GPT, get_config

    return GPT(get_config("tiny", tie_embeddings=False))


def gpt_loss(step: int, world: int) -> Callable[[nn.Module, int], torch.Tensor]:
    """Rank r's next-token loss at ``step`` (``zerotest.synced_step``'s ``losses``)."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 256, (world, 2, 17), generator=g)

    def loss(m: nn.Module, r: int) -> torch.Tensor:
        return m(tokens[r][:, :-1], tokens[r][:, 1:])[1]

    return loss
