"""Scenarios from PyTorch FSDP2's test suite (``test_fully_shard_{frozen,clip_grad_norm_,comm,
init,ignore_params}.py``), rewritten with zerodp's public API: 2 gloo ranks, fp32, every step
compared with unsharded training on the same global batch (relative error per parameter <= 1e-6
with SGD, <= 1e-5 with Adam/AdamW). FSDP2's training loops call
``zero_grad(set_to_none=(iter_idx % 2 == 0))``; so do these. docs/peer-tests-fsdp2.part.md maps
each FSDP2 test to the function here. Each test runs all its cases in one ``world(2).run``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from fsdp2_models import (
    ADAM_TOL,
    SGD_TOL,
    STAGES,
    Stack,
    adam,
    cfg,
    lm_loss,
    mlp_stack,
    mse_steps,
    pair,
    sgd,
    token_batches,
    train,
)
from torch import nn
from zerotest import assert_close, batches, full, make_pair, mse, rank_world, reference_step

import zerodp

TIMEOUT = 120.0


# -- test_fully_shard_frozen.py ----------------------------------------------------------------


def _bitfit() -> nn.Module:
    m = mlp_stack(8)
    for name, param in m.named_parameters():
        if "bias" not in name:
            param.requires_grad_(False)
    return m


def case_frozen_per_group() -> dict:
    """``test_train_mixed_requires_grad_per_group`` (BitFit: biases only, frozen at
    initialize); only the biases are reduced and gathered."""
    out = {}
    for stage in STAGES:
        p = pair(_bitfit, adam, cfg(stage, ("MLPBlock",)))
        with full(p.model):
            frozen = {
                n: q.detach().clone() for n, q in p.model.named_parameters() if "bias" not in n
            }
        train(p, mse_steps(8, 8), 3, ADAM_TOL, f"stage {stage}")
        with full(p.model):
            for n, q in p.model.named_parameters():
                if n in frozen:
                    assert torch.equal(q, frozen[n]), f"stage {stage}: frozen {n} changed"
        out[stage] = dict(p.opt.comm_stats().elements)
    return out


def test_train_mixed_requires_grad_per_group(world):
    out = world(2).run(case_frozen_per_group, timeout=TIMEOUT)[0]
    biases = 3 * (16 + 8)  # 72 trainable elements (multiples of 8: no padding with 2 ranks)
    assert out[0] == {"all_reduce": biases}, out[0]
    assert out[1] == {"reduce_scatter": biases, "all_gather": biases}, out[1]
    assert out[2] == {"reduce_scatter": biases, "all_gather": biases}, out[2]
    # Stage 3: each unit holds only its bias (the frozen weights are not sharded), which
    # ``addmm`` saves nothing of: no unit's backward reads its parameters, so each is gathered
    # once, in forward ([Note: backward without parameters] in params/saved.py; FSDP2
    # re-gathers them).
    assert out[3] == {"reduce_scatter": biases, "all_gather": biases}, out[3]


def _interleaved_frozen() -> nn.Module:
    layers: list[nn.Module] = []
    for i in range(6):
        lin = nn.Linear(8, 8)
        lin.requires_grad_(i % 2 == 1)  # frozen, trainable, frozen, ...
        layers += [lin, nn.ReLU()]
    return nn.Sequential(*layers)


def case_frozen_across_groups() -> None:
    """``test_train_mixed_requires_grad_across_groups``: frozen and trainable Linear units
    interleaved; the middle iteration is a forward under ``torch.no_grad()`` only."""
    rank, world = rank_world()
    for stage in STAGES:
        p = pair(_interleaved_frozen, adam, cfg(stage, ("Linear",)))
        for step in range(3):
            data = batches(step, world, 4, [(8,), (8,)])
            if step == 1:
                with torch.no_grad():
                    got = F.mse_loss(p.model(data[rank][0]), data[rank][1])
                    want = F.mse_loss(p.ref(data[rank][0]), data[rank][1])
                assert torch.allclose(got, want, rtol=1e-6), f"stage {stage}: no_grad loss"
                continue
            reference_step(p, mse(data), world)
            mse(data)(p.model, rank).backward()
            p.opt.step()
            p.opt.zero_grad(set_to_none=step % 2 == 0)
            assert_close(p.model, p.ref, ADAM_TOL, f"stage {stage} step {step}")


def test_train_mixed_requires_grad_across_groups(world):
    world(2).run(case_frozen_across_groups, timeout=TIMEOUT)


def case_unfreeze_after_init() -> None:
    """The ``unfreeze_params=True`` variant: the frozen layers are unfrozen (in both models)
    after the first step; training goes on exactly as unsharded training ([Note: unfreezing]
    in engine.py: parameters frozen at initialize are adopted by the next forward)."""
    rank, world = rank_world()
    for stage in STAGES:
        # The optimizers hold every parameter, frozen ones too (unlike ``pair``).
        p = make_pair(_interleaved_frozen, adam, cfg(stage, ("Linear",)))
        for step in range(3):
            if step == 1:
                for m in (p.model, p.ref):
                    m.requires_grad_(True)
            data = batches(step, world, 4, [(8,), (8,)])
            before = p.ref[0].weight.detach().clone()
            reference_step(p, mse(data), world)
            mse(data)(p.model, rank).backward()
            p.opt.step()
            p.opt.zero_grad()
            assert_close(p.model, p.ref, ADAM_TOL, f"stage {stage} step {step}")
            moved = not torch.equal(before, p.ref[0].weight)
            assert moved == (step >= 1), f"stage {stage} step {step}: layer 0 moved={moved}"


def test_unfreeze_after_initialize_trains_like_unsharded(world):
    world(2).run(case_unfreeze_after_init, timeout=TIMEOUT)


class MultiForwardFrozen(nn.Module):
    """``test_multi_forward_mixed_requires_grad``: a trainable and a frozen layer applied three
    times, the trainable one once more under ``torch.no_grad()`` each time."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_0 = nn.Linear(5, 5)
        self.layer_no_grad = nn.Linear(5, 5)
        self.layer_with_grad = nn.Linear(5, 5)
        self.layer_no_grad.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer_0(x)
        for _ in range(3):
            x = self.layer_no_grad(F.relu(self.layer_with_grad(x)))
            with torch.no_grad():  # in place, as FSDP2's test: x keeps its autograd history
                x += F.relu(self.layer_with_grad(x))
        return x


