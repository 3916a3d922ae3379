"""The step's cross-rank agreement: which parameters get an update, whether the step is skipped,
and whether some rank detected misuse, decided by every rank from the same all-reduced flags.

[Note: step agreement] One small all-reduce (MAX) of
``[used bit per parameter..., error, non-finite]``:

- a parameter gets an update iff it *has a gradient* in unsharded training on the same global
  batch: some rank produced one since the last ``zero_grad``, or some rank produced one before a
  ``zero_grad(set_to_none=False)`` with no ``zero_grad(set_to_none=True)`` since ([Note: kept
  gradients]). A parameter without a gradient gets no weight decay, momentum or step count;
- a step is skipped on every rank if any rank saw a non-finite gradient;
- the error flag (``requires_grad`` changed after ``initialize``) makes every rank raise together
  instead of leaving the others blocked in the next collective.

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

import torch
from torch import nn

from zerodp.comm import Communicator
from zerodp.partition.segment import Segment


def agree_on_step(
    comm: Communicator,
    used: list[list[bool]],  # per segment, per parameter: this rank produced a gradient
    segments: list[Segment],
    frozen: list[tuple[str, nn.Parameter]],
    nonfinite: bool,
) -> tuple[list[list[bool]], bool]:
    """(per segment, per parameter: some rank produced a gradient; some rank saw a non-finite
    gradient). Raises on every rank if any rank saw ``requires_grad`` change."""
    flags = [u for seg in used for u in seg]
    changed = requires_grad_changed(segments, frozen)
    t = torch.tensor([*flags, bool(changed), nonfinite], dtype=torch.uint8)
    t = t.to(segments[0].device if segments else "cpu")
    comm.all_reduce_control(t, op="max")
    bits = t.tolist()
    if bits[-2]:
        raise RuntimeError(
            "requires_grad of a parameter changed after zerodp.initialize "
            f"({changed or 'on another rank'}); freezing or unfreezing after initialize is "
            "not supported: set requires_grad before zerodp.initialize and re-initialize"
        )
    out, k = [], 0
    for seg in used:
        out.append([bool(b) for b in bits[k : k + len(seg)]])
        k += len(seg)
    return out, bool(bits[-1])


def requires_grad_changed(segments: list[Segment], frozen: list[tuple[str, nn.Parameter]]) -> str:
    """What changed on this rank since ``initialize`` ("" if nothing): a trainable parameter
    frozen, or a frozen one unfrozen."""
    for seg in segments:
        for name, p in zip(seg.names, seg.params, strict=True):
            if not p.requires_grad:
                return f"'{name}' was frozen"
    for name, p in frozen:
        if p.requires_grad:
            return f"'{name}' was unfrozen"
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

    def has_grad(self, used: list[list[bool]]) -> list[list[bool]]:
        """This rank's view of which parameters have a gradient now (before the agreement)."""
        return _either(self.kept, used)


def _either(a: list[list[bool]], b: list[list[bool]]) -> list[list[bool]]:
    return [[x or y for x, y in zip(xs, ys, strict=True)] for xs, ys in zip(a, b, strict=True)]
