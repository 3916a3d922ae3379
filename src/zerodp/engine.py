"""The one place where components are wired together.

``ZeroEngine`` chooses, once, from the resolved ``Plan``: a ``ParamSync`` (``params/sync.py``:
replicated at stages 0-2, sharded units at stage 3), the ``GradSync`` it provides
(``grads/sync.py``), a ``StepRunner`` (``optim/runner.py``: fp32 whole, mixed precision chunked)
and a ``LossPolicy`` (``optim/loss_policy.py``: fp16 scaled, fp32/bf16 checked). Then it runs
the step over their protocols (``docs/architecture.md``):

1. backward: the gradient sync's hooks launch bucketed reductions as gradients become ready;
2. ``step``: wait for them, agree across ranks on which parameters got a gradient and whether
   all are finite (one small all-reduce), step the user's optimizer on the owned pieces, publish
   the updated parameters.

Over the ~400-line budget (479): adopting parameters unfrozen after ``initialize`` ([Note:
unfreezing]) or added by ``opt.add_param_group`` ([Note: param groups added after initialize])
rebuilds the components construction builds, so it lives beside it; splitting adoption into its
own module (with a narrow view of the components) is the next step of the restructure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from zerodp.comm import BETWEEN_STEPS, CommLedger, CommStats, Communicator
from zerodp.config import ZeroConfig
from zerodp.grads.sync import GradSync
from zerodp.optim import misuse
from zerodp.optim.agreement import (
    KeptGrads,
    StepFlags,
    added_group_problem,
    agree_on_step,
    check_added_group,
    check_unfrozen,
)
from zerodp.optim.compute_dtype import batchnorm_param_ids, cast_floats, cast_to_compute_dtype
from zerodp.optim.loss_policy import LossPolicy, make_loss_policy
from zerodp.optim.loss_scaler import StepInfo
from zerodp.optim.masters import Masters
from zerodp.optim.pieces import (
    OptimPiece,
    check_optimizer,
    group_of_params,
    make_pieces,
    rebind_optimizer,
    replace_pieces,
)
from zerodp.optim.runner import StepRunner, make_runner
from zerodp.params.manager import ShardedParams, Stage3Options
from zerodp.params.order import Op
from zerodp.params.sync import broadcast_segments, make_param_sync
from zerodp.partition.build import build_segments
from zerodp.partition.segment import Segment
from zerodp.plan import Plan, resolve
from zerodp.validation import agree, check_devices, fingerprint

log = logging.getLogger("zerodp")


class ZeroEngine:
    """Sharded data-parallel training state of one rank."""

    config: ZeroConfig
    plan: Plan
    comm: Communicator
    segments: list[Segment]
    frozen: list[tuple[str, nn.Parameter]]
    params: ShardedParams | None  # stage 3: units and their lifecycle (zerodp.params)
    reducer: GradSync
    pieces: list[OptimPiece]
    optimizer: torch.optim.Optimizer  # the user's, rebound to pieces
    masters: Masters
    runner: StepRunner  # how the optimizer step runs (fp32 whole, mixed chunked)
    loss: LossPolicy  # loss scaling (fp16) or checking (fp32, bf16)
    steps: int  # optimizer steps attempted (skipped ones included)
    skipped_steps: int
    steps_without_backward: int  # step() calls with no gradient produced since the last step
    last_step: StepInfo | None

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: ZeroConfig,
        process_group: Any = None,
        stage3: Stage3Options | None = None,
    ) -> None:
        self.config = config
        self.plan = resolve(config)
        self.comm = Communicator(process_group, CommLedger(), config.watchdog_s)
        self.model = model
        named = _unique_named_parameters(model)
        trainable = [(n, p) for n, p in named if p.requires_grad]
        self.frozen = [(n, p) for n, p in named if not p.requires_grad]
        error = check_devices(named, self.comm, allow_meta=self.plan.shard_params)
        error = error or check_optimizer(optimizer, (p for _, p in named))
        agree(self.comm, fingerprint(model, optimizer, config), error)

        self._fp32_ids = batchnorm_param_ids(model) if self.plan.mixed else set()
        self._groups = group_of_params(optimizer)  # by parameter id: frozen ones too
        optimized = set(self._groups)
        fp32 = self._fp32_ids
        self.param_sync = make_param_sync(
            model, trainable, optimized, self.plan, config, self.comm, fp32, stage3
        )
        self.params = self.param_sync.sharded
        self.segments = self.param_sync.segments
        plan = self.plan
        self.masters = Masters(
            self.segments, separate=plan.mixed, sharded=plan.shard_optimizer, rank=self.comm.rank
        )
        self._hooks: list[Any] = []
        if plan.mixed:
            self._cast_to_compute_dtype()
        self._reduce_dtype = plan.reduce_dtype  # also fp32 parameters with bf16 reduction
        self.reducer = self._grad_sync()
        self.pieces = self._build_pieces()
        rebind_optimizer(optimizer, self.pieces, self.segments)
        self.runner = self._runner()
        self.param_gather = self.param_sync.gather
        self.param_sync.install(model)
        self.optimizer = optimizer
        self.loss = make_loss_policy(plan, config.precision)
        self.scaler = self.loss.scaler  # fp16 only (the checkpoint and opt.loss_scale read it)
        self._hooks.append(model.register_forward_pre_hook(self._before_forward, with_kwargs=True))
        self._hooks.append(model.register_forward_hook(self._after_forward))
        # Before the schedule's root hook and the parameter-gather waits: [Note: unfreezing].
        self._hooks.append(model.register_forward_pre_hook(self._adopt_unfrozen, prepend=True))
        self._hooks += self.param_sync.guard(model)
        # First of all: stage 3 gathers (a collective) in its own root hook.
        self._hooks.append(model.register_forward_pre_hook(self._enter_forward, prepend=True))
        self.steps = 0
        self.skipped_steps = 0
        self.steps_without_backward = 0
        self.last_step = None
        self._grads_final = False  # finish_gradients ran since the last step / zero_grad
        self._skip = False  # the current step's gradients are not finite somewhere
        self._flags = StepFlags()  # the agreed flags of the current step
        self._seen_at_step = 0  # reducer.grads_seen at the end of the last step
        self._staleness = misuse.Staleness()
        self._used: list[list[bool]] = []  # per segment, per parameter: some rank has a grad
        self.kept_grads = KeptGrads(self.segments)
        self._grad_norm: float | None = None
        self._scaled_backward = False
        # Last: the one in-place write to the user's tensors ([Note: initialize is all or
        # nothing] in snapshot.py); nothing after it can fail.
        self._broadcast_frozen_and_buffers()
        self.init_comm = self.comm.ledger.end_step()
        self.comm.ledger.steps.clear()
        self.comm.progress.enter(BETWEEN_STEPS)

    # -- construction --------------------------------------------------------------------------

    def _broadcast_frozen_and_buffers(self) -> None:
        """Rank 0's frozen parameters (after the compute-dtype cast: the same values) and
        buffers."""
        if self.comm.world_size == 1:
            return
        with torch.no_grad():
            for _, p in self.frozen:
                self.comm.broadcast(p.data)
            for b in self.model.buffers():
                self.comm.broadcast(b)

    def _cast_to_compute_dtype(self) -> None:
        dtype = self.plan.compute_dtype
        self._hooks += cast_to_compute_dtype(
            self.model, self.segments, self.frozen, self._fp32_ids, dtype
        )

    def _grad_sync(self) -> GradSync:
        return self.param_sync.grad_sync(self.masters, self._reduce_dtype, self._on_grads_replaced)

    def _on_grads_replaced(self, replaced: list[list[bool]]) -> None:
        """[Note: replaced gradients] in grads/reducer.py: a replaced ``.grad`` is kept no more;
        every one replaced is a ``zero_grad``."""
        self.kept_grads.forget(replaced)
        if all(all(r) for r in replaced):
            self._staleness.cleared()

    def _build_pieces(self) -> list[OptimPiece]:
        rank = self.comm.rank
        per_seg = [
            s.layout.pieces(rank) if self.plan.shard_optimizer else s.layout.full_pieces()
            for s in self.segments
        ]
        master = [self.masters.storage(i) for i in range(len(self.segments))]
        grads = [self.reducer.grad_storage(i) for i in range(len(self.segments))]
        return make_pieces(self.segments, per_seg, self._groups, master, grads)

    def _runner(self) -> StepRunner:
        return make_runner(
            self.segments,
            self.pieces,
            mixed=self.plan.mixed,
            sharded=self.plan.shard_optimizer,
            rank=self.comm.rank,
        )

    def _adopt_unfrozen(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """[Note: unfreezing] A parameter frozen at ``initialize`` has no segment, bucket or
        optimizer piece. When it requires grad again (progressive unfreezing), the first forward
        with grad enabled adopts it, before any gradient of it exists: new segments (stage 3:
        persistent ones) built like the first ones, their masters and gather, a reducer over
        every segment, and the optimizer rebound to the pieces, each old piece keeping its state.
        Every rank must unfreeze the same parameters before the same forward (checked: one
        small collective, only then). Freezing a trainable parameter needs nothing: it gets no
        gradient and is not stepped, as a parameter unused in a step."""
        if not torch.is_grad_enabled() or not any(p.requires_grad for _, p in self.frozen):
            return
        unfrozen = [(n, p) for n, p in self.frozen if p.requires_grad]
        check_unfrozen(self.comm, [n for n, _ in unfrozen], self.reducer.used)
        self.frozen = [(n, p) for n, p in self.frozen if not p.requires_grad]
        self._adopt(unfrozen)

    def _adopt(self, named: list[tuple[str, nn.Parameter]], *, broadcast: bool = False) -> None:
        """Segments, masters, gather and pieces for trainable parameters that have none, and a
        reducer over every segment; ``broadcast``: parameters new to zerodp (rank 0's values)."""
        self.param_gather.wait_all()
        new = build_segments(
            named, self.plan, self.comm.world_size, self._fp32_ids, first=len(self.segments)
        )
        if broadcast:
            broadcast_segments(self.comm, new)
        self.segments += new  # in place: the masters' (and stage 3's manager's) list too
        self.masters.add(new)  # before the cast: a new fp32 parameter's master is exact
        for seg in new:
            if self.plan.mixed and id(seg.params[0]) not in self._fp32_ids:
                seg.cast_(self.plan.compute_dtype)
        seen = self.reducer.grads_seen
        self.param_sync.adopt(new)  # [stage 3] persistent segments
        self.reducer = self._grad_sync()
        self.reducer.grads_seen = seen
        self.kept_grads.add(new)
        self._rebind_pieces()

    def _rebind_pieces(self) -> None:
        old, self.pieces = self.pieces, self._build_pieces()
        replace_pieces(self.optimizer, old, self.pieces)
        self.runner = self._runner()

    def add_param_group(self, group: dict[str, Any]) -> None:
        """[Note: param groups added after initialize] ``opt.add_param_group`` as in torch (the
        group keeps its options; the defaults fill the rest), its parameters sharded like the
        others. One already known to zerodp (frozen at ``initialize``, or trainable in no group)
        joins the group: it is stepped from its next gradient on (a frozen one once unfrozen,
        [Note: unfreezing]). One registered in the model after ``initialize`` is broadcast from
        rank 0 and adopted (stage 3: a persistent segment), or replicated if frozen. Every rank
        must add the same parameters and options (checked: one small collective; otherwise every
        rank raises and nothing changes); adopting a new trainable parameter rebuilds the
        reducer, so no gradient may be pending then (after ``opt.zero_grad()``)."""
        given = group["params"]
        given = [given] if isinstance(given, torch.Tensor) else list(given)
        params = list(dict.fromkeys(given))  # torch warns about duplicates (add_param_group)
        names = {id(p): n for n, p in _unique_named_parameters(self.model)}
        known = {id(p) for seg in self.segments for p in seg.params}
        known |= {id(p) for _, p in self.frozen}
        new = [(names[id(p)], p) for p in params if id(p) in names and id(p) not in known]
        device = self.segments[0].device if self.segments else None
        pending = any(map(any, self.reducer.used)) and any(p.requires_grad for _, p in new)
        problem = added_group_problem(params, names, self._groups, device, pending)
        labels = [names.get(id(p), f"<unnamed {type(p).__name__}>") for p in params]
        options = sorted((k, repr(v)) for k, v in group.items() if k != "params")
        check_added_group(self.comm, labels, options, problem)
        self.optimizer.add_param_group({**group, "params": given})  # validates, fills defaults
        for p in params:
            self._groups[id(p)] = len(self.optimizer.param_groups) - 1
        frozen = [(n, p) for n, p in new if not p.requires_grad]
        with torch.no_grad():
            for _, p in frozen:  # replicated, as frozen parameters are
                if self.comm.world_size > 1:
                    self.comm.broadcast(p.data)
                if self.plan.mixed and p.is_floating_point():
                    p.data = p.data.to(self.plan.compute_dtype)
        self.frozen += frozen
        trainable = [(n, p) for n, p in new if p.requires_grad]
        if trainable:
            self._adopt(trainable, broadcast=True)
        else:
            self._rebind_pieces()

    # -- the training step ---------------------------------------------------------------------

    def _before_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if self._broadcasts_buffers(module):
            self.param_sync.check(Op.BUFFERS)
            with torch.no_grad():
                for b in module.buffers():
                    self.comm.broadcast(b)
        if not self.plan.mixed:
            return None
        dtype = self.plan.compute_dtype
        return cast_floats(args, dtype), cast_floats(kwargs, dtype)

    def _enter_forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        training = module.training and torch.is_grad_enabled()
        self.comm.progress.enter("forward" if training else "evaluation forward")

    def _after_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """For the watchdog's messages: the phase is "backward" once autograd reaches the
        output, and the loss computation between forward and backward counts as the forward."""
        if not torch.is_grad_enabled():
            self.comm.progress.enter(BETWEEN_STEPS)
            return
        leaf = next((t for t in tree_leaves(output) if _needs_grad(t)), None)
        if leaf is not None:
            progress = self.comm.progress
            leaf.register_hook(lambda grad: progress.enter("backward"))

    def _broadcasts_buffers(self, module: nn.Module) -> bool:
        """[Note: buffers] Rank 0's buffers are broadcast only before a *training* forward
        (module in train mode, grad enabled); DDP likewise syncs them only after forwards run
        with grad enabled. Every rank runs those (the backward that follows is a collective
        anyway), so the broadcast is never one that some ranks skip. Eval and ``no_grad``
        forwards issue no collective at stages 0-2: ranks may run different numbers of them
        (uneven evaluation, ``generate`` of different lengths), and each rank computes with its
        own buffers, which the last training forward made equal (running statistics updated in
        that forward from each rank's own batch differ, as under DDP)."""
        return (
            self.config.broadcast_buffers
            and self.comm.world_size > 1
            and module.training
            and torch.is_grad_enabled()
            and next(module.buffers(), None) is not None
        )

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, multiplied by the loss scale under fp16 (fp32, bf16: the loss is
        checked too, ``ZeroConfig.precision.nonfinite``; a device flag, no synchronisation)."""
        self._scaled_backward = True
        self.loss.backward_loss(loss).backward()

    def finish_gradients(self) -> None:
        """Wait for the step's reductions, make the owned gradients final (fp32, averaged,
        unscaled) and agree across ranks on which parameters got a gradient and whether every
        gradient is finite. Idempotent until the step."""
        if self._grads_final:
            self._check_nonfinite()
            return
        self.reducer.finish()
        backward = self.reducer.grads_seen != self._seen_at_step  # this rank, since the step
        self.loss.check_backward(backward, self._scaled_backward)
        check = self.plan.check_finite
        nonfinite = check and self.runner.nonfinite(self.reducer, self._inv_scale())
        # [Note: step agreement] in optim/agreement.py: one small all-reduce of flags.
        has_grad = self.kept_grads.has_grad(self.reducer.used)  # [Note: kept gradients]
        mine = StepFlags(nonfinite, self.loss.nonfinite_loss(), backward)
        used, flags = agree_on_step(self.comm, has_grad, self.segments, self.frozen, mine)
        self._used, self._flags = used, flags
        self._skip = self.loss.skips(flags)
        self.runner.bind(used)
        self._grads_final = True
        self._check_nonfinite()

    def _check_nonfinite(self) -> None:
        """``ZeroConfig.precision.nonfinite='raise'`` (fp32, bf16): every rank raises, at every
        step or clip until ``zero_grad``."""
        self.loss.refuse(self._skip, self._flags, self.steps + 1)

    def _inv_scale(self) -> float:
        scale = self.loss.scale
        return 1.0 / scale if scale else 1.0

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.comm.progress.enter("optimizer step")
        self.finish_gradients()
        self.param_gather.wait_all()  # the optimizer writes the slices a gather may be sending
        without_backward = not self._flags.backward
        if without_backward:
            self.steps_without_backward += 1
            policy = self.config.step_without_backward
            if policy == "raise":
                self._end_step()  # nothing changed; a backward then step() goes on normally
            misuse.without_backward(policy, self.steps + 1, self.steps_without_backward)
        else:
            self._staleness.check(self.steps + 1)
        scale = self.loss.scale
        self.steps += 1
        if self._skip:
            self.skipped_steps += 1
            reason = f"non-finite {misuse.nonfinite_what(self._flags, scale is not None)}"
            log.warning(
                "zerodp: step %d skipped (%s on at least one rank)%s; %d skipped so far",
                self.steps,
                reason,
                f", loss scale {scale:g}" if scale else "",
                self.skipped_steps,
            )
        else:
            reason = None
            self.runner.step(self.optimizer, self.reducer, self._inv_scale(), self._used)
            self.publish_params()
        self.loss.after_step(self._skip)
        self.comm.progress.step = self.steps
        self.comm.progress.enter(BETWEEN_STEPS)
        info = StepInfo(self.steps, self._skip, reason, scale, self._grad_norm, without_backward)
        self.last_step = info
        self._seen_at_step = self.reducer.grads_seen
        self._staleness.stepped(self._flags.backward)
        self._end_step()
        self.comm.ledger.end_step()
        return loss

    def _end_step(self) -> None:
        self.runner.reset()
        self._grads_final = False
        self._skip = False
        self._flags = StepFlags()
        self._grad_norm = None
        self._scaled_backward = False
        self.loss.reset()

    def publish_params(self) -> None:
        """Make every rank's parameters equal the owners' masters: cast (mixed precision) and
        all-gather the owned slices (stages 1-2), waited for by the next forward or reader
        ([Note: deferred parameter gather]). Also what a checkpoint load calls after writing
        the owned masters."""
        self.param_sync.publish(self.masters)

    def wait_params(self) -> None:
        """Wait for the parameter all-gather of the last step (stages 1-2): afterwards every
        parameter holds its updated value. Idempotent and cheap when nothing is in flight."""
        self.param_gather.wait_all()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.kept_grads.zero_grad(self.reducer.used, set_to_none)
        self.reducer.zero_grad()
        for op in self.pieces:
            op.tensor.grad = None
        self.runner.reset()
        self._grads_final = False
        self._skip = False
        self.loss.reset()
        self._staleness.cleared()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        self.comm.progress.enter("gradient clipping")
        self.finish_gradients()
        norm = self.runner.clip(
            self.reducer, self._inv_scale(), self._used, max_norm, norm_type, self.comm
        )
        self._grad_norm = float(norm)
        return norm

    # -- introspection -------------------------------------------------------------------------

    def comm_stats(self) -> CommStats | None:
        """Collective traffic of the last completed step."""
        return self.comm.ledger.last_step

    @property
    def num_trainable(self) -> int:
        return sum(s.numel for s in self.segments)

    def remove(self) -> None:
        self.param_sync.remove()
        for h in self._hooks:
            h.remove()


def _needs_grad(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.requires_grad


def _unique_named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``named_parameters`` already yields a tied parameter once, under its first name."""
    return list(model.named_parameters())