def case_multi_forward_frozen() -> None:
    for stage in STAGES:
        p = pair(MultiForwardFrozen, adam, cfg(stage, ("Linear",)))
        train(p, mse_steps(5, 5), 3, ADAM_TOL, f"stage {stage}")


def test_multi_forward_mixed_requires_grad(world):
    world(2).run(case_multi_forward_frozen, timeout=TIMEOUT)


# -- test_fully_shard_clip_grad_norm_.py -------------------------------------------------------


def case_clip_grad_norm() -> dict:
    """``test_clip_grad_norm_1d``: norm types 2, 1, inf; the returned total norm equals torch's
    on the unsharded gradients and every step clips (SGD: the update is the clipped gradient)."""
    rank, world = rank_world()
    out = {}
    for stage in STAGES:
        for norm_type in (2.0, 1.0, float("inf")):
            p = pair(Stack, sgd, cfg(stage, ("Block",)))
            for step in range(2):
                losses = lm_loss(token_batches(step, world))
                reference_step(p, losses, world, step=False)
                want = torch.nn.utils.clip_grad_norm_(p.ref.parameters(), 0.1, norm_type)
                assert want.item() > 0.1, "the test must actually clip"
                p.ref_opt.step()
                p.ref_opt.zero_grad()
                losses(p.model, rank).backward()
                got = p.opt.clip_grad_norm_(0.1, norm_type)
                rel = abs(got.item() - want.item()) / want.item()
                assert rel <= SGD_TOL, f"stage {stage} {norm_type}: {got.item()} vs {want.item()}"
                p.opt.step()
                p.opt.zero_grad()
                assert_close(p.model, p.ref, SGD_TOL, f"stage {stage} norm {norm_type}")
                assert p.opt.last_step.grad_norm == got.item()
            out[(stage, norm_type)] = got.item()
    return out


def test_clip_grad_norm(world):
    a, b = world(2).run(case_clip_grad_norm, timeout=TIMEOUT)
    assert a == b, "ranks disagree on the total norm"


# -- test_fully_shard_comm.py ------------------------------------------------------------------


