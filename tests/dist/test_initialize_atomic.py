"""``zerodp.initialize`` succeeds or changes nothing ([Note: initialize is all or nothing]).

A failure is forced at each point of initialization (after the real work of that point ran, so
the change it made must be undone), on every rank alike. Afterwards the model, its class, every
module's hooks, parameters (identity, class, storage, values, ``requires_grad``, ``.grad``,
hooks), buffers and the optimizer (groups, hyperparameters, state) must be exactly as before;
then a normal ``initialize`` of the same objects must train with parity. The model is a
Hugging Face Llama with LoRA adapters: frozen parameters, trainable ones, a rotary buffer, and a
class whose ``__init_subclass__`` used to fail on zerodp's class swap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any
from unittest import mock

import pytest
import torch
from hf_models import build, global_batches, hf_loss
from test_hf_models import adamw, max_error
from torch import nn
from zerotest import Pair, rank_world, synced_step

import zerodp
from zerodp import api, engine
from zerodp.grads.reducer import GradReducer
from zerodp.optim import compute_dtype, runner
from zerodp.params import sync as param_sync
from zerodp.params.deferred import DeferredGather
from zerodp.params.manager import ShardedParams
from zerodp.partition.segment import Segment

TIMEOUT = 240.0


class Injected(RuntimeError):
    """The failure a test forces."""


def _after(owner: Any, attr: str) -> contextlib.AbstractContextManager[Any]:
    """Patch ``owner.attr`` to do its real work, then raise."""
    real = getattr(owner, attr)

    if isinstance(real, type):  # a class: construct it, then fail (isinstance still works)

        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            real.__init__(self, *args, **kwargs)
            raise Injected(attr)

        return mock.patch.object(owner, attr, type(real.__name__, (real,), {"__init__": init}))

    def failing(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)
        raise Injected(attr)

    return mock.patch.object(owner, attr, failing)


def _instead(owner: Any, attr: str) -> contextlib.AbstractContextManager[Any]:
    def failing(*args: Any, **kwargs: Any) -> Any:
        raise Injected(attr)

    return mock.patch.object(owner, attr, failing)


# name -> (patch factory, the configurations where initialize passes there: stage "s0", "s12"
# or "s3", and "mixed" for bf16/fp16)
S012 = {"s0", "s12"}
ALL = {"s0", "s12", "s3"}
POINTS: dict[str, tuple[Callable[[], contextlib.AbstractContextManager[Any]], set[str]]] = {
    "class swap": (partial(_instead, api, "zero_class"), ALL),
    "agreement": (partial(_after, engine, "agree"), ALL),
    "flat segments": (partial(_after, Segment, "build"), S012),
    "replicated segments": (partial(_after, param_sync, "ReplicatedParams"), S012),
    "stage-3 units": (partial(_after, param_sync, "ShardedParams"), {"s3"}),
    "stage-3 start": (partial(_after, ShardedParams, "start"), {"s3"}),
    "masters": (partial(_after, engine, "Masters"), ALL),
    "cast": (partial(_after, compute_dtype.ComputeCast, "install"), {"mixed"}),
    "reducer hooks": (partial(_after, GradReducer, "register_hooks"), S012),
    "rebind optimizer": (partial(_after, engine, "rebind_optimizer"), ALL),
    "chunked step": (partial(_after, runner, "ChunkedGrads"), {"mixed"}),
    "gather hooks": (partial(_after, DeferredGather, "register_hooks"), {"s12"}),
    "frozen broadcast": (
        partial(_instead, engine.ZeroEngine, "_broadcast_frozen_and_buffers"),
        ALL,
    ),
    "optimizer facade": (partial(_after, api, "ZeroOptimizer"), ALL),
    "attach": (partial(_after, api, "attach"), ALL),
}


def _hooks(obj: Any) -> dict[str, tuple[int, ...]]:
    return {
        k: tuple(v.keys())
        for k, v in vars(obj).items()
        if k.endswith("hooks") and isinstance(v, dict)
    }


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Everything initialize may touch, by identity and value."""
    modules = [
        (
            name,
            type(m),
            _hooks(m),
            {k: id(p) for k, p in m._parameters.items()},
            {k: id(b) for k, b in m._buffers.items()},
        )
        for name, m in model.named_modules()
    ]
    params = [
        (
            name,
            id(p),
            type(p),
            p.data_ptr(),
            p.dtype,
            tuple(p.shape),
            p.requires_grad,
            p.grad is None,
            tuple((getattr(p, "_post_accumulate_grad_hooks", None) or {}).keys()),
            p.detach().clone(),
        )
        for name, p in model.named_parameters()
    ]
    buffers = [(n, id(b), b.data_ptr(), b.clone()) for n, b in model.named_buffers()]
    groups = [
        ({k: v for k, v in g.items() if k != "params"}, [id(p) for p in g["params"]])
        for g in opt.param_groups
    ]
    state = {id(p): dict(s) for p, s in opt.state.items()}
    return {
        "class": type(model),
        "modules": modules,
        "params": params,
        "buffers": buffers,
        "opt": (type(opt), _hooks(opt), groups, state),
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    out = []
    for key in before:
        if key in ("modules", "params", "buffers"):
            for x, y in zip(before[key], after[key], strict=True):
                if not _same(x, y):
                    out.append(f"{key} {x[0]!r}")
        elif not _same(before[key], after[key]):
            out.append(key)
    return out


@contextlib.contextmanager
def _applicable(point: str, kinds: set[str]) -> Iterator[bool]:
    make, where = POINTS[point]
    if not (where & kinds):
        yield False
        return
    with make():
        yield True


def _kinds(stage: int, precision: str) -> set[str]:
    return {["s0", "s12", "s12", "s3"][stage]} | ({"mixed"} if precision != "fp32" else set())


def case_failures_leave_everything_untouched(stage: int, precision: str) -> list[str]:
    rank, world = rank_world()
    kinds = _kinds(stage, precision)
    cfg = zerodp.ZeroConfig(stage=stage, precision=precision, bucket_bytes=4096)
    model = build("lora")
    opt = adamw(model.parameters())
    before = _state(model, opt)
    tried = []
    for point in POINTS:
        with _applicable(point, kinds) as applies:
            if not applies:
                continue
            try:
                zerodp.initialize(model, opt, cfg)
                raise AssertionError(f"no failure at '{point}': initialize returned")
            except Injected:
                pass
        problems = _differences(before, _state(model, opt))
        assert not problems, f"after a failure at '{point}': changed {problems}"
        tried.append(point)
    if precision == "fp32":  # the same objects then initialize normally and train with parity
        ref = build("lora")
        pair = Pair(*zerodp.initialize(model, opt, cfg), ref, adamw(ref.parameters()))
        for step in range(2):
            synced_step(pair, hf_loss(global_batches("lora", step, world)), world, rank)
        err = max_error(pair.model, pair.ref)
        assert err <= 1e-5, f"training after the failures: error {err:.3e}"
    return tried


@pytest.mark.parametrize(
    ("stage", "precision"), [(0, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")]
)
def test_failed_initialize_changes_nothing(world, stage: int, precision: str) -> None:
    tried = world(2).run(
        case_failures_leave_everything_untouched, stage, precision, timeout=TIMEOUT
    )
    kinds = _kinds(stage, precision)
    assert tried[0] == [p for p, (_, where) in POINTS.items() if where & kinds]
