"""The stage-3 schedule, run by module and autograd hooks.

The extras of merged plans live in extras.py, the holds on units that are not running
(prefetches, kept last units, borrowed attached units) in holding.py, and the deferred
reduce-scatters in reductions.py.

[Note: recompute]
A checkpointed module's backward first runs its forward again ([Note: activation checkpointing]
in activations/checkpointing.py), inside ``recompute_scope()``. Units called there (units inside
the checkpointed module; the checkpointed module's own hooks do not run again) are gathered if
they are not (usually they are not: released after their forward) and then *held*
(``recomputed``) until their post-backward, which comes right after: their pre-backward hook
finds them gathered, so a unit is gathered twice per step, checkpointed or not. The recompute
records no forward order, prefetches nothing and attaches no post-backward callback (the
recomputed graph is never run backward: its tensors only refill the saved ones). The gathered
memory then includes every unit inside the checkpointed module being recomputed.

[Note: stage-3 schedule]
Forward, per call of a unit's module:
  pre:   attach the post-backward trigger to the inputs that require grad; gather the unit (or
         wait for its prefetch); prefetch the next units of the recorded forward order.
  post:  hook the outputs that require grad (pre-backward trigger); release the unit unless it
         is still held. The root is kept gathered until the end of backward when a backward
         will follow (so parameters read in the root forward after its children ran, such as
         a tied LM head, and root parameters read in the loss, are available).
Reads: a parameter of an attached unit ([Note: units]) read while the root is held gathers that
unit on demand (``gather_on_read``), which is then held as long as the root.
Backward:
  pre-backward (a hook on the unit's forward outputs; fires before the unit's backward runs):
         gather the unit, prefetch the next units of the recorded backward order; a unit whose
         backward reads none of its parameters is neither ([Note: backward without parameters]
         in saved.py).
  post-backward (``PostBackward``, an identity autograd function on the unit's inputs; runs once
         the gradients w.r.t. the inputs exist, i.e. after the unit's backward, and after the
         ``AccumulateGrad`` of its parameters, which the engine runs first): after the last call
         of the unit, release it and queue its reduce-scatter, which the next hook that issues
         collectives (in practice the pre-backward hook of the unit before it, which fires right
         after) issues first, under one order check with its own gathers (``approve``: one
         rank-synchronising check per hook instead of two).
         A unit with a call on inputs that need no gradient (token ids; the model input given
         to the same unit twice) is "untracked": that call has no callback, so the last
         callback does not mean the last use, and the unit waits for "grad ready".
  grad ready (a parameter's post-accumulate-grad hook): an untracked unit, or an attached unit
         that was only read on demand (its module's forward did not run), is reduce-scattered
         and released once every one of its parameters has its gradient (each has one
         AccumulateGrad per backward, run after every use).
  end    (an autograd engine callback): reduce-scatter every unit not reduced yet (unused units,
         units whose inputs need no gradient), then the persistent segments, in a fixed order;
         release everything; the recorded orders become the next predictions.
Each trigger but "grad ready" depends only on the autograd graph, never on which parameters
happened to get a gradient, so ranks running the same graph issue the same collectives in the
same order; "grad ready" fires for the parameters the graph gives a gradient, which is the same
on every rank whose loss depends on what it read in the same way. The order checks
(``order.py``) turn ranks whose graphs differ into a clear error.

A unit returning a *view* that the caller then modifies in place loses its pre-backward hook
(as with FSDP2): return fresh tensors from unit modules.

[Note: inference]
A forward of the root that starts with the root released marks what kind of forward it is
(``Op.TRAIN`` or ``Op.INFER``: grad enabled or not), and the ranks agree on the mark in the next
order-check exchange (the first gather), so a rank still evaluating while another trains raises
on every rank instead of pairing an eval forward with a training forward. ``generate``
(``ZeroModule``, [Note: generate] in module.py) runs inside ``generating``: it marks
``Op.GENERATE`` and gathers and holds the root unit (``Unit.scoped``) until ``generate``
returns, because Hugging Face's ``generate`` calls submodules directly (an encoder-decoder's
``get_encoder()(...)``, not through the root's forward), and those read root parameters (a shared
embedding, a final norm); attached units read then are gathered on demand as in the root's
forward. Unit modules called that way gather themselves through their own hooks. While every unit
is pinned (``full_parameters``) the root is never released, so an inference forward issues no
collective: forwards and ``generate`` may then run on some ranks only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from zerodp.activations.scope import recomputing
from zerodp.params.extras import ScheduleExtras
from zerodp.params.holding import Holding
from zerodp.params.order import Op, OrderCheck
from zerodp.params.prefetch import PassOrder
from zerodp.params.reduce import ShardedGrads
from zerodp.params.reductions import Reductions
from zerodp.params.saved import QUIET_AGREEMENTS, agree, begin_forward, end_forward
from zerodp.params.tree import map_tensors, tensors_in
from zerodp.params.unit import Gatherer, Trace, Unit, UnitState


class PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward tells the schedule the unit's backward is done.
    Returns detached aliases rather than the inputs themselves: autograd forbids in-place ops on
    inputs returned as-is from a custom function, and units may modify their inputs in place."""

    @staticmethod
    def forward(ctx: Any, schedule: Schedule, unit: Unit, *inputs: torch.Tensor) -> Any:
        ctx.schedule, ctx.unit = schedule, unit
        return tuple(t.detach() for t in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.schedule.post_backward(ctx.unit)
        return (None, None, *grads)


class Schedule:
    """Gathers, prefetches, reduces and releases units at the right hooks; see
    [Note: stage-3 schedule]."""

    def __init__(
        self,
        units: list[Unit],
        gatherer: Gatherer,
        grads: ShardedGrads,
        check: OrderCheck,
        depth: int,
        persistent_seg_ids: list[int],
        trace: Trace,
        *,
        keep: int = 0,
        skip_gathers: bool = True,
    ) -> None:
        self.units = units
        # [Note: backward without parameters] in saved.py: measured and agreed until
        # QUIET_AGREEMENTS agreements in a row find no unit any rank could skip.
        self._measure = skip_gathers
        self._quiet = 0
        self.root = units[0]
        self.gatherer = gatherer
        self.grads = grads
        self.check = check
        # Units that own no parameter are never gathered: they are left out of the orders so
        # that they take no prefetch slot.
        self.fwd = PassOrder(depth)
        self.bwd = PassOrder(depth)
        self.persistent_seg_ids = persistent_seg_ids
        self.trace = trace
        self.holding = Holding(units, gatherer, keep)  # holds on units not running
        self.reductions = Reductions(lambda: self.grads, check, trace)
        self._backward_open = False
        self._handles: list[Any] = []
        # Collectives other ranks planned ([Note: merged plans]); the check holds it weakly.
        self._extras = ScheduleExtras(
            units,
            gatherer,
            lambda: self.grads,
            persistent_seg_ids,
            trace,
            lambda: self._backward_open,
        )
        check.extras = self._extras

    def register(self, param_units: list[tuple[nn.Parameter, str, Unit | None]]) -> None:
        for unit in self.units:
            m = unit.module
            pre = partial(self._pre_forward, unit)
            post = partial(self._post_forward, unit)
            self._handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            self._handles.append(m.register_forward_hook(post, always_call=True))
        self.register_params(param_units)

    def register_params(self, param_units: list[tuple[nn.Parameter, str, Unit | None]]) -> None:
        for p, name, owner in param_units:
            hook = partial(self._grad_ready, owner, name)
            self._handles.append(p.register_post_accumulate_grad_hook(hook))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- forward -------------------------------------------------------------------------------

    def _pre_forward(
        self, unit: Unit, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if recomputing():  # [Note: recompute]
            unit.read_in_backward = True  # [Note: backward without parameters] in saved.py
            self.holding.use(unit)
            unit.active += 1
            unit.recomputed = True
            self.trace("recompute", unit)
            return args, kwargs
        if unit is self.root and unit.active == 0:
            self.fwd.begin()
            self.holding.choose_carried(self.fwd, unit)
        if torch.is_grad_enabled():
            args, kwargs = self._attach_post_backward(unit, args, kwargs)
        if unit is self.root and unit.state is UnitState.RELEASED:
            self.check.mark(Op.TRAIN if torch.is_grad_enabled() else Op.INFER)
        self.holding.use(unit)
        measure = self._measure and not self._backward_open  # not a reentrant recompute
        if measure and unit.segments and not unit.active and torch.is_grad_enabled():
            begin_forward(unit)
        unit.active += 1
        unit.touched = True
        self.trace("forward", unit)
        if unit.segments:
            self.holding.prefetch([self.units[i] for i in self.fwd.visit(unit.index)])
        return args, kwargs

    def _attach_post_backward(
        self, unit: Unit, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        needs = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
        if not needs:
            unit.untracked = True
            return args, kwargs
        unit.pending_post_backward += 1
        outs = iter(PostBackward.apply(self, unit, *needs))
        return map_tensors((args, kwargs), lambda t: next(outs) if t.requires_grad else t)

    def _post_forward(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        unit.active -= 1
        if recomputing():  # held until its backward, which comes next ([Note: recompute])
            return
        if not unit.active:
            end_forward(unit)
        outs = [t for t in tensors_in(output) if t.requires_grad]
        if torch.is_grad_enabled():
            for t in outs:
                t.register_hook(partial(self._pre_backward, unit))
            unit.hooked = unit.hooked or bool(outs)
            # Kept whatever this rank measured: a decision every rank takes alike (the ranks
            # agree on the skips only when the backward starts).
            if outs:
                self.holding.carry(unit)
        if unit is self.root and unit.active == 0:
            # A forward that exchanged nothing (every unit it used was held) has nothing to
            # tell apart: its marker must not land on some later, unrelated exchange.
            self.check.mark(Op.NOTHING)
            unit.kept = unit.kept or bool(outs and torch.is_grad_enabled())
            self.fwd.end()
            self.holding.drop_prefetches([])
            if not unit.kept:  # no backward follows: attached units read on demand go too
                self.holding.return_borrowed()
        self.trace("forward_end", unit)
        self.holding.release_unless_held(unit)

    @contextmanager
    def generating(self) -> Iterator[None]:
        """Hold the root gathered while ``generate`` runs ([Note: inference])."""
        root = self.root
        if root.state is UnitState.RELEASED:
            self.check.mark(Op.GENERATE)
        self.holding.use(root)
        root.scoped += 1
        try:
            yield
        finally:
            root.scoped -= 1
            if not root.scoped:
                self.holding.drop_prefetches([])
                self.holding.return_borrowed()
                self.holding.release_unless_held(root)

    # -- backward ------------------------------------------------------------------------------

    def _pre_backward(self, unit: Unit, grad: torch.Tensor) -> None:
        self._open_backward()
        if unit.in_backward or unit.reduced:  # several outputs, or a unit called twice
            return
        unit.in_backward = True
        # [Note: backward without parameters] in saved.py: not gathered, not in the order.
        gather = unit.gathered_for_backward
        upcoming = self.bwd.visit(unit.index) if unit.segments and gather else []
        wanted = [u for u in (self.units[i] for i in upcoming) if u.gathered_for_backward]
        reductions = self.reductions
        plan = reductions.deferred_plan() + (Gatherer.start_plan(unit) if gather else [])
        plan += [op for u in wanted for op in Gatherer.start_plan(u)]
        reductions.flush(reductions.approve(plan))
        if unit.segments and gather:
            self.holding.let_go_of_carried(unit, wanted)
        if gather:
            self.holding.use(unit)
        self.trace("backward" if gather else "backward_skip", unit)
        if unit.segments and gather:
            self.holding.prefetch(wanted)

    def post_backward(self, unit: Unit) -> None:
        self._open_backward()
        unit.pending_post_backward -= 1
        if unit.pending_post_backward > 0:  # an earlier call of the unit is still to come
            return
        # A unit also called on inputs that need no gradient may have a call whose backward is
        # still to come: it is reduced when its gradients are complete ("grad ready").
        if self.grads.sync_enabled and not unit.reduced and not unit.untracked:
            self.reductions.defer(unit)  # issued by the next hook that issues collectives
        unit.in_backward = False
        unit.carried = False
        unit.recomputed = False
        self.trace("backward_end", unit)
        self.holding.release_unless_held(unit)

    def _grad_ready(self, unit: Unit | None, name: str, param: torch.Tensor) -> None:
        self._open_backward()
        if unit is None or not self.grads.sync_enabled:
            return
        if unit.reduced:
            self.check.error = (
                f"the gradient of '{name}' arrived after its unit '{unit.label}' was "
                "reduce-scattered: the parameter is used outside its unit's forward; make it "
                "part of an enclosing unit (ZeroConfig.stage3.unit_classes / unit_policy)"
            )
            return
        unit.ready_grads += 1
        if unit.ready_grads < unit.num_params:
            return
        hooked = unit.hooked or unit.pending_post_backward
        if unit.untracked or (unit.borrowed and not hooked):
            # No post-backward callback covers every use of the unit: an attached unit only
            # read on demand (a head applied as F.linear(x, head.weight) in the root's
            # forward), or a call on inputs that need no gradient (token ids; a unit applied
            # to the same input twice). Each parameter has one AccumulateGrad per backward,
            # run after every use, so the gradients are complete now: reduce and release.
            reductions = self.reductions
            own = reductions.plan(unit)
            agreed = reductions.approve(reductions.deferred_plan() + own)
            reductions.flush(agreed)
            if all(op in agreed for op in own):
                reductions.reduce(unit)
            else:  # another rank cannot take part yet: a later hook issues it
                reductions.defer(unit)
            unit.borrowed = False
            unit.in_backward = False
            unit.carried = False
            unit.recomputed = False
            self.holding.release_unless_held(unit)

    def _open_backward(self) -> None:
        if self._backward_open:
            return
        self.check.backwards += 1
        if self._measure:  # before the backward is open: a failed agreement leaves none open
            self._quiet = 0 if agree(self.units, self.check) else self._quiet + 1
            self._measure = self._quiet < QUIET_AGREEMENTS
        self._backward_open = True
        self.grads.open_backward()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        gathered = [i for i in self.fwd.last[::-1] if self.units[i].gathered_for_backward]
        self.bwd.begin(guess=gathered)

    def _end_backward(self) -> None:
        if self.grads.sync_enabled:
            self.reductions.reduce_the_rest(self.units, self.persistent_seg_ids)
            self.grads.end_round()
        self._backward_open = False
        self.bwd.end()
        self.reset()

    # -- holding and releasing -----------------------------------------------------------------

    def gather_on_read(self, unit: Unit) -> bool:
        """A parameter of released ``unit`` is being read. An attached unit (a large leaf of the
        root, [Note: units]) read while the root is held (its forward, or kept until the end of
        backward) is gathered now, on every rank alike since every rank runs the same root
        forward and loss, and held as long as the root is. Returns whether it was gathered."""
        if unit.in_backward and not unit.gathered_for_backward:  # [Note: backward without ...]
            unit.read_in_backward = True
            self.bwd.visit(unit.index)  # in the order the next backward predicts
            self.holding.use(unit)  # held: in its backward
            self.trace("read", unit)
            return True
        if not unit.spec.attached:
            return False
        parent = self.units[unit.spec.parent] if unit.spec.parent is not None else None
        if parent is None or not (parent.active or parent.kept or parent.scoped):
            return False
        unit.borrowed = True
        unit.touched = True
        self.holding.use(unit)
        self.trace("read", unit)
        return True

    def reset(self) -> None:
        """Forget per-step holds (end of backward, or the step / a checkpoint load with stale
        gathered copies) and release every unit nobody holds."""
        self.holding.forget()
        self.reductions.clear()
        for unit in self.units:
            unit.reduced = False
            unit.in_backward = False
            unit.pending_post_backward = 0
            unit.kept = False
            unit.carried = False
            unit.recomputed = False
            unit.borrowed = False
            unit.hooked = False
            unit.ready_grads = 0
            unit.untracked = False
            unit.prefetched = False
            unit.refs, unit.backward_reads = None, None
            unit.touched = False
            self.holding.release_unless_held(unit)
