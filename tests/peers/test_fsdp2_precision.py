"""Mixed precision and loss scaling scenarios from PyTorch FSDP2's test suite
(``test_fully_shard_mixed_precision.py``, ``test_fully_shard_grad_scaler.py``), 2 gloo ranks,
stages 0-3, against a single-process emulation of zerodp's mixed-precision protocol
(tests/dist/emulation.py, generalised here to other reduce dtypes, gradient accumulation,
fp32 BatchNorm and injected infinities).

Tolerance: **bitwise**. With 2 ranks a cross-rank sum is one addition of two values, which
rounds the same in any order and in any reduce dtype (the sum of two bf16/fp16 values formed in
fp32 and rounded once is what a bf16/fp16 reduction returns; dividing by 2 is exact), so the
emulation's fp32 masters and compute copies must equal zerodp's exactly
(tests/dist/test_precision.py explains why 3+ ranks would need 1e-3).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from emulation import masters_error
from fsdp2_models import CONTAINERS, STAGES, Stack, cfg, container_model, mlp_stack, token_batches
from fsdp2_models import lm_loss as _lm_loss
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from zerotest import batches, build, full, mse, rank_world

import zerodp
from zerodp.optim.pieces import select_fused

TIMEOUT = 120.0
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _cast(value, dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


class Emulation:
    """zerodp's mixed-precision data parallelism in one process for ``world`` ranks: fp32
    masters stepped by AdamW; per rank, forward/backward of a compute-dtype copy (BatchNorm kept
    fp32, its input cast to fp32 and output back), micro-batches accumulated in the compute
    dtype; gradients cast to ``reduce``, summed over ranks and divided by ``world`` in that
    dtype, stored in the compute dtype, cast to fp32 and unscaled."""

    def __init__(self, model: nn.Module, precision: str, reduce: str, world: int, scale: float):
        self.dtype, self.reduce = DTYPES[precision], DTYPES[reduce]
        self.master = copy.deepcopy(model).float()
        self.compute = copy.deepcopy(model)
        bn = {id(p) for m in self.compute.modules() if isinstance(m, _BatchNorm)
              for p in m.parameters()}  # fmt: skip
        for p in self.compute.parameters():
            if p.is_floating_point() and id(p) not in bn:
                p.data = p.data.to(self.dtype)
        self.compute.register_forward_pre_hook(lambda m, a: _cast(a, self.dtype))
        for m in self.compute.modules():
            if isinstance(m, _BatchNorm):
                m.register_forward_pre_hook(lambda m, a: _cast(a, torch.float32))
                m.register_forward_hook(lambda m, a, out: _cast(out, self.dtype))
        self.trainable = [n for n, p in self.master.named_parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(
            [p for p in self.master.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1
        )
        select_fused(self.opt)  # zerodp's kernel choice
        self.world, self.scale = world, scale

    def step(self, micro_losses: list[Callable], poison: Callable | None = None) -> bool:
        """One step over micro-batches; ``poison(rank)`` is called before each rank's last
        backward (to inject infinities). Returns whether the step was taken."""
        cp = dict(self.compute.named_parameters())
        with torch.no_grad():
            for n, m in self.master.named_parameters():
                cp[n].copy_(m.to(cp[n].dtype))
        sums = {n: None for n in self.trainable}
        for r in range(self.world):
            self.compute.zero_grad(set_to_none=True)
            for k, loss_fn in enumerate(micro_losses):
                if poison is not None and k == len(micro_losses) - 1:
                    poison(self.compute, r)
                (loss_fn(self.compute, r) * self.scale).backward()
            for n in self.trainable:
                g = cp[n].grad.to(self.reduce).float()
                sums[n] = g if sums[n] is None else (sums[n] + g).to(self.reduce).float()
        finite = all(bool(torch.isfinite(s).all()) for s in sums.values())
        mp = dict(self.master.named_parameters())
        for n, s in sums.items():
            avg = (s.to(self.reduce) / self.world).to(cp[n].dtype)
            mp[n].grad = avg.float() / self.scale
        if finite:
            self.opt.step()
        self.opt.zero_grad()
        return finite


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _check_bitwise(model: nn.Module, opt, emu: Emulation, what: str) -> None:
    err = masters_error(opt, emu)
    assert err == 0.0, f"{what}: fp32 masters differ from the emulation by {err:.3e}"
    want = dict(emu.compute.named_parameters())
    with full(model):
        for n, p in model.named_parameters():
            q = emu.master.get_parameter(n).detach().to(want[n].dtype)
            assert p.dtype == want[n].dtype, f"{what}: {n} is {p.dtype}, not {want[n].dtype}"
            assert torch.equal(p, q), f"{what}: compute copy of {n} differs"


def _check_reduce_bytes(opt, reduce: str) -> None:
    """FSDP2 checks the reduce-scatter's dtype: gradients cross ranks in ``reduce``."""
    stats = opt.comm_stats()
    size = torch.empty((), dtype=DTYPES[reduce]).element_size()
    for kind in ("all_reduce", "reduce_scatter"):
        n = stats.elements.get(kind, 0)
        assert stats.bytes.get(kind, 0) == n * size, f"{kind}: {stats.bytes} for {n} elements"


