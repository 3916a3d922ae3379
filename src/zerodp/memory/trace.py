"""Activations and the backward's working set of any model, from one measured step: what
``zerodp estimate --model ... --model-step ...`` counts where no formula knows the model.

``trace_step(model, step)`` runs ``loss = step(model)`` and ``loss.backward()`` once (on the
model's device, at the batch ``step`` builds) and measures, with the allocator's own accounting
(``AllocationTrace``: every tensor allocation and free in the window):

- ``saved_bytes``: what the forward left for the backward (``SavedForBackward``, unique
  storages, the parameters left out): attention scores or SDPA's statistics, MLP, norms,
  dropout masks, logits and loss, whatever the model's code keeps;
- ``working_bytes``: how far the step's live bytes rose above that during the backward (the
  gradients of activations, the loss's gradients of the logits, the fresh weight gradient that
  zerodp adds into its buffer at once: each ``.grad`` is dropped as soon as autograd wrote it,
  as zerodp's hooks do, so the model's own gradients are not counted here but as model states).

Their sum is the peak of activations over the step, the same quantities ``gpt_saved_bytes`` and
``gpt_working_bytes`` give for the shipped GPT ([Note: backward working set] in
activations.py). The parameters and their ``.grad`` are left as they were.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from zerodp.memory.alloc_trace import AllocationTrace
from zerodp.memory.estimator import resolve_factory
from zerodp.memory.saved import SavedForBackward


@dataclass(frozen=True, slots=True)
class StepTrace:
    saved_bytes: int
    working_bytes: int

    @property
    def peak_bytes(self) -> int:
        return self.saved_bytes + self.working_bytes


def trace_step(model: nn.Module, step: Callable[[nn.Module], torch.Tensor]) -> StepTrace:
    """One forward (``step(model)``, which returns the loss) and backward of ``model``,
    measured (see the module docstring)."""
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.grad for p in params]
    hooks = [p.register_post_accumulate_grad_hook(_drop_grad) for p in params]
    devices = sorted({p.device.type for p in params} or {"cpu"})
    try:
        for p in params:
            p.grad = None
        saved = SavedForBackward(model.parameters())
        with AllocationTrace(devices) as trace:
            with saved:
                loss = step(model)
            kept = saved.alive_bytes()
            saved.release()
            loss.backward()
            del loss
    finally:
        for hook in hooks:
            hook.remove()
        for p, grad in zip(params, before, strict=True):
            p.grad = grad
    return StepTrace(kept, max(0, trace.peak_live - kept))


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None


def trace_spec(model: str, step: str) -> StepTrace:
    """``trace_step`` of the model ``"module:factory"`` builds (for real, on the default
    device) and the step ``"module:function"`` names (it takes the model, returns the loss)."""
    built = resolve_factory(model)()
    if not isinstance(built, nn.Module):
        raise TypeError(f"the factory returned {type(built).__name__}, not a torch.nn.Module")
    run = cast(Callable[[nn.Module], object], resolve_factory(step))

    def loss_of(m: nn.Module) -> torch.Tensor:
        loss = run(m)
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"{step} returned {type(loss).__name__}, not the loss tensor")
        return loss

    return trace_step(built, loss_of)
