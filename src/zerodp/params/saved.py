"""Whether a unit's backward reads its parameters, so that the backward all-gather of a unit whose
backward does not is skipped.

[Note: backward without parameters]
A unit's backward needs its gathered parameters only where its forward left something that
refers to them: autograd's saved tensors (``linear`` saves ``weight.t()``, ``layer_norm`` the
weight itself) or anything else kept (a view cached on the module). An embedding lookup saves
only the indices, ``x + bias`` saves nothing: such a unit's gradients are computed without its
parameters, so its pre-backward hook does not gather it (``Schedule._pre_backward``); the
gradients still arrive through ``AccumulateGrad`` and the unit is reduce-scattered after its
backward as any other. Traffic: 3Ψ - Ψ_kept - Ψ_skipped per step.

It is measured on every training forward of the unit, from reference counts rather than from
saved-tensor hooks: hooks that another layer pushed inside the unit's forward (a checkpoint,
``save_on_cpu``, zerodp's offload) would hide the saved tensors from ours, and a parameter
saved as itself (a leaf, by ``layer_norm`` or ``mul``) is no new reference to its storage. So
at the start of the unit's outermost forward call and at its end, per segment, the use count of
the full buffer's storage (views saved or kept hold it) and of each parameter's tensor (a saved
leaf holds it; so does a view's record of its base). ``AccumulateGrad``, which the graph holds
for each parameter used with a gradient, holds the parameter too: it is fetched (or made) at
the start and held until the end, so the forward adds none and any rise means the backward may
read the parameter. A parameter referenced by more than itself and its accumulator at the start
(a graph of an earlier forward that saved it and is still alive) is counted as read, as is every
parameter of a unit that runs inside a recompute or under saved-tensor hooks (its recompute
will read it), and of a unit that checkpoints its own forward (zerodp's checkpoint wrapper,
Hugging Face's gradient checkpointing of a layer). A unit whose parameters a backward
nevertheless reads through the parameter (a checkpoint inside the unit's module recomputes it)
is gathered on demand there (``Schedule.gather_on_read``), blocking, and counted as read in
every later step.

Where the graph depends on the data (a parameter multiplied in on some batches only), ranks
measure differently, and a unit gathered on one rank and skipped on another would leave their
collectives unmatched. So the ranks agree at the start of each backward (``agree``: a barrier
of the order check, then one all-reduce of two integers per unit): a unit is skipped only where
no rank reads it. Once ``QUIET_AGREEMENTS`` agreements in a row find no unit any rank could skip
(most models: every unit saves a weight), later backwards gather every unit without agreeing.
Nothing is measured while a backward runs (a reentrant checkpoint's recompute): those units
keep what was agreed. A unit read through its parameters in a backward on some ranks only (the
gather on demand above, where the data decides) is a collective of those ranks alone: the order
check merges it, or raises the divergence error on every rank once steps are replayed.

Not seen: a reference no count shows, i.e. a saved-tensor hook pushed *inside* the unit's
forward that keeps the parameter's Python object. If its unpack reads the parameter through a
torch function (``save_on_cpu`` on CPU tensors: ``.to()``), that read gathers the unit on
demand as above. If nothing does (hooks that hand the object back untouched, a custom autograd
function that keeps ``ctx.weight = weight`` and reads it through a raw pointer, a Triton
kernel), the backward reads the released placeholder (NaN), and the step's non-finite check
raises (or skips) as for any NaN gradient; nothing tells such a read from a diverged run, so
the message cannot name it. ``Stage3.skip_backward_gathers=False`` gathers every unit for its
backward, as before.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from zerodp.activations.scope import is_checkpointed
from zerodp.params.order import Op, OrderCheck
from zerodp.params.segment import ShardedSegment
from zerodp.params.unit import Holds, Unit


def _storage_uses(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _counts(segments: list[ShardedSegment]) -> tuple[int, ...]:
    out: list[int] = []
    for seg in segments:
        out.append(_storage_uses(seg.param_buffer))
        out.extend(p._use_count() for p in seg.params)  # type: ignore[attr-defined]
    return tuple(out)


def _top_hooks_probe() -> Any:
    """``_top_saved_tensors_default_hooks`` as a call without arguments: some releases' binding
    takes ``ignore_is_tracing``, others nothing. None where it is missing."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return None
    try:
        top(False)
    except TypeError:
        return top
    return lambda: top(False)


