"""What a step does about misuse that torch accepts silently (issue 13: never silently wrong).

Each decision is taken by every rank alike from the flags of the step's one agreement
all-reduce ([Note: step agreement] in agreement.py); the messages name the step, the cause and
the fix:

- a non-finite gradient, or loss given to ``opt.backward`` (fp32, bf16):
  ``ZeroConfig.precision.nonfinite`` (fp16: the loss scaler skips);
- ``step()`` with no gradient produced since the last step on any rank:
  ``ZeroConfig.step_without_backward``;
- a step on gradients that no ``zero_grad`` cleared since the previous step: logged once
  ([Note: model.zero_grad] in module.py: the one form of clearing gradients behind zerodp's
  back that stages 2-3 cannot see).
"""

from __future__ import annotations

import logging
import math

import torch

from zerodp.optim.agreement import StepFlags

log = logging.getLogger("zerodp")


class LossCheck:
    """The losses given to ``opt.backward`` since the last ``zero_grad`` or step, summed into one
    persistent fp32 scalar (NaN and inf survive a sum; an in-place add allocates nothing and
    does not synchronise); read once, at the step."""

    def __init__(self) -> None:
        self._sum: torch.Tensor | None = None
        self._active = False

    def add(self, loss: torch.Tensor) -> None:
        if self._sum is None or self._sum.device != loss.device:
            self._sum = torch.zeros((), dtype=torch.float32, device=loss.device)
        if not self._active:
            self._sum.zero_()
        value = loss.detach()
        self._sum.add_(value.reshape(()) if value.numel() == 1 else value.sum())
        self._active = True

    def nonfinite(self) -> bool:
        return self._active and self._sum is not None and not math.isfinite(float(self._sum))

    def reset(self) -> None:
        self._active = False


def nonfinite_what(flags: StepFlags, loss_scaling: bool) -> str:
    if flags.nonfinite_loss and not loss_scaling:
        return "loss and gradients" if flags.nonfinite_grads else "loss"
    return "gradients"


def skipped(flags: StepFlags, scale: float | None, step: int, count: int) -> str:
    """Log that step ``step`` was skipped (the ``count``-th); returns the reason."""
    reason = f"non-finite {nonfinite_what(flags, scale is not None)}"
    log.warning(
        "zerodp: step %d skipped (%s on at least one rank)%s; %d skipped so far",
        step,
        reason,
        f", loss scale {scale:g}" if scale else "",
        count,
    )
    return reason


def nonfinite_error(step: int, what: str) -> RuntimeError:
    return RuntimeError(
        f"zerodp: step {step}: non-finite {what} on at least one rank; no parameter was updated "
        "(ZeroConfig.precision.nonfinite='raise'). The run diverged or a batch is bad: lower the "
        "learning rate or clip gradients (opt.clip_grad_norm_), check the data and the loss, or "
        "pass ZeroConfig(precision=Precision(..., nonfinite='skip')) to skip such steps on every "
        "rank"
    )


def without_backward(policy: str, step: int, count: int) -> None:
    """``step()`` number ``step`` found no gradient produced since the last step on any rank
    (the ``count``-th time): raise or warn as ``policy`` says."""
    if policy == "raise":
        raise RuntimeError(
            f"zerodp: step {step}: opt.step() with no backward since the last step on any rank "
            "(no gradient was produced): call loss.backward() (or opt.backward(loss)) before "
            "every opt.step(), and step once per backward; nothing was updated "
            "(ZeroConfig.step_without_backward='raise')"
        )
    if policy == "warn":
        log.warning(
            "zerodp: step %d: opt.step() with no backward since the last step on any rank (no "
            "gradient was produced: loss.backward() missing, or step() called twice?); it steps "
            "the gradients left since the last zero_grad, as torch does; %d such step(s) so far "
            "(ZeroConfig.step_without_backward='warn')",
            step,
            count,
        )


class Staleness:
    """Whether gradients from before the last step are left (a backward ran before it and no
    ``zero_grad`` since); a step that adds to them is logged once."""

    def __init__(self) -> None:
        self.stale = False
        self._warned = False

    def cleared(self) -> None:
        self.stale = False

    def stepped(self, backward: bool) -> None:
        self.stale = self.stale or backward

    def check(self, step: int) -> None:
        if not self.stale or self._warned:
            return
        self._warned = True
        log.warning(
            "zerodp: step %d steps gradients accumulated since before step %d: no "
            "opt.zero_grad() or model.zero_grad() ran in between. If you cleared them with "
            "`p.grad = None` or a submodule's zero_grad(): at stages 2-3 zerodp keeps gradients "
            "in its own buffers, so that cleared nothing; call opt.zero_grad(). If accumulating "
            "across steps is intended (torch allows it), ignore this (logged once)",
            step,
            step - 1,
        )
