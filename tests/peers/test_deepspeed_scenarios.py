"""Scenarios from DeepSpeed's ZeRO unit tests (deepspeedai/DeepSpeed ``tests/unit/runtime/zero/``),
rewritten with zerodp's public API: world size 2, gloo, fp32 unless said, each against unsharded
training on the same global batch (SGD 1e-6, AdamW 1e-5 relative), exact step counts or exact
error messages. docs/peer-tests-deepspeed.part.md maps each to its DeepSpeed test.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ds_models import (
    AlbertLike,
    EltwiseNet,
    Frozen,
    Layers,
    outputs,
)
from zerotest import Pair, assert_close, batches, build, make_pair, mse, rank_world, reference_step

import zerodp

STAGES = [0, 1, 2, 3]
TIMEOUT = 120.0
ADAM = 1e-5  # relative error bound for AdamW parity (tests/dist/test_hf_models.py)
SGD = 1e-6


def adamw(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def cfg(
    stage: int,
    units: tuple[str, ...] = (),
    precision: str | zerodp.Precision = "fp32",
    bucket_bytes: int = 96,  # small buckets: parameters cut across buckets
    **stage3,
) -> zerodp.ZeroConfig:
    """``stage3``: fields of ``Stage3`` besides the units (used at stage 3 only)."""
    stage3["unit_classes"] = units if stage == 3 else ()
    return zerodp.ZeroConfig(
        stage=stage, bucket_bytes=bucket_bytes, precision=precision, stage3=zerodp.Stage3(**stage3)
    )


def labelled(step: int, world: int, per: int, d: int) -> list:
    """Rank r's (x, integer labels) of one global classification batch."""
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(world * per, d, generator=g)
    y = torch.randint(0, d, (world * per,), generator=g)
    return [(x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]) for r in range(world)]


def train(pair, losses_at, steps: int, tol: float, what: str) -> float:
    rank, world = rank_world()
    worst = 0.0
    for step in range(steps):
        losses = losses_at(step)
        reference_step(pair, losses, world)
        losses(pair.model, rank).backward()
        pair.opt.step()
        pair.opt.zero_grad()
        worst = max(worst, assert_close(pair.model, pair.ref, tol, f"{what} step {step}"))
    return worst


# -- TestZeroUnbalancedGradients / test_ignore_unused_parameters ---------------------------------

# Per step, per rank: which of the 4 layers run. Step 3 differs across ranks.
MASKS = [
    [[True] * 4, [True] * 4],
    [[False, True, False, True]] * 2,
    [[True, False, True, False]] * 2,
    [[True] * 4, [True, False, False, False]],
]


def case_unbalanced(stage: int) -> list[float]:
    _, world = rank_world()
    out = []
    # units=(): one stage-3 unit, so the rank-dependent step 3 is allowed. ("Linear",): a unit
    # per layer, skipped on every rank alike (step 3 then uses rank 0's mask everywhere).
    for units in [(), ("Linear",)]:
        masks = [m if units == () else [m[0]] * world for m in MASKS]
        pair = make_pair(Layers, adamw, cfg(stage, units))

        def losses_at(step: int, masks=masks):
            data = batches(step, world, 3, [(6,), (3,)])
            return lambda mod, r: F.mse_loss(mod(data[r][0], masks[step][r]), data[r][1])

        out.append(train(pair, losses_at, len(MASKS), ADAM, f"stage {stage} units {units}"))
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_unbalanced_gradients_and_unused_layers(world, stage):
    """Layers unused on alternate steps (every rank), then unused on one rank only."""
    world(2).run(case_unbalanced, stage, timeout=TIMEOUT)


def case_never_used(stage: int) -> dict:
    """``UnusedParametersModel``: a layer no forward ever uses (DeepSpeed stage 2 raises unless
    ``ignore_unused_parameters``). Its Adam state must stay empty, as torch's does."""
    _, world = rank_world()
    pair = make_pair(Layers, adamw, cfg(stage, ("Linear",)))
    use = [True, True, False, True]
    before = {n: p.detach().clone() for n, p in pair.ref.named_parameters() if "linears.2" in n}
    train(pair, lambda s: _masked(s, world, use), 3, ADAM, f"stage {stage}")
    sd = pair.opt.state_dict()
    states = {}
    for i, (name, _, _) in enumerate(sd["zerodp"]["pieces"]):
        states.setdefault(name, []).append(sorted(sd["state"].get(i, {})))
    with zerodp.full_parameters(pair.model, writeback=False):
        for n, p in pair.model.named_parameters():
            if n in before:
                assert torch.equal(p.detach(), before[n]), f"{n} changed"
    assert not any(pair.ref_opt.state[p] for p in pair.ref.linears[2].parameters())
    return states


def _masked(step: int, world: int, use: list[bool]):
    data = batches(step, world, 3, [(6,), (3,)])
    return lambda m, r: F.mse_loss(m(data[r][0], use), data[r][1])


