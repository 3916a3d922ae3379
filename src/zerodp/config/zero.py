"""``ZeroConfig``: how zerodp shards and communicates; frozen and validated.

Every field is checked at construction, so that a bad value fails before any process group
traffic or model surgery, with a ``ValueError`` that names the field by its path
(``ZeroConfig.precision.reduce``) and what is allowed. The settings of one concern are a nested
policy ([Note: nested policies] in nesting.py); the flat names of 0.1 still work for one
release ([Note: flat names] in legacy.py). ``ZeroConfig.from_dict`` / ``from_json`` take the
nested form ``to_dict`` gives, and reject unknown keys at every level (a typo in a JSON file
must not be silently ignored).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from zerodp.config.activations import Activations
from zerodp.config.checks import (
    check_bool,
    check_choice,
    check_positive_float,
    check_positive_int,
)
from zerodp.config.legacy import accepts_flat_names, nest_flat_names, read_flat_name
from zerodp.config.nesting import Policy, coerce_policies, from_mapping
from zerodp.config.offload import OffloadConfig, check_offload_stage
from zerodp.config.policies import Precision, Stage3

STAGES = (0, 1, 2, 3)
STEP_WITHOUT_BACKWARD = ("warn", "raise", "ignore")


@accepts_flat_names
@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroConfig(Policy):
    """How zerodp shards and communicates.

    The defaults suit both CPU/gloo and GPU/NCCL; most users set only ``stage`` (and
    ``precision="bf16"``, short for ``precision=Precision(compute="bf16")``).
    """

    PATH: ClassVar[str] = "ZeroConfig"

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
    does; eval and ``no_grad`` forwards issue no collective ([Note: buffers] in
    forward_hooks.py)."""

    overlap_param_gather: bool = True
    """Stages 1-2: issue the all-gather of the updated parameter slices per bucket at the end of
    ``step()`` without waiting, and wait for each bucket just before the first module that
    registers one of its parameters runs its next forward (``forward`` pre-hooks), so the
    gather overlaps the time until then and the next forward. Results are identical. Reading a
    parameter *outside* a forward before the next forward sees the old values of other ranks'
    slices unless it goes through the model (``model.parameters()``, ``named_parameters()``,
    ``state_dict()``, attribute access on the model, ``zerodp.full_parameters``, checkpoints:
    all wait first) or ``opt.wait_params()``. ``False``: ``step()`` waits for the gather."""

    watchdog_s: float | None = 300.0
    """How long a rank waits in one collective for the others before it raises
    ``zerodp.CollectiveError`` on every waiting rank, naming the rank that is late (and its
    step and phase), the rank that failed first, or the ranks at different steps ([Note:
    watchdog] in comm/watchdog.py). ``None``: wait for the process group's own timeout. Raise
    it if some rank legitimately works alone for longer (e.g. rank 0 evaluates between steps
    while the others wait in the next step)."""

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

    precision: Precision = field(default_factory=Precision)
    """Compute and reduction dtypes, fp16 loss scaling, and what a non-finite step does."""

    stage3: Stage3 = field(default_factory=Stage3)
    """Stage 3's units, prefetching and persistent parameters; other stages ignore it."""

    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Optimizer state (stages 1-3) and parameters (stage 3) in host memory or on NVMe."""

    activations: Activations = field(default_factory=Activations)
    """Activation checkpointing of chosen module classes (every stage)."""

    if TYPE_CHECKING:
        # What type checkers see: the generated __init__ but with the precision shorthand.
        # At run time the dataclass's own __init__ (wrapped by accepts_flat_names) is used;
        # tests/unit/test_config.py checks that these parameters are the fields.
        def __init__(
            self,
            *,
            stage: int = ...,
            bucket_bytes: int = ...,
            broadcast_buffers: bool = ...,
            overlap_param_gather: bool = ...,
            watchdog_s: float | None = ...,
            step_without_backward: str = ...,
            precision: Precision | str = ...,
            stage3: Stage3 = ...,
            offload: OffloadConfig = ...,
            activations: Activations = ...,
        ) -> None: ...

    else:

        def __getattr__(self, name: str) -> Any:
            # Only for names that are not fields: the flat names of 0.1 ([Note: flat names]).
            return read_flat_name(self, name)

    def __post_init__(self) -> None:
        coerce_policies(self)
        check_choice(self, "stage", STAGES)
        check_positive_int(self, "bucket_bytes")
        check_bool(self, "broadcast_buffers")
        check_bool(self, "overlap_param_gather")
        check_positive_float(self, "watchdog_s", optional=True)
        check_choice(self, "step_without_backward", STEP_WITHOUT_BACKWARD)
        check_offload_stage(self.offload, self.stage)

    def to_dict(self) -> dict[str, Any]:
        """The nested form, JSON-ready (tuples aside): ``from_dict`` gives this config back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ZeroConfig:
        """The config ``to_dict`` (or a JSON file) gives: policies as nested dicts, partial
        ones keeping their other defaults, ``"precision": "bf16"`` as the shorthand."""
        return cls._from_dict(values, stacklevel=4)

    @classmethod
    def from_json(cls, path: str | Path) -> ZeroConfig:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
        if not isinstance(values, dict):
            raise ValueError(f"{path}: a ZeroConfig JSON file must hold an object at top level")
        return cls._from_dict(values, stacklevel=4)

    @classmethod
    def _from_dict(cls, values: Mapping[str, Any], stacklevel: int) -> ZeroConfig:
        """``stacklevel``: the user's frame for flat-name warnings, counted from
        ``nest_flat_names`` (it, this, ``from_dict``/``from_json``, the user)."""
        if not isinstance(values, Mapping):
            raise ValueError(f"ZeroConfig.from_dict takes a dict; got {values!r}")
        nested, _ = nest_flat_names(cls, values, spelling="dict", stacklevel=stacklevel)
        return from_mapping(cls, nested)
