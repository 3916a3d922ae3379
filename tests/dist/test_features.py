"""Stage 0-2 features beyond plain steps: buffers, accumulation, clipping, schedulers, optimizer
state round trip, process subgroups, and agreement errors (issue 2)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from zerotest import (
    MLP,
    adamw_two_groups,
    assert_close,
    batches,
    build,
    full,
    make_pair,
    mse,
    rank_world,
    reference_step,
)

import zerodp

STAGES = [0, 1, 2, 3]
TIMEOUT = 90.0
HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_state_dict_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _cfg(stage: int) -> zerodp.ZeroConfig:
    # Stage 3: every layer is a unit (these models are too small for the default policy).
    units = ("Linear", "BatchNorm1d") if stage == 3 else ()
    return zerodp.ZeroConfig(stage=stage, bucket_bytes=96, stage3=zerodp.Stage3(unit_classes=units))


class BN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.bn(torch.relu(self.fc(x))))


def case_buffers_like_ddp(stage: int) -> float:
    """Module buffers (BatchNorm running stats) behave exactly as under torch DDP."""
    rank, world = rank_world()
    ddp = nn.parallel.DistributedDataParallel(build(BN))
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    model = build(BN)
    model, opt = zerodp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), _cfg(stage)
    )
    for step in range(3):
        x, y = batches(step, world, 4, [(6,), (2,)])[rank]
        F.mse_loss(ddp(x), y).backward()
        ddp_opt.step()
        ddp_opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        err = assert_close(model, ddp.module, what=f"BN step {step}")
    for name, b in model.named_buffers():
        ref = dict(ddp.module.named_buffers())[name]
        assert torch.allclose(b.float(), ref.float(), rtol=1e-6, atol=1e-7), f"buffer {name}"
    return err


def case_accumulation(stage: int) -> dict:
    """Three micro-batches, the first two under no_sync(): no gradient traffic until the last,
    and the step equals the reference on the large batch."""
    rank, world = rank_world()
    pair = make_pair(MLP, adamw_two_groups, _cfg(stage))
    silent = []
    for step in range(3):
        micro = [batches(100 * step + k, world, 2, [(7,), (5,)]) for k in range(3)]
        total = sum(mse(d)(pair.ref, r) for d in micro for r in range(world)) / (3 * world)
        total.backward()
        pair.ref_opt.step()
        pair.ref_opt.zero_grad()
        for k, data in enumerate(micro):
            loss = mse(data)(pair.model, rank) / 3
            if k < 2:
                with pair.model.no_sync():
                    loss.backward()
                traffic = pair.opt.engine.comm.ledger.current().elements
                # Stage 3 gathers parameters in every forward and backward; gradients: none.
                silent.append({k: n for k, n in traffic.items() if k != "all_gather"})
            else:
                loss.backward()
        pair.opt.step()
        pair.opt.zero_grad()
        assert_close(pair.model, pair.ref, what=f"accumulation step {step}")
    assert all(not e for e in silent), f"gradient traffic inside no_sync: {silent}"
    return {"silent": silent}


def case_clipping(stage: int, norm_type: float) -> list[float]:
    rank, world = rank_world()
    pair = make_pair(MLP, adamw_two_groups, _cfg(stage))
    norms = []
    for step in range(3):
        data = batches(step, world, 3, [(7,), (5,)])
        reference_step(pair, mse(data), world, step=False)
        ref_norm = torch.nn.utils.clip_grad_norm_(pair.ref.parameters(), 0.05, norm_type)
        pair.ref_opt.step()
        pair.ref_opt.zero_grad()
        mse(data)(pair.model, rank).backward()
        norm = pair.opt.clip_grad_norm_(0.05, norm_type)
        rel = abs(norm.item() - ref_norm.item()) / ref_norm.item()
        assert rel <= 1e-6, f"norm {norm.item()} vs reference {ref_norm.item()}"
        assert ref_norm.item() > 0.05, "the test must actually clip"
        pair.opt.step()
        pair.opt.zero_grad()
        assert_close(pair.model, pair.ref, what=f"clip step {step}")
        norms.append(norm.item())
    return norms


def case_scheduler(stage: int) -> list[float]:
    rank, world = rank_world()
    pair = make_pair(MLP, adamw_two_groups, _cfg(stage))
    sched = torch.optim.lr_scheduler.LambdaLR(pair.opt, lambda s: 1.0 / (1 + s))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(pair.ref_opt, lambda s: 1.0 / (1 + s))
    lrs = []
    for step in range(4):
        data = batches(step, world, 3, [(7,), (5,)])
        reference_step(pair, mse(data), world)
        ref_sched.step()
        mse(data)(pair.model, rank).backward()
        pair.opt.step()
        pair.opt.zero_grad()
        sched.step()
        lrs.append(pair.opt.param_groups[0]["lr"])
        assert lrs[-1] == pair.ref_opt.param_groups[0]["lr"], "scheduler lr differs"
        assert_close(pair.model, pair.ref, what=f"scheduled step {step}")
        assert pair.opt.steps == step + 1, f"opt.steps {pair.opt.steps} after {step + 1} steps"
    assert pair.opt.config == _cfg(stage), "opt.config is not the config initialize got"
    pair.opt.close()  # every hook zerodp registered is gone
    hooks = [
        (name, kind)
        for name, m in pair.model.named_modules()
        for kind in HOOK_DICTS
        if getattr(m, kind)
    ]
    hooks += [
        (n, "grad") for n, p in pair.model.named_parameters() if p._post_accumulate_grad_hooks
    ]
    assert not hooks, f"hooks left after opt.close(): {hooks}"
    return lrs


def case_state_dict_round_trip(stage: int) -> None:
    rank, world = rank_world()
    pair = make_pair(MLP, adamw_two_groups, _cfg(stage))

    def train(steps: range) -> None:
        for step in steps:
            x, y = batches(step, world, 3, [(7,), (5,)])[rank]
            F.mse_loss(pair.model(x), y).backward()
            pair.opt.step()
            pair.opt.zero_grad()

    train(range(2))
    saved_opt = copy.deepcopy(pair.opt.state_dict())  # torch's state_dict holds references
    saved_model = {k: v.clone() for k, v in pair.model.state_dict().items()}
    train(range(2, 4))
    with full(pair.model):
        expected = [p.detach().clone() for p in pair.model.parameters()]
    pair.model.load_state_dict(saved_model)
    pair.opt.load_state_dict(saved_opt)
    train(range(2, 4))
    with full(pair.model):
        for p, q in zip(pair.model.parameters(), expected, strict=True):
            assert torch.equal(p, q), "state_dict round trip is not bitwise"


def case_foreign_parameter(stage: int) -> str:
    model = build(MLP)
    stray = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([*model.parameters(), stray], lr=0.1)
    try:
        zerodp.initialize(model, opt, _cfg(stage))
    except ValueError as exc:
        return str(exc)
    raise AssertionError("an optimizer parameter outside the model was accepted")


def case_rank_mismatch(kind: str) -> str:
    rank, _ = rank_world()
    hidden = 13 if (kind != "model" or rank == 0) else 14
    stage = 1 if (kind != "config" or rank == 0) else 2
    model = MLP(hidden=hidden)
    try:
        zerodp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), _cfg(stage))
    except ValueError as exc:
        return str(exc)
    raise AssertionError("ranks that disagree were not detected")


def case_subgroups(stage: int) -> float:
    """ZeRO over a data-parallel subgroup: ranks {0,1} and {2,3} train independent replicas."""
    rank, _ = rank_world()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    local_rank = rank % 2
    pair = make_pair(MLP, adamw_two_groups, _cfg(stage), process_group=mine, seed=rank // 2)
    for step in range(3):
        data = batches(1000 * (rank // 2) + step, 2, 3, [(7,), (5,)])
        reference_step(pair, mse(data), 2)
        mse(data)(pair.model, local_rank).backward()
        pair.opt.step()
        pair.opt.zero_grad()
        err = assert_close(pair.model, pair.ref, what=f"subgroup step {step}")
    return err


@pytest.mark.parametrize("stage", STAGES)
def test_buffers_follow_ddp(world, stage):
    world(2).run(case_buffers_like_ddp, stage, timeout=TIMEOUT)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_gradient_accumulation_no_sync(world, world_size, stage):
    world(world_size).run(case_accumulation, stage, timeout=TIMEOUT)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_clip_grad_norm_matches_torch(world, world_size, stage, norm_type):
    out = world(world_size).run(case_clipping, stage, norm_type, timeout=TIMEOUT)
    assert all(o == out[0] for o in out), "ranks disagree on the total norm"


@pytest.mark.parametrize("stage", STAGES)
def test_lr_scheduler(world, stage):
    world(2).run(case_scheduler, stage, timeout=TIMEOUT)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_optimizer_state_dict_round_trip(world, world_size, stage):
    world(world_size).run(case_state_dict_round_trip, stage, timeout=TIMEOUT)


@pytest.mark.parametrize("stage", STAGES)
def test_optimizer_with_foreign_parameter(world, stage):
    for msg in world(2).run(case_foreign_parameter, stage, timeout=TIMEOUT):
        assert "is not a parameter of the model passed to zerodp.initialize" in msg, msg
        assert "shape (3,)" in msg, msg


def test_models_that_differ_across_ranks(world):
    for msg in world(2).run(case_rank_mismatch, "model", timeout=TIMEOUT):
        assert "rank 1 differs from rank 0 in parameters" in msg, msg
        assert "('fc1.weight', (13, 7)" in msg and "(14, 7)" in msg, msg


def test_configs_that_differ_across_ranks(world):
    for msg in world(2).run(case_rank_mismatch, "config", timeout=TIMEOUT):
        assert "rank 1 differs from rank 0 in config: stage=1 on rank 0 vs 2" in msg, msg


@pytest.mark.parametrize("stage", STAGES)
def test_process_subgroups(world, stage):
    world(4).run(case_subgroups, stage, timeout=TIMEOUT)
