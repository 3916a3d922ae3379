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

Beside it: what to adopt after ``initialize`` (``optim/adoption.py``; the engine rebuilds the
components for it), the hooks around the forward (``forward_hooks.py``), and the narrow views
it hands to checkpoints, ``full_parameters`` and the memory report (``views.py``). Over the
~400-line budget (517): the three view builders at the end read the engine's own components,
which is what keeps checkpoints and the report from reading the engine, and the offloaded
step's wiring (streams, landings, removal after a failed update) is here; moving the view
builders into ``views.py`` behind a narrow protocol is the next split.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from zerodp.comm import BETWEEN_STEPS, CommLedger, CommStats, Communicator, GroupLike
from zerodp.config import ZeroConfig
from zerodp.forward_hooks import ForwardHooks
from zerodp.grads.sync import GradSync
from zerodp.memory.report import Holdings
from zerodp.offload.build import offload_pieces, offload_step
from zerodp.offload.host_memory import bound_host_allocator
from zerodp.offload.landing import Landing
from zerodp.offload.partial import offload_fraction, offloaded_share, partial_step
from zerodp.offload.refuse import refuse_adoption
from zerodp.optim import misuse
from zerodp.optim.adoption import examine_added_group, replicate_frozen, take_unfrozen
from zerodp.optim.agreement import KeptGrads, StepFlags, agree_on_step
from zerodp.optim.clip import norm_scope
from zerodp.optim.compute_dtype import Cast, make_cast
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
from zerodp.params.sync import broadcast_segments, make_param_sync
from zerodp.partition.build import build_segments
from zerodp.partition.segment import Segment
from zerodp.plan import Plan, resolve
from zerodp.streams import StreamError, make_streams
from zerodp.validation import agree, check_devices, fingerprint
from zerodp.views import CheckpointState, ParamAccess, StepCounters


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
    counters: StepCounters  # steps, skipped steps, steps without backward
    last_step: StepInfo | None

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: ZeroConfig,
        process_group: GroupLike = None,
        stage3: Stage3Options | None = None,
    ) -> None:
        self.config = config
        self.plan = resolve(config)
        if self.plan.offload_optimizer != "none":
            bound_host_allocator()  # before the shards are built: [Note: host allocator]
        self.comm = Communicator(process_group, CommLedger(), config.watchdog_s)
        self.norm_scope = norm_scope(self.comm, model)  # [Note: norms under tensor parallelism]
        self.model = model
        named = _unique_named_parameters(model)
        trainable = [(n, p) for n, p in named if p.requires_grad]
        self.frozen = [(n, p) for n, p in named if not p.requires_grad]
        error = check_devices(named, self.comm, allow_meta=self.plan.shard_params)
        error = error or check_optimizer(optimizer, (p for _, p in named))
        agree(self.comm, fingerprint(model, optimizer, config), error)

        self.cast: Cast = make_cast(model, self.plan.mixed, self.plan.compute_dtype)
        self._groups = group_of_params(optimizer)  # by parameter id: frozen ones too
        optimized = set(self._groups)
        fp32 = self.cast.fp32_ids  # BatchNorm's, kept fp32 in segments of their own
        world, precision = self.comm.world_size, config.precision.compute
        fraction = offload_fraction(self.plan, trainable, optimizer, world, precision)
        self.param_sync = make_param_sync(
            model, trainable, optimized, self.plan, config, self.comm, fp32, stage3, fraction
        )
        self.params = self.param_sync.sharded
        self.segments = self.param_sync.segments
        plan = self.plan
        offload = plan.offload_optimizer != "none"
        self.masters = Masters(
            self.segments,
            separate=plan.mixed,
            sharded=plan.shard_optimizer,
            rank=self.comm.rank,
            host=offload,
            stored=plan.offload_optimizer == "nvme",
            kept=self.param_sync.kept,
        )
        # The offloaded step's streams and landings ([Note: offloaded step] in offload/).
        device = self.segments[0].device if self.segments else torch.device("cpu")
        self.landing: Landing | None = Landing(make_streams(device)) if offload else None
        self._hooks: list[Any] = []
        self._hooks += self.cast.install(model, self.segments, self.frozen)
        if self.landing is not None:  # stage 3 may move the shards off the device here
            self.param_sync.attach_landing(self.landing)
        self._reduce_dtype = plan.reduce_dtype  # also fp32 parameters with bf16 reduction
        self.reducer = self._grad_sync()
        self.pieces = self._build_pieces()
        rebind_optimizer(optimizer, self.pieces, self.segments)
        self.runner = self._runner(optimizer)
        self.param_gather = self.param_sync.gather
        self.param_sync.install(model)
        self.optimizer = optimizer
        self.loss = make_loss_policy(plan, config.precision)
        self.scaler = self.loss.scaler  # fp16 only (the checkpoint and opt.loss_scale read it)
        forward = ForwardHooks(
            self.comm, config.broadcast_buffers, self.param_sync.check, self.cast
        )
        self._hooks += forward.install(model)
        # Before the schedule's root hook and the parameter-gather waits: [Note: unfreezing].
        self._hooks.append(model.register_forward_pre_hook(self._adopt_unfrozen, prepend=True))
        self._hooks += self.param_sync.guard(model)
        self._hooks.append(forward.install_first(model))
        self.counters = StepCounters()
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

    def _grad_sync(self) -> GradSync:
        return self.param_sync.grad_sync(self.masters, self._reduce_dtype, self._on_grads_replaced)

    def _on_grads_replaced(self, replaced: list[list[bool]]) -> None:
        """[Note: replaced gradients] in grads/reducer.py: a replaced ``.grad`` is kept no more;
        every one replaced is a ``zero_grad``."""
        self.kept_grads.forget(replaced)
        if all(all(r) for r in replaced):
            self._staleness.cleared()

    def _build_pieces(self, *, cut: bool = True) -> list[OptimPiece]:
        """The optimizer's pieces; offloaded, ``cut`` at the chunk boundaries. Uncut ones are
        for the device runner that only checks and clips: they view the gradients in place of
        the masters, which they must not keep alive (the NVMe store drops them)."""
        owner = self.masters.owner
        per_seg = [s.layout.owned_pieces(owner) for s in self.segments]
        if cut and self.landing is not None and owner is not None:
            host = [self.masters.on_host(i) for i in range(len(self.segments))]
            per_seg = offload_pieces(self.plan, self.segments, per_seg, owner, host)
        grads = [self.reducer.grad_storage(i) for i in range(len(self.segments))]
        master = [self.masters.storage(i) for i in range(len(self.segments))]
        return make_pieces(self.segments, per_seg, self._groups, master if cut else grads, grads)

    def _runner(self, optimizer: torch.optim.Optimizer) -> StepRunner:
        def runner(pieces: list[OptimPiece]) -> StepRunner:
            plan, rank = self.plan, self.comm.rank
            args = (self.segments, pieces)
            return make_runner(*args, mixed=plan.mixed, sharded=plan.shard_optimizer, rank=rank)

        if self.landing is None:
            return runner(self.pieces)
        order = self.param_sync.update_order()
        host = [op for op in self.pieces if self.masters.on_host(op.seg)]
        args = (self.plan, self.segments, host, self.masters, self.landing, order)
        sync = self.param_sync
        check = partial(runner, self._build_pieces(cut=False)) if sync.spill is None else None
        step = offload_step(*args, optimizer, sync.home, sync.spill, check)
        return partial_step(self.plan, self.segments, self.pieces, self.masters, step)

    def _adopt_unfrozen(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """[Note: unfreezing] in optim/adoption.py."""
        if not torch.is_grad_enabled() or not any(p.requires_grad for _, p in self.frozen):
            return
        refuse_adoption(self.plan)
        self.frozen, unfrozen = take_unfrozen(self.frozen, self.comm, self.reducer.used)
        self._adopt(unfrozen)

    def _adopt(self, named: list[tuple[str, nn.Parameter]], *, broadcast: bool = False) -> None:
        """Segments, masters, gather and pieces for trainable parameters that have none, and a
        reducer over every segment; ``broadcast``: parameters new to zerodp (rank 0's values)."""
        self.wait_params()
        new = build_segments(
            named, self.plan, self.comm.world_size, self.cast.fp32_ids, first=len(self.segments)
        )
        if broadcast:
            broadcast_segments(self.comm, new)
        self.segments += new  # in place: the masters' (and stage 3's manager's) list too
        self.masters.add(new)  # before the cast: a new fp32 parameter's master is exact
        for seg in new:
            self.cast.segment(seg)
        seen = self.reducer.grads_seen
        self.param_sync.adopt(new)  # [stage 3] persistent segments
        self.reducer = self._grad_sync()
        self.reducer.grads_seen = seen
        self.kept_grads.add(new)
        self._rebind_pieces()

    def _rebind_pieces(self) -> None:
        old, self.pieces = self.pieces, self._build_pieces()
        replace_pieces(self.optimizer, old, self.pieces)
        self.runner = self._runner(self.optimizer)

    def add_param_group(self, group: dict[str, Any]) -> None:
        """[Note: param groups added after initialize] in optim/adoption.py."""
        refuse_adoption(self.plan)
        added = examine_added_group(
            group,
            self.model,
            self.segments,
            self.frozen,
            self._groups,
            self.reducer.used,
            self.comm,
        )
        self.optimizer.add_param_group({**group, "params": added.given})  # fills the defaults
        for p in added.params:
            self._groups[id(p)] = len(self.optimizer.param_groups) - 1
        replicate_frozen(added.new_frozen, self.comm, self.cast)
        self.frozen += added.new_frozen
        if added.new_trainable:
            self._adopt(added.new_trainable, broadcast=True)
        else:
            self._rebind_pieces()

    # -- the training step ---------------------------------------------------------------------

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
        used, flags = agree_on_step(
            self.comm, has_grad, self.segments, self.frozen, mine, self.norm_scope.tp
        )
        self._used, self._flags = used, flags
        self._skip = self.loss.skips(flags)
        self.runner.bind(used)
        self._grads_final = True
        self._check_nonfinite()

    def _check_nonfinite(self) -> None:
        """``ZeroConfig.precision.nonfinite='raise'`` (fp32, bf16): every rank raises, at every
        step or clip until ``zero_grad``."""
        self.loss.refuse(self._skip, self._flags, self.counters.steps + 1)

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
        self.wait_params()  # the optimizer writes the slices a gather may be sending
        without_backward = not self._flags.backward
        counters = self.counters
        if without_backward:
            counters.steps_without_backward += 1
            policy = self.config.step_without_backward
            if policy == "raise":
                self._end_step()  # nothing changed; a backward then step() goes on normally
            misuse.without_backward(policy, counters.steps + 1, counters.steps_without_backward)
        else:
            self._staleness.check(counters.steps + 1)
        scale = self.loss.scale
        counters.steps += 1
        if self._skip:
            counters.skipped_steps += 1
            reason = misuse.skipped(self._flags, scale, counters.steps, counters.skipped_steps)
        else:
            reason = None
            self.runner.step(self.optimizer, self.reducer, self._inv_scale(), self._used)
            self.param_sync.publish(self.masters, written=self.runner.writes_params)
        self.loss.after_step(self._skip)
        self.comm.progress.step = counters.steps
        self.comm.progress.enter(BETWEEN_STEPS)
        self.last_step = StepInfo(
            counters.steps, self._skip, reason, scale, self._grad_norm, without_backward
        )
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
        """Wait for the parameter all-gather of the last step (stages 1-2) and, offloaded, for
        every bucket's update: afterwards every parameter (and master) holds its updated
        value. Idempotent and cheap when nothing is in flight."""
        self.param_gather.wait_all()
        self.wait_optimizer()

    def wait_optimizer(self) -> None:
        """Wait for the offloaded step to finish writing masters and optimizer state. Local:
        unlike ``wait_params`` it issues no collective, so one rank alone may call it."""
        if self.landing is not None:
            self.landing.wait_all()
        self.masters.settle()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.kept_grads.zero_grad(self.reducer.used, set_to_none)
        self.reducer.zero_grad()
        self.runner.unbind()
        self.runner.reset()
        self._grads_final = False
        self._skip = False
        self.loss.reset()
        self._staleness.cleared()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        self.comm.progress.enter("gradient clipping")
        self.finish_gradients()
        norm = self.runner.clip(
            self.reducer, self._inv_scale(), self._used, max_norm, norm_type, self.norm_scope
        )
        self._grad_norm = float(norm)
        return norm

    # -- introspection -------------------------------------------------------------------------

    def comm_stats(self) -> CommStats | None:
        """Collective traffic of the last completed step."""
        return self.comm.ledger.last_step

    @property
    def steps(self) -> int:
        return self.counters.steps

    @property
    def skipped_steps(self) -> int:
        return self.counters.skipped_steps

    @property
    def steps_without_backward(self) -> int:
        return self.counters.steps_without_backward

    def checkpoint_state(self) -> CheckpointState:
        return CheckpointState(
            comm=self.comm,
            stage=self.plan.stage,
            precision=self.config.precision.compute,
            config=self.config.to_dict(),
            segments=tuple(self.segments),
            frozen=tuple(self.frozen),
            pieces=tuple(self.pieces),
            optimizer=self.optimizer,
            masters=self.masters,
            scaler=self.loss.scaler,
            counters=self.counters,
            meet=self.param_sync.check,
            publish=self.publish_params,
        )

    def param_access(self) -> ParamAccess:
        return ParamAccess(
            self.comm, tuple(self.segments), tuple(self.frozen), self.masters, self.params
        )

    def holdings(self) -> Holdings:
        """What this rank holds, for the memory report (after the offloaded step, which
        creates optimizer state on its worker, has finished)."""
        self.wait_optimizer()
        return Holdings(
            rank=self.comm.rank,
            world_size=self.comm.world_size,
            stage=self.plan.stage,
            precision=self.config.precision.compute,
            num_params=self.num_trainable,
            padded_numel=sum(s.layout.padded_numel for s in self.segments),
            param_dtype=self.segments[0].dtype if self.segments else torch.float32,
            parameters=self.param_sync.param_bytes(),
            gradients=self.reducer.gradient_bytes(),
            masters=self.masters.nbytes,
            comm_buffers=self.reducer.buffer_bytes(),
            frozen=sum(p.numel() * p.element_size() for _, p in self.frozen),
            step_transient=self.runner.nbytes,
            optimizer=self.optimizer,
            stage3=self.param_sync.unit_bytes(),
            offload=self.plan.offload_optimizer,
            host=self.runner.host_nbytes,
            params_offload=self.plan.offload_params,
            params_home=self.param_sync.home_bytes(),
            gradients_offload=self.plan.offload_gradients,
            kept=tuple(op.tensor for op in self.pieces if op.seg in self.masters.kept),
            kept_masters=self.masters.nbytes_where(host=False) if self.landing else 0,
            offload_fraction=offloaded_share(self.pieces, self.masters.kept)
            if self.landing is not None
            else 1.0,
        )

    def offload_timing(self) -> dict[str, float] | None:
        return self.runner.timing  # [Note: offload timing] in offload/timing.py

    def nvme_io(self) -> tuple[int, int]:
        """Bytes read from and written to the NVMe tier's files since initialize."""
        self.wait_optimizer()
        parts = [self.masters.store, self.param_sync.home, self.param_sync.spill]
        moved = [part.io_bytes() for part in parts if part is not None]
        return sum(r for r, _ in moved), sum(w for _, w in moved)

    @property
    def num_trainable(self) -> int:
        return sum(s.numel for s in self.segments)

    def remove(self) -> None:
        """Remove every hook; an offloaded update that failed is raised (again) after."""
        failed: StreamError | None = None
        try:
            self.wait_params()
        except StreamError as exc:
            failed = exc
            assert self.landing is not None
            self.landing.abandon()  # what failed is reported once more, below
        self.param_sync.remove()
        for h in self._hooks:
            h.remove()
        if self.landing is not None:
            self.landing.streams.close()
        self.masters.close()
        if failed is not None:
            raise failed


def _unique_named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``named_parameters`` already yields a tied parameter once, under its first name."""
    return list(model.named_parameters())