@pytest.mark.parametrize("stage", STAGES)
def test_never_used_layer_has_no_optimizer_state(world, stage):
    for states in world(2).run(case_never_used, stage, timeout=TIMEOUT):
        for name, entries in states.items():
            want = [] if name.startswith("linears.2.") else ["exp_avg", "exp_avg_sq", "step"]
            assert all(e == want for e in entries), (name, entries)


# -- TestZero3RepeatForwardLoop ---------------------------------------------------------------


def case_repeat_loop(stage: int, units: tuple[str, ...], depth: int) -> float:
    _, world = rank_world()
    pair = make_pair(AlbertLike, adamw, cfg(stage, units, prefetch_depth=depth))
    rank = dist.get_rank()
    worst = 0.0
    for step in range(3):  # 2 micro-batches per step, the first under no_sync (DeepSpeed: GA=2)
        for micro in range(2):
            data = labelled(10 * step + micro, world, 2, 4)
            losses = lambda m, r, data=data: m(*data[r]) / 2  # noqa: E731
            reference_step(pair, losses, world, step=False)
            if micro == 0:
                with pair.model.no_sync():
                    losses(pair.model, rank).backward()
            else:
                losses(pair.model, rank).backward()
        pair.ref_opt.step()
        pair.ref_opt.zero_grad()
        pair.opt.step()
        pair.opt.zero_grad()
        worst = max(worst, assert_close(pair.model, pair.ref, ADAM, f"step {step}"))
    return worst


@pytest.mark.parametrize(
    ("stage", "units", "depth"),
    [(3, ("Linear",), 0), (3, ("Linear",), 1), (3, (), 1), (2, (), 1), (1, (), 1)],
)
def test_repeat_forward_loop(world, stage, units, depth):
    """One layer applied 3 times per forward, with gradient accumulation."""
    world(2).run(case_repeat_loop, stage, units, depth, timeout=TIMEOUT)


# -- TestZero3DictFwd / TestZero3ParamPartitioningBase (model_class, zero_grad, persistence,
#    prefetching) -----------------------------------------------------------------------------

KINDS = ["dict", "dict_extra", "namedtuple", "tuple", "list"]


def case_structured(stage: int) -> int:
    rank, world = rank_world()
    cases = 0
    for kind in KINDS:
        # Stage 1 refuses a second synchronised backward before zero_grad (tested elsewhere).
        for persist, depth, accumulate in [(0, 0, stage != 1), (15, 1, False), (0, 1, False)]:
            units = ("Eltwise",)
            config = cfg(stage, units, persist_numel=persist, prefetch_depth=depth)
            pair = make_pair(lambda kind=kind: EltwiseNet(kind), adam_lr1, config)
            x = torch.ones(3, 5)
            y = torch.ones(3, 5)
            total_ref = None
            for it in range(3):
                got = outputs(pair.model(x * (1 + rank), y))
                refs = [outputs(pair.ref(x * (1 + r), y)) for r in range(world)]
                for a, b in zip(got, refs[rank], strict=True):
                    assert torch.equal(a, b), f"{kind}: forward {it} differs"
                got[3].sum().backward()
                ref_loss = sum(o[3].sum() for o in refs) / world
                ref_loss.backward()
                # DeepSpeed's zero_grad=True: only the last backward counts.
                if not accumulate and it < 2:
                    pair.opt.zero_grad()
                    pair.ref_opt.zero_grad()
                total_ref = ref_loss
            assert total_ref is not None
            pair.opt.step()
            pair.ref_opt.step()
            what = f"{kind} persist={persist} depth={depth} accumulate={accumulate}"
            assert_close(pair.model, pair.ref, ADAM, what)
            cases += 1
    return cases


def adam_lr1(params: list) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1.0)  # DeepSpeed's lr for this test


@pytest.mark.parametrize("stage", STAGES)
def test_dict_namedtuple_tuple_list_outputs(world, stage):
    """Units returning dicts / namedtuples, the root returning dict (with non-tensor values),
    namedtuple, tuple or list with the loss inside; three synchronised backwards with and
    without ``zero_grad`` between them, then one step."""
    assert world(2).run(case_structured, stage, timeout=TIMEOUT) == [15, 15]


# -- TestZeroFrozenWeights ----------------------------------------------------------------------


def case_frozen(stage: int) -> list[str]:
    _, world = rank_world()
    pair = make_pair(Frozen, adamw, cfg(stage, ("Linear",)))
    frozen = {n: p.detach().clone() for n, p in pair.ref.named_parameters() if n.startswith("l2.")}
    train(pair, lambda s: mse(batches(s, world, 3, [(10,), (10,)])), 3, ADAM, f"stage {stage}")
    with zerodp.full_parameters(pair.model, writeback=False):
        for n, p in pair.model.named_parameters():
            assert p.requires_grad == (n not in frozen), n
            if n in frozen:
                assert torch.equal(p.detach(), frozen[n]), f"frozen {n} changed"
    return sorted({name for name, _, _ in pair.opt.state_dict()["zerodp"]["pieces"]})


