"""``ParamSync``: how parameters are kept in sync across ranks, chosen once from the plan.

- ``ReplicatedParams`` (stages 0-2): every rank holds every parameter; after a step the owners'
  updated slices are all-gathered (stages 1-2, [Note: deferred parameter gather]); gradients
  go through ``grads.reducer.GradReducer``.
- ``ShardedParamSync`` (stage 3): parameters sharded at rest, gathered per unit by the schedule
  (``params.manager.ShardedParams``); the small persistent parameters are replicated and
  gathered after the step like stages 1-2; gradients go through ``params.reduce.ShardedGrads``.

The engine builds one, takes its segments, asks it for the gradient synchroniser, tells it when
a step has written the masters (``publish``), and hands it parameters adopted later.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from zerodp.comm import Communicator
from zerodp.config import ZeroConfig
from zerodp.grads.reducer import GradReducer
from zerodp.grads.sync import GradSync
from zerodp.offload.grad_spill import GradSpill, make_spill
from zerodp.offload.home import ShardHome, make_home, resident
from zerodp.offload.landing import Landing
from zerodp.offload.partial import kept_prefix
from zerodp.optim.masters import Masters
from zerodp.params.deferred import DeferredGather
from zerodp.params.manager import ShardedParams, Stage3Options
from zerodp.params.nocompile import refuse_compile
from zerodp.params.order import Op
from zerodp.params.state_dict import StateDictHooks
from zerodp.partition.build import build_segments
from zerodp.partition.segment import Segment
from zerodp.plan import Plan

Named = list[tuple[str, nn.Parameter]]
OnReplaced = Callable[[list[list[bool]]], None]


class ParamSync(Protocol):
    segments: list[Segment]  # every trainable parameter's segment (appended to on adoption)
    gather: DeferredGather  # the after-step all-gather of the replicated segments

    @property
    def sharded(self) -> ShardedParams | None:
        """Stage 3's units (gathers on access, pins, state dicts); None at stages 0-2."""

    def grad_sync(
        self, masters: Masters, reduce_dtype: torch.dtype | None, on_replaced: OnReplaced
    ) -> GradSync:
        """The gradient synchroniser over every segment, its hooks registered (after the
        segments took their final dtype). Called again after adoption: a new one."""

    def adopt(self, new: list[Segment]) -> None:
        """``new`` was appended to ``segments`` (parameters unfrozen or added after
        ``initialize``); the next ``grad_sync`` covers them."""

    def install(self, model: nn.Module) -> None:
        """Forward hooks of the parameter gather (stages 1-2: waits before each module's
        forward), removed by ``remove``."""

    def guard(self, model: nn.Module) -> list[Any]:
        """Root pre-hooks that refuse what this sync cannot do (stage 3: ``torch.compile``),
        prepended after the engine's unfreezing hook; their handles."""

    def check(self, op: Op) -> None:
        """Before a collective outside the step's schedule that every rank issues (buffer
        broadcasts, checkpoints): stage 3 agrees on it with every rank first."""

    def publish(self, masters: Masters, *, written: bool = False) -> None:
        """The masters were written (a step, a checkpoint load): make the parameters follow.
        ``written``: the step runner is copying the owned slices itself (offload), each
        bucket's landing awaited by its gather."""

    @property
    def kept(self) -> frozenset[int]:
        """Segments whose optimizer state stays on the device under partial offload ([Note:
        partial offload] in offload/partial.py); empty otherwise."""

    def update_order(self) -> list[tuple[int, int]]:
        """(segment, bucket) in the order the next forward first reads them: the order an
        offloaded step updates them in."""

    def attach_landing(self, landing: Landing) -> None:
        """Make every gather of a bucket wait for its offloaded update ([Note: offloaded
        step]); stage 3 with offloaded parameters also moves the shards to their home
        ([Note: offloaded parameters]). After the cast, before the pieces are built."""

    @property
    def home(self) -> ShardHome | None:
        """Where stage 3's unit shards rest when offloaded (``attach_landing`` made it)."""

    @property
    def spill(self) -> GradSpill | None:
        """Where stage 3's gradient shards wait on NVMe ([Note: gradients on NVMe])."""

    def home_bytes(self) -> dict[str, int]:
        """Host and NVMe bytes of offloaded parameters, named as ``MemoryReport``'s fields."""

    def param_bytes(self) -> int:
        """Bytes of trainable parameters held at rest (stage 3: shards and persistent ones)."""

    def unit_bytes(self) -> dict[str, int]:
        """Stage 3: persistent, gathered (now, peak, bound) and largest-unit bytes, named as
        ``MemoryReport``'s fields; empty at stages 0-2."""

    def remove(self) -> None: ...


