"""Building stage-3 state from a model: units, their sharded segments, persistent segments.

Two paths. A materialised model (the usual case) is sharded unit by unit: build the unit's flat
buffer (moving its parameters in), broadcast it from rank 0 (DDP's starting point), keep this
rank's slice, free the rest; peak memory is the model plus one unit.

[Note: sharded construction]
A model built on the meta device (``with zerodp.sharded_init(): model = GPT(cfg)``) is never
materialised whole: units are materialised one at a time, root first, then in module pre-order.
For each unit: its own buffers and frozen parameters are created on the device, its parameters
become views of a fresh flat buffer, ``init_fn(unit_module)`` initialises them (nested units'
parameters are still on meta, so an init that skips meta tensors, as ``GPT.init_weights`` does,
initialises exactly this unit), this rank keeps its slice and the buffer is freed. The attached
units of a unit ([Note: units]: the large leaves of the root) are materialised together with it
and initialised by its ``init_fn``, as when they were part of it, so that the numbers drawn do
not depend on ``leaf_unit_min_numel``. Peak memory is this rank's shards plus the largest unit
with its attached units (plus persistent parameters).

Seeding: nothing is broadcast; every rank must draw the same numbers. Seed the global RNG
identically on every rank (``torch.manual_seed(s)``) before ``zerodp.initialize``. A checksum of
every unit is compared across ranks afterwards and a mismatch raises on every rank. The result
equals a model built normally after ``torch.manual_seed(s)`` when the model's initialisation
draws its random numbers unit by unit in this order (true for ``zerodp.apps.models.gpt.GPT``
with tied embeddings: embeddings, then each block). ``init_fn`` defaults to the unit module's
``init_weights()`` when it has one taking no arguments, else ``reset_parameters()`` of each module
of the unit (in module order) whose parameters all belong to the unit.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from zerodp.comm import Communicator
from zerodp.params.meta_writes import written_in_constructor
from zerodp.params.policy import UnitPlan
from zerodp.params.segment import ShardedSegment
from zerodp.partition.layout import ParamSpec, build_layout
from zerodp.partition.segment import Segment
from zerodp.plan import Plan

InitFn = Callable[[nn.Module], None]
Named = list[tuple[str, nn.Parameter]]
_ONE_BUCKET = 2**62


@dataclass
class Built:
    """What ``build`` produced: per unit its segments (by engine segment index), and the
    persistent segments, all in engine order (units first)."""

    segments: list[Segment] = field(default_factory=list)
    unit_segs: list[list[int]] = field(default_factory=list)
    persistent: list[int] = field(default_factory=list)
    construction_peak: int = 0  # bytes of flat buffers and shards alive at once (meta path)


@dataclass
class Builder:
    plan: Plan
    comm: Communicator
    uplan: UnitPlan
    fp32_ids: set[int]  # mixed precision: BatchNorm parameters, kept fp32 (own segments)
    device: torch.device | None  # where a meta model is materialised
    init_fn: InitFn | None

    def build(self, members: list[Named], persistent: Named) -> Built:
        meta = any(p.is_meta for named in members for _, p in named) or any(
            p.is_meta for _, p in persistent
        )
        out = Built()
        groups = [self._by_kind(named) for named in members]
        kinds = self._by_kind(persistent)
        n_units = sum(len(g) for g in groups)
        if meta:
            written = written_in_constructor(self.uplan.units[0].module)
            if written:  # [Note: values written in a constructor] in meta_writes.py
                raise ValueError(
                    "zerodp.initialize: a constructor under zerodp.sharded_init() wrote "
                    f"parameter(s) {written} outside reset_parameters()/init_weights(); the meta "
                    "device keeps no values, so they would be lost. Write them in the module's "
                    "reset_parameters() or init_weights(), or pass init_fn=... that does"
                )
            return self._materialise(groups, kinds, n_units, out)
        for unit_groups in groups:
            ids = []
            for items in unit_groups:
                seg = self._segment(len(out.segments), items, one_bucket=True)
                self._broadcast(seg)
                out.segments.append(ShardedSegment.from_segment(seg, self.comm.rank))
                ids.append(len(out.segments) - 1)
            out.unit_segs.append(ids)
        for items in kinds:
            seg = self._segment(len(out.segments), items, one_bucket=False)
            self._broadcast(seg)
            out.persistent.append(len(out.segments))
            out.segments.append(seg)
        return out

    # -- layouts ---------------------------------------------------------------------------------

    def _by_kind(self, named: Named) -> list[Named]:
        """Split by (dtype, keep fp32): one flat buffer holds one dtype."""
        kinds: dict[tuple[torch.dtype, bool], Named] = {}
        for name, p in named:
            kinds.setdefault((p.dtype, id(p) in self.fp32_ids), []).append((name, p))
        return list(kinds.values())

    def _layout_dtype(self, p: nn.Parameter) -> torch.dtype:
        # Buckets and alignment are sized for the dtype the segment is stored in.
        if self.plan.mixed and id(p) not in self.fp32_ids:
            return self.plan.compute_dtype
        return p.dtype

    def _segment(
        self, index: int, items: Named, *, one_bucket: bool, meta: bool = False
    ) -> Segment:
        dtype = self._layout_dtype(items[0][1])
        layout = build_layout(
            [ParamSpec(n, tuple(p.shape)) for n, p in items],
            self.comm.world_size,
            _ONE_BUCKET if one_bucket else self.plan.bucket_numel(dtype),
            self.plan.align(dtype),
        )
        params, names = [p for _, p in items], [n for n, _ in items]
        if not meta:
            return Segment.build(index, layout, params, names)
        device = self.device or torch.device("cpu")
        buf = torch.zeros(layout.padded_numel, dtype=params[0].dtype, device=device)
        seg = Segment(index, layout, params, names, params[0].dtype, device, buf)
        return seg

    def _broadcast(self, seg: Segment) -> None:
        """Start from rank 0's values, as DDP does."""
        if self.comm.world_size > 1:
            with torch.no_grad():
                self.comm.broadcast(seg.param_buffer)

    # -- the meta path: [Note: sharded construction] ----------------------------------------------

    def _materialise(
        self, groups: list[list[Named]], kinds: list[Named], n_units: int, out: Built
    ) -> Built:
        persistent = [
            self._segment(n_units + k, items, one_bucket=False, meta=True)
            for k, items in enumerate(kinds)
        ]
        pending = {id(p): (seg, slot) for seg in persistent for slot, p in enumerate(seg.params)}
        # Every shard is allocated before any unit buffer, so that each unit's buffer reuses the
        # memory the previous one freed instead of fragmenting the heap between shards.
        shards = [[self._empty_shard(items) for items in unit_groups] for unit_groups in groups]
        alive = sum(_nbytes(t) for t in (*[s.param_buffer for s in persistent], *_flat(shards)))
        sums: list[int] = []
        base = [0]
        for unit_groups in groups:
            base.append(base[-1] + len(unit_groups))
        made: dict[int, ShardedSegment] = {}
        for u in range(len(groups)):
            if self.uplan.units[u].attached:
                continue  # materialised with its parent, below
            batch = [u] + [
                a for a, spec in enumerate(self.uplan.units) if spec.attached and spec.parent == u
            ]
            segs: dict[int, list[Segment]] = {}
            for v in batch:
                self._materialise_modules(v, pending)
                segs[v] = [
                    self._segment(base[v] + k, items, one_bucket=True, meta=True)
                    for k, items in enumerate(groups[v])
                ]
                for seg in segs[v]:
                    _bind(seg, range(len(seg.params)))
            every = [seg for v in batch for seg in segs[v]]
            out.construction_peak = max(
                out.construction_peak, alive + sum(_nbytes(s.param_buffer) for s in every)
            )
            with torch.no_grad():
                self._init(batch)
            for v in batch:
                for seg, shard in zip(segs[v], shards[v], strict=True):
                    sums.append(_checksum(seg.param_buffer))
                    made[seg.index] = ShardedSegment.from_segment(seg, self.comm.rank, shard)
        out.segments = [made[i] for i in range(base[-1])]
        out.unit_segs = [list(range(base[u], base[u + 1])) for u in range(len(groups))]
        for seg in persistent:
            sums.append(_checksum(seg.param_buffer))
            out.persistent.append(len(out.segments))
            out.segments.append(seg)
        self._check_same_values(sums)
        return out

    def _empty_shard(self, items: Named) -> torch.Tensor:
        dtype = self._layout_dtype(items[0][1])
        specs = [ParamSpec(n, tuple(p.shape)) for n, p in items]
        layout = build_layout(specs, self.comm.world_size, _ONE_BUCKET, self.plan.align(dtype))
        device = self.device or torch.device("cpu")
        return torch.empty(layout.shard_numel, dtype=items[0][1].dtype, device=device)

    def _materialise_modules(self, u: int, pending: dict[int, tuple[Segment, int]]) -> None:
        """Buffers, frozen and persistent parameters of the modules unit ``u`` owns."""
        device = self.device or torch.device("cpu")
        for m in self.uplan.modules[u]:
            for name, b in m._buffers.items():
                if b is not None and b.is_meta:
                    m._buffers[name] = torch.empty_like(b, device=device)
            for p in m.parameters(recurse=False):
                if not p.is_meta:
                    continue
                if id(p) in pending:
                    seg, slot = pending.pop(id(p))
                    _bind(seg, [slot])
                elif not p.requires_grad:
                    fresh = nn.Parameter(torch.empty_like(p, device=device), requires_grad=False)
                    torch.utils.swap_tensors(p, fresh)

    def _init(self, batch: list[int]) -> None:
        """Initialise unit ``batch[0]`` and the attached units ``batch[1:]`` (materialised with
        it, so that its init draws their numbers where a normal build would)."""
        module = self.uplan.units[batch[0]].module
        if self.init_fn is not None:
            self.init_fn(module)
            return
        init = getattr(module, "init_weights", None)
        if callable(init) and _takes_no_arguments(init):
            init()
            return
        mine = {pid for pid, unit in self.uplan.param_unit.items() if unit in batch}
        order = {id(m): i for i, m in enumerate(module.modules())}
        modules = sorted(
            (m for v in batch for m in self.uplan.modules[v]), key=lambda m: order[id(m)]
        )
        uncovered = []
        for m in modules:
            reset = getattr(m, "reset_parameters", None)
            own = list(m.parameters(recurse=False))
            if callable(reset) and all(id(p) in mine or not p.requires_grad for p in own):
                reset()
            elif own and not callable(reset):
                uncovered.append(type(m).__name__)
        if uncovered:
            # Values a constructor computes on the meta device are not kept: nothing would
            # initialise these parameters (they would stay zeros, or uninitialised memory).
            raise ValueError(
                "zerodp.initialize: a model built under zerodp.sharded_init() has modules with "
                f"parameters but no reset_parameters() ({', '.join(sorted(set(uncovered)))}, in "
                f"unit '{self.uplan.units[batch[0]].label}'), and the unit has no init_weights(): "
                "values set in __init__ are not kept on the meta device. Pass "
                "init_fn=<function initialising a unit's module> to zerodp.initialize, or give "
                "those modules a reset_parameters()"
            )

    def _check_same_values(self, sums: list[int]) -> None:
        if self.comm.world_size == 1 or not sums:
            return
        mine = torch.tensor(sums, dtype=torch.int64)
        everyone = self.comm.all_gather_control(mine)
        if not bool((everyone == everyone[0]).all()):
            raise ValueError(
                "zerodp.initialize: the ranks materialised different parameter values for the "
                "meta-device model: seed the global RNG identically on every rank "
                "(torch.manual_seed(s)) before zerodp.initialize, or pass an init_fn that does"
            )


def _bind(seg: Segment, slots: range | list[int]) -> None:
    """Make meta parameters views of the segment's buffer, keeping the Parameter objects (the
    optimizer and tied modules hold them). The swap goes through an empty tensor and ``.data``:
    a Parameter made *from* the view would share the buffer's version counter, and every
    re-gather into the buffer would then invalidate what autograd saved of the parameter."""
    for s in slots:
        p = seg.params[s]
        if p.is_meta:
            empty = torch.empty(0, dtype=p.dtype, device=seg.device)
            torch.utils.swap_tensors(p, nn.Parameter(empty, requires_grad=p.requires_grad))
        p.data = seg.param_view(s)


def _takes_no_arguments(fn: Callable[..., object]) -> bool:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    return all(
        p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        for p in sig.parameters.values()
    )


def _checksum(t: torch.Tensor) -> int:
    """Sum of the values' bit patterns: exact, so independent of summation order and thread
    count, and chunked, so it allocates no copy of a unit."""
    bits = t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return sum(int(c.sum(dtype=torch.int64)) for c in bits.split(1 << 16))


def _flat(nested: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [t for inner in nested for t in inner]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
