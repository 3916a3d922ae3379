"""Mixed precision (issue 4): every stage in bf16 and fp16 against a single-process emulation of
the same protocol, the fp16 loss-scale sequence with injected overflows, skipped steps, and the
paper's memory formulas.

The emulation (``Emulation``) is the protocol written out for one process: fp32 masters; each
rank's micro-batch runs forward/backward on a compute-dtype copy; gradients are summed over
ranks in fp32 (``reduce_dtype``), averaged and stored in the compute dtype, cast to fp32 and
unscaled; AdamW steps the masters in fp32; the compute copy is the cast of the masters.

Tolerance: with 1 or 2 ranks the fp32 sum of two values does not depend on the order, so the
emulation must match **bitwise**. With 3-4 ranks gloo's ring sums in another order than the
emulation; an fp32 sum that lands on a rounding boundary of the compute dtype can then differ by
one bf16/fp16 ulp (2^-8 / 2^-11 relative) in one gradient element, which moves that element's
Adam update by at most ~lr. We bound the relative L2 error of every parameter by 1e-3.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from emulation import DTYPES, Emulation, masters_error
from emulation import adamw as _opt
from torch import nn
from zerotest import MLP, batches, build, full, mse, rank_world

import zerodp
from zerodp import LossScaling, Precision, Stage3

TIMEOUT = 120.0


def _cfg(stage: int, compute: str, nonfinite: str = "raise", **scaling) -> zerodp.ZeroConfig:
    """``scaling``: fields of ``LossScaling``."""
    precision = Precision(compute=compute, nonfinite=nonfinite, loss_scaling=LossScaling(**scaling))
    # Stage 3: each Linear its own unit (the default policy makes MLP one root unit).
    units = Stage3(unit_classes=("Linear",) if stage == 3 else ())
    return zerodp.ZeroConfig(stage=stage, precision=precision, bucket_bytes=64, stage3=units)


def case_emulation(stage: int, precision: str) -> float:
    rank, world = rank_world()
    model = build(MLP)
    emu = Emulation(model, precision, stage, world, scale=2.0**16 if precision == "fp16" else 1.0)
    model, opt = zerodp.initialize(model, _opt(model.parameters()), _cfg(stage, precision))
    worst = 0.0
    for step in range(4):
        data = batches(step, world, 3, [(7,), (5,)])
        emu.step(mse(data))
        opt.backward(mse(data)(model, rank))
        opt.step()
        opt.zero_grad()
        assert opt.last_step is not None and not opt.last_step.skipped, "unexpected skip"
        worst = max(worst, masters_error(opt, emu))
        with full(model):
            pairs = zip(model.named_parameters(), emu.master.parameters(), strict=True)
            for (name, p), q in pairs:
                assert p.dtype == DTYPES[precision], f"{name} is {p.dtype}"
                want = q.detach().to(p.dtype)
                if world <= 2:
                    assert torch.equal(p, want), f"step {step} {name}: compute copy not bitwise"
        if world <= 2:
            assert worst == 0.0, f"step {step}: masters differ by {worst:.3e}"
        assert worst <= 1e-3, f"step {step}: masters differ by {worst:.3e}"
    return worst


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_matches_protocol_emulation(world, world_size, precision, stage):
    world(world_size).run(case_emulation, stage, precision, timeout=TIMEOUT)


def case_loss_scale_sequence(stage: int) -> list[tuple]:
    """Overflows injected at steps 1, 2 (rank 1 only), 5 and 6; growth every 3 finite steps."""
    rank, world = rank_world()
    poison = {1: {0, 1}, 2: {1}, 5: {1}, 6: {0}}
    model = build(MLP)
    cfg = _cfg(stage, "fp16", initial=1024.0, growth_interval=3, hysteresis=2)
    emu = Emulation(model, "fp16", stage, world, scale=1024.0)
    model, opt = zerodp.initialize(model, _opt(model.parameters()), cfg)
    seen = []
    for step in range(9):
        data = batches(step, world, 2, [(7,), (5,)])
        with full(model):
            before = [p.detach().clone() for p in model.parameters()]
        state_before = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state.items()}
        loss = mse(data)(model, rank)
        if rank in poison.get(step, ()):
            loss = loss * float("inf")
        emu.scale = opt.loss_scale
        stepped = emu.step(mse(data), poison.get(step, set()))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        info = opt.last_step
        assert info is not None and info.skipped == (not stepped), f"step {step}: {info}"
        if info.skipped:
            assert info.reason == "non-finite gradients", info
            with full(model):
                for p, q in zip(model.parameters(), before, strict=True):
                    assert torch.equal(p, q), f"step {step}: parameters changed on a skipped step"
            for k, v in opt.state.items():
                for n, t in v.items():
                    assert torch.equal(t, state_before[k][n]), f"step {step}: state {n} changed"
        seen.append((step, info.skipped, info.loss_scale, opt.loss_scale))
        assert masters_error(opt, emu) <= 1e-3, f"step {step}"
    assert opt.skipped_steps == 4
    return seen


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_loss_scale_sequence(world, stage):
    out = world(2).run(case_loss_scale_sequence, stage, timeout=TIMEOUT)
    assert out[0] == out[1], "ranks disagree on the loss-scale sequence"
    # (step, skipped, scale used, scale after): hysteresis 2 forgives the first overflow of a
    # run, the second halves the scale; three finite steps in a row double it.
    assert out[0] == [
        (0, False, 1024.0, 1024.0),
        (1, True, 1024.0, 1024.0),
        (2, True, 1024.0, 512.0),
        (3, False, 512.0, 512.0),
        (4, False, 512.0, 512.0),
        (5, True, 512.0, 256.0),
        (6, True, 256.0, 128.0),
        (7, False, 128.0, 128.0),
        (8, False, 128.0, 128.0),
    ]


def case_min_scale(_: int) -> str:
    rank, world = rank_world()
    model = build(MLP)
    cfg = _cfg(2, "fp16", initial=2.0, hysteresis=1, min_scale=1.0)
    model, opt = zerodp.initialize(model, _opt(model.parameters()), cfg)
    x, y = batches(0, world, 2, [(7,), (5,)])[rank]
    for _ in range(3):
        loss = F.mse_loss(model(x).float(), y) * (float("inf") if rank == 0 else 1.0)
        opt.backward(loss)
        try:
            opt.step()
        except RuntimeError as exc:
            return f"{opt.loss_scale} {exc}"
        opt.zero_grad()
    raise AssertionError("the minimum loss scale was passed without an error")


def test_fp16_minimum_scale_raises_on_every_rank(world):
    for msg in world(2).run(case_min_scale, 0, timeout=TIMEOUT):
        assert msg.startswith("1.0 fp16 loss scale reached its minimum (1)"), msg


def case_bf16_skip(stage: int) -> dict:
    rank, world = rank_world()
    model = build(MLP)
    cfg = _cfg(stage, "bf16", nonfinite="skip")  # the default raises (tests/dist/test_misuse.py)
    model, opt = zerodp.initialize(model, _opt(model.parameters()), cfg)
    x, y = batches(0, world, 2, [(7,), (5,)])[rank]
    with full(model):
        before = [p.detach().clone() for p in model.parameters()]
    loss = F.mse_loss(model(x).float(), y) * (float("nan") if rank == world - 1 else 1.0)
    loss.backward()  # bf16 needs no opt.backward
    opt.step()
    opt.zero_grad()
    with full(model):
        same = all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert same, "parameters changed on a skipped step"
    info = opt.last_step
    assert info is not None
    return {"skipped": info.skipped, "scale": info.loss_scale, "count": opt.skipped_steps}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_non_finite_step_is_skipped_everywhere(world, stage):
    out = world(3).run(case_bf16_skip, stage, timeout=TIMEOUT)
    assert out == [{"skipped": True, "scale": None, "count": 1}] * 3


def case_fp16_needs_scaled_backward(_: int) -> str:
    model = build(MLP)
    model, opt = zerodp.initialize(model, _opt(model.parameters()), _cfg(2, "fp16"))
    model(torch.randn(2, 7)).float().sum().backward()
    try:
        opt.step()
    except RuntimeError as exc:
        return str(exc)
    raise AssertionError("an unscaled fp16 backward was accepted")


def test_fp16_requires_opt_backward(world):
    for msg in world(2).run(case_fp16_needs_scaled_backward, 0, timeout=TIMEOUT):
        assert "call opt.backward(loss) instead of loss.backward()" in msg, msg


def case_clip_true_norm(stage: int) -> float:
    rank, world = rank_world()
    model = build(MLP)
    model, opt = zerodp.initialize(model, _opt(model.parameters()), _cfg(stage, "fp16"))
    data = batches(0, world, 3, [(7,), (5,)])
    ref = Emulation(build(MLP), "fp16", stage, world, scale=2.0**16)
    sums = []
    for r in range(world):
        ref.compute.zero_grad()
        (mse(data)(ref.compute, r) * ref.scale).backward()
        sums.append([p.grad.float() for p in ref.compute.parameters()])
    grads = [sum(g[i] for g in sums) / world / ref.scale for i in range(len(sums[0]))]
    want = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()
    opt.backward(mse(data)(model, rank))
    norm = opt.clip_grad_norm_(1e-3).item()
    opt.step()
    assert opt.last_step is not None and opt.last_step.grad_norm == norm
    rel = abs(norm - want) / want
    assert rel < 1e-2, f"clip norm {norm} vs true unscaled norm {want}"  # fp16 grads: ~2^-11
    return norm


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_clipping_sees_unscaled_fp32_gradients(world, stage):
    world(2).run(case_clip_true_norm, stage, timeout=TIMEOUT)


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x)).float()


def case_dtypes(_: int) -> dict:
    model = build(BNNet)
    model, opt = zerodp.initialize(model, _opt(model.parameters()), _cfg(2, "bf16"))
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return {n: str(t.dtype) for n, t in [*model.named_parameters(), *model.named_buffers()]}


def test_parameter_and_buffer_dtypes(world):
    out = world(2).run(case_dtypes, 0, timeout=TIMEOUT)[0]
    # BatchNorm stays fp32 (parameters and statistics); other buffers keep their dtype.
    assert out == {
        "fc.weight": "torch.bfloat16",
        "fc.bias": "torch.bfloat16",
        "bn.weight": "torch.float32",
        "bn.bias": "torch.float32",
        "steps": "torch.int64",
        "bn.running_mean": "torch.float32",
        "bn.running_var": "torch.float32",
        "bn.num_batches_tracked": "torch.int64",
    }


def case_train_gpt(precision: str, steps: int) -> list[float]:
    from zerodp.apps.data.corpus import BatchSampler, load_corpus
    from zerodp.apps.models.gpt import GPT, get_config

    rank, world = rank_world()
    torch.manual_seed(0)
    model = GPT(get_config("tiny"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model, opt = zerodp.initialize(model, opt, zerodp.ZeroConfig(stage=2, precision=precision))
    sampler = BatchSampler(
        load_corpus(max_bytes=1 << 18), 4, 64, seed=1, rank=rank, world_size=world
    )
    losses = []
    for _ in range(steps):
        x, y = next(sampler)
        _, loss = model(x, y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_bf16_training_tracks_fp32(world):
    """200 steps of the tiny GPT: the bf16 loss (last 20 steps) is within 3% of fp32's."""
    fp32 = world(2).run(case_train_gpt, "fp32", 200, timeout=300)[0]
    bf16 = world(2).run(case_train_gpt, "bf16", 200, timeout=300)[0]
    last = lambda xs: sum(xs[-20:]) / 20  # noqa: E731
    assert last(fp32) < 0.75 * sum(fp32[:5]) / 5, "fp32 did not learn"
    assert abs(last(bf16) - last(fp32)) / last(fp32) < 0.03, (last(bf16), last(fp32))


def case_second_sync_backward(_: int) -> str:
    model = build(MLP)
    model, _ = zerodp.initialize(model, _opt(model.parameters()), _cfg(1, "fp32"))
    model(torch.randn(2, 7)).sum().backward()
    try:
        model(torch.randn(2, 7)).sum().backward()
    except RuntimeError as exc:
        return str(exc)
    raise AssertionError("a second synchronised backward in one stage-1 step was accepted")


def test_stage1_second_synchronised_backward_is_an_error(world):
    for msg in world(2).run(case_second_sync_backward, 0, timeout=TIMEOUT):
        assert "accumulate micro-batches inside model.no_sync()" in msg, msg
