"""The step's cross-rank agreement: which parameters get an update, whether the step is skipped,
and whether some rank detected misuse, decided by every rank from the same all-reduced flags.

[Note: step agreement] One small all-reduce (MAX) of
``[used bit per parameter..., error, non-finite]``:

- a parameter gets an update iff some rank produced a gradient for it, exactly as in unsharded
  training (a parameter without a gradient gets no weight decay, momentum or step count);
- a step is skipped on every rank if any rank saw a non-finite gradient;
- the error flag (``requires_grad`` changed after ``initialize``) makes every rank raise together
  instead of leaving the others blocked in the next collective.
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
