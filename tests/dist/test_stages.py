"""Stages 0-2 against an unsharded reference, on real gloo ranks (issue 2).

Each ``case_*`` runs in every rank of a persistent world; assertions inside carry messages
because pytest does not rewrite asserts in the worker processes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from zerotest import (
    MLP,
    Branchy,
    OddSizes,
    Tied,
    adamw_two_groups,
    assert_close,
    batches,
    full,
    make_pair,
    mse,
    rank_world,
    sgd_momentum,
    synced_step,
)

import zerodp

STAGES = [0, 1, 2, 3]
WORLDS = [1, 2, 3, 4]
STEPS = 4
TIMEOUT = 90.0
OPTIMIZERS = {"sgd": sgd_momentum, "adamw": adamw_two_groups}
UNITS = ("Linear", "Embedding")


def _cfg(stage: int, bucket_bytes: int = 96, units: tuple[str, ...] = UNITS) -> zerodp.ZeroConfig:
    # A tiny bucket (24 fp32 elements) forces many buckets and parameters cut across them.
    # Stage 3: every Linear / Embedding is a unit (the default policy would make these small
    # models one root unit), so parameters are gathered and reduced per layer.
    if stage == 3:
        stage3 = zerodp.Stage3(unit_classes=units)
        return zerodp.ZeroConfig(stage=stage, bucket_bytes=bucket_bytes, stage3=stage3)
    return zerodp.ZeroConfig(stage=stage, bucket_bytes=bucket_bytes)


def _train_mlp(stage: int, opt_name: str, factory=MLP, d_in: int = 7, d_out: int = 5) -> float:
    rank, world = rank_world()
    pair = make_pair(factory, OPTIMIZERS[opt_name], _cfg(stage))
    worst = 0.0
    for step in range(STEPS):
        synced_step(pair, mse(batches(step, world, 3, [(d_in,), (d_out,)])), world, rank)
        worst = max(worst, assert_close(pair.model, pair.ref, what=f"step {step}"))
    return worst


def case_optimizer(stage: int, opt_name: str) -> float:
    return _train_mlp(stage, opt_name)


def case_odd_sizes(stage: int) -> dict:
    worst = _train_mlp(stage, "adamw", OddSizes, 5, 3)
    pair = make_pair(OddSizes, adamw_two_groups, _cfg(stage))
    x = torch.randn(2, 5)
    pair.model(x).sum().backward()
    pair.opt.step()
    # Padding never reaches the optimizer: every state tensor is exactly its piece's size.
    owned = 0
    for op in pair.opt.engine.pieces:
        st = pair.opt.state[op.tensor]
        n = op.piece.param_range.numel
        owned += n
        for key in ("exp_avg", "exp_avg_sq"):
            assert st[key].numel() == n, f"{op.name} {key} has {st[key].numel()} != {n}"
    return {"worst": worst, "owned": owned}


def case_tied(stage: int) -> float:
    rank, world = rank_world()
    pair = make_pair(Tied, adamw_two_groups, _cfg(stage))
    assert pair.model.out.weight is pair.model.emb.weight, "tying broken by initialize"
    worst = 0.0
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, 11, (world, 4), generator=g)
        tgt = torch.randint(0, 11, (world, 4), generator=g)

        def loss(m: nn.Module, r: int, idx=idx, tgt=tgt) -> torch.Tensor:
            return F.cross_entropy(m(idx[r]), tgt[r])

        synced_step(pair, loss, world, rank)
        worst = max(worst, assert_close(pair.model, pair.ref, what=f"tied step {step}"))
    return worst


def case_unused(stage: int) -> float:
    """``never`` gets no gradient anywhere (so AdamW must not decay it); ``sometimes`` only on
    rank 0 (so it is updated with rank 0's gradient averaged over all ranks)."""
    rank, world = rank_world()
    # Stage 3: one root unit, so that `sometimes` is a parameter unused on some ranks inside a
    # unit that runs everywhere (a *unit* that runs on some ranks only: test_stage3.py).
    pair = make_pair(Branchy, adamw_two_groups, _cfg(stage, units=("Branchy",)))
    with full(pair.model):
        before = pair.model.never.weight.detach().clone()
    worst = 0.0
    for step in range(STEPS):
        data = batches(step, world, 2, [(4,), (4,)])

        def loss(m: nn.Module, r: int, data=data) -> torch.Tensor:
            x, y = data[r]
            return F.mse_loss(m(x, use_branch=(r == 0)), y)

        synced_step(pair, loss, world, rank)
        worst = max(worst, assert_close(pair.model, pair.ref, what=f"unused step {step}"))
    with full(pair.model):
        assert torch.equal(pair.model.never.weight, before), "an unused parameter was updated"
    for op in pair.opt.engine.pieces:
        if op.name.startswith("never"):
            assert not pair.opt.state.get(op.tensor), f"optimizer state created for {op.name}"
    return worst


def case_frozen(stage: int) -> dict:
    rank, world = rank_world()

    def factory() -> nn.Module:
        m = MLP()
        m.fc1.requires_grad_(False)
        return m

    pair = make_pair(factory, adamw_two_groups, _cfg(stage))
    frozen_before = pair.model.fc1.weight.detach().clone()
    for step in range(STEPS):
        synced_step(pair, mse(batches(step, world, 3, [(7,), (5,)])), world, rank)
        assert_close(pair.model, pair.ref, what=f"frozen step {step}")
    assert torch.equal(pair.model.fc1.weight, frozen_before), "a frozen parameter changed"
    assert pair.model.fc1.weight.grad is None, "a frozen parameter got a gradient"
    names = {op.name for op in pair.opt.engine.pieces}
    assert not any(n.startswith("fc1") for n in names), f"frozen params in optimizer: {names}"
    stats = pair.opt.comm_stats()
    assert stats is not None
    trainable = sum(s.layout.padded_numel for s in pair.opt.engine.segments)
    moved = stats.elements.get("all_reduce", 0) + stats.elements.get("reduce_scatter", 0)
    # Only fc2 (13*5 + 5 = 70 elements, padded) is reduced.
    assert moved == (trainable if world > 1 else moved), f"moved {moved} != {trainable}"
    return {"trainable_padded": trainable, "moved": moved}


def case_freeze_on_one_rank(stage: int) -> str:
    rank, world = rank_world()
    pair = make_pair(MLP, adamw_two_groups, _cfg(stage))
    if rank == world - 1:  # only one rank freezes it: every rank must raise, not hang
        pair.model.fc1.weight.requires_grad_(False)
    pair.model(torch.randn(2, 7)).sum().backward()
    try:
        pair.opt.step()
    except RuntimeError as exc:
        return str(exc)
    raise AssertionError("requires_grad differing between ranks was not detected")


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_optimizers_match_reference(world, world_size, stage, opt_name):
    errs = world(world_size).run(case_optimizer, stage, opt_name, timeout=TIMEOUT)
    assert max(errs) <= 1e-6


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("stage", STAGES)
def test_odd_sizes(world, world_size, stage):
    out = world(world_size).run(case_odd_sizes, stage, timeout=TIMEOUT)
    psi = 15 + 3 + 1 + 0 + 2
    if stage == 0:
        assert all(o["owned"] == psi for o in out)
    else:
        assert sum(o["owned"] for o in out) == psi  # every element owned exactly once


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("stage", STAGES)
def test_tied_parameters(world, world_size, stage):
    world(world_size).run(case_tied, stage, timeout=TIMEOUT)


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("stage", STAGES)
def test_unused_parameters(world, world_size, stage):
    world(world_size).run(case_unused, stage, timeout=TIMEOUT)


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_frozen_parameters(world, world_size, stage):
    world(world_size).run(case_frozen, stage, timeout=TIMEOUT)


@pytest.mark.parametrize("stage", STAGES)
def test_freezing_on_one_rank_raises_on_every_rank(world, stage):
    """Freezing between steps is supported (test_peer_rows.py); freezing on some ranks only
    would silently average one rank's gradient with nothing: every rank raises at the step."""
    messages = world(2).run(case_freeze_on_one_rank, stage, timeout=TIMEOUT)
    want = (
        "requires_grad of 'fc1.weight' differs between ranks (frozen on some, trainable on "
        "others): freeze and unfreeze parameters identically on every rank"
    )
    assert messages == [want, want]
