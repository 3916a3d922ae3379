"""Scenarios from the peers' own test suites (FSDP2, DeepSpeed), world size 2, gloo, fp32, each
against unsharded training on the same global batch (docs/peer-tests.md lists them).

- FSDP2 ``unused_forward_output``: ``zero_grad(set_to_none=False)`` leaves a zero ``.grad`` on a
  parameter, so torch's optimizer steps it in a later step in which it is unused; zerodp must
  step exactly the parameters unsharded training steps ([Note: step agreement]).
- DeepSpeed ``test_zero_tensor_fragment``: param groups in another order than the layout; every
  entry of ``opt.state_dict()`` must be labelled with its own parameter and range.
- FSDP2 ``single_group``: a 0-dim (scalar) parameter trains at every stage.
- FSDP2 ``test_gradient_accumulation``: a synchronised backward per micro-batch (no
  ``no_sync``) accumulates exactly (stage 1 refuses it with a clear error, tested in
  test_precision.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hf_models import build as build_hf
from hf_models import global_batches, hf_loss
from torch import nn
from zerotest import (
    MLP,
    Branchy,
    Pair,
    adamw_two_groups,
    assert_close,
    batches,
    build,
    full,
    make_pair,
    max_rel_error,
    mse,
    rank_world,
    reference_step,
    sgd_momentum,
)

import zerodp

STAGES = [0, 1, 2, 3]
TIMEOUT = 120.0
# Adam moments after 3 steps, ||sharded - unsharded|| / ||unsharded|| per tensor: the gradients
# agree to ~1e-7 (summation order); a wrongly labelled entry is off by O(1).
STATE_TOL = 1e-5


def _cfg(stage: int, units: tuple[str, ...] = ("Linear",)) -> zerodp.ZeroConfig:
    # Small buckets cut parameters across buckets; stage 3: every listed layer is its own unit.
    stage3 = zerodp.Stage3(unit_classes=units if stage == 3 else ())
    return zerodp.ZeroConfig(stage=stage, bucket_bytes=96, stage3=stage3)


def _gpt2_blocks(stage: int) -> zerodp.Stage3:
    """Stage 3: each Hugging Face GPT-2 block a unit."""
    return zerodp.Stage3(unit_classes=("GPT2Block",) if stage == 3 else ())


# -- 1. zero_grad(set_to_none=False) and a parameter unused in a step ---------------------------

# Which ranks run ``Branchy.sometimes`` at each step: both, none, rank 0 only, none, none.
USE_BRANCH = [(True, True), (False, False), (True, False), (False, False), (False, False)]
# set_to_none passed to zero_grad after each step.
SET_TO_NONE = {
    "false": [False] * 5,
    "true": [True] * 5,
    # kept (step 1 steps the unused branch), dropped, kept again (step 3), dropped (step 4)
    "mixed": [False, True, False, True, False],
}


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def case_zero_grad_keeps_grads(stage: int, pattern: str, ref_via: str) -> list[bool]:
    """Parity after every step; returns, per step, whether the reference stepped the unused
    ``sometimes`` branch (the scenario must actually exercise both behaviours)."""
    rank, world = rank_world()
    # Stage 3: one unit (the default policy's root unit for a model this small), because a unit
    # that runs on some ranks only is refused (docs/stage3.md) and step 2 runs the branch on
    # rank 0 only.
    pair = make_pair(Branchy, _adamw, _cfg(stage, units=()))
    stepped_unused = []
    for step, (use, none) in enumerate(zip(USE_BRANCH, SET_TO_NONE[pattern], strict=True)):
        data = batches(step, world, 3, [(4,), (4,)])
        x, y = data[rank]
        before = pair.ref.sometimes.weight.detach().clone()
        ref_loss = sum(F.mse_loss(pair.ref(*data[r][:1], use[r]), data[r][1]) for r in range(world))
        (ref_loss / world).backward()
        pair.ref_opt.step()
        if ref_via == "opt":
            pair.ref_opt.zero_grad(set_to_none=none)
        else:
            pair.ref.zero_grad(set_to_none=none)
        if not any(use):
            stepped_unused.append(not torch.equal(before, pair.ref.sometimes.weight))
        F.mse_loss(pair.model(x, use[rank]), y).backward()
        pair.opt.step()
        pair.opt.zero_grad(set_to_none=none)
        assert_close(pair.model, pair.ref, what=f"stage {stage} {pattern} step {step}")
    return stepped_unused


@pytest.mark.parametrize("ref_via", ["opt", "model"])
@pytest.mark.parametrize("pattern", sorted(SET_TO_NONE))
@pytest.mark.parametrize("stage", STAGES)
def test_zero_grad_set_to_none_and_unused_parameter(world, stage, pattern, ref_via):
    """FSDP2 ``unused_forward_output``: the same parameters are stepped as in unsharded
    training, for ``set_to_none`` True, False and a mix."""
    out = world(2).run(case_zero_grad_keeps_grads, stage, pattern, ref_via, timeout=TIMEOUT)
    # Steps 1, 3, 4 leave the branch unused on every rank; a kept zero .grad steps it.
    expected = {
        "false": [True, True, True],
        "true": [False, False, False],
        "mixed": [True, True, False],
    }[pattern]
    assert out == [expected, expected], out


# -- 2. opt.state_dict() with param groups in another order than the layout --------------------


def _mlp_groups_out_of_order(model: nn.Module) -> list[dict]:
    # The layout is reverse registration order (fc2.bias, fc2.weight, fc1.bias, fc1.weight);
    # these groups interleave with it.
    m = dict(model.named_parameters())
    return [
        {"params": [m["fc1.weight"], m["fc2.bias"]], "lr": 1e-2, "weight_decay": 0.1},
        {"params": [m["fc2.weight"], m["fc1.bias"]], "lr": 3e-3, "weight_decay": 0.0},
    ]


def _hf_groups_out_of_order(model: nn.Module) -> list[dict]:
    # No-decay (biases, norms) first: interleaves with the layout in every block.
    named = list(model.named_parameters())
    no_decay = [p for n, p in named if n.endswith("bias") or ".ln_" in n]
    decay = [p for n, p in named if not (n.endswith("bias") or ".ln_" in n)]
    return [
        {"params": no_decay, "lr": 3e-3, "weight_decay": 0.0},
        {"params": decay, "lr": 1e-2, "weight_decay": 0.1},
    ]


def _full_state_from_shards(shards: list[dict], shapes: dict[str, torch.Size]) -> dict:
    """Reassemble {name: {"exp_avg", "exp_avg_sq", "step", "covered"}} from every rank's
    ``opt.state_dict()``, trusting only ``pieces[i]`` to say what ``state[i]`` is."""
    full: dict[str, dict] = {}
    for sd in shards:
        for i, (name, start, stop) in enumerate(sd["zerodp"]["pieces"]):
            st = sd["state"][i]
            numel = int(torch.Size(shapes[name]).numel())
            entry = full.setdefault(
                name,
                {
                    "exp_avg": torch.zeros(numel),
                    "exp_avg_sq": torch.zeros(numel),
                    "covered": torch.zeros(numel, dtype=torch.bool),
                    "step": set(),
                },
            )
            assert st["exp_avg"].numel() == stop - start, (
                f"state[{i}] has {st['exp_avg'].numel()} elements, its label '{name}' "
                f"[{start}, {stop}) says {stop - start}"
            )
            entry["exp_avg"][start:stop] = st["exp_avg"]
            entry["exp_avg_sq"][start:stop] = st["exp_avg_sq"]
            entry["covered"][start:stop] = True
            entry["step"].add(float(st["step"]))
    return full


def _check_state(full: dict, ref: nn.Module, ref_opt: torch.optim.Optimizer, what: str) -> None:
    for name, p in ref.named_parameters():
        want = ref_opt.state[p]
        got = full.get(name)
        assert got is not None, f"{what}: no optimizer state labelled '{name}'"
        assert bool(got["covered"].all()), f"{what}: '{name}' not fully covered"
        assert got["step"] == {float(want["step"])}, (
            f"{what}: '{name}' step {got['step']} vs {float(want['step'])}"
        )
        for key in ("exp_avg", "exp_avg_sq"):
            ref_state = want[key].reshape(-1)
            err = ((got[key] - ref_state).norm() / ref_state.norm()).item()
            assert err <= STATE_TOL, f"{what}: {key} of '{name}': relative error {err:.3e}"


def _state_dict_after_training(
    build_model: Callable[[], nn.Module],
    groups: Callable[[nn.Module], list[dict]],
    losses_of_step: Callable[[int, int], Callable[[nn.Module, int], torch.Tensor]],
    cfg: zerodp.ZeroConfig,
    what: str,
) -> int:
    """3 AdamW steps of zerodp and of the unsharded reference, then the full state reassembled
    from every rank's ``opt.state_dict()`` against the reference's; returns this rank's count
    of labelled pieces."""
    rank, world = rank_world()
    ref, model = build_model(), build_model()
    ref_opt = torch.optim.AdamW(groups(ref))
    model, opt = zerodp.initialize(model, torch.optim.AdamW(groups(model)), cfg)
    for step in range(3):
        losses = losses_of_step(step, world)
        (sum(losses(ref, r) for r in range(world)) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses(model, rank).backward()
        opt.step()
        opt.zero_grad()
    shards: list = [None] * world
    dist.all_gather_object(shards, opt.state_dict())
    shapes = {n: p.shape for n, p in ref.named_parameters()}
    _check_state(_full_state_from_shards(shards, shapes), ref, ref_opt, what)
    return len(shards[rank]["zerodp"]["pieces"])


def case_state_dict_group_order(stage: int) -> int:
    return _state_dict_after_training(
        lambda: build(MLP),
        _mlp_groups_out_of_order,
        lambda step, world: mse(batches(step, world, 3, [(7,), (5,)])),
        _cfg(stage),
        f"stage {stage}",
    )


def case_state_dict_group_order_hf(stage: int) -> int:
    cfg = zerodp.ZeroConfig(stage=stage, bucket_bytes=4096, stage3=_gpt2_blocks(stage))
    return _state_dict_after_training(
        lambda: build_hf("gpt2"),
        _hf_groups_out_of_order,
        lambda step, world: hf_loss(global_batches("gpt2", step, world)),
        cfg,
        f"gpt2 stage {stage}",
    )


@pytest.mark.parametrize("stage", STAGES)
def test_state_dict_labels_with_groups_out_of_layout_order(world, stage):
    """DeepSpeed ``test_zero_tensor_fragment`` (two groups): the full Adam state reassembled
    from every rank's ``opt.state_dict()`` equals the unsharded optimizer's, per name."""
    counts = world(2).run(case_state_dict_group_order, stage, timeout=TIMEOUT)
    assert all(n > 0 for n in counts), counts


@pytest.mark.parametrize("stage", STAGES)
def test_state_dict_labels_with_groups_out_of_layout_order_gpt2(world, stage):
    counts = world(2).run(case_state_dict_group_order_hf, stage, timeout=TIMEOUT)
    assert all(n > 0 for n in counts), counts


# -- 3. 0-dim (scalar) parameters ---------------------------------------------------------------


class Scaled(nn.Module):
    """A layer with a 0-dim gain: a stage-3 unit holding a scalar parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(7, 6)
        self.gain = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)) * self.gain


