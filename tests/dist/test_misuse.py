"""Misuse that must never be silently wrong (issue 13), world size 2, gloo, against unsharded
training or against the correct use, with exact messages and counts:

1. a non-finite loss or gradient in fp32 / bf16 (``ZeroConfig.precision.nonfinite``, default
   "raise");
2. ``opt.step()`` with no backward since the last step (``ZeroConfig.step_without_backward``,
   default "warn");
3. ``model.zero_grad()`` (and ``p.grad = None`` loops) instead of ``opt.zero_grad()``;
4. ``opt.add_param_group`` after ``initialize`` (a parameter frozen at ``initialize``, or one
   registered in the model afterwards).

Models: ``zerotest.MLP`` (or a variant), zerodp's GPT, and the tiny Hugging Face GPT-2.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hf_models import build as build_hf
from hf_models import global_batches, hf_loss
from torch import nn
from zerotest import (
    MLP,
    NONFINITE_RAISE,
    Branchy,
    Pair,
    adamw_two_groups,
    batches,
    build,
    full,
    make_pair,
    max_rel_error,
    mse,
    rank_world,
    reference_step,
)

import zerodp
from zerodp import Precision, Stage3
from zerodp.apps.models.gpt import GPT, get_config

STAGES = [0, 1, 2, 3]
TIMEOUT = 240.0
# fp32 parity with the unsharded reference: MLP as in test_stages.py (max relative error);
# transformers as in test_hf_models.py (AdamW, relative to max(norm, 0.01 * sqrt(numel))).
TOL = {"mlp": 1e-6, "gpt": 1e-5, "gpt2": 1e-5}
GPT_CONFIG = get_config("tiny", vocab_size=64, seq_len=16, n_layer=2, n_head=2, n_embd=32)
# Branchy: one root unit (its `sometimes` layer is unused in some steps, inside a unit that runs).
UNITS = {"mlp": ("Linear",), "branchy": ("Branchy",), "gpt": ("Block",), "gpt2": ("GPT2Block",)}


def _cfg(
    model_name: str, stage: int, precision: str = "fp32", nonfinite: str = "raise", **kw: Any
) -> zerodp.ZeroConfig:
    # Small buckets cut parameters across buckets; stage 3: a unit per layer.
    units = Stage3(unit_classes=UNITS[model_name] if stage == 3 else ())
    bucket = 96 if model_name in ("mlp", "branchy") else 4096
    return zerodp.ZeroConfig(
        stage=stage,
        bucket_bytes=bucket,
        precision=Precision(compute=precision, nonfinite=nonfinite),
        stage3=units,
        **kw,
    )


def _factory(model_name: str) -> Callable[[], nn.Module]:
    if model_name == "gpt":
        return lambda: GPT(GPT_CONFIG)
    if model_name == "gpt2":
        return lambda: build_hf("gpt2")
    return Branchy if model_name == "branchy" else MLP


def _optimizer(model_name: str) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    if model_name in ("mlp", "branchy"):
        return adamw_two_groups
    from test_hf_models import OPTIMIZERS

    return OPTIMIZERS["adamw"]


def _losses(model_name: str, seed: int, world: int) -> Callable[[nn.Module, int], torch.Tensor]:
    """Rank r's loss of step ``seed`` (one global batch split by rank)."""
    if model_name == "gpt2":
        return hf_loss(global_batches("gpt2", seed, world))
    if model_name == "gpt":
        g = torch.Generator().manual_seed(500 + seed)
        tokens = torch.randint(0, GPT_CONFIG.vocab_size, (2 * world, 9), generator=g)

        def loss(m: nn.Module, r: int) -> torch.Tensor:
            x = tokens[2 * r : 2 * r + 2]
            return m(x[:, :-1], x[:, 1:])[1]

        return loss
    if model_name == "branchy":  # `sometimes` gets a gradient at seed 0 only
        data = batches(seed, world, 3, [(4,), (4,)])
        return lambda m, r: F.mse_loss(m(data[r][0], use_branch=seed == 0), data[r][1])
    return mse(batches(seed, world, 3, [(7,), (5,)]))


