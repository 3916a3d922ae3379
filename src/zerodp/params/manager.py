"""``ShardedParams``: the stage-3 state of one engine, and its accounting.

Call path: ``engine`` → ``ShardedParams`` (build, start, pins, accounting) → ``Schedule``
(hooks: when to gather, prefetch, reduce, release) → ``Gatherer`` / ``ShardedGrads`` (the
collectives) → ``ShardedSegment`` (one flat buffer's storage and views).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn

from zerodp.comm import Communicator
from zerodp.config import Stage3
from zerodp.offload.grad_spill import GradSpill
from zerodp.offload.home import ShardHome
from zerodp.params.access import guard_parameters
from zerodp.params.build import Builder, InitFn, Named
from zerodp.params.hooks import Schedule
from zerodp.params.order import OrderCheck
from zerodp.params.policy import UnitPlan, UnitPolicy, plan_units
from zerodp.params.reduce import ShardedGrads
from zerodp.params.reuse import GatherMemory
from zerodp.params.segment import ShardedSegment
from zerodp.params.unit import Gatherer, Trace, Unit, UnitState
from zerodp.partition.segment import Segment
from zerodp.plan import Plan


@dataclass(frozen=True)
class Stage3Options:
    """What ``zerodp.initialize`` passes to stage 3 besides the config."""

    unit_policy: UnitPolicy | None = None
    init_fn: InitFn | None = None
    device: torch.device | None = None  # where a meta-device model is materialised


class ShardedParams:
    """Units, their segments and the machinery that gathers and reduces them."""

    units: list[Unit]
    segments: list[Segment]  # unit segments in unit order, then persistent segments
    persistent_seg_ids: list[int]
    uplan: UnitPlan
    gatherer: Gatherer
    check: OrderCheck
    trace: Trace
    depth: int
    construction_peak: int  # bytes (sharded construction only; 0 otherwise)
    grads: ShardedGrads | None
    schedule: Schedule | None
    home: ShardHome | None  # where the unit shards rest, when offloaded (ParamSync sets it)
    spill: GradSpill | None  # where the gradient shards wait, when offloaded (ParamSync sets it)

    def __init__(
        self,
        model: nn.Module,
        trainable: Named,
        optimized: set[int],
        plan: Plan,
        policy: Stage3,
        comm: Communicator,
        fp32_ids: set[int],
        options: Stage3Options,
    ) -> None:
        self.comm = comm
        self.plan = plan
        self.depth = policy.prefetch_depth
        self.keep = min(policy.keep_last_units, policy.prefetch_depth + 1)  # within the bound
        self.skip_gathers = policy.skip_backward_gathers
        self.uplan = plan_units(
            model,
            policy.unit_classes,
            policy.unit_min_numel,
            options.unit_policy,
            leaf_min_numel=policy.leaf_unit_min_numel,
        )
        # Small (or empty) parameters, and trainable ones no optimizer group holds (never
        # updated), stay replicated: see [Note: persistent parameters] in config/policies.py.
        keep = {
            id(p)
            for _, p in trainable
            if p.numel() <= policy.persist_numel or p.numel() == 0 or id(p) not in optimized
        }
        members: list[Named] = [[] for _ in self.uplan.units]
        for name, p in trainable:
            if id(p) not in keep:
                members[self.uplan.param_unit[id(p)]].append((name, p))
        persistent = [(n, p) for n, p in trainable if id(p) in keep]
        _agree_on_units(comm, self.uplan, members)
        device = options.device or _default_device(comm)
        builder = Builder(plan, comm, self.uplan, fp32_ids, device, options.init_fn)
        built = builder.build(members, persistent)
        self.segments = built.segments
        self.persistent_seg_ids = built.persistent
        self.construction_peak = built.construction_peak
        self.units = [
            Unit(
                spec,
                [self._sharded(i) for i in built.unit_segs[spec.index]],
                built.unit_segs[spec.index],
                tuple(self.uplan.ancestors(spec.index)),
            )
            for spec in self.uplan.units
        ]
        labels = [u.label for u in self.units]
        labels += [f"persistent parameters #{k}" for k in range(len(self.persistent_seg_ids))]
        device_of = self.segments[0].device if self.segments else torch.device("cpu")
        self.check = OrderCheck(comm, labels, policy.check_unit_order, device_of)
        self.trace = Trace()
        self.gatherer = Gatherer(comm, self.check, self.trace)
        if GatherMemory.applies(device_of):
            self.gatherer.memory = GatherMemory(self.gathered_bound)
        self._where: dict[int, tuple[str, Unit]] = {
            id(p): (n, u)
            for u in self.units
            for s in u.segments
            for n, p in zip(s.names, s.params, strict=True)
        }
        guard_parameters([p for u in self.units for s in u.segments for p in s.params], self)
        self.grads = None
        self.schedule = None
        self.home = None
        self.spill = None

    def _sharded(self, i: int) -> ShardedSegment:
        seg = self.segments[i]
        assert isinstance(seg, ShardedSegment)
        return seg

    def _make_grads(self, reduce_dtype: torch.dtype | None) -> ShardedGrads:
        check_ids = [0] * len(self.segments)
        for u in self.units:
            for i in u.seg_ids:
                check_ids[i] = u.index
        for k, i in enumerate(self.persistent_seg_ids):
            check_ids[i] = len(self.units) + k
        # Reduce-scatters of at most one bucket each ([Note: stage-3 reduce chunks]).
        chunks = [self.plan.bucket_numel(s.dtype) for s in self.segments]
        return ShardedGrads(
            self.segments, self.comm, self.check, check_ids, reduce_dtype, chunks, spill=self.spill
        )

    def adopt(self, new_ids: list[int], reduce_dtype: torch.dtype | None) -> ShardedGrads:
        """Segments ``new_ids`` (already appended to ``segments``: parameters unfrozen after
        ``initialize``, [Note: unfreezing] in optim/adoption.py) become persistent segments,
        reduced at the end of backward. Called before a forward with no reduced gradient
        pending (the engine checks; ``no_sync`` gradients live in ``param.grad`` and survive):
        the reducer is rebuilt over every segment. Returns it."""
        assert self.schedule is not None
        for i in new_ids:
            self.check.labels.append(f"persistent parameters #{len(self.persistent_seg_ids)}")
            self.persistent_seg_ids.append(i)  # the schedule's list too
        self.grads = self._make_grads(reduce_dtype)
        self.schedule.grads = self.grads
        seg_params = [self.segments[i] for i in new_ids]
        self.schedule.register_params(
            [(p, n, None) for s in seg_params for n, p in zip(s.names, s.params, strict=True)]
        )
        return self.grads

    def start(self, reduce_dtype: torch.dtype | None) -> ShardedGrads:
        """Create the reducer (after the segments took their final dtype) and register the
        hooks. Returns the reducer, which the engine uses as its ``reducer``."""
        self.grads = self._make_grads(reduce_dtype)
        self.schedule = Schedule(
            self.units,
            self.gatherer,
            self.grads,
            self.check,
            self.depth,
            self.persistent_seg_ids,
            self.trace,
            keep=self.keep,
            skip_gathers=self.skip_gathers,
        )
        params: list[tuple[nn.Parameter, str, Unit | None]] = []
        for u in self.units:
            for us in u.segments:
                params += [(p, n, u) for n, p in zip(us.names, us.params, strict=True)]
        for i in self.persistent_seg_ids:
            ps = self.segments[i]
            params += [(p, n, None) for n, p in zip(ps.names, ps.params, strict=True)]
        self.schedule.register(params)
        return self.grads

    def remove(self) -> None:
        if self.schedule is not None:
            self.schedule.remove()

    def reset(self) -> None:
        """Drop every per-step hold and release what nobody holds: after the optimizer step (the
        gathered copies are stale) and after a checkpoint load."""
        if self.schedule is not None:
            self.schedule.reset()

    # -- ShardedParameter's lookup (access.py) -----------------------------------------------------

    def released(self, param: torch.Tensor) -> tuple[str, str] | None:
        where = self._where.get(id(param))
        if where is None or where[1].state is UnitState.GATHERED:
            return None
        return where[0], where[1].label

    def read(self, param: torch.Tensor) -> tuple[str, str] | None:
        """``param`` is about to be read: gather its unit on demand if it is an attached unit
        and the root is gathered ([Note: units]); else as ``released``."""
        where = self.released(param)
        unit = self._where[id(param)][1] if where is not None else None
        if unit is not None and self.schedule is not None and self.schedule.gather_on_read(unit):
            return None
        return where

    # -- pins (full_parameters, state_dict) --------------------------------------------------------

    def units_of(self, modules: Sequence[nn.Module] | None) -> list[Unit]:
        """Units holding parameters of ``modules`` (and their descendants), in unit order."""
        if modules is None:
            return list(self.units)
        wanted = {id(p) for m in modules for p in m.parameters()}
        return [u for u in self.units if any(id(p) in wanted for s in u.segments for p in s.params)]

    def pin(self, units: list[Unit]) -> None:
        for u in units:
            u.pinned += 1
            self.gatherer.start(u, private=True)  # user aliases must outlive the release
        for u in units:
            self.gatherer.wait(u)
            for seg in u.segments:  # edits in one place ([Note: parameters that view the shard])
                seg.show_buffer()

    def unpin(self, units: list[Unit]) -> None:
        for u in units:
            u.pinned -= 1
            if not u.held:
                self.gatherer.release(u)

    def generating(self) -> AbstractContextManager[None]:
        """The root held gathered while ``generate`` runs ([Note: inference] in hooks.py)."""
        assert self.schedule is not None, "start() registers the schedule"
        return self.schedule.generating()

    def fully_pinned(self) -> bool:
        """Every unit is held by ``full_parameters`` (or ``state_dict``): forwards issue no
        collective ([Note: inference] in hooks.py)."""
        return all(u.pinned for u in self.units)

    def persistent_segments(self) -> list[tuple[int, Segment]]:
        return [(i, self.segments[i]) for i in self.persistent_seg_ids]

    def state_dict_modules(self) -> list[tuple[nn.Module, list[Unit], list[str]]]:
        """(module, units its state_dict needs gathered, names of its own unit parameters) for
        every unit module and every module registering a unit parameter."""
        out = []
        unit_of_module = {id(u.module): u for u in self.units}
        for m in self.uplan.units[0].module.modules():
            own = [(n, p) for n, p in m.named_parameters(recurse=False) if id(p) in self._where]
            units = {self._where[id(p)][1].index: self._where[id(p)][1] for _, p in own}
            if id(m) in unit_of_module:
                unit = unit_of_module[id(m)]
                units[unit.index] = unit
            if units:
                out.append((m, [units[k] for k in sorted(units)], [n for n, _ in own]))
        return out

    # -- accounting ------------------------------------------------------------------------------

    def param_bytes(self) -> int:
        """Parameters held at rest on the device: shards (unless offloaded: partial offload
        keeps some), plus persistent parameters (full)."""
        home = self.home
        device = [
            s for u in self.units for s in u.segments if home is None or not home.holds(s.index)
        ]
        return sum(s.shard_nbytes for s in device) + self.persistent_bytes()

    def persistent_bytes(self) -> int:
        return sum(_nbytes(self.segments[i].param_buffer) for i in self.persistent_seg_ids)

    def largest_unit_bytes(self) -> int:
        return max((u.full_nbytes for u in self.units), default=0)

    def gathered_bound(self) -> int:
        """The most gathered bytes the schedule may hold: the unit running and ``depth``
        prefetched ones (each at most the largest unit), plus the units enclosing the running
        one, which stay gathered while it runs (the root among them, when it owns parameters),
        plus the attached units, which a read while the root is gathered holds as long as the
        root ([Note: units])."""
        enclosing = max(
            (sum(self.units[a].full_nbytes for a in u.ancestors) for u in self.units), default=0
        )
        attached = sum(u.full_nbytes for u in self.units if u.spec.attached)
        return (self.depth + 1) * self.largest_unit_bytes() + enclosing + attached


def _agree_on_units(comm: Communicator, uplan: UnitPlan, members: list[Named]) -> None:
    """Every rank must cut the model into the same units (a ``unit_policy`` may look at
    anything): compare before the first unit collective, and raise the same error everywhere."""
    pairs = zip(uplan.units, members, strict=True)
    mine = [(spec.label, [n for n, _ in named]) for spec, named in pairs]
    everyone = comm.all_gather_object(mine)
    for r, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            diff = next(
                (
                    f"{a} on rank 0 vs {b}"
                    for a, b in zip(everyone[0], theirs, strict=False)
                    if a != b
                ),
                f"{len(everyone[0])} units on rank 0 vs {len(theirs)}",
            )
            raise ValueError(
                f"zerodp.initialize: rank {r} chose other stage-3 units than rank 0 ({diff}); "
                "unit_policy must give the same answer on every rank"
            )


def _default_device(comm: Communicator) -> torch.device:
    if "cuda" in comm.supported_device_types() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