class Scalars(nn.Module):
    """0-dim parameters inside a unit (``Scaled.gain``) and in the root (``shift``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Scaled()
        self.head = nn.Linear(6, 5)
        self.shift = nn.Parameter(torch.tensor(-0.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)) + self.shift


OPTIMIZERS = {"sgd": sgd_momentum, "adamw": adamw_two_groups}


def case_scalar_parameter(stage: int, optim: str) -> list[float]:
    rank, world = rank_world()
    pair = make_pair(Scalars, OPTIMIZERS[optim], _cfg(stage, ("Scaled",)))
    shapes = {n: tuple(p.shape) for n, p in pair.ref.named_parameters()}
    assert shapes["shift"] == () and shapes["body.gain"] == (), shapes
    errs = []
    for step in range(4):
        data = batches(step, world, 3, [(7,), (5,)])
        (sum(mse(data)(pair.ref, r) for r in range(world)) / world).backward()
        pair.ref_opt.step()
        pair.ref_opt.zero_grad()
        mse(data)(pair.model, rank).backward()
        pair.opt.step()
        pair.opt.zero_grad()
        errs.append(assert_close(pair.model, pair.ref, what=f"stage {stage} step {step}"))
    moved = float(pair.ref.shift.detach()) != -0.25 and float(pair.ref.body.gain.detach()) != 1.5
    assert moved, "the scalars must actually train"
    return errs


@pytest.mark.parametrize("optim", sorted(OPTIMIZERS))
@pytest.mark.parametrize("stage", STAGES)
def test_scalar_parameter(world, stage, optim):
    """FSDP2 ``single_group`` with a 0-dim parameter: parity at every stage."""
    world(2).run(case_scalar_parameter, stage, optim, timeout=TIMEOUT)


# -- 4. gradient accumulation with a synchronised backward per micro-batch ----------------------

MICRO = 2


def case_synced_micro_batches(stage: int, model_name: str) -> float:
    """FSDP2 ``test_gradient_accumulation`` / DDP without ``no_sync``: every micro-batch's
    backward reduces; the step sees the sum over micro-batches of the rank-averaged gradients,
    exactly as unsharded training on the loss sum."""
    rank, world = rank_world()
    if model_name == "gpt2":
        pair = make_pair(lambda: build_hf("gpt2"), sgd_momentum, _cfg(stage, ("GPT2Block",)))
    else:
        pair = make_pair(MLP, sgd_momentum, _cfg(stage))
    worst = 0.0
    for step in range(3):
        for micro in range(MICRO):
            seed = 10 * step + micro
            if model_name == "gpt2":
                losses = hf_loss(global_batches("gpt2", seed, world))
            else:
                losses = mse(batches(seed, world, 3, [(7,), (5,)]))
            reference_step(pair, losses, world, step=False)
            losses(pair.model, rank).backward()
        pair.ref_opt.step()
        pair.ref_opt.zero_grad()
        pair.opt.step()
        pair.opt.zero_grad()
        worst = max(worst, assert_close(pair.model, pair.ref, what=f"step {step}"))
    return worst


@pytest.mark.parametrize("model_name", ["mlp", "gpt2"])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_synchronised_micro_batches(world, stage, model_name):
    world(2).run(case_synced_micro_batches, stage, model_name, timeout=TIMEOUT)


# -- 5. stage 3: one unit applied several times in one forward ----------------------------------


class Twice(nn.Module):
    """DeepSpeed ``SimpleModel`` / FSDP2 ``multi_forward``: ``layers[i // 2]`` is applied again
    at depth i, to the same input as ``layers[i]``; ``layers[0]`` runs twice on the model input
    (which needs no gradient) and once more on a hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
        self.head = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(self.layers[i // 2](x) + layer(x))
        return self.head(x)


def case_unit_applied_twice(stage: int) -> float:
    rank, world = rank_world()
    pair = make_pair(Twice, adamw_two_groups, _cfg(stage))
    worst = 0.0
    for step in range(3):
        losses = mse(batches(step, world, 3, [(6,), (5,)]))
        reference_step(pair, losses, world)
        losses(pair.model, rank).backward()
        pair.opt.step()
        pair.opt.zero_grad()
        worst = max(worst, assert_close(pair.model, pair.ref, what=f"step {step}"))
    return worst


@pytest.mark.parametrize("stage", STAGES)
def test_unit_applied_several_times(world, stage):
    """Stage 3 reduces a unit's gradients once every use's backward has run: after the last
    post-backward callback, or, when a call's inputs need no gradient (no callback for it),
    once every parameter's gradient is accumulated ([Note: stage-3 schedule]). The Hugging
    Face case is ALBERT (one layer applied at every depth) in test_hf_models.py."""
    world(2).run(case_unit_applied_twice, stage, timeout=TIMEOUT)


# -- 6. requires_grad switched between steps (progressive unfreezing) ---------------------------


class Three(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(7, 9)
        self.fc2 = nn.Linear(9, 6)
        self.fc3 = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


# Before each step: (module, requires_grad). fc1 starts frozen (no segment at initialize); it is
# adopted before step 1. fc3 is frozen then unfrozen (it keeps its segment), fc1 frozen again
# after its adoption and unfrozen once more.
FLIPS = {
    1: [("fc1", True)],
    2: [("fc3", False)],
    3: [("fc3", True)],
    4: [("fc1", False)],
    5: [("fc1", True)],
}


def _layer_groups(model: nn.Module, frozen_too: bool) -> list[dict]:
    groups = []
    for i, name in enumerate(("fc1", "fc2", "fc3")):
        params = [p for p in getattr(model, name).parameters() if frozen_too or p.requires_grad]
        groups.append({"params": params, "lr": 1e-2 * (i + 1), "weight_decay": 0.1})
    return groups


def _set(model: nn.Module, name: str, flag: bool) -> None:
    for p in getattr(model, name).parameters():
        p.requires_grad_(flag)


def case_progressive_unfreezing(stage: int, frozen_in_optimizer: bool) -> list[float]:
    """Returns the relative change of fc1.weight in the reference at each step (the scenario
    must really train the unfrozen layer, or really leave it alone)."""
    rank, world = rank_world()
    ref, model = build(Three), build(Three)
    for m in (ref, model):
        _set(m, "fc1", False)
    ref_opt = torch.optim.AdamW(_layer_groups(ref, frozen_in_optimizer))
    model, opt = zerodp.initialize(
        model, torch.optim.AdamW(_layer_groups(model, frozen_in_optimizer)), _cfg(stage)
    )
    moved = []
    for step in range(7):
        for name, flag in FLIPS.get(step, []):
            _set(ref, name, flag)
            _set(model, name, flag)
        data = batches(step, world, 3, [(7,), (5,)])
        before = ref.fc1.weight.detach().clone()
        reference_step(Pair(model, opt, ref, ref_opt), mse(data), world)
        mse(data)(model, rank).backward()
        opt.step()
        opt.zero_grad()
        assert_close(model, ref, tol=1e-5, what=f"stage {stage} step {step}")
        moved.append(((ref.fc1.weight.detach() - before).norm() / before.norm()).item())
    if stage == 3:  # the merged plans' extras reduce through the reducer unfreezing rebuilt
        schedule = opt.engine.params.schedule
        assert schedule._extras.grads is schedule.grads is opt.engine.params.grads
    return moved


@pytest.mark.parametrize("frozen_in_optimizer", [True, False])
@pytest.mark.parametrize("stage", STAGES)
def test_progressive_unfreezing(world, stage, frozen_in_optimizer):
    """DeepSpeed ``TestZeroUnbalancedGradients`` / progressive unfreezing: ``requires_grad``
    switched on and off between steps trains exactly as unsharded training, with the frozen
    layer in the optimizer from the start (stepped once unfrozen) or not (never stepped)."""
    out = world(2).run(case_progressive_unfreezing, stage, frozen_in_optimizer, timeout=TIMEOUT)
    for moved in out:
        trained = [m > 0 for m in moved]
        if frozen_in_optimizer:  # frozen at 0 and 4; trained at 1-3, 5, 6
            assert trained == [False, True, True, True, False, True, True], moved
        else:
            assert not any(trained), moved


def _gpt2_frozen_base() -> nn.Module:
    """Tiny GPT-2 with everything frozen but the last block and the final norm."""
    model = build_hf("gpt2")
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(("transformer.h.1.", "transformer.ln_f.")))
    return model


# Before each step: name prefixes unfrozen (wte is tied to the LM head).
GPT2_UNFREEZE = {1: ("transformer.h.0.",), 2: ("transformer.wte.", "transformer.wpe.")}


def case_progressive_unfreezing_gpt2(stage: int) -> float:
    from test_hf_models import OPTIMIZERS as HF_OPTIMIZERS
    from test_hf_models import max_error

    rank, world = rank_world()
    cfg = zerodp.ZeroConfig(stage=stage, bucket_bytes=4096, stage3=_gpt2_blocks(stage))
    pair = make_pair(_gpt2_frozen_base, HF_OPTIMIZERS["adamw"], cfg)
    worst = 0.0
    for step in range(4):
        for m in (pair.model, pair.ref):
            for name, p in m.named_parameters():
                if name.startswith(GPT2_UNFREEZE.get(step, ())):
                    p.requires_grad_(True)
        losses = hf_loss(global_batches("gpt2", step, world))
        reference_step(pair, losses, world)
        losses(pair.model, rank).backward()
        pair.opt.step()
        pair.opt.zero_grad()
        err = max_error(pair.model, pair.ref)
        assert err <= 1e-5, f"stage {stage} step {step}: {err:.3e}"
        worst = max(worst, err)
    return worst


@pytest.mark.parametrize("stage", STAGES)
def test_progressive_unfreezing_gpt2(world, stage):
    world(2).run(case_progressive_unfreezing_gpt2, stage, timeout=TIMEOUT)


def _bf16_exact(factory: type[nn.Module]) -> nn.Module:
    """Parameters rounded to bf16-representable values: then a master built from a bf16
    parameter (adopted after being frozen in bf16) equals one built from the fp32 value."""
    model = build(factory)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def case_adopted_equals_trainable_from_start(stage: int, precision: str) -> float:
    rank, world = rank_world()
    cfg = zerodp.ZeroConfig(
        stage=stage,
        precision=precision,
        bucket_bytes=96,
        stage3=zerodp.Stage3(unit_classes=("Linear",) if stage == 3 else ()),
    )
    runs = []
    for adopt in (True, False):
        model = _bf16_exact(Three)
        if adopt:
            _set(model, "fc1", False)
        opt = torch.optim.AdamW(_layer_groups(model, frozen_too=True))
        model, opt = zerodp.initialize(model, opt, cfg)
        for step in range(3):
            _set(model, "fc1", True)
            x, y = batches(step, world, 3, [(7,), (5,)])[rank]
            loss = F.mse_loss(model(x).float(), y)
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
        with full(model):
            runs.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return max((runs[0][n] - runs[1][n]).abs().max().item() for n in runs[1])


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage", STAGES)
def test_adopted_parameters_train_like_trainable_ones(world, stage, precision):
    """A layer frozen at initialize and unfrozen before the first step trains bit for bit as
    when it is trainable from the start, in every precision (the mixed-precision masters of an
    adopted parameter come from its compute-dtype value: equal here because the weights are
    bf16-representable)."""
    out = world(2).run(case_adopted_equals_trainable_from_start, stage, precision, timeout=TIMEOUT)
    # fp32 stages 1-3: 3.0e-8 max absolute difference measured (weights ~0.3): the adopted
    # layer is a segment of its own, so its pieces are stepped in other multi-tensor groups.
    # Mixed precision publishes bf16/fp16 parameters, equal bit for bit.
    bound = 1e-7 if precision == "fp32" else 0.0
    assert max(out) <= bound, out


def case_unfreeze_errors(stage: int, how: str) -> str:
    rank, world = rank_world()
    model = build(Three)
    _set(model, "fc1", False)
    model, _ = zerodp.initialize(
        model, torch.optim.AdamW(_layer_groups(model, frozen_too=True)), _cfg(stage)
    )
    x, y = batches(0, world, 3, [(7,), (5,)])[rank]
    if how == "different":  # rank 0 unfreezes the weight, rank 1 the bias
        (model.fc1.weight if rank == 0 else model.fc1.bias).requires_grad_(True)
    else:  # between two micro-batches of one step
        with model.no_sync():
            F.mse_loss(model(x), y).backward()
        _set(model, "fc1", True)
    try:
        F.mse_loss(model(x), y).backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def case_unfreeze_between_micro_batches_stage3() -> float:
    """Stage 3 keeps ``no_sync`` gradients in ``param.grad`` (reduced by the synchronised
    backward), so nothing accumulated is lost when the reducer is rebuilt: allowed, and exact."""
    rank, world = rank_world()
    ref, model = build(Three), build(Three)
    for m in (ref, model):
        _set(m, "fc1", False)
    ref_opt = torch.optim.AdamW(_layer_groups(ref, frozen_too=True))
    opt = torch.optim.AdamW(_layer_groups(model, frozen_too=True))
    model, opt = zerodp.initialize(model, opt, _cfg(3))
    pair = Pair(model, opt, ref, ref_opt)
    worst = 0.0
    for step in range(2):
        first, second = (mse(batches(10 * step + k, world, 3, [(7,), (5,)])) for k in (0, 1))
        reference_step(pair, first, world, step=False)
        with model.no_sync():
            first(model, rank).backward()
        if step == 0:
            _set(ref, "fc1", True)
            _set(model, "fc1", True)
        reference_step(pair, second, world)
        second(model, rank).backward()
        opt.step()
        opt.zero_grad()
        worst = max(worst, assert_close(model, ref, tol=1e-5, what=f"step {step}"))
    return worst


def test_unfreezing_errors(world):
    """Ranks that unfreeze different parameters, or unfreeze between micro-batches (stages
    0-2, whose reducer holds the accumulated gradients), get the same clear error on every rank
    (nothing was changed). Stage 3 adopts between micro-batches with parity."""
    world(2).run(case_unfreeze_between_micro_batches_stage3, timeout=TIMEOUT)
    for stage in STAGES:
        out = world(2).run(case_unfreeze_errors, stage, "different", timeout=TIMEOUT)
        head = "zerodp: cannot adopt unfrozen parameters:\n  "
        want = head + "rank 1 unfroze ['fc1.bias'] but rank 0 unfroze ['fc1.weight']"
        assert out == [want, want], (stage, out)
        if stage == 3:
            continue
        out = world(2).run(case_unfreeze_errors, stage, "micro", timeout=TIMEOUT)
        late = (
            "has gradients accumulated since the last zero_grad (a backward ran before this "
            "forward): unfreeze parameters after opt.step() / opt.zero_grad(), not between "
            "micro-batches"
        )
        want = head + f"rank 0 {late}\n  rank 1 {late}"
        assert out == [want, want], (stage, out)


def case_checkpoint_after_unfreezing(stage: int, load_stage: int, tmp: str) -> float:
    """Save after a layer was adopted, load into a fresh model in which it is trainable from
    the start (another stage), continue: the same as continuing the first run."""
    rank, world = rank_world()
    model = build(Three)
    _set(model, "fc1", False)
    opt = torch.optim.AdamW(_layer_groups(model, frozen_too=True))
    model, opt = zerodp.initialize(model, opt, _cfg(stage))

    def train(m: nn.Module, o: zerodp.ZeroOptimizer, steps: range) -> None:
        for step in steps:
            mse(batches(step, world, 3, [(7,), (5,)]))(m, rank).backward()
            o.step()
            o.zero_grad()

    train(model, opt, range(1))
    _set(model, "fc1", True)
    train(model, opt, range(1, 3))
    zerodp.save_checkpoint(tmp, model, opt)
    train(model, opt, range(3, 5))
    fresh = build(Three, seed=7)
    fresh_opt = torch.optim.AdamW(_layer_groups(fresh, frozen_too=True))
    fresh, fresh_opt = zerodp.initialize(fresh, fresh_opt, _cfg(load_stage))
    zerodp.load_checkpoint(tmp, fresh, fresh_opt)
    train(fresh, fresh_opt, range(3, 5))
    return max_rel_error(fresh, model)


@pytest.mark.parametrize(("stage", "load_stage"), [(0, 3), (2, 1), (3, 2)])
def test_checkpoint_after_unfreezing(world, tmp_path, stage, load_stage):
    out = world(2).run(
        case_checkpoint_after_unfreezing, stage, load_stage, str(tmp_path), timeout=TIMEOUT
    )
    assert max(out) <= 1e-6, out