class Uniform(nn.Module):
    """3 blocks of Linear(16, 16) (272 elements each: no padding) and a root Linear(16, 16)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def case_comm_counts() -> dict:
    """``test_fully_shard_communication_count``: collectives and elements of one step."""
    out = {}
    for stage in STAGES:
        for depth in (0, 1, 2) if stage == 3 else (1,):
            p = pair(
                Uniform,
                sgd,
                cfg(stage, bucket_bytes=1 << 20, prefetch_depth=depth),
                unit_policy=lambda n, m: n.startswith("layers."),
            )
            train(p, mse_steps(16, 16), 2, SGD_TOL, f"stage {stage} prefetch {depth}")
            s = p.opt.comm_stats()
            out[(stage, depth)] = (dict(s.elements), dict(s.calls))
    return out


def test_communication_count(world):
    out = world(2).run(case_comm_counts, timeout=TIMEOUT)[0]
    psi, unit = 4 * 272, 272
    assert out[(0, 1)] == ({"all_reduce": psi}, {"all_reduce": 1}), out[(0, 1)]
    for stage in (1, 2):  # one bucket: one reduce-scatter, one all-gather
        assert out[(stage, 1)] == (
            {"reduce_scatter": psi, "all_gather": psi},
            {"reduce_scatter": 1, "all_gather": 1},
        ), out[(stage, 1)]
    for depth in (0, 1, 2):
        # Forward gathers the root and 3 blocks; backward re-gathers the blocks (the root
        # stays gathered to the end of backward), but the first (its input needs no gradient,
        # so its backward reads no parameter: [Note: backward without parameters] in
        # params/saved.py) and the last ones the forward ran, kept into the backward
        # (Stage3.keep_last_units: 2, at most depth + 1); one reduce-scatter per unit.
        kept = min(2, depth + 1)
        assert out[(3, depth)] == (
            {"all_gather": psi + (2 - kept) * unit, "reduce_scatter": psi},
            {"all_gather": 6 - kept, "reduce_scatter": 4},
        ), (depth, out[(3, depth)])


# -- test_fully_shard_init.py / test_fully_shard_state_dict.py ---------------------------------


def case_rank0_broadcast_and_full_parameters() -> None:
    """``test_rank0_broadcast_meta_device_init`` / ``test_hsdp_broadcast_across_replicas``:
    ranks build different weights, initialize makes every rank hold rank 0's;
    ``test_unshard_without_lazy_init`` / ``test_param_registration_after_forward``: the full
    parameters read before the first forward and after a forward equal the unsharded ones."""
    rank, _ = rank_world()
    for stage in STAGES:
        torch.manual_seed(0)
        ref = mlp_stack(8)
        torch.manual_seed(rank)  # rank 1's weights differ
        model = mlp_stack(8)
        model, _ = zerodp.initialize(model, adam(list(model.parameters())), cfg(stage))
        with full(model):  # before any forward
            for (n, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
                assert torch.equal(a, b), f"stage {stage}: {n} is not rank 0's"
        x = torch.randn(2, 8)
        assert torch.allclose(model(x), ref(x), rtol=1e-6, atol=1e-7), f"stage {stage}: forward"
        with full(model):  # after a forward, before backward
            for (n, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
                assert torch.equal(a, b), f"stage {stage}: {n} after forward"


def test_rank0_weights_and_full_parameters(world):
    world(2).run(case_rank0_broadcast_and_full_parameters, timeout=TIMEOUT)


class IgnoreC(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin_c = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin_c(x)


class IgnoreB(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin_b = nn.Linear(8, 8)
        self.module_c = IgnoreC()
        self.subtrahend = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin_b(self.module_c(x)) - self.subtrahend


class IgnoreA(nn.Module):
    """FSDP2 ``test_fully_shard_ignore_params``'s A(B(C)) model."""

    def __init__(self) -> None:
        super().__init__()
        self.module_b = IgnoreB()
        self.addend = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.module_b(x) + self.addend).pow(2).mean()


def _without_c(params: list[nn.Parameter], model: nn.Module) -> torch.optim.Optimizer:
    ignored = {id(q) for q in model.module_b.module_c.parameters()}
    return adam([q for q in params if id(q) not in ignored])


def case_ignored_params() -> None:
    """``test_ddp_A_fsdp_B_ddp_C``: ``module_c``'s parameters left out of the optimizer (the
    zerodp counterpart of ignored parameters) stay as they were; the rest trains as unsharded."""
    rank, world = rank_world()
    for stage in STAGES:
        torch.manual_seed(0)
        ref, model = IgnoreA(), IgnoreA()
        model.load_state_dict(ref.state_dict())
        ref_opt = _without_c(list(ref.parameters()), ref)
        model, opt = zerodp.initialize(
            model, _without_c(list(model.parameters()), model), cfg(stage, ("IgnoreB",))
        )
        before = {k: v.clone() for k, v in ref.module_b.module_c.state_dict().items()}
        for step in range(3):
            data = batches(step, world, 8, [(8,)])
            (sum(ref(data[r][0]) for r in range(world)) / world).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            model(data[rank][0]).backward()
            opt.step()
            opt.zero_grad()
            assert_close(model, ref, ADAM_TOL, f"stage {stage} step {step}")
        sd = model.state_dict()
        for k, v in before.items():
            assert torch.equal(sd[f"module_b.module_c.{k}"], v), f"stage {stage}: {k} changed"


def test_ignored_params(world):
    world(2).run(case_ignored_params, timeout=TIMEOUT)
