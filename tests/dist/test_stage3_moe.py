"""Stage 3 with units that run on some ranks only (issue 13): a top-1 mixture of experts whose
ranks route to different experts, a layer skipped on one rank, a unit run on one rank, and a tiny
Hugging Face Switch Transformers model. Every case trains with the default configuration and
matches the unsharded data-parallel reference ([Note: merged plans] in params/order.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hf_models import switch_transformers
from torch import nn
from zerotest import (
    Branchy,
    adamw_two_groups,
    assert_close,
    batches,
    make_pair,
    rank_world,
    reference_step,
)

import zerodp

TIMEOUT = 180.0
EXPERTS = 4


class Expert(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class MoELayer(nn.Module):
    """Top-1 routing; an expert with no token is not run."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.router = nn.Linear(d, EXPERTS)
        self.experts = nn.ModuleList(Expert(d) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor, allowed: list[int]) -> torch.Tensor:
        logits = self.router(x)
        mask = torch.full((EXPERTS,), float("-inf"))
        mask[allowed] = 0.0
        probs = torch.softmax(logits + mask, dim=-1)
        top = probs.argmax(dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx = (top == e).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue
            out = out.index_add(0, idx, expert(x[idx]) * probs[idx, e, None])
        return x + out


class MoE(nn.Module):
    def __init__(self, d: int = 6, layers: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.layers = nn.ModuleList(MoELayer(d) for _ in range(layers))
        self.out = nn.Linear(d, 8)

    def forward(self, x: torch.Tensor, allowed: list[int], skip: tuple[int, ...] = ()):
        h = self.inp(x)
        for k, layer in enumerate(self.layers):
            if k not in skip:
                h = layer(h, allowed)
        return self.out(h)


def _allowed(step: int, rank: int) -> list[int]:
    """Experts rank ``rank`` may route to in ``step``: different sets per rank; expert 3 is used
    by no rank in even steps."""
    if step % 2 == 0:
        return [rank % 3]
    return [(rank + 1) % EXPERTS, 3]


def _moe_steps(pair, world: int, rank: int, steps: int, skip_at: int | None) -> float:
    worst = 0.0
    for step in range(steps):
        data = batches(step, world, 5, [(8,), (8,)])

        def loss(m: nn.Module, r: int, data=data, step=step) -> torch.Tensor:
            x, y = data[r]
            skip = (1,) if step == skip_at and r == world - 1 else ()
            return F.mse_loss(m(x, _allowed(step, r), skip), y)

        reference_step(pair, loss, world)
        loss(pair.model, rank).backward()
        pair.opt.step()
        pair.opt.zero_grad()
        worst = max(worst, assert_close(pair.model, pair.ref, what=f"MoE step {step}"))
    return worst


def case_moe(depth: int, skip_at: int | None) -> dict:
    rank, world = rank_world()
    stage3 = zerodp.Stage3(unit_min_numel=1, prefetch_depth=depth)
    cfg = zerodp.ZeroConfig(stage=3, stage3=stage3)
    pair = make_pair(MoE, adamw_two_groups, cfg)
    worst = _moe_steps(pair, world, rank, 4, skip_at)
    report = pair.opt.memory_report()
    params = pair.opt.engine.params
    return {
        "worst": worst,
        "merges": params.check.merges,
        "now": report.gathered_now,
        "units": len(params.units),
    }


def test_moe_top1_routing_differs_across_ranks(world):
    """Experts unused on some ranks, and one unused on every rank, and a layer skipped on the
    last rank in one step: parity with the unsharded reference, every prefetch depth."""
    for depth in (0, 1, 2):
        for o in world(2).run(case_moe, depth, 2, timeout=TIMEOUT):
            assert o["worst"] <= 1e-6, o
            assert o["merges"] > 0, o  # the plans did differ, and were merged
            assert o["now"] == 0, o  # nothing gathered as an extra is left behind
            assert o["units"] == 1 + 3 * (1 + EXPERTS)


def test_moe_three_ranks(world):
    for o in world(3).run(case_moe, 1, 1, timeout=TIMEOUT):
        assert o["worst"] <= 1e-6, o
        assert o["merges"] > 0 and o["now"] == 0, o


def case_branch_on_rank_zero() -> float:
    """``sometimes`` (a unit) runs on rank 0 only; ``never`` on no rank."""
    rank, world = rank_world()
    cfg = zerodp.ZeroConfig(stage=3, stage3=zerodp.Stage3(unit_classes=("Linear",)))
    pair = make_pair(Branchy, adamw_two_groups, cfg)
    worst = 0.0
    for step in range(3):
        data = batches(step, world, 2, [(4,), (4,)])

        def loss(m: nn.Module, r: int, data=data) -> torch.Tensor:
            x, y = data[r]
            return F.mse_loss(m(x, use_branch=(r == 0)), y)

        reference_step(pair, loss, world)
        loss(pair.model, rank).backward()
        pair.opt.step()
        pair.opt.zero_grad()
        worst = max(worst, assert_close(pair.model, pair.ref, what=f"step {step}"))
    return worst


def test_unit_run_on_one_rank_only(world):
    for n in (2, 3):
        assert max(world(n).run(case_branch_on_rank_zero, timeout=TIMEOUT)) <= 1e-6


def case_switch(steps: int) -> dict:
    import transformers

    transformers.logging.set_verbosity_error()
    rank, world = rank_world()
    # unit_min_numel 512: every block, every layer of a block and every expert is a unit.
    cfg = zerodp.ZeroConfig(stage=3, stage3=zerodp.Stage3(unit_min_numel=512))
    pair = make_pair(lambda: switch_transformers(EXPERTS), adamw_two_groups, cfg)
    g = torch.Generator().manual_seed(3)
    worst = 0.0
    for step in range(steps):
        ids = torch.randint(3, 64, (world, 2, 8), generator=g)
        labels = torch.randint(3, 64, (world, 2, 8), generator=g)

        def loss(m: nn.Module, r: int, ids=ids, labels=labels) -> torch.Tensor:
            return m(input_ids=ids[r], labels=labels[r]).loss

        reference_step(pair, loss, world)
        loss(pair.model, rank).backward()
        pair.opt.step()
        pair.opt.zero_grad()
        worst = max(worst, assert_close(pair.model, pair.ref, what=f"switch step {step}"))
    params = pair.opt.engine.params
    experts = sum(".experts." in u.label for u in params.units)
    return {"worst": worst, "merges": params.check.merges, "experts": experts}


def test_hf_switch_transformers_moe(world):
    """transformers' Switch Transformers (top-1 routing, a ModuleDict of experts, an expert
    with no token not run), each expert a unit: parity over a few AdamW steps."""
    for o in world(2).run(case_switch, 3, timeout=TIMEOUT):
        assert o["experts"] == 4 * EXPERTS, o
        assert o["merges"] > 0, o
        assert o["worst"] <= 1e-6, o
