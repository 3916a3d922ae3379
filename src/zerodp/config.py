"""User-facing configuration: one frozen, validated dataclass.

Every field is checked in ``__post_init__`` so that a bad value fails at construction, before any
process group traffic or model surgery, with a ``ValueError`` that names the field and what is
allowed. ``ZeroConfig.from_dict`` / ``from_json`` accept the same names, and reject unknown keys
(a typo in a JSON file must not be silently ignored).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

__all__ = [
    "NONFINITE",
    "PRECISIONS",
    "REDUCE_DTYPES",
    "STAGES",
    "STEP_WITHOUT_BACKWARD",
    "ZeroConfig",
]

STAGES = (0, 1, 2, 3)
PRECISIONS = ("fp32", "bf16", "fp16")
REDUCE_DTYPES = ("fp32", "bf16", "fp16")
NONFINITE = ("raise", "skip", "ignore")
STEP_WITHOUT_BACKWARD = ("warn", "raise", "ignore")


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroConfig:
    """How zerodp shards and communicates.

    The defaults suit both CPU/gloo and GPU/NCCL; most users set only ``stage``.
    """

    stage: int = 2
    """0: plain data parallelism; 1: shard optimizer state; 2: also gradients; 3: also
    parameters."""

    bucket_bytes: int = 32 * 2**20
    """Size of one gradient-reduction / parameter-gather bucket, in bytes of the parameter dtype.
    Buckets are the unit of communication: larger amortises per-collective latency, smaller
    starts reduction earlier in backward and bounds stage-2 staging memory."""

    broadcast_buffers: bool = True
    """Broadcast rank 0's module buffers (e.g. BatchNorm running stats) before every training
    forward (train mode, grad enabled), as ``DistributedDataParallel(broadcast_buffers=True)``
    does; eval and ``no_grad`` forwards issue no collective ([Note: buffers] in engine.py)."""

    overlap_param_gather: bool = True
    """Stages 1-2: issue the all-gather of the updated parameter slices per bucket at the end of
    ``step()`` without waiting, and wait for each bucket just before the first module that
    registers one of its parameters runs its next forward (``forward`` pre-hooks), so the
    gather overlaps the time until then and the next forward. Results are identical. Reading a
    parameter *outside* a forward before the next forward sees the old values of other ranks'
    slices unless it goes through the model (``model.parameters()``, ``named_parameters()``,
    ``state_dict()``, attribute access on the model, ``zerodp.full_parameters``, checkpoints:
    all wait first) or ``opt.wait_params()``. ``False``: ``step()`` waits for the gather."""

    precision: str = "fp32"
    """Compute dtype of the model: ``fp32``, ``bf16`` or ``fp16``. Low precision keeps an fp32
    master copy of the owned shard inside the optimizer."""

    reduce_dtype: str = "fp32"
    """Dtype gradients are reduced in. fp32 (default) is safe; bf16/fp16 halve traffic but can
    lose small gradients."""

    loss_scale: float | None = None
    """fp16 only: a fixed loss scale, or ``None`` for dynamic loss scaling."""

    initial_scale: float = 2.0**16
    """fp16 dynamic loss scaling: the starting scale."""

    growth_factor: float = 2.0
    """fp16 dynamic loss scaling: multiply the scale by this after ``growth_interval`` finite
    steps."""

    backoff_factor: float = 0.5
    """fp16 dynamic loss scaling: multiply the scale by this on overflow (after hysteresis)."""

    growth_interval: int = 1000
    """fp16 dynamic loss scaling: consecutive finite steps before the scale grows."""

    hysteresis: int = 2
    """fp16 dynamic loss scaling: overflows tolerated before the scale is lowered."""

    min_loss_scale: float = 1.0
    """fp16 dynamic loss scaling: reaching a lower scale than this raises an error."""

    # -- stage 3 (parameter partitioning; see zerodp/params) --------------------------------------

    unit_classes: tuple[str, ...] = ()
    """Stage 3: class names of the modules whose parameters are gathered together (*units*),
    e.g. ``("Block",)``. Empty: every element of an ``nn.ModuleList`` / ``nn.Sequential`` /
    ``nn.ModuleDict`` with at least ``unit_min_numel`` parameter elements (the repeated layers)
    and every large leaf child of the root (``leaf_unit_min_numel``); everything else is in the
    root unit. ``zerodp.initialize(unit_policy=...)`` overrides both."""

    unit_min_numel: int = 2**14
    """Stage 3, default unit policy: a container element with fewer parameter elements than this
    stays in its parent's unit (tiny units cost a collective each for little memory)."""

    leaf_unit_min_numel: int = 2**20
    """Stage 3, default unit policy: a leaf module directly under the root (no children, e.g. a
    token embedding or an LM head) owning at least this many parameter elements is a unit of
    its own (*attached*) instead of part of the root unit, which stays gathered for the whole
    step. Reading its parameters while the root is gathered (the root's forward, the loss)
    gathers it on demand. Set it above the model's size to keep such modules in the root."""

    prefetch_depth: int = 1
    """Stage 3: how many units ahead to all-gather while a unit computes (forward and backward).
    Gathered parameters are bounded by (prefetch_depth + 1) x the largest unit, plus the units
    enclosing the running one. 0: gather on demand only."""

    persist_numel: int = 0
    """Stage 3: trainable parameters with at most this many elements stay replicated
    (*persistent*): never released, so readable anywhere. [Note: persistent parameters] Their
    gradients are reduce-scattered at the end of backward and their optimizer state is sharded,
    and the updated slices are all-gathered after the step, as in stage 2: the same 2x volume as
    stage 0's all-reduce. Trainable parameters that no optimizer group holds are persistent too.
    The memory report counts them (``persistent_parameters``)."""

    check_unit_order: bool = True
    """Stage 3: before each parameter collective, agree (one tiny all-gather) on what every rank
    is about to do: where ranks run different units (mixture-of-experts routing, a layer skipped
    on one rank) their plans are merged and each rank joins the others' collectives ([Note:
    merged plans] in params/order.py); where they cannot be merged every rank raises a clear
    error instead of hanging. Costs a small blocking collective, about 2 per unit per step.
    ``False`` is unsafe with control flow that differs between ranks (docs/stage3.md)."""

    watchdog_s: float | None = 300.0
    """How long a rank waits in one collective for the others before it raises
    ``zerodp.CollectiveError`` on every waiting rank, naming the rank that is late (and its
    step and phase), the rank that failed first, or the ranks at different steps ([Note:
    watchdog] in comm/watchdog.py). ``None``: wait for the process group's own timeout. Raise
    it if some rank legitimately works alone for longer (e.g. rank 0 evaluates between steps
    while the others wait in the next step)."""

    # -- misuse and failures ("never silently wrong") -------------------------------------------

    nonfinite: str = "raise"
    """precision ``fp32`` and ``bf16``: what ``step()`` does when a gradient (or the loss given
    to ``opt.backward``) is NaN or inf on some rank; every rank decides the same, from the flag
    the step's one agreement all-reduce already carries ([Note: step agreement]).
    ``"raise"`` (default): every rank raises the same ``RuntimeError`` naming the step, before
    any parameter changes; ``"skip"``: the step is skipped on every rank, logged and counted in
    ``opt.skipped_steps`` / ``opt.last_step``; ``"ignore"``: no check (torch's, DDP's and
    FSDP2's behaviour: NaN reaches the weights). Raising is the default because without a loss
    scale a non-finite value is no transient overflow that a lower scale fixes: it is a
    diverging run, a bad batch or a bug, and skipping would hide it while every later step is
    skipped too (Megatron-LM raises by default for the same reason); ``"skip"`` is one line
    away for runs that must ride over rare bad batches. Costs one read of the owned gradient
    shard per step (~16 ms per 100M fp32 elements on one CPU core, about a sixth of a fused
    AdamW step). ``fp16`` ignores this: its loss scaler skips such steps and lowers the scale."""

    step_without_backward: str = "warn"
    """What ``step()`` does when no backward since the previous ``step()`` produced a gradient
    on any rank (``loss.backward()`` forgotten, or ``step()`` called twice): ``"warn"``
    (default): log a warning and step as torch does (the gradients left since the last
    ``zero_grad``, often none); ``"raise"``: every rank raises, nothing changes; ``"ignore"``.
    Always counted (``opt.steps_without_backward``, ``opt.last_step.without_backward``). Not
    ``"raise"`` by default because torch accepts such a step and some code relies on it (one
    ``step()`` to create optimizer state before loading one; kept zero gradients after
    ``zero_grad(set_to_none=False)``), while the bugs it reveals (a model that silently does not
    train, a double update) only need to be seen. Decided from a bit of the step's agreement
    all-reduce, so a rank whose parameters legitimately got no gradient is not flagged while
    another rank's did."""

    def __post_init__(self) -> None:
        _check_choice("stage", self.stage, STAGES)
        _check_positive_int("bucket_bytes", self.bucket_bytes)
        _check_bool("broadcast_buffers", self.broadcast_buffers)
        _check_bool("overlap_param_gather", self.overlap_param_gather)
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("reduce_dtype", self.reduce_dtype, REDUCE_DTYPES)
        if self.loss_scale is not None:
            _check_positive_float("loss_scale", self.loss_scale)
            if self.precision != "fp16":
                raise ValueError(
                    "ZeroConfig.loss_scale is only used with precision='fp16'; "
                    f"got precision={self.precision!r}: drop loss_scale or use fp16"
                )
        _check_positive_float("initial_scale", self.initial_scale)
        if not self.growth_factor > 1.0:
            raise ValueError(f"ZeroConfig.growth_factor must be > 1.0; got {self.growth_factor!r}")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(
                f"ZeroConfig.backoff_factor must be in (0, 1); got {self.backoff_factor!r}"
            )
        _check_positive_int("growth_interval", self.growth_interval)
        _check_positive_int("hysteresis", self.hysteresis)
        _check_positive_float("min_loss_scale", self.min_loss_scale)
        if isinstance(self.unit_classes, list):  # from JSON
            object.__setattr__(self, "unit_classes", tuple(self.unit_classes))
        if not isinstance(self.unit_classes, tuple) or not all(
            isinstance(c, str) and c for c in self.unit_classes
        ):
            raise ValueError(
                "ZeroConfig.unit_classes must be a tuple of module class names; "
                f"got {self.unit_classes!r}"
            )
        _check_non_negative_int("unit_min_numel", self.unit_min_numel)
        _check_non_negative_int("leaf_unit_min_numel", self.leaf_unit_min_numel)
        _check_non_negative_int("prefetch_depth", self.prefetch_depth)
        _check_non_negative_int("persist_numel", self.persist_numel)
        _check_bool("check_unit_order", self.check_unit_order)
        if self.watchdog_s is not None:
            _check_positive_float("watchdog_s", self.watchdog_s)
        _check_choice("nonfinite", self.nonfinite, NONFINITE)
        _check_choice("step_without_backward", self.step_without_backward, STEP_WITHOUT_BACKWARD)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ZeroConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"ZeroConfig got unknown field(s) {unknown}; allowed fields: {sorted(known)}"
            )
        return cls(**values)

    @classmethod
    def from_json(cls, path: str | Path) -> ZeroConfig:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
        if not isinstance(values, dict):
            raise ValueError(f"{path}: a ZeroConfig JSON file must hold an object at top level")
        return cls.from_dict(values)


def _check_choice(name: str, value: object, allowed: tuple[object, ...]) -> None:
    # bool is an int subclass: stage=True must not pass as stage=1.
    if isinstance(value, bool) or value not in allowed:
        raise ValueError(
            f"ZeroConfig.{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}"
        )


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"ZeroConfig.{name} must be a positive integer; got {value!r}")


def _check_non_negative_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"ZeroConfig.{name} must be a non-negative integer; got {value!r}")


def _check_positive_float(name: str, value: object) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    if not ok or value != value:  # NaN
        raise ValueError(f"ZeroConfig.{name} must be a positive number; got {value!r}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"ZeroConfig.{name} must be True or False; got {value!r}")
