"""The nested policies of ``ZeroConfig``: precision (with fp16 loss scaling) and stage 3.

Each is a frozen dataclass validated at construction ([Note: nested policies] in nesting.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from zerodp.config.checks import (
    check_bool,
    check_choice,
    check_class_names,
    check_in_range,
    check_non_negative_int,
    check_positive_float,
    check_positive_int,
    field_path,
)
from zerodp.config.nesting import Policy, coerce_policies

PRECISIONS = ("fp32", "bf16", "fp16")
REDUCE_DTYPES = ("fp32", "bf16", "fp16")
NONFINITE = ("raise", "skip", "ignore")


@dataclass(frozen=True, kw_only=True, slots=True)
class LossScaling(Policy):
    """fp16 loss scaling (``Precision(compute="fp16")``; other compute dtypes ignore it)."""

    PATH: ClassVar[str] = "ZeroConfig.precision.loss_scaling"

    fixed: float | None = None
    """fp16 only: a fixed loss scale, or ``None`` for dynamic loss scaling."""

    initial: float = 2.0**16
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

    min_scale: float = 1.0
    """fp16 dynamic loss scaling: reaching a lower scale than this raises an error."""

    def __post_init__(self) -> None:
        check_positive_float(self, "fixed", optional=True)
        check_positive_float(self, "initial")
        check_in_range(self, "growth_factor", 1.0, None)
        check_in_range(self, "backoff_factor", 0, 1)
        check_positive_int(self, "growth_interval")
        check_positive_int(self, "hysteresis")
        check_positive_float(self, "min_scale")


@dataclass(frozen=True, kw_only=True, slots=True)
class Precision(Policy):
    """Dtypes of compute and gradient reduction, and what a non-finite step does.

    ``ZeroConfig(precision="bf16")`` is short for ``ZeroConfig(precision=Precision(
    compute="bf16"))``."""

    PATH: ClassVar[str] = "ZeroConfig.precision"
    SHORTHAND: ClassVar[str | None] = "compute"

    compute: str = "fp32"
    """Compute dtype of the model: ``fp32``, ``bf16`` or ``fp16``. Low precision keeps an fp32
    master copy of the owned shard inside the optimizer."""

    reduce: str = "fp32"
    """Dtype gradients are reduced in. fp32 (default) is safe; bf16/fp16 halve traffic but can
    lose small gradients."""

    nonfinite: str = "raise"
    """compute ``fp32`` and ``bf16``: what ``step()`` does when a gradient (or the loss given
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

    loss_scaling: LossScaling = field(default_factory=LossScaling)
    """fp16: how the loss is scaled (fixed or dynamic) and how the scale adapts."""

    def __post_init__(self) -> None:
        coerce_policies(self)
        check_choice(self, "compute", PRECISIONS)
        check_choice(self, "reduce", REDUCE_DTYPES)
        check_choice(self, "nonfinite", NONFINITE)
        if self.loss_scaling.fixed is not None and self.compute != "fp16":
            fixed = field_path(self.loss_scaling, "fixed")
            raise ValueError(
                f"{fixed} is only used with compute 'fp16'; got {field_path(self, 'compute')}="
                f"{self.compute!r}: drop loss_scaling.fixed or compute in fp16"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class Stage3(Policy):
    """Stage 3 (parameter partitioning; see zerodp/params and docs/stage3.md): which modules
    are gathered together, how far ahead, and what stays replicated. Other stages ignore it."""

    PATH: ClassVar[str] = "ZeroConfig.stage3"

    unit_classes: tuple[str, ...] = ()
    """Class names of the modules whose parameters are gathered together (*units*), e.g.
    ``("Block",)``. Empty: every element of an ``nn.ModuleList`` / ``nn.Sequential`` /
    ``nn.ModuleDict`` with at least ``unit_min_numel`` parameter elements (the repeated layers)
    and every large leaf child of the root (``leaf_unit_min_numel``); everything else is in the
    root unit. ``zerodp.initialize(unit_policy=...)`` overrides both."""

    unit_min_numel: int = 2**14
    """Default unit policy: a container element with fewer parameter elements than this stays
    in its parent's unit (tiny units cost a collective each for little memory)."""

    leaf_unit_min_numel: int = 2**20
    """Default unit policy: a leaf module directly under the root (no children, e.g. a token
    embedding or an LM head) owning at least this many parameter elements is a unit of its own
    (*attached*) instead of part of the root unit, which stays gathered for the whole step.
    Reading its parameters while the root is gathered (the root's forward, the loss) gathers it
    on demand. Set it above the model's size to keep such modules in the root."""

    prefetch_depth: int = 1
    """How many units ahead to all-gather while a unit computes (forward and backward).
    Gathered parameters are bounded by (prefetch_depth + 1) x the largest unit, plus the units
    enclosing the running one. 0: gather on demand only."""

    keep_last_units: int = 2
    """How many of the last units of the forward stay gathered into the backward, which starts
    with them (as FSDP2 keeps its root): their backward all-gather is skipped, 3Ψ - Ψ_kept per
    step. At most ``prefetch_depth + 1`` of them are kept (the running unit and its prefetches
    at the end of the forward), so the bound on gathered parameters does not change ([Note:
    keeping the last units] in params/holding.py); 0 re-gathers them."""

    skip_backward_gathers: bool = True
    """Do not all-gather for its backward a unit whose backward reads none of its parameters
    (an embedding lookup saves only the indices; ``x + bias`` saves nothing), measured from what
    each forward left referenced and agreed by every rank ([Note: backward without parameters]
    in params/saved.py). ``False`` gathers every unit for its backward: for a custom autograd
    function whose backward reads a parameter through a raw pointer (``ctx.weight = weight``
    and a Triton kernel), which no reference shows."""

    persist_numel: int = 0
    """Trainable parameters with at most this many elements stay replicated (*persistent*):
    never released, so readable anywhere. [Note: persistent parameters] Their gradients are
    reduce-scattered at the end of backward and their optimizer state is sharded, and the
    updated slices are all-gathered after the step, as in stage 2: the same 2x volume as stage
    0's all-reduce. Trainable parameters that no optimizer group holds are persistent too. The
    memory report counts them (``persistent_parameters``)."""

    check_unit_order: bool | str = True
    """Before each parameter collective, agree (one tiny all-gather) on what every rank is
    about to do: where ranks run different units (mixture-of-experts routing, a layer skipped
    on one rank) their plans are merged and each rank joins the others' collectives ([Note:
    merged plans] in params/order.py); where they cannot be merged every rank raises a clear
    error instead of hanging. ``True``: blocking exchanges (about 2 per unit) until a step
    runs alike on every rank, then each step replays the last one's order and checks it
    without waiting; ranks that part from it raise the divergence error ([Note: verified
    orders] in params/replay.py), and once plans were merged every exchange blocks.
    ``"exchange"``: always block (ranks that run the same units for many steps, then not).
    ``False`` is unsafe with control flow that differs between ranks (docs/stage3.md)."""

    def __post_init__(self) -> None:
        check_class_names(self, "unit_classes")
        check_non_negative_int(self, "unit_min_numel")
        check_non_negative_int(self, "leaf_unit_min_numel")
        check_non_negative_int(self, "prefetch_depth")
        check_non_negative_int(self, "keep_last_units")
        check_bool(self, "skip_backward_gathers")
        check_non_negative_int(self, "persist_numel")
        order = self.check_unit_order
        if not (isinstance(order, bool) or order == "exchange"):
            raise ValueError(
                f"{field_path(self, 'check_unit_order')} must be True, False or 'exchange'; "
                f"got {self.check_unit_order!r}"
            )