_TOP_HOOKS = _top_hooks_probe()


def hooks_active() -> bool:
    """Saved-tensor hooks (a checkpoint, an offload) are in effect: what is saved now may be
    recomputed from the parameters in the backward."""
    assert _TOP_HOOKS is not None
    return _TOP_HOOKS() is not None


QUIET_AGREEMENTS = 2
"""Agreements in a row that find no unit any rank could skip, after which no backward measures
or agrees again (a first backward under saved-tensor hooks, or a second one over a retained
graph, finds none either)."""

# Private torch entry points the counts need; without them every backward gathers, as before.
_AVAILABLE = all(
    (
        hasattr(torch._C, "_storage_Use_Count"),
        hasattr(torch.Tensor, "_use_count"),
        _TOP_HOOKS is not None,
    )
)


def _recomputed(module: nn.Module) -> bool:
    """The module checkpoints its own forward, inside its hooks: zerodp's wrapper, or Hugging
    Face's gradient checkpointing of a layer (``GradientCheckpointingLayer`` checkpoints
    ``forward`` when ``gradient_checkpointing`` is set and the module trains)."""
    own = getattr(module, "gradient_checkpointing", False) is True and module.training
    return own or is_checkpointed(module)


def begin_forward(unit: Unit) -> None:
    """The outermost training forward call of gathered ``unit`` starts. Bypasses the
    parameters' read guard: no value is read."""
    if not _AVAILABLE or unit.read_in_backward or hooks_active() or _recomputed(unit.module):
        unit.backward_reads, unit.refs = True, None
        return
    params = [p for seg in unit.segments for p in seg.params]
    with torch._C.DisableTorchFunctionSubclass():
        accumulators = [get_gradient_edge(p).node for p in params if p.requires_grad]
        # Anything beyond the parameter itself and its accumulator: a graph still alive.
        if any(p._use_count() > 1 + p.requires_grad for p in params):  # type: ignore[attr-defined]
            unit.backward_reads, unit.refs = True, None
            return
        unit.refs = Holds(_counts(unit.segments), accumulators)


def end_forward(unit: Unit) -> None:
    """The call ``begin_forward`` saw start ended: whether the backward reads the parameters."""
    holds = unit.refs
    if holds is None:
        return
    with torch._C.DisableTorchFunctionSubclass():
        end = _counts(unit.segments)
    unit.refs = None
    reads = any(e > s for e, s in zip(end, holds.counts, strict=True))
    unit.backward_reads = bool(unit.backward_reads) or reads


def agree(units: list[Unit], check: OrderCheck) -> bool:
    """At the start of a backward: every rank keeps ``backward_reads`` False only for the units
    no rank reads (see the note); a unit that did not run on a rank since the last backward
    (another rank's expert) does not hold the others back. Returns whether any rank measured a
    unit it could skip."""
    measured = [int(u.backward_reads is False) for u in units]
    world = check.comm.world_size
    if world == 1:  # nothing to agree with; measuring stops as on many ranks
        return any(measured)
    check(Op.SKIPS)
    votes = [int(m or not u.touched) for m, u in zip(measured, units, strict=True)]
    both = torch.tensor(votes + measured, dtype=torch.int32, device=check.device)
    check.comm.all_reduce_control(both)
    agreed = both.tolist()
    for unit, vote in zip(units, agreed[: len(units)], strict=True):
        if vote < world and unit.backward_reads is False:
            unit.backward_reads = True
    return any(agreed[len(units) :])
