"""Small models for the DeepSpeed scenarios (importable by the worker processes).

Each mirrors the model of a DeepSpeed ZeRO unit test (``tests/unit/runtime/zero/``), rewritten:
same structure and use pattern, our own code.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Layers(nn.Module):
    """``SimpleModel`` with ``nlayers`` linears; ``use[i]`` says whether layer i runs."""

    def __init__(self, n: int = 4, d: int = 6, out: int = 3) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.head = nn.Linear(d, out)

    def forward(self, x: torch.Tensor, use: list[bool] | None = None) -> torch.Tensor:
        for i, layer in enumerate(self.linears):
            if use is None or use[i]:
                x = torch.tanh(layer(x))
        return self.head(x)


class AlbertLike(nn.Module):
    """``TestZero3RepeatForwardLoop``: one layer applied three times in a loop, loss inside."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden = x
        for _ in range(3):
            hidden = hidden + self.linear(hidden)
        return F.cross_entropy(hidden, y)


Pair = namedtuple("Pair", ["y"])


class Eltwise(nn.Module):
    """An element-wise product unit returning a dict, a namedtuple or a tensor."""

    def __init__(self, weight: nn.Parameter, kind: str) -> None:
        super().__init__()
        self.weight = weight
        self.kind = kind

    def forward(self, x: torch.Tensor) -> Any:
        out = self.weight * x
        if self.kind == "dict":
            return {"y": out}
        if self.kind == "namedtuple":
            return Pair(out)
        return out


def _unwrap(out: Any) -> torch.Tensor:
    if isinstance(out, dict):
        return out["y"]
    if isinstance(out, Pair):
        return out.y
    return out


class EltwiseNet(nn.Module):
    """``EltwiseMultiplicationTestNetwork_*``: three units, the loss computed inside forward,
    everything returned as ``kind`` (dict, namedtuple, tuple, list, or a dict with non-tensor
    values as in ``TestZero3DictFwd``)."""

    def __init__(self, kind: str, m: int = 3, n: int = 5) -> None:
        super().__init__()
        pattern = (torch.arange(m * n) >= m * n // 2).float().add(1).view(m, n)
        unit_kind = "dict" if kind in ("dict", "dict_extra") else "namedtuple"
        if kind == "tuple":
            unit_kind = "tensor"
        self.kind = kind
        self.layer1 = Eltwise(nn.Parameter(pattern * 1), unit_kind)
        self.layer2 = Eltwise(nn.Parameter(pattern * 2), unit_kind)
        self.layer3 = Eltwise(nn.Parameter(pattern * 3), unit_kind)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        h1 = _unwrap(self.layer1(x))
        h2 = _unwrap(self.layer2(h1))
        y_hat = _unwrap(self.layer3(h2))
        loss = F.l1_loss(y_hat, y, reduction="none")
        if self.kind == "dict":
            return {"hidden1": h1, "hidden2": h2, "y_hat": y_hat, "loss": loss}
        if self.kind == "dict_extra":
            return {"hidden1": h1, "hidden2": h2, "y_hat": y_hat, "loss": loss, "b": 1, "c": None}
        if self.kind == "list":
            return [h1, h2, y_hat, loss]
        return (h1, h2, y_hat, loss)


def outputs(out: Any) -> list[torch.Tensor]:
    """hidden1, hidden2, y_hat, loss from any of ``EltwiseNet``'s output kinds."""
    if isinstance(out, dict):
        return [out["hidden1"], out["hidden2"], out["y_hat"], out["loss"]]
    return list(out)


class Frozen(nn.Module):
    """``TestZeroFrozenWeights``: ``l2`` frozen at construction."""

    def __init__(self, d: int = 10) -> None:
        super().__init__()
        self.l1 = nn.Linear(d, d)
        self.l2 = nn.Linear(d, d)
        self.l3 = nn.Linear(d, d)
        self.l2.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))


class ChooseByCounter(nn.Module):
    """``test_zero_leaf_module``: the forward picks ``linears[counter % 2]``."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)])
        self.counter = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.linears[self.counter % 2](x))
        self.counter += 1
        return F.cross_entropy(x, y)


class ChooseByRank(nn.Module):
    """``test_zero_leaf_module``: rank r runs ``linears[r % 2]`` only."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)])

    def forward(self, x: torch.Tensor, y: torch.Tensor, rank: int) -> torch.Tensor:
        return F.cross_entropy(torch.relu(self.linears[rank % 2](x)), y)


class MLPBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, d, bias=False)
        self.up_proj = nn.Linear(d, d, bias=False)
        self.down_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x))


class FineGrainedBlock(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.mlp_layers = nn.ModuleList(MLPBlock(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.mlp_layers:
            x = layer(x)
        return x


class FineGrained(nn.Module):
    """``TestZ3LeafOptimization``'s ``modelWithFineGrainedBlock``."""

    def __init__(self, d: int = 8, n: int = 4) -> None:
        super().__init__()
        self.coarse_grained_layer1 = nn.Linear(d, 4 * d)
        self.coarse_grained_layer2 = nn.Linear(4 * d, d)
        self.fine_grained_layer = FineGrainedBlock(d, n)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.coarse_grained_layer2(self.coarse_grained_layer1(x))
        return F.cross_entropy(self.fine_grained_layer(x), y)


class ExtLinear(nn.Module):
    """``test_ext_param_getattr``: ``linear1.weight`` used again outside ``linear1``."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.linear1 = nn.Linear(d, d)
        self.linear2 = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.linear2(self.linear1(x))
        return F.linear(b, self.linear1.weight)


class DanglingBias(nn.Linear):
    """``test_zero_context_return``: a unit that returns its own bias parameter."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(x), self.bias


class DanglingContainer(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.linear1 = nn.Linear(d, d)
        self.dangler = DanglingBias(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act, bias = self.dangler(self.linear1(x))
        return act + bias


class WithAttrs(nn.Module):
    """``TestZero3ClientModuleID`` / ``TestDSInitWZinit``: user attributes and methods."""

    def __init__(self) -> None:
        super().__init__()
        self.id = 3
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)

    def magic(self) -> int:
        return 42


class ConvX(nn.Conv1d):
    """``test_zero_context``: a subclass of a torch layer adding a parameter of its own."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.param_in = nn.Parameter(torch.empty(5))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "param_in"):
            nn.init.uniform_(self.param_in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.param_in.sum()


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = ConvX(1, 3, 4)
        self.head = nn.Linear(3 * 5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv1(x)).flatten(1))


class ValueInConstructor(nn.Module):
    """``TestSerialParamInit`` alone: a parameter computed in ``__init__`` of a module that has
    no ``reset_parameters``."""

    def __init__(self) -> None:
        super().__init__()
        self.param = nn.Parameter(torch.ones(5) + 1)
        self.linear = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x * self.param)


class ParentInitialisesChild(nn.Module):
    """``TestZero3InitForParentWeightInitialization`` alone: the parent fills its child's weight
    in ``__init__``; the child (``nn.Linear``) has a ``reset_parameters``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 1)
        with torch.no_grad():
            self.linear.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * x).sum()