def _run(
    factory, precision, reduce, stage, units, losses_for_step, steps=3, micro=1, initial=2.0**16
):
    rank, world = rank_world()
    model = build(factory)
    scale = initial if precision == "fp16" else 1.0
    emu = Emulation(model, precision, reduce, world, scale)
    scaling = zerodp.LossScaling(initial=initial)
    policy = zerodp.Precision(compute=precision, reduce=reduce, loss_scaling=scaling)
    config = cfg(stage, units, precision=policy)
    model, opt = zerodp.initialize(model, _adamw(model.parameters()), config)
    for step in range(steps):
        losses = [losses_for_step(10 * step + k) for k in range(micro)]
        assert emu.step(losses), f"the emulation skipped step {step} ({precision} stage {stage})"
        for k, loss in enumerate(losses):
            if k < micro - 1:
                with model.no_sync():
                    opt.backward(loss(model, rank))
            else:
                opt.backward(loss(model, rank))
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        assert not opt.last_step.skipped, f"step {step} skipped"
        _check_reduce_bytes(opt, reduce)
        _check_bitwise(model, opt, emu, f"{precision}/{reduce} stage {stage} step {step}")
    return model, opt


def _mse(d_in: int, d_out: int):
    world = rank_world()[1]
    return lambda seed: mse(batches(seed, world, 2, [(d_in,), (d_out,)]))


def _lm(seed: int):
    return _lm_loss(token_batches(seed, rank_world()[1]))


# -- test_fully_shard_mixed_precision.py -------------------------------------------------------


def case_compute_dtype() -> list:
    """``test_compute_dtype``: bf16 / fp16 parameters, fp32 reduction; an MLP stack and a tiny
    transformer with activation checkpointing (``test_checkpoint_recompute_casts_*``)."""
    runs = []
    for precision in ("bf16", "fp16"):
        for stage in STAGES:
            _run(lambda: mlp_stack(16), precision, "fp32", stage, ("MLPBlock",), _mse(16, 16),
                 steps=2)  # fmt: skip
            _run(lambda: Stack(ckpt=True), precision, "fp32", stage, ("Block",), _lm, steps=2)
            runs.append((precision, stage))
    return runs


def test_compute_dtype(world):
    world(2).run(case_compute_dtype, timeout=TIMEOUT)


def case_reduce_dtype(cases: list[tuple[str, str]]) -> list:
    for precision, reduce in cases:
        for stage in STAGES:
            _run(lambda: mlp_stack(16), precision, reduce, stage, ("MLPBlock",), _mse(16, 16),
                 steps=2, initial=1024.0)  # fmt: skip
    return cases


def test_reduce_dtype(world):
    """``test_reduce_dtype``: bf16 compute with bf16 reduction (fp32 reduction is in
    ``test_compute_dtype``); fp16 likewise."""
    world(2).run(case_reduce_dtype, [("bf16", "bf16"), ("fp16", "fp16")], timeout=TIMEOUT)


def test_reduce_dtype_low_precision_with_fp32_parameters(world):
    """FSDP2's ``_test_reduce_dtype_bf16_reduce``: fp32 parameters, gradients reduced in bf16
    (and fp16), bit for bit as the emulation. Was silently reduced in fp32 (the setting was
    ignored without mixed precision)."""
    world(2).run(case_reduce_dtype, [("fp32", "bf16"), ("fp32", "fp16")], timeout=TIMEOUT)