class ReplicatedParams:
    """Stages 0-2 (see the module docstring)."""

    sharded: None = None

    def __init__(
        self,
        trainable: Named,
        plan: Plan,
        config: ZeroConfig,
        comm: Communicator,
        fp32: set[int],
        fraction: float,
    ) -> None:
        self.plan = plan
        self.comm = comm
        # Partial offload: the first parameters in registration order, in segments of their own.
        first = kept_prefix([p.numel() for _, p in trainable], fraction)
        ids = frozenset(id(p) for _, p in trainable[:first])
        self.segments = build_segments(trainable, plan, comm.world_size, fp32, kept=ids)
        self.kept = frozenset(s.index for s in self.segments if id(s.params[0]) in ids)
        broadcast_segments(comm, self.segments)  # start from rank 0's values, as DDP does
        self.gather = DeferredGather(self.segments, comm, overlap=config.overlap_param_gather)
        self._reducer: GradReducer | None = None

    def grad_sync(
        self, masters: Masters, reduce_dtype: torch.dtype | None, on_replaced: OnReplaced
    ) -> GradSync:
        if self._reducer is not None:
            self._reducer.remove_hooks()
        reducer = GradReducer(self.segments, self.comm, self.plan.reduce_mode, reduce_dtype)
        reducer.register_hooks()
        reducer.on_replaced = on_replaced
        self._reducer = reducer
        return reducer

    def adopt(self, new: list[Segment]) -> None:
        self.gather.add(new)

    def install(self, model: nn.Module) -> None:
        if self.plan.gather_params:
            self.gather.register_hooks(model)

    def guard(self, model: nn.Module) -> list[Any]:
        return []

    def check(self, op: Op) -> None:
        pass  # stages 0-2 issue the same collectives in the same order on every rank

    def publish(self, masters: Masters, *, written: bool = False) -> None:
        _publish(self.gather, masters, self.plan, written)

    def update_order(self) -> list[tuple[int, int]]:
        return self.gather.issue_order

    def attach_landing(self, landing: Landing) -> None:
        self.gather.landing = landing

    @property
    def home(self) -> None:
        return None

    @property
    def spill(self) -> None:
        return None

    def home_bytes(self) -> dict[str, int]:
        return {}

    def param_bytes(self) -> int:
        return sum(s.param_buffer.numel() * s.param_buffer.element_size() for s in self.segments)

    def unit_bytes(self) -> dict[str, int]:
        return {}

    def remove(self) -> None:
        _remove(self.gather, self._reducer)


