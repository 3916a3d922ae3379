"""Gradients accumulated across steps (no ``zero_grad`` between them), world size 2, gloo, fp32,
against unsharded training, which adds every backward to ``.grad`` until it is cleared.

Before [Note: accumulating across steps] (grads/reducer.py): stages 2-3 stepped before the
second step's reductions had landed (rel. error 6e-2 on an MLP), and a step whose backwards all
ran under ``no_sync`` stepped each rank's local gradients at stages 0-1 (1.3e-1): silently
wrong. Now stages 0, 2 and 3 match torch and stage 1 refuses with an error naming the fix.

Models: ``zerotest.MLP``, zerodp's GPT and the tiny Hugging Face GPT-2 (helpers of
``test_misuse.py``).
"""

from __future__ import annotations

import contextlib

import pytest
from test_misuse import STAGES, TIMEOUT, _cfg, _check, _factory, _losses, _optimizer
from zerotest import make_pair, rank_world, reference_step

# Each step's backwards: one synchronised; one under no_sync then one synchronised; one under
# no_sync only (``step`` reduces it).
PATTERNS = {"sync": (True,), "no_sync then sync": (False, True), "no_sync only": (False,)}

STAGE1_ERROR = (
    "zerodp stage 1 reduces a step's gradients exactly once, but a backward ran after "
    "opt.step() (or clip_grad_norm_) without optimizer.zero_grad(): stage 1 cannot accumulate "
    "gradients across steps; call optimizer.zero_grad() after each step (stages 0, 2 and 3 "
    "accumulate across steps as torch does)"
)


def case_accumulate(stage: int, model_name: str) -> dict[str, list[str]]:
    """Three steps of each pattern, ``zero_grad`` only before the first; per pattern, what each
    step did ("ok" or the error) after checking parity with the reference."""
    rank, world = rank_world()
    out: dict[str, list[str]] = {}
    for name, syncs in PATTERNS.items():
        pair = make_pair(_factory(model_name), _optimizer(model_name), _cfg(model_name, stage))
        pair.opt.zero_grad()
        done: list[str] = []
        for step in range(3):
            try:
                for micro, sync in enumerate(syncs):
                    losses = _losses(model_name, 10 * step + micro, world)
                    with contextlib.nullcontext() if sync else pair.model.no_sync():
                        losses(pair.model, rank).backward()
                    reference_step(pair, losses, world, step=False)
                pair.opt.step()
            except RuntimeError as exc:
                done.append(str(exc))
                break
            pair.ref_opt.step()  # no zero_grad: the next backward adds to these gradients
            _check(model_name, pair.model, pair.ref, f"{name}, step {step}")
            done.append("ok")
        out[name] = done
    return out


@pytest.mark.parametrize("model_name", ["mlp", "gpt", "gpt2"])
@pytest.mark.parametrize("stage", STAGES)
def test_accumulate_across_steps(world, stage, model_name):
    """Stages 0, 2, 3: every step matches torch within test_misuse's fp32 tolerance. Stage 1:
    the first step trains, the first backward after it raises the error."""
    expected = ["ok", STAGE1_ERROR] if stage == 1 else ["ok"] * 3
    for out in world(2).run(case_accumulate, stage, model_name, timeout=TIMEOUT):
        assert out == dict.fromkeys(PATTERNS, expected), out