def case_grad_acc_reduce_dtype() -> None:
    """``test_grad_acc_with_reduce_dtype``: bf16 compute, fp32 reduction, 3 micro-batches with
    the first two under ``no_sync``; zerodp accumulates the local gradient in the compute dtype
    (FSDP2 in the reduce dtype), which the emulation reproduces."""
    for stage in STAGES:
        _run(lambda: mlp_stack(16), "bf16", "fp32", stage, ("MLPBlock",), _mse(16, 16),
             steps=2, micro=3)  # fmt: skip


def test_grad_acc_with_reduce_dtype(world):
    world(2).run(case_grad_acc_reduce_dtype, timeout=TIMEOUT)


def case_structured_io() -> list:
    """``test_structured_input_output``: dataclass, nested dataclass and namedtuple activations
    between units, bf16 compute with bf16 or fp32 reduction."""
    runs = []
    for kind in CONTAINERS:
        for reduce in ("bf16", "fp32"):
            for stage in STAGES:
                _run(lambda k=kind: container_model(k), "bf16", reduce, stage,
                     ("ContainerLayer",), _mse(8, 8), steps=2)  # fmt: skip
                runs.append((kind, reduce, stage))
    return runs


def test_structured_input_output(world):
    world(2).run(case_structured_io, timeout=TIMEOUT)


class Norms(nn.Module):
    """``test_norm_modules_*`` in one model: LayerNorm, BatchNorm1d, Conv2d + BatchNorm2d; plus
    a frozen int64 parameter (``test_reduce_dtype_after_frozen_first_forward``'s ``non_float``,
    ``test_mixed_dtypes_no_grad_param``) and a float buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn2d = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 8)
        self.ln = nn.LayerNorm(8)
        self.bn1d = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 4)
        self.non_float = nn.Parameter(torch.ones(4, dtype=torch.int64), requires_grad=False)
        self.register_buffer("shift", torch.full((4,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn2d(self.conv(x))).flatten(1)
        h = self.bn1d(self.ln(self.fc(h)))
        return self.out(F.relu(h)) + self.shift.to(h.dtype) * self.non_float.to(h.dtype)


def case_norm_modules() -> dict:
    world = rank_world()[1]
    out = {}
    for precision in ("bf16", "fp16"):
        for stage in STAGES:
            model, _ = _run(Norms, precision, "fp32", stage, ("Linear", "Conv2d"),
                            lambda s: _images(s, world), steps=2,
                            initial=1024.0)  # fmt: skip
            y = model(torch.randn(3, 1, 6, 6))
            assert y.dtype == DTYPES[precision], f"output is {y.dtype}"
            got = {n: str(t.dtype) for n, t in [*model.named_parameters(),
                                                *model.named_buffers()]}  # fmt: skip
            out[(precision, stage)] = got
    return out


def _images(seed: int, world: int):
    data = batches(seed, world, 3, [(1, 6, 6), (4,)])

    def loss(m: nn.Module, r: int) -> torch.Tensor:
        x, y = data[r]
        return F.mse_loss(m(x).float(), y)

    return loss


def test_norm_modules(world):
    """BatchNorm parameters and statistics stay fp32, LayerNorm and the rest run in the compute
    dtype, other buffers and non-float parameters keep their dtype; parity with the emulation."""
    out = world(2).run(case_norm_modules, timeout=TIMEOUT)[0]
    for (precision, stage), got in out.items():
        low = str(DTYPES[precision])
        want = {
            "conv.weight": low, "conv.bias": low, "bn2d.weight": "torch.float32",
            "bn2d.bias": "torch.float32", "fc.weight": low, "fc.bias": low, "ln.weight": low,
            "ln.bias": low, "bn1d.weight": "torch.float32", "bn1d.bias": "torch.float32",
            "out.weight": low, "out.bias": low, "non_float": "torch.int64",
            "shift": "torch.float32", "bn2d.running_mean": "torch.float32",
            "bn2d.running_var": "torch.float32", "bn2d.num_batches_tracked": "torch.int64",
            "bn1d.running_mean": "torch.float32", "bn1d.running_var": "torch.float32",
            "bn1d.num_batches_tracked": "torch.int64",
        }  # fmt: skip
        assert got == want, (precision, stage, got)


class CastInside(nn.Module):
    """``test_grouped_module_cast_forward_inputs``: an fp32 intermediate fed to a module."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).float())