def _error(model_name: str, model: nn.Module, ref: nn.Module) -> float:
    if model_name == "mlp":
        return max_rel_error(model, ref)
    from test_hf_models import max_error

    return max_error(model, ref)


def _check(model_name: str, model: nn.Module, ref: nn.Module, what: str) -> float:
    err = _error(model_name, model, ref)
    assert err <= TOL[model_name], f"{what}: error {err:.3e} > {TOL[model_name]:.0e}"
    return err


@contextlib.contextmanager
def zerodp_log() -> Iterator[list[str]]:
    """The messages logged by zerodp (logger ``zerodp``) inside the block."""
    messages: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Handler(logging.WARNING)
    logger = logging.getLogger("zerodp")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    with full(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    after = _snapshot(model)
    return all(torch.equal(after[n], t) for n, t in before.items())


# -- 1. non-finite loss or gradients ------------------------------------------------------------

BAD = 2  # the step at which rank 1's loss is infinite
SKIP_MSG = "zerodp: step {step} skipped ({reason} on at least one rank); {n} skipped so far"


def case_nonfinite_skip(stage: int, model_name: str) -> dict:
    """``nonfinite='skip'``: rank 1's loss is inf at step BAD; the reference skips that step
    (no update, no Adam step count), parity after every step. ``via``: ``loss.backward()`` (the
    engine sees only the gradients) or ``opt.backward(loss)`` (it sees the loss too)."""
    rank, world = rank_world()
    out = {}
    for via in ("loss", "opt"):
        cfg = _cfg(model_name, stage, nonfinite="skip")
        pair = make_pair(_factory(model_name), _optimizer(model_name), cfg)
        seen = []
        with zerodp_log() as logs:
            for step in range(4):
                losses = _losses(model_name, step, world)
                if step != BAD:
                    reference_step(pair, losses, world)
                loss = losses(pair.model, rank)
                if step == BAD and rank == 1:
                    loss = loss * float("inf")
                if via == "opt":
                    pair.opt.backward(loss)
                else:
                    loss.backward()
                pair.opt.step()
                pair.opt.zero_grad()
                info = pair.opt.last_step
                assert info is not None
                seen.append((info.step, info.skipped, info.reason))
                _check(model_name, pair.model, pair.ref, f"{via} stage {stage} step {step}")
        out[via] = {"steps": seen, "skipped": pair.opt.skipped_steps, "logs": logs}
    return out


@pytest.mark.parametrize("model_name", ["mlp", "gpt2"])
@pytest.mark.parametrize("stage", STAGES)
def test_nonfinite_skip(world, stage, model_name):
    """fp32 used to step NaN into every replica (skipped=False); 'skip' skips the step on every
    rank, as a reference that never took it."""
    for out in world(2).run(case_nonfinite_skip, stage, model_name, timeout=TIMEOUT):
        for via, reason in (
            ("loss", "non-finite gradients"),
            ("opt", "non-finite loss and gradients"),
        ):
            want = [(1, False, None), (2, False, None), (3, True, reason), (4, False, None)]
            assert out[via]["steps"] == want, (via, out[via])
            assert out[via]["skipped"] == 1, (via, out[via])
            assert out[via]["logs"] == [SKIP_MSG.format(step=3, reason=reason, n=1)], out[via]


def case_single_element(stage: int) -> list:
    """One gradient element made inf on one rank (before the reduction), for the first and the
    last element of every parameter, alternating ranks: each rank checks only the reduced
    gradient it owns, so together the owned slices must cover every element."""
    rank, world = rank_world()
    model, opt = _init(_cfg("mlp", stage, nonfinite="skip"))
    before = _snapshot(model)
    seen = []
    for k, (name, p) in enumerate(model.named_parameters()):
        for index in (0, p.numel() - 1):

            def poison(g: torch.Tensor, index: int = index) -> torch.Tensor:
                g = g.clone()
                g.view(-1)[index] = float("inf")
                return g

            handle = p.register_hook(poison) if rank == k % world else None
            mse(batches(k, world, 3, [(7,), (5,)]))(model, rank).backward()
            opt.step()
            opt.zero_grad()
            if handle is not None:
                handle.remove()
            info = opt.last_step
            assert info is not None
            seen.append((name, index, info.skipped))
    assert _unchanged(model, before), "a parameter changed in a skipped step"
    return seen


def test_nonfinite_single_element(world):
    for stage in STAGES:
        for seen in world(2).run(case_single_element, stage, timeout=TIMEOUT):
            assert len(seen) == 8 and all(skipped for *_, skipped in seen), (stage, seen)


def case_nonfinite_raise(stage: int, model_name: str) -> dict:
    """The default ('raise'): rank 1's loss is NaN at step 1. Every rank raises, again at a
    second ``step()``, nothing is updated; after ``zero_grad`` training goes on like a reference
    that skipped the batch."""
    rank, world = rank_world()
    pair = make_pair(_factory(model_name), _optimizer(model_name), _cfg(model_name, stage))
    errors = []
    for step in range(3):
        losses = _losses(model_name, step, world)
        loss = losses(pair.model, rank)
        if step == 1 and rank == 1:
            loss = loss * float("nan")
        if step != 1:
            reference_step(pair, losses, world)
        before = _snapshot(pair.model)
        loss.backward()
        for _ in range(2 if step == 1 else 1):
            try:
                pair.opt.step()
            except RuntimeError as exc:
                errors.append(str(exc))
                assert _unchanged(pair.model, before), "a parameter changed in a raising step"
        pair.opt.zero_grad()
        _check(model_name, pair.model, pair.ref, f"stage {stage} step {step}")
    info = pair.opt.last_step
    assert info is not None
    return {"errors": errors, "steps": info.step, "skipped": pair.opt.skipped_steps}


@pytest.mark.parametrize("model_name", ["mlp", "gpt2"])
@pytest.mark.parametrize("stage", STAGES)
def test_nonfinite_raises_by_default(world, stage, model_name):
    assert zerodp.ZeroConfig().precision.nonfinite == "raise"
    want = NONFINITE_RAISE.format(step=2, what="gradients")
    for out in world(2).run(case_nonfinite_raise, stage, model_name, timeout=TIMEOUT):
        # The raising call is not a step: the next step is step 2 again.
        assert out == {"errors": [want, want], "steps": 2, "skipped": 0}, out


def case_nonfinite_bf16_and_ignore(stage: int) -> dict:
    """bf16 under each policy (the loss given to opt.backward is inf on rank 0), and fp32
    'ignore' (today's torch behaviour: NaN reaches the weights)."""
    rank, world = rank_world()
    out: dict = {}
    for precision, policy in (
        ("bf16", "raise"),
        ("bf16", "skip"),
        ("bf16", "ignore"),
        ("fp32", "ignore"),
    ):
        cfg = _cfg("mlp", stage, precision=precision, nonfinite=policy)
        model, opt = _init(cfg)
        x, y = batches(0, world, 3, [(7,), (5,)])[rank]
        loss = F.mse_loss(model(x).float(), y) * (float("inf") if rank == 0 else 1.0)
        before = _snapshot(model)
        opt.backward(loss)
        try:
            opt.step()
            info = opt.last_step
            assert info is not None
            result = (info.skipped, info.reason, opt.skipped_steps, _unchanged(model, before))
        except RuntimeError as exc:
            result = (str(exc), _unchanged(model, before))
        with full(model):
            finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        out[f"{precision} {policy}"] = (*result, finite)
    return out


def _init(cfg: zerodp.ZeroConfig) -> tuple[nn.Module, zerodp.ZeroOptimizer]:
    model = build(MLP)
    return zerodp.initialize(model, adamw_two_groups(list(model.parameters())), cfg)


@pytest.mark.parametrize("stage", STAGES)
def test_nonfinite_bf16_and_ignore(world, stage):
    for out in world(2).run(case_nonfinite_bf16_and_ignore, stage, timeout=TIMEOUT):
        assert out == {
            "bf16 raise": (NONFINITE_RAISE.format(step=1, what="loss and gradients"), True, True),
            "bf16 skip": (True, "non-finite loss and gradients", 1, True, True),
            "bf16 ignore": (False, None, 0, False, False),
            "fp32 ignore": (False, None, 0, False, False),
        }, out


# -- 2. opt.step() with no backward since the last step -----------------------------------------

NO_BACKWARD_WARN = (
    "zerodp: step {step}: opt.step() with no backward since the last step on any rank (no "
    "gradient was produced: loss.backward() missing, or step() called twice?); it steps the "
    "gradients left since the last zero_grad, as torch does; {n} such step(s) so far "
    "(ZeroConfig.step_without_backward='warn')"
)
NO_BACKWARD_RAISE = (
    "zerodp: step {step}: opt.step() with no backward since the last step on any rank (no "
    "gradient was produced): call loss.backward() (or opt.backward(loss)) before every "
    "opt.step(), and step once per backward; nothing was updated "
    "(ZeroConfig.step_without_backward='raise')"
)


def _try_step(opt: zerodp.ZeroOptimizer) -> str:
    try:
        opt.step()
    except RuntimeError as exc:
        return str(exc)
    return "ok"


def case_step_without_backward(stage: int, model_name: str, root: str) -> dict:
    """Per policy: a step after zero_grad with a forward but no backward (torch updates
    nothing), a second step() on the same gradients (torch applies them again; 'raise'
    refuses), and (stages 0-2) a step at which rank 1 runs no forward or backward at all while
    rank 0 does: not a step without backward. Parity with torch after every step. Then the
    count as a checkpoint saved in ``root`` restores it."""
    rank, world = rank_world()
    out = {}
    for policy in ("warn", "raise", "ignore"):
        cfg = _cfg(model_name, stage, step_without_backward=policy)
        pair = make_pair(_factory(model_name), _optimizer(model_name), cfg)
        model, opt, ref, ref_opt = pair.model, pair.opt, pair.ref, pair.ref_opt
        calls, flags = [], []
        with zerodp_log() as logs:
            losses = _losses(model_name, 0, world)
            reference_step(pair, losses, world)
            losses(model, rank).backward()
            calls.append(_try_step(opt))
            opt.zero_grad()
            flags.append(opt.last_step.without_backward)
            # Forgotten backward: torch's step sees no gradient and updates nothing.
            losses = _losses(model_name, 1, world)
            losses(model, rank)
            ref_opt.step()
            calls.append(_try_step(opt))
            flags.append(opt.last_step.without_backward)
            _check(model_name, model, ref, f"{policy} forgotten backward")
            opt.zero_grad()  # a loop's next iteration (stage 1 refuses a second reduction)
            # step() twice on the same gradients.
            losses = _losses(model_name, 2, world)
            reference_step(pair, losses, world, step=False)
            ref_opt.step()
            losses(model, rank).backward()
            calls.append(_try_step(opt))
            if policy != "raise":
                ref_opt.step()
            calls.append(_try_step(opt))
            flags.append(opt.last_step.without_backward)
            ref_opt.zero_grad()
            opt.zero_grad()
            _check(model_name, model, ref, f"{policy} step twice")
            if stage != 3:  # stage 3: every rank runs every unit's collectives
                losses = _losses(model_name, 3, world)
                (losses(ref, 0) / world).backward()  # rank 1's batch is empty
                ref_opt.step()
                ref_opt.zero_grad()
                if rank == 0:
                    losses(model, rank).backward()
                calls.append(_try_step(opt))
                opt.zero_grad()
                flags.append(opt.last_step.without_backward)
                _check(model_name, model, ref, f"{policy} rank 1 without a batch")
        zerodp.save_checkpoint(f"{root}/{policy}", model, opt)
        resumed = make_pair(_factory(model_name), _optimizer(model_name), cfg)
        zerodp.load_checkpoint(f"{root}/{policy}", resumed.model, resumed.opt)
        out[policy] = {
            "calls": calls,
            "flags": flags,
            "count": opt.steps_without_backward,
            "logs": logs,
            "resumed count": resumed.opt.steps_without_backward,
        }
    return out


@pytest.mark.parametrize("model_name", ["mlp", "gpt2"])
@pytest.mark.parametrize("stage", STAGES)
def test_step_without_backward(world, stage, model_name, tmp_path):
    assert zerodp.ZeroConfig().step_without_backward == "warn"
    ok = ["ok"] * (4 if stage == 3 else 5)
    last = [] if stage == 3 else [False]
    root = str(tmp_path)
    for out in world(2).run(case_step_without_backward, stage, model_name, root, timeout=TIMEOUT):
        warn = [NO_BACKWARD_WARN.format(step=2, n=1), NO_BACKWARD_WARN.format(step=4, n=2)]
        assert out["warn"] == {
            "calls": ok,
            "flags": [False, True, True, *last],
            "count": 2,
            "logs": warn,
            "resumed count": 2,
        }, out["warn"]
        # 'raise': the refused calls are no steps (step 2 is then the one after the backward).
        raising = [NO_BACKWARD_RAISE.format(step=2), NO_BACKWARD_RAISE.format(step=3)]
        assert out["raise"] == {
            "calls": ["ok", raising[0], "ok", raising[1], *(["ok"] if stage != 3 else [])],
            "flags": [False, False, False, *last],
            "count": 2,
            "logs": [],
            "resumed count": 2,
        }, out["raise"]
        assert out["ignore"] == {
            "calls": ok,
            "flags": [False, True, True, *last],
            "count": 2,
            "logs": [],
            "resumed count": 2,
        }, out["ignore"]


# -- 3. model.zero_grad() instead of opt.zero_grad() --------------------------------------------

ACCUMULATION_MSG = (
    "zerodp: step 2 steps gradients accumulated since before step 1: no opt.zero_grad() or "
    "model.zero_grad() ran in between. If you cleared them with `p.grad = None` or a "
    "submodule's zero_grad(): at stages 2-3 zerodp keeps gradients in its own buffers, so that "
    "cleared nothing; call opt.zero_grad(). If accumulating across steps is intended (torch "
    "allows it), ignore this (logged once)"
)
# How gradients are cleared at the start of each step (mid: between the first forward and its
# backward); *_false: set_to_none=False.
CLEARS = ["opt", "opt_false", "model", "model_false", "model_mid", "loop", "loop_mid"]
SAME_AS = {"model": "opt", "model_false": "opt_false", "model_mid": "opt", "loop": "opt"}
SAME_AS["loop_mid"] = "opt"


def _clear(how: str, model: nn.Module, opt: zerodp.ZeroOptimizer) -> None:
    if how == "opt":
        opt.zero_grad()
    elif how == "opt_false":
        opt.zero_grad(set_to_none=False)
    elif how in ("model", "model_mid"):
        model.zero_grad()
    elif how == "model_false":
        model.zero_grad(set_to_none=False)
    else:
        for p in model.parameters():
            p.grad = None


def case_model_zero_grad(stage: int, model_name: str, precision: str) -> dict:
    """3 steps of each way of clearing gradients, without and with gradient accumulation (2
    micro-batches, the first in no_sync), from the same start: the parameters of each run."""
    rank, world = rank_world()
    runs, logs_of = {}, {}
    for how in CLEARS:
        for accumulate in (False, True):
            model = build(_factory(model_name))
            opt = _optimizer(model_name)(list(model.parameters()))
            cfg = _cfg(model_name, stage, precision=precision)
            model, opt = zerodp.initialize(model, opt, cfg)
            with zerodp_log() as logs:
                for step in range(3):
                    for micro in range(2 if accumulate else 1):
                        losses = _losses(model_name, 10 * step + micro, world)
                        if micro == 0 and not how.endswith("_mid"):
                            _clear(how, model, opt)
                        sync = accumulate and micro == 0
                        with model.no_sync() if sync else contextlib.nullcontext():
                            loss = losses(model, rank)
                            if micro == 0 and how.endswith("_mid"):
                                _clear(how, model, opt)
                            opt.backward(loss)
                    opt.step()
            runs[(how, accumulate)] = _snapshot(model)
            logs_of[(how, accumulate)] = logs
    out = {}
    for (how, accumulate), params in runs.items():
        base = runs[(SAME_AS.get(how, how), accumulate)]
        out[f"{how} {accumulate}"] = (
            all(torch.equal(params[n], base[n]) for n in base),
            logs_of[(how, accumulate)],
        )
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("model_name", ["branchy", "gpt", "gpt2"])
@pytest.mark.parametrize("stage", STAGES)
def test_model_zero_grad(world, stage, model_name, precision):
    """``model.zero_grad()`` (set_to_none True or False, before the forward or between it and
    the backward) trains bit for bit as ``opt.zero_grad()`` at every stage; so does a
    ``p.grad = None`` loop at stages 0-1 (they see it); at stages 2-3 such a loop clears
    nothing and the accumulation across steps is logged once. Before: stage 1 raised a
    misleading error, stages 2-3 accumulated across steps, stage 0 stepped a parameter unused
    since the first step (Branchy's `sometimes`) with its stale gradient."""
    for out in world(2).run(case_model_zero_grad, stage, model_name, precision, timeout=TIMEOUT):
        for key, (same, logs) in out.items():
            how = key.split()[0]
            if how.startswith("loop") and stage >= 2:
                assert not same and logs == [ACCUMULATION_MSG], (key, same, logs)
            else:
                assert same and logs == [], (key, same, logs)


# -- 4. opt.add_param_group after initialize ----------------------------------------------------


class Growing(nn.Module):
    """``MLP`` whose output goes through ``extra`` (a residual layer) once it exists."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.fc2 = nn.Linear(13, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc2(torch.tanh(self.fc1(x)))
        extra = self._modules.get("extra")
        return y if extra is None else y + extra(y)


def _grow(model_name: str, model: nn.Module, seed: int) -> nn.Module:
    """Register a new layer in ``model`` (initialised from ``seed``); returns it."""
    torch.manual_seed(seed)
    if model_name == "mlp":
        model.extra = nn.Linear(5, 5)
        return model.extra
    mlp = model.transformer.h[1].mlp
    mlp.adapter = nn.Linear(16, 16)
    mlp.register_forward_hook(lambda m, args, out: out + m.adapter(out))
    return mlp.adapter


def _first_layer(model_name: str, model: nn.Module) -> nn.Module:
    return model.fc1 if model_name == "mlp" else model.transformer.h[0].attn


def case_add_param_group(stage: int, model_name: str) -> dict:
    """Step 1: a layer frozen at initialize (and in no group) is unfrozen and given its own
    group (fine-tuning's classic pattern). Step 2: a layer created after initialize (with
    another seed on each rank: rank 0's must win) gets a group of its own options; an LR
    scheduler made after it schedules every group. Parity with torch after every step."""
    rank, world = rank_world()
    factory = Growing if model_name == "mlp" else _factory(model_name)
    ref, model = build(factory), build(factory)
    for m in (ref, model):
        _first_layer(model_name, m).requires_grad_(False)
    make = _optimizer(model_name)
    ref_opt = make([p for p in ref.parameters() if p.requires_grad])
    opt = make([p for p in model.parameters() if p.requires_grad])
    model, opt = zerodp.initialize(model, opt, _cfg(model_name, stage))
    schedulers = []
    for step in range(5):
        if step == 1:
            for m, o in ((ref, ref_opt), (model, opt)):
                layer = _first_layer(model_name, m)
                layer.requires_grad_(True)
                o.add_param_group({"params": layer.parameters(), "lr": 3e-3, "weight_decay": 0})
        if step == 2:
            for m, o, seed in ((ref, ref_opt, 100), (model, opt, 100 + rank)):
                layer = _grow(model_name, m, seed)
                o.add_param_group({"params": layer.parameters(), "lr": 2e-2, "betas": (0.8, 0.9)})
                sched = torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.7**s)
                schedulers.append(sched)
        losses = _losses(model_name, step, world)
        reference_step(Pair(model, opt, ref, ref_opt), losses, world)
        losses(model, rank).backward()
        opt.step()
        opt.zero_grad()
        for sched in schedulers:
            sched.step()
        _check(model_name, model, ref, f"stage {stage} step {step}")
    added = opt.param_groups[-1]
    return {
        "groups": len(opt.param_groups),
        "options": (added["betas"], added["weight_decay"], added["initial_lr"]),
        "lrs": [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups],
    }


@pytest.mark.parametrize("model_name", ["mlp", "gpt2"])
@pytest.mark.parametrize("stage", STAGES)
def test_add_param_group(world, stage, model_name):
    """Used to diverge silently (the new group's full parameters were stepped by each rank's
    local gradient, or dropped at the next rebind)."""
    groups = 3 if model_name == "mlp" else 2  # adamw_two_groups has an empty third group
    for out in world(2).run(case_add_param_group, stage, model_name, timeout=TIMEOUT):
        # AdamW's default weight decay (0.01) fills what the group left out.
        assert out == {"groups": groups + 2, "options": ((0.8, 0.9), 0.01, 2e-2), "lrs": True}, out


REFUSED = "zerodp: opt.add_param_group refused, nothing was changed:\n  "
HINT = (
    "\n(every rank must add the same model parameters, with no gradient pending if one is new; "
    "or pass every group to the optimizer before zerodp.initialize)"
)


def case_add_param_group_errors(stage: int) -> list[str]:
    rank, world = rank_world()
    model, opt = _init(_cfg("mlp", stage))
    model.extra = nn.Linear(5, 5)
    model.other = nn.Linear(5, 5)
    x, y = batches(0, world, 3, [(7,), (5,)])[rank]
    attempts: list[Callable[[], None]] = [
        lambda: opt.add_param_group({"params": [nn.Parameter(torch.zeros(3, 4))]}),
        lambda: opt.add_param_group({"params": [model.fc1.weight]}),
        lambda: opt.add_param_group({"params": (model.extra if rank == 0 else model.other).weight}),
        lambda: opt.add_param_group({"params": model.extra.parameters(), "lr": 0.1 * (rank + 1)}),
    ]
    errors = []
    for attempt in attempts:
        try:
            attempt()
        except ValueError as exc:
            errors.append(str(exc))
    F.mse_loss(model(x), y).backward()
    try:  # a gradient is pending: rebuilding the reducer would lose it
        opt.add_param_group({"params": model.extra.parameters()})
    except ValueError as exc:
        errors.append(str(exc))
    groups = len(opt.param_groups)
    opt.step()
    opt.zero_grad()
    opt.add_param_group({"params": model.extra.parameters()})  # now fine
    errors.append(f"{groups} -> {len(opt.param_groups)}")
    return errors


def test_add_param_group_errors(world):
    for stage in STAGES:
        out = world(2).run(case_add_param_group_errors, stage, timeout=TIMEOUT)
        assert out[0] == out[1], out
        alien = (
            "a tensor of shape (3, 4) is not a parameter of the model given to "
            "zerodp.initialize: register it in the model on every rank first (e.g. as a "
            "submodule's parameter), so that zerodp can broadcast and shard it"
        )
        twice = (
            "parameter 'fc1.weight' is already in param group 0 (some parameters appear in "
            "more than one parameter group)"
        )
        pending = (
            "gradients are pending since the last zero_grad: add a group with new trainable "
            "parameters after opt.step() and opt.zero_grad(), not between micro-batches"
        )
        assert out[0] == [
            REFUSED + f"rank 0: {alien}\n  rank 1: {alien}" + HINT,
            REFUSED + f"rank 0: {twice}\n  rank 1: {twice}" + HINT,
            REFUSED + "rank 1 adds ['other.weight'] but rank 0 adds ['extra.weight']" + HINT,
            REFUSED
            + "rank 1 adds the group with options [('lr', '0.2')], rank 0 [('lr', '0.1')]"
            + HINT,
            REFUSED + f"rank 0: {pending}\n  rank 1: {pending}" + HINT,
            "3 -> 4",
        ], (stage, out[0])
