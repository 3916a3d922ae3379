"""The step's cross-rank agreement: which parameters get an update, whether the step is skipped,
and whether some rank detected misuse, decided by every rank from the same all-reduced flags.

[Note: step agreement] One small all-reduce (MAX) of
``[used bit per parameter..., requires_grad per parameter..., its complement..., error,
non-finite gradients, non-finite loss, backward]``:

- a parameter gets an update iff it *has a gradient* in unsharded training on the same global
  batch: some rank produced one since the last ``zero_grad``, or some rank produced one before a
  ``zero_grad(set_to_none=False)`` with no ``zero_grad(set_to_none=True)`` since ([Note: kept
  gradients]). A parameter without a gradient gets no weight decay, momentum or step count;
- a step is skipped on every rank if any rank saw a non-finite gradient (fp16; fp32 and bf16:
  or a non-finite loss given to ``opt.backward``), or every rank raises, as
  ``ZeroConfig.precision.nonfinite`` says. Each rank checks the *reduced* gradient it owns
  (stages 1-3: its shard; stage 0: its 1/N of every bucket): a non-finite element of any rank's
  local gradient makes the reduced element non-finite (NaN and inf survive a sum), and the
  reduced gradient is what the optimizer steps, so together the ranks check every element once;
- ``backward`` is 1 if some rank produced a gradient since the last step: a step with 0 is a
  step without backward (``ZeroConfig.step_without_backward``). A rank whose parameters got no
  gradient (all unused there) does not make it 0 while another rank's did;
- a parameter whose ``requires_grad`` and its complement both come out 1 is frozen on some ranks
  only (its gradient would be averaged with nothing): every rank raises;
- the error flag (a parameter unfrozen after its forward, so its gradient was never reduced)
  makes every rank raise together instead of leaving the others blocked in the next collective.

[Note: kept gradients] In torch, ``zero_grad(set_to_none=False)`` leaves a zero ``.grad`` on
every parameter that had one, and it stays until a ``zero_grad(set_to_none=True)``: the optimizer
then steps such a parameter in a later step in which nothing uses it (Adam's moments decay, weight
decay applies, the step count advances). zerodp's gradients live in persistent buffers, so
"has a ``.grad``" is tracked here instead: ``KeptGrads`` remembers, per parameter, whether this
rank had produced a gradient at a ``zero_grad(set_to_none=False)``, and the step's used bits are
``used or kept``. The MAX all-reduce then gives ``kept`` on every rank as soon as some rank kept
it, i.e. exactly the parameters whose ``.grad`` unsharded training keeps, with no extra
collective. Their reduced gradient is zero (nothing contributed), as torch's kept ``.grad`` is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zerodp.comm import Communicator
from zerodp.partition.segment import Segment


@dataclass(frozen=True, slots=True)
class StepFlags:
    """Per-step bits that the agreement makes global (each: on at least one rank)."""

    nonfinite_grads: bool = False
    nonfinite_loss: bool = False
    backward: bool = True  # a gradient was produced since the last step


def agree_on_step(
    comm: Communicator,
    used: list[list[bool]],  # per segment, per parameter: this rank produced a gradient
    segments: list[Segment],
    frozen: list[tuple[str, nn.Parameter]],
    mine: StepFlags,
    tp: Communicator | None = None,
) -> tuple[list[list[bool]], StepFlags]:
    """(per segment, per parameter: some rank produced a gradient; each flag: on some rank).
    Raises on every rank if any rank has an unreduced gradient of a frozen parameter. ``tp``:
    the tensor-parallel group of a split model, whose ranks must skip (a non-finite gradient on
    one TP rank's slice) or raise together too."""
    flags = [u for seg in used for u in seg]
    # requires_grad and its complement: both 1 after the MAX = frozen on some ranks only.
    trainable = [p.requires_grad for seg in segments for p in seg.params]
    changed = unreduced_unfrozen(frozen)
    tail = [bool(changed), mine.nonfinite_grads, mine.nonfinite_loss, mine.backward]
    t = torch.tensor([*flags, *trainable, *(not b for b in trainable), *tail], dtype=torch.uint8)
    t = t.to(segments[0].device if segments else "cpu")
    comm.all_reduce_control(t, op="max")
    if tp is not None:
        tp.all_reduce_control(t, op="max")
    bits = t.tolist()
    n = len(flags)
    split = next((i for i in range(n) if bits[n + i] and bits[2 * n + i]), None)
    if split is not None:
        name = [name for seg in segments for name in seg.names][split]
        raise RuntimeError(
            f"requires_grad of '{name}' differs between ranks (frozen on some, trainable "
            "on others): freeze and unfreeze parameters identically on every rank"
        )
    if bits[-4]:
        raise RuntimeError(
            "a parameter frozen at zerodp.initialize got a gradient that was not reduced "
            f"({changed or 'on another rank'}): unfreeze parameters before the forward of a "
            "step (zerodp adopts them there), not between a forward and its backward"
        )
    out, k = [], 0
    for seg in used:
        out.append([bool(b) for b in bits[k : k + len(seg)]])
        k += len(seg)
    return out, StepFlags(bool(bits[-3]), bool(bits[-2]), bool(bits[-1]))


def unreduced_unfrozen(frozen: list[tuple[str, nn.Parameter]]) -> str:
    """A parameter frozen at ``initialize`` that got a gradient without the engine adopting it
    ("" if none): unfrozen after the last forward that ran with grad enabled ([Note:
    unfreezing] in optim/adoption.py). Freezing a trainable parameter needs nothing: it simply
    gets no gradient, as a parameter unused in a step."""
    for name, p in frozen:
        if p.requires_grad and p.grad is not None:
            return f"'{name}'"
    return ""


class KeptGrads:
    """Which parameters keep a (zero) gradient across ``zero_grad`` ([Note: kept gradients])."""

    kept: list[list[bool]]  # per segment, per parameter: had a gradient at a set_to_none=False

    def __init__(self, segments: list[Segment]) -> None:
        self.kept = [[False] * len(s.params) for s in segments]

    def zero_grad(self, used: list[list[bool]], set_to_none: bool) -> None:
        """Called before the gradients are cleared; ``used``: this rank produced a gradient
        since the last ``zero_grad``."""
        if set_to_none:
            self.kept = [[False] * len(seg) for seg in self.kept]
        else:
            self.kept = _either(self.kept, used)

    def add(self, segments: list[Segment]) -> None:
        self.kept += [[False] * len(s.params) for s in segments]

    def forget(self, cleared: list[list[bool]]) -> None:
        """User code replaced these parameters' ``.grad`` ([Note: replaced gradients])."""
        self.kept = [
            [k and not c for k, c in zip(ks, cs, strict=True)]
            for ks, cs in zip(self.kept, cleared, strict=True)
        ]

    def has_grad(self, used: list[list[bool]]) -> list[list[bool]]:
        """This rank's view of which parameters have a gradient now (before the agreement)."""
        return _either(self.kept, used)


def _either(a: list[list[bool]], b: list[list[bool]]) -> list[list[bool]]:
    return [[x or y for x, y in zip(xs, ys, strict=True)] for xs, ys in zip(a, b, strict=True)]