def case_cast_inside() -> list:
    msgs = []
    for stage in STAGES:
        model = build(CastInside)
        config = cfg(stage, ("Linear",), precision="bf16")
        model, _ = zerodp.initialize(model, _adamw(model.parameters()), config)
        try:
            model(torch.randn(2, 8))
        except RuntimeError as exc:
            msgs.append(str(exc))
        else:
            raise AssertionError(f"stage {stage}: an fp32 input to a bf16 Linear was accepted")
    return msgs


def test_fp32_intermediate_into_a_submodule(world):
    """FSDP2 casts the inputs of every ``fully_shard`` module (``cast_forward_inputs``); zerodp
    casts the root's inputs only (docs/design.md, [Note: mixed precision]), so a model that
    upcasts between modules gets torch's own dtype error, as a plain ``model.bfloat16()``."""
    for msgs in world(2).run(case_cast_inside, timeout=TIMEOUT):
        for msg in msgs:
            assert (
                msg == "expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16"
            ), msg


# -- test_fully_shard_grad_scaler.py -----------------------------------------------------------


class Poisonable(nn.Module):
    """An MLP stack whose first activation's gradient gets an inf in one element on
    ``_poison_rank`` (FSDP2 fills one gradient element with inf on one rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp_stack(8)
        self._poison_rank = -1
        self._rank = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body[0](x)
        if self._rank == self._poison_rank and h.requires_grad:

            def hook(g: torch.Tensor) -> torch.Tensor:
                g = g.clone()
                g[0, 0] = float("inf")
                return g

            h.register_hook(hook)
        return self.body[2](self.body[1](h))


def case_grad_scaler(has_inf: bool) -> list:
    """fp16 with dynamic loss scaling (hysteresis 1, as ``torch.amp.GradScaler``): an inf in one
    gradient element of rank 1 at step 1 skips the step on every rank, leaves parameters and
    optimizer state as they were and halves the scale; training then goes on exactly as the
    emulation. Without the inf, every step is taken and the scale is unchanged."""
    rank, world = rank_world()
    seen = []
    for stage in STAGES:
        model = build(Poisonable)
        emu = Emulation(model, "fp16", "fp32", world, 1024.0)
        scaling = zerodp.LossScaling(initial=1024.0, hysteresis=1)
        policy = zerodp.Precision(compute="fp16", loss_scaling=scaling)
        config = cfg(stage, ("MLPBlock",), precision=policy)
        model, opt = zerodp.initialize(model, _adamw(model.parameters()), config)
        model._rank = rank
        for step in range(4):
            poisoned = has_inf and step == 1
            loss = _mse(8, 8)(step)
            with full(model):
                before = {n: p.detach().clone() for n, p in model.named_parameters()}
            state = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state.items()}
            emu.scale = opt.loss_scale

            def poison(m: nn.Module, r: int, poisoned=poisoned) -> None:
                m._rank, m._poison_rank = r, (1 if poisoned else -1)

            stepped = emu.step([loss], poison)
            model._poison_rank = 1 if poisoned else -1
            opt.backward(loss(model, rank))
            opt.step()
            opt.zero_grad()
            info = opt.last_step
            assert info.skipped == (not stepped) == poisoned, f"stage {stage} step {step}: {info}"
            if info.skipped:
                assert info.reason == "non-finite gradients", info
                with full(model):
                    for n, p in model.named_parameters():
                        assert torch.equal(p, before[n]), f"stage {stage}: {n} changed"
                for k, v in opt.state.items():
                    for n, t in v.items():
                        assert torch.equal(t, state[k][n]), f"stage {stage}: state {n} changed"
            _check_bitwise(model, opt, emu, f"stage {stage} step {step}")
            seen.append((stage, step, info.skipped, info.loss_scale, opt.loss_scale))
    return seen


def test_gradient_scaler_with_inf(world):
    a, b = world(2).run(case_grad_scaler, True, timeout=TIMEOUT)
    assert a == b, "ranks disagree"
    for stage in STAGES:
        assert [s[2:] for s in a if s[0] == stage] == [
            (False, 1024.0, 1024.0),
            (True, 1024.0, 512.0),  # skipped on both ranks; scale x backoff 0.5
            (False, 512.0, 512.0),
            (False, 512.0, 512.0),
        ], a


def test_gradient_scaler_without_inf(world):
    a, b = world(2).run(case_grad_scaler, False, timeout=TIMEOUT)
    assert a == b, "ranks disagree"
    assert [s[2:] for s in a] == [(False, 1024.0, 1024.0)] * 16, a