class ShardedParamSync:
    """Stage 3 (see the module docstring)."""

    def __init__(
        self, sharded: ShardedParams, plan: Plan, comm: Communicator, fraction: float
    ) -> None:
        self.plan = plan
        self.sharded = sharded
        self.segments = sharded.segments
        persistent = [s for _, s in self.sharded.persistent_segments()]
        # Persistent parameters may be read anywhere: their gather is waited for in the step.
        self.gather = DeferredGather(persistent, comm, overlap=False)
        # Partial offload: whole segments, in the order the next forward needs them.
        order = list(dict.fromkeys(s for s, _ in self.update_order()))
        first = kept_prefix([self.segments[s].numel for s in order], fraction)
        self.kept = frozenset(order[:first])
        self._grads: GradSync | None = None
        self._state_dict: StateDictHooks | None = None  # full state dicts ([Note: writeback])
        self._adopted: list[int] = []

    def grad_sync(
        self, masters: Masters, reduce_dtype: torch.dtype | None, on_replaced: OnReplaced
    ) -> GradSync:
        # Gradients are never replaced behind stage 3's back: they live in its shards.
        if self._grads is None:
            self._grads = self.sharded.start(reduce_dtype)
            self._state_dict = StateDictHooks(self.sharded, masters, self.sharded.comm)
            self._state_dict.install()
        else:
            self._grads = self.sharded.adopt(self._adopted, reduce_dtype)
            self._adopted = []
        return self._grads

    def adopt(self, new: list[Segment]) -> None:
        self._adopted += [s.index for s in new]
        self.gather.add(new)

    def install(self, model: nn.Module) -> None:
        # Persistent parameters are gathered inside the step: only ``in_forward`` is tracked.
        self.gather.register_hooks(model)

    def guard(self, model: nn.Module) -> list[Any]:
        return [model.register_forward_pre_hook(refuse_compile, prepend=True)]

    def check(self, op: Op) -> None:
        self.sharded.check(op)

    def publish(self, masters: Masters, *, written: bool = False) -> None:
        self.sharded.reset()  # gathered copies are stale now: release them
        # Offloaded shards are written by the step itself; a load's publish writes them here.
        with resident(None if written else self.sharded.home, write=True):
            _publish(self.gather, masters, self.plan, written)

    def update_order(self) -> list[tuple[int, int]]:
        # The persistent segments first: their gather is waited for inside the step. Then the
        # units in order (the order their forward runs in, the first time and usually after).
        first = [seg.index for seg in self.gather.segments]
        rest = [s.index for s in self.segments if s.index not in set(first)]
        return [(i, b) for i in first + rest for b in range(len(self.segments[i].layout.buckets))]

    def attach_landing(self, landing: Landing) -> None:
        self.gather.landing = landing
        sharded = self.sharded
        sharded.gatherer.landing = landing
        # A kept unit's shard stays on the device with its optimizer state.
        units = [s for u in sharded.units for s in u.segments if s.index not in self.kept]
        sharded.home = make_home(self.plan, landing, units, sharded.comm.rank)
        sharded.gatherer.home = sharded.home
        sharded.spill = make_spill(self.plan, landing.streams, self.segments, sharded.comm.rank)

    @property
    def home(self) -> ShardHome | None:
        return self.sharded.home

    @property
    def spill(self) -> GradSpill | None:
        return self.sharded.spill

    def home_bytes(self) -> dict[str, int]:
        home = self.sharded.home
        if home is None:
            return {}
        ring = "host_parameters" if home.tier == "cpu" else "host_buffers"  # NVMe: its reads
        return {ring: home.host_nbytes, "nvme": home.nvme_nbytes}

    def param_bytes(self) -> int:
        return self.sharded.param_bytes()

    def unit_bytes(self) -> dict[str, int]:
        sharded = self.sharded
        return {
            "persistent_parameters": sharded.persistent_bytes(),
            "gathered_now": sharded.gatherer.gathered_bytes,
            "gathered_peak": sharded.gatherer.peak_bytes,
            "gathered_bound": sharded.gathered_bound(),
            "gathered_cached": sharded.gatherer.cached_bytes,
            "largest_unit": sharded.largest_unit_bytes(),
        }

    def remove(self) -> None:
        _remove(self.gather, self._grads)
        self.sharded.remove()
        if self._state_dict is not None:
            for h in self._state_dict.handles:
                h.remove()
        if self.sharded.home is not None:
            self.sharded.home.close()
        if self.sharded.spill is not None:
            self.sharded.spill.close()


def _publish(gather: DeferredGather, masters: Masters, plan: Plan, written: bool) -> None:
    """Masters to parameters (unless the step runner copies them: ``written``), then the
    all-gather of the replicated segments' updated slices (never while the previous one may
    still be sending them)."""
    gather.wait_all()
    if not written:
        masters.publish()
    if plan.gather_params:
        gather.launch()


def _remove(gather: DeferredGather, grads: GradSync | None) -> None:
    gather.wait_all()
    gather.remove_hooks()
    if grads is not None:
        grads.remove_hooks()


def make_param_sync(
    model: nn.Module,
    trainable: Named,
    optimized: set[int],
    plan: Plan,
    config: ZeroConfig,
    comm: Communicator,
    fp32: set[int],
    stage3: Stage3Options | None,
    fraction: float = 1.0,
) -> ParamSync:
    """The plan's parameter sync; builds (and broadcasts from rank 0) the segments.
    ``fraction``: of the optimizer state, what is offloaded ([Note: partial offload])."""
    if plan.shard_params:
        options = stage3 or Stage3Options()
        args = (model, trainable, optimized, plan, config.stage3, comm, fp32, options)
        return ShardedParamSync(ShardedParams(*args), plan, comm, fraction)
    return ReplicatedParams(trainable, plan, config, comm, fp32, fraction)


def broadcast_segments(comm: Communicator, segments: list[Segment]) -> None:
    """Every rank's segments take rank 0's parameter values (stage 3 broadcasts its units while
    it builds them)."""
    if comm.world_size == 1:
        return
    with torch.no_grad():
        for seg in segments:
            comm.broadcast(seg.param_buffer)