@pytest.mark.parametrize("stage", STAGES)
def test_frozen_weights(world, stage):
    """l2 frozen at initialize (a stage-3 unit with only frozen parameters): parity, frozen
    values bitwise unchanged, no optimizer state labelled with a frozen name."""
    names = world(2).run(case_frozen, stage, timeout=TIMEOUT)
    assert sorted(set(names[0]) | set(names[1])) == ["l1.bias", "l1.weight", "l3.bias", "l3.weight"]


# -- TestZeroAdamOptimizerStepCount -------------------------------------------------------------


def case_step_count(stage: int, precision: str) -> list:
    """bf16: rank 1's gradients are non-finite at step 2 (DeepSpeed runs this test in fp16/bf16,
    where such a step is skipped; zerodp skips it with ``nonfinite='skip'``, the default raises);
    fp32 gets only finite gradients."""
    rank, world = rank_world()
    config = cfg(stage, ("Linear",), zerodp.Precision(compute=precision, nonfinite="skip"))
    pair = make_pair(lambda: Layers(n=12, d=4, out=4), torch.optim.Adam, config)
    bad = 2 if precision == "bf16" else -1
    seen = []
    for step in range(4):
        for micro in range(2):
            data = batches(10 * step + micro, world, 2, [(4,), (4,)])
            if step == bad and micro == 1 and rank == 1:
                data[rank] = (data[rank][0] * float("inf"), data[rank][1])
            loss = F.mse_loss(pair.model(data[rank][0]).float(), data[rank][1])
            if micro == 0:
                with pair.model.no_sync():
                    loss.backward()
            else:
                loss.backward()
            if step != bad:
                reference_step(pair, mse(data), world, step=False)
        pair.opt.step()
        pair.opt.zero_grad()
        if step != bad:
            pair.ref_opt.step()
        pair.ref_opt.zero_grad()
        sd = pair.opt.state_dict()
        steps = {float(s["step"]) for s in sd["state"].values()}
        ref_steps = {float(pair.ref_opt.state[p]["step"]) for p in pair.ref.parameters()}
        info = pair.opt.last_step
        seen.append((info.step, info.skipped, sorted(steps), sorted(ref_steps)))
    if precision == "fp32":
        assert_close(pair.model, pair.ref, ADAM, f"stage {stage}")
    return [*seen, pair.opt.skipped_steps]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", STAGES)
def test_adam_step_count(world, stage, precision):
    """Every owned piece's Adam ``step`` equals torch's after each optimizer step (gradient
    accumulation of 2); in bf16 the step with a non-finite gradient on rank 1 only is skipped
    on every rank and counts nowhere."""
    skip = precision == "bf16"
    counts = [1.0, 2.0, 2.0, 3.0] if skip else [1.0, 2.0, 3.0, 4.0]
    expected = [(i + 1, skip and i == 2, [c], [c]) for i, c in enumerate(counts)]
    expected.append(int(skip))
    for seen in world(2).run(case_step_count, stage, precision, timeout=TIMEOUT):
        assert seen == expected, seen


# -- TestEmptyParameterGroup; a param group spread over several stage-3 units -------------------


def _groups(model, empty_weights: bool) -> list[dict]:
    weights = [lin.weight for lin in model.linears]
    biases = [lin.bias for lin in model.linears] + list(model.head.parameters())
    return [
        {"params": [] if empty_weights else weights, "lr": 1e-2, "weight_decay": 0.1},
        {"params": biases + (weights if empty_weights else []), "lr": 3e-3, "weight_decay": 0},
        {"params": [], "lr": 5.0},
    ]


def case_empty_group(stage: int) -> list:
    _, world = rank_world()
    out = []
    for empty_weights in (True, False):
        ref, model = build(Layers), build(Layers)
        ref_opt = torch.optim.AdamW(_groups(ref, empty_weights))
        opt = torch.optim.AdamW(_groups(model, empty_weights))
        model, opt = zerodp.initialize(model, opt, cfg(stage, ("Linear",)))
        pair = Pair(model, opt, ref, ref_opt)
        train(pair, lambda s: mse(batches(s, world, 3, [(6,), (3,)])), 3, ADAM, f"{empty_weights}")
        out.append([(g["lr"], g["weight_decay"], len(g["params"]) > 0) for g in opt.param_groups])
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_empty_parameter_group_and_groups_across_units(world, stage):
    """An empty param group (either the decay or the no-decay one, plus an always-empty one),
    each non-empty group holding parameters of every stage-3 unit: parity, groups kept."""
    for out in world(2).run(case_empty_group, stage, timeout=TIMEOUT):
        assert [[(lr, wd) for lr, wd, _ in groups] for groups in out] == [
            [(1e-2, 0.1), (3e-3, 0), (5.0, 0.01)]
        ] * 2, out
        # The empty groups stay empty on every rank (the non-empty ones hold this rank's pieces).
        assert [flags[2] for flags in out[0]] == [False, True, False]
        assert out[1][2][2] is False
