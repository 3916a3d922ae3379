"""Stage 3: every documented way to look at a parameter is safe outside forward.

Outside forward each access on a released parameter either raises the ``RuntimeError`` that
names ``zerodp.full_parameters`` or returns the true full values; inside
``zerodp.full_parameters`` every one returns the true values (the truth: an unsharded copy of the
same model built under the same seed). One row per access ([Note: safe reads] in
``zerodp/params/access.py``), on a small ``nn.Module`` and on a tiny Hugging Face
``GPT2LMHeadModel``. The ranks compute every outcome once per model (one shared world); the
tests below assert one row each.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from zerotest import rank_world

import zerodp

TIMEOUT = 120.0
CONFIG = {"stage": 3, "stage3": {"unit_min_numel": 1, "persist_numel": 0}}  # all sharded


class Small(nn.Module):
    """Two units (``blocks.0``, ``blocks.1``) under a root that owns ``emb``; ``blocks.1`` has a
    one-element parameter (``scale``) for ``item()``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Parameter(torch.randn(5, 8))
        self.blocks = nn.ModuleList([nn.Linear(8, 32), ScaledLinear(32, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x + self.emb.sum(0)


class ScaledLinear(nn.Linear):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.scale = nn.Parameter(torch.tensor([0.75]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2)
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0  # gradients compared bit for bit
    return GPT2LMHeadModel(cfg)


# model: (factory, parameter read by the rows, its unit, 1-element parameter or None,
#         first parameter of named_parameters(), its unit)
MODELS: dict[str, tuple[Callable[[], nn.Module], str, str, str | None, str, str]] = {
    "small": (Small, "blocks.1.weight", "blocks.1", "blocks.1.scale", "emb", "<root Small>"),
    "gpt2": (
        _gpt2,
        "transformer.h.1.mlp.c_fc.weight",
        "transformer.h.1",
        None,
        "transformer.wte.weight",
        "<root GPT2LMHeadModel>",
    ),
}


def _saved(p: torch.Tensor) -> Any:
    buf = io.BytesIO()
    torch.save(p, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


# row: (access on a parameter, what the refusal names it; None: str / repr never raise)
ROWS: dict[str, tuple[Callable[[torch.Tensor], Any], str | None]] = {
    "torch op": (lambda p: torch.mul(p, 2.0), "mul"),
    "p.data": (lambda p: p.data, ".data"),
    "p.detach()": (lambda p: p.detach(), "detach"),
    "p.detach().tolist()": (lambda p: p.detach().tolist(), "detach"),
    "p.clone()": (lambda p: p.clone(), "clone"),
    "p.cpu()": (lambda p: p.cpu(), "cpu"),
    "p.tolist()": (lambda p: p.tolist(), "tolist"),
    "p.numpy()": (lambda p: p.numpy(), "numpy"),
    "p.detach().numpy()": (lambda p: p.detach().numpy(), "detach"),
    "p[0]": (lambda p: p[0], "__getitem__"),
    "p.T": (lambda p: p.T, ".T"),
    "torch.save(p)": (lambda p: _saved(p), "pickling"),
    "copy.deepcopy(p)": (lambda p: copy.deepcopy(p), "copy.deepcopy"),
    "str(p)": (lambda p: str(p), None),
    "repr(p)": (lambda p: repr(p), None),
    "p.sum()": (lambda p: p.sum(), "sum"),
    "p.norm()": (lambda p: p.norm(), "norm"),
    "p.to(float64)": (lambda p: p.to(torch.float64), "to"),
    "p.float()": (lambda p: p.float(), "float"),
}


def _same(a: Any, b: Any) -> bool:
    """Exactly the same value: tensors (both Parameters or neither) of the same dtype, shape
    and elements; lists element by element."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and isinstance(a, nn.Parameter) == isinstance(b, nn.Parameter)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.detach(), b.detach())
        )
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, type(a))
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b, strict=True))
        )
    return type(a) is type(b) and bool(a == b)


def _outcome(fn: Callable[[], Any], truth: Callable[[], Any]) -> tuple[str, str]:
    """("raises", message), ("equal", "") when the value is exactly the truth's, ("returns",
    the string) for any other string, else ("differs", a summary)."""
    try:
        value = fn()
    except RuntimeError as exc:
        return "raises", str(exc)
    if _same(value, truth()):
        return "equal", ""
    if isinstance(value, str):
        return "returns", value
    return "differs", f"{type(value).__name__}: {value!r:.300}"


def _rows_on(model: nn.Module, ref: nn.Module, name: str, scalar: str | None) -> dict:
    """Every row's outcome on ``model`` (zerodp) against ``ref`` (the truth)."""
    p, q = model.get_parameter(name), ref.get_parameter(name)
    out = {row: _outcome(partial(f, p), partial(f, q)) for row, (f, _) in ROWS.items()}
    if scalar is not None:
        s, t = model.get_parameter(scalar), ref.get_parameter(scalar)
        out["p.item()"] = _outcome(lambda: s.item(), lambda: t.item())
    out["state_dict()"] = _outcome(lambda: model.state_dict(), lambda: ref.state_dict())
    out["named_parameters()"] = _outcome(
        lambda: [(n, x.detach().clone()) for n, x in model.named_parameters()],
        lambda: [(n, x.detach().clone()) for n, x in ref.named_parameters()],
    )
    return out


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    if isinstance(model, Small):
        return model(batch).pow(2).mean()
    return model(input_ids=batch, labels=batch).loss


def _batch(model_key: str, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    if model_key == "small":
        return torch.randn(3, 8, generator=g)
    return torch.randint(0, 64, (2, 12), generator=g)


def _grads(model: nn.Module, ref: nn.Module, batch: torch.Tensor) -> dict[str, tuple[str, str]]:
    """``p.grad`` after backward: under ``no_sync`` this rank's full local gradient (exactly
    the reference's on the same batch), after a synchronised backward None (the reduced
    gradient lives in the owned shard)."""
    with model.no_sync():
        _loss(model, batch).backward()
    _loss(ref, batch).backward()
    local = _outcome(
        lambda: [(n, p.grad) for n, p in model.named_parameters()],
        lambda: [(n, p.grad) for n, p in ref.named_parameters()],
    )
    _loss(model, batch).backward()
    synced = _outcome(
        lambda: [(n, p.grad) for n, p in model.named_parameters()],
        lambda: [(n, None) for n, _ in ref.named_parameters()],
    )
    return {"no_sync": local, "synced": synced}


def case_reads(model_key: str) -> dict[str, dict[str, tuple[str, str]]]:
    factory, name, _, scalar, _, _ = MODELS[model_key]
    torch.manual_seed(0)
    ref = factory()
    torch.manual_seed(0)
    model = factory()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = zerodp.initialize(model, opt, zerodp.ZeroConfig.from_dict(CONFIG))
    outside = _rows_on(model, ref, name, scalar)
    with zerodp.full_parameters(model, writeback=False):
        inside = _rows_on(model, ref, name, scalar)
    # Plain tensors taken inside the block stay valid after it: they hold their own memory
    # (before: views of a freed buffer, whose reads crashed the rank).
    p, q = model.get_parameter(name), ref.get_parameter(name)
    with zerodp.full_parameters(model, writeback=False):
        held = [p.detach(), p.data[1:], p[0], p.T]
    held_out = _outcome(
        lambda: [h.sum() for h in held],
        lambda: [q.detach().sum(), q.data[1:].sum(), q[0].sum(), q.T.sum()],
    )
    grads = _grads(model, ref, _batch(model_key, rank_world()[0]))
    opt.zero_grad()
    return {"outside": outside, "inside": inside, "other": {"held": held_out, **grads}}


@pytest.fixture(scope="module")
def outcomes(world) -> dict[str, list[dict]]:
    return {key: world(2).run(case_reads, key, timeout=TIMEOUT) for key in MODELS}


def _refusal(name: str, unit: str, what: str) -> str:
    return (
        f"zerodp stage 3: parameter '{name}' was read ({what}) while its unit '{unit}' is "
        "released (each rank holds only a shard). Read parameters only inside the forward of "
        "their unit's module, in the loss only if they belong to the root unit (or a unit "
        "attached to it), or inside `with zerodp.full_parameters(model):`; to keep a parameter "
        "available, make it part of an enclosing unit (ZeroConfig.stage3.unit_classes / "
        "unit_policy) or persistent (ZeroConfig.stage3.persist_numel)"
    )


def _released_repr(name: str, shape: tuple[int, ...], unit: str) -> str:
    return (
        f"ShardedParameter('{name}', shape={shape}, dtype=torch.float32, released: unit "
        f"'{unit}' is not gathered; read it inside `with zerodp.full_parameters(model):`)"
    )


SHAPES = {"blocks.1.weight": (8, 32), "transformer.h.1.mlp.c_fc.weight": (16, 64)}


@pytest.mark.parametrize("model_key", list(MODELS))
@pytest.mark.parametrize("row", list(ROWS))
def test_parameter_read(outcomes, model_key, row):
    _, name, unit, _, _, _ = MODELS[model_key]
    what = ROWS[row][1]
    if what is None:  # str / repr: a description (never values) outside, the values inside
        want_outside = ("returns", _released_repr(name, SHAPES[name], unit))
    else:
        want_outside = ("raises", _refusal(name, unit, what))
    if row == "p.numpy()":  # as on a plain Parameter: torch's own refusal (requires grad)
        want_inside = (
            "raises",
            "Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.",
        )
    else:
        want_inside = ("equal", "")
    for r, out in enumerate(outcomes[model_key]):
        assert out["outside"][row] == want_outside, f"rank {r} outside: {out['outside'][row]}"
        assert out["inside"][row] == want_inside, f"rank {r} inside: {out['inside'][row]}"


def test_item_of_a_one_element_parameter(outcomes):
    want = ("raises", _refusal("blocks.1.scale", "blocks.1", "item"))
    for out in outcomes["small"]:
        assert out["outside"]["p.item()"] == want, out["outside"]["p.item()"]
        assert out["inside"]["p.item()"] == ("equal", ""), out["inside"]["p.item()"]


@pytest.mark.parametrize("model_key", list(MODELS))
def test_state_dict_is_full_outside_and_inside(outcomes, model_key):
    for out in outcomes[model_key]:
        assert out["outside"]["state_dict()"] == ("equal", ""), out["outside"]["state_dict()"]
        assert out["inside"]["state_dict()"] == ("equal", ""), out["inside"]["state_dict()"]


@pytest.mark.parametrize("model_key", list(MODELS))
def test_named_parameters_values(outcomes, model_key):
    """Iterating is metadata; reading the first parameter's values (``detach``) refuses."""
    _, _, _, _, first, first_unit = MODELS[model_key]
    for out in outcomes[model_key]:
        got = out["outside"]["named_parameters()"]
        assert got == ("raises", _refusal(first, first_unit, "detach")), got
        assert out["inside"]["named_parameters()"] == ("equal", ""), out["inside"]


@pytest.mark.parametrize("model_key", list(MODELS))
def test_tensors_taken_inside_full_parameters_stay_valid(outcomes, model_key):
    for out in outcomes[model_key]:
        assert out["other"]["held"] == ("equal", ""), out["other"]["held"]


@pytest.mark.parametrize("model_key", list(MODELS))
def test_grad_after_backward(outcomes, model_key):
    for out in outcomes[model_key]:
        assert out["other"]["no_sync"] == ("equal", ""), out["other"]["no_sync"]
        assert out["other"]["synced"] == ("equal", ""), out["other"]["synced"]
