"""Bytes one rank holds on each tier (device, host, NVMe) under an offload placement.

Pure arithmetic, in the layout zerodp's offload uses ([Note: offloaded step] in
offload/runner.py) or, for the tiers not built yet, the layout they are being built to. Per
parameter Ψ, world size N, compute dtype of p bytes (2 for bf16), optimizer bytes K (12 for
mixed-precision Adam: fp32 masters and two moments), this rank's owned slice Ψ/N (stages 1-3),
a bucket's owned slice ``c`` (``bucket_bytes / p / N`` elements) and ``R`` ring buckets:

- ``optimizer="cpu"`` (built): host holds K·Ψ/N of masters and moments, a full fp32 copy of the
  owned gradient (4·Ψ/N) and two transfer rings (to and from the device) of R slots of 4·c
  bytes: 16 B per owned parameter plus 2·R·4·c. The device keeps parameters and gradients.
- Partial offload, ``optimizer_fraction`` f (not built): a fraction f of the owned optimizer
  state is offloaded (and stepped there), 1 - f stays on the device (and is stepped there).
- ``optimizer="nvme"`` (built with f = 1: [Note: optimizer state on NVMe] in offload/swap.py):
  the offloaded K·f·Ψ/N are in files; the host keeps R swap slots of K·c bytes and the
  gradient ring below.
- ``params="cpu"|"nvme"`` (stage 3, built with f = 1): the parameter shards (p·Ψ/N) rest on
  that tier; the device holds the gathered units in flight, activations and, as built, every
  reduced gradient shard until the step.
- ``gradients="nvme"`` (stage 3, built): the reduced gradient shards (p·Ψ/N) are written to a
  file as backward produces them; the host keeps R spill slots of p·c bytes besides the step's
  fp32 gradient ring, and the device none of them.
- Gradients of the placements not built yet (f < 1): with the parameters on the device
  (``params="none"``), the device keeps its gradients and the host pulls them bucket by bucket
  through an fp32 ring of R slots (no full host copy); with the parameters offloaded, each
  unit's reduced gradient leaves the device during backward and the host keeps the offloaded
  part in the compute dtype (p·f·Ψ/N) until the step's non-finite check and clipping are known,
  then upcasts it bucket by bucket through that ring. (Stepping a bucket before every gradient
  is known would not be the exact step: a skipped or clipped step is decided from all of them.)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from zerodp.config.offload import GRADIENT_TIERS, TIERS
from zerodp.memory.estimator import (
    GPTShape,
    activation_bytes,
    comm_buffer_bytes,
    dtype_bytes,
    gpt_largest_unit_params,
    gpt_param_count,
    optimizer_multiplier,
)

DEFAULT_BUCKET_BYTES = 32 * 2**20  # ZeroConfig().bucket_bytes
DEFAULT_RING_BUCKETS = 4  # OffloadConfig().ring_buckets
FP32 = 4.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """What is trained, per rank: the model, the tokens of one step and zerodp's settings."""

    num_params: float
    tokens: float
    """Tokens per rank per step (micro-batch x sequence length)."""
    shape: GPTShape | None = None
    """For activations and stage-3 units; ``None``: neither is counted."""
    precision: str = "bf16"
    optimizer: str = "adamw"
    world_size: int = 1
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ring_buckets: int = DEFAULT_RING_BUCKETS
    prefetch_depth: int = 1
    reduce_precision: str = "fp32"
    largest_unit_params: float | None = None
    """Overrides the unit size taken from ``shape``."""

    def __post_init__(self) -> None:
        if not self.num_params > 0 or not self.tokens > 0:
            raise ValueError("Workload.num_params and Workload.tokens must be > 0")
        dtype_bytes(self.precision)
        dtype_bytes(self.reduce_precision)
        optimizer_multiplier(self.optimizer, self.precision)
        for name in ("world_size", "bucket_bytes", "ring_buckets"):
            if getattr(self, name) < 1:
                raise ValueError(f"Workload.{name} must be >= 1")
        if self.prefetch_depth < 0:
            raise ValueError("Workload.prefetch_depth must be >= 0")

    @classmethod
    def gpt(cls, shape: GPTShape, **settings: Any) -> Workload:
        """A GPT of ``shape``: its parameter count and micro-batch x sequence tokens."""
        tokens = float(shape.micro_batch * shape.seq_len)
        return cls(num_params=float(gpt_param_count(shape)), tokens=tokens, shape=shape, **settings)

    @property
    def param_bytes(self) -> float:
        return float(dtype_bytes(self.precision))

    @property
    def mixed(self) -> bool:
        return self.precision != "fp32"

    @property
    def unit_params(self) -> float:
        """Parameters of the largest stage-3 unit (0 if not known)."""
        if self.largest_unit_params is not None:
            return self.largest_unit_params
        return float(gpt_largest_unit_params(self.shape)) if self.shape is not None else 0.0

    @property
    def units(self) -> float:
        """Stage-3 units (blocks + the root unit); without a shape, one per bucket."""
        if self.shape is not None:
            return float(self.shape.layers + 1)
        return max(1.0, self.num_params / self.bucket_numel)

    @property
    def bucket_numel(self) -> float:
        return float(max(1, int(self.bucket_bytes // self.param_bytes)))


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Where the optimizer state and the parameters of one rank rest (``OffloadConfig``'s
    ``optimizer`` and ``params``), the offloaded fraction, the stage and checkpointing."""

    optimizer: str = "none"
    params: str = "none"
    optimizer_fraction: float = 1.0
    """Of the owned optimizer state, the fraction offloaded (the rest stays on the device, as
    DeepSpeed's ``offload_optimizer.ratio``); only with an offloaded optimizer."""
    stage: int = 2
    checkpointing: bool = False
    gradients: str = "device"
    """Stage 3: ``"nvme"``, the reduced gradient shards are written to a file as backward
    produces them and read back by the step (``OffloadConfig.gradients``)."""

    def __post_init__(self) -> None:
        for name in ("optimizer", "params"):
            if getattr(self, name) not in TIERS:
                raise ValueError(f"Placement.{name} must be one of {', '.join(TIERS)}")
        if self.gradients not in GRADIENT_TIERS:
            raise ValueError(f"Placement.gradients must be one of {', '.join(GRADIENT_TIERS)}")
        if self.gradients != "device" and (self.stage != 3 or self.optimizer == "none"):
            raise ValueError("gradients on NVMe need stage 3 and an offloaded optimizer")
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"Placement.stage must be 0-3; got {self.stage!r}")
        if not 0.0 <= self.optimizer_fraction <= 1.0:
            raise ValueError("Placement.optimizer_fraction must be in [0, 1]")
        if self.optimizer == "none" and self.optimizer_fraction != 1.0:
            raise ValueError("Placement.optimizer_fraction needs an offloaded optimizer")
        if self.optimizer != "none" and self.stage == 0:
            raise ValueError("an offloaded optimizer needs stage 1, 2 or 3")
        if self.params != "none" and self.stage != 3:
            raise ValueError("offloaded parameters need stage 3")

    @property
    def offloaded(self) -> float:
        """The fraction of the owned optimizer state off the device (0 without offload)."""
        return 0.0 if self.optimizer == "none" else self.optimizer_fraction

    @property
    def built(self) -> bool:
        """Whether zerodp implements this placement today (the rest are predictions)."""
        if self.params != "none" and self.optimizer == "none":
            return False  # refused: parameter offload needs the optimizer offloaded
        return self.optimizer == "none" or self.optimizer_fraction == 1.0

    @property
    def host_gradient(self) -> str:
        """Where the offloaded step's gradients wait on the host: ``"none"`` (no offloaded
        step), ``"fp32"`` (a full fp32 copy: the built path), ``"ring"`` (pulled per bucket from
        the device), ``"compute"`` (a compute-dtype copy: the device keeps none)."""
        if self.optimizer == "none":
            return "none"
        if self.built:  # the step's own host gradient: whole (cpu) or a ring (nvme)
            return "fp32" if self.optimizer == "cpu" and self.gradients == "device" else "ring"
        return "ring" if self.params == "none" else "compute"

    def label(self) -> str:
        """Short text: ``optimizer=cpu:0.5 params=cpu s3 ckpt``, ``no offload s2``."""
        parts = []
        if self.optimizer != "none":
            fraction = "" if self.optimizer_fraction == 1.0 else f":{self.optimizer_fraction:g}"
            parts.append(f"optimizer={self.optimizer}{fraction}")
        if self.params != "none":
            parts.append(f"params={self.params}")
        if self.gradients != "device":
            parts.append(f"grads={self.gradients}")
        if not parts:
            parts.append("no offload")
        parts.append(f"s{self.stage}")
        if self.checkpointing:
            parts.append("ckpt")
        return " ".join(parts)


@dataclass(frozen=True, slots=True)
class Breakdown:
    """Bytes of one tier, by what holds them (entries of 0 bytes are left out)."""

    items: tuple[tuple[str, float], ...]

    @classmethod
    def of(cls, items: Iterable[tuple[str, float]]) -> Breakdown:
        return cls(tuple((name, float(n)) for name, n in items if n))

    @property
    def total(self) -> float:
        return sum((n for _, n in self.items), 0.0)

    def get(self, name: str) -> float:
        return sum(n for key, n in self.items if key == name)

    def as_dict(self) -> dict[str, float]:
        return dict(self.items)


@dataclass(frozen=True, slots=True)
class TierBytes:
    device: Breakdown
    host: Breakdown
    nvme: Breakdown


@dataclass(frozen=True, slots=True)
class _Counts:
    """Elements behind the byte counts: what rests here and what the offloaded step moves."""

    resting_params: float  # parameter elements this rank keeps (Ψ/N at stage 3)
    grads: float  # gradient elements this rank keeps with the parameters on the device
    owned: float  # the owned slice the optimizer steps (Ψ/N at stages 1-3)
    offloaded: float  # of which stepped off the device (f·owned)
    chunk: float  # elements of the largest bucket's owned slice (the device step's scratch)
    ring_chunk: float  # the same, of the offloaded part (a ring slot)


def counts(w: Workload, p: Placement) -> _Counts:
    psi, n = w.num_params, w.world_size
    owned = psi / n if p.stage >= 1 else psi
    bucket_owned = w.bucket_numel / n if p.stage >= 1 else w.bucket_numel
    offloaded = p.offloaded * owned
    return _Counts(
        resting_params=psi / n if p.stage == 3 else psi,
        grads=psi / n if p.stage >= 2 else psi,
        owned=owned,
        offloaded=offloaded,
        chunk=min(bucket_owned, owned),
        ring_chunk=min(bucket_owned, offloaded),
    )


def tier_bytes(w: Workload, p: Placement) -> TierBytes:
    """Bytes per tier for one rank; see the module docstring for the layout."""
    c = counts(w, p)
    pb = w.param_bytes
    k_device = optimizer_multiplier(w.optimizer, w.precision)
    k_off = optimizer_multiplier(w.optimizer, w.precision, offload=True)
    on_device_states = c.owned - c.offloaded
    unit = w.unit_params
    ring = w.ring_buckets
    staging = comm_buffer_bytes(
        p.stage,
        w.bucket_numel * pb,
        param_bytes=pb,
        reduce_bytes=dtype_bytes(w.reduce_precision),
    )
    activations = logits = 0.0
    if w.shape is not None:
        s = w.shape
        activations = activation_bytes(s, dtype_bytes=int(pb), checkpointing=p.checkpointing)
        # The logits in the compute dtype and the loss's fp32 copy of them (b·s·V each).
        logits = s.micro_batch * s.seq_len * s.vocab * (pb + FP32)
    device = Breakdown.of(
        [
            ("parameters", pb * c.resting_params if p.params == "none" else 0.0),
            ("gradients", _device_gradients(p, c, pb)),
            ("optimizer state", k_device * on_device_states),
            ("step scratch", FP32 * c.chunk if w.mixed else 0.0),
            ("gradient staging", staging),
            ("gathered units", (w.prefetch_depth + 1) * unit * pb if p.stage == 3 else 0.0),
            ("unit gradients", unit * pb if p.stage == 3 else 0.0),
            ("activations", activations),
            ("logits", logits),
        ]
    )
    grad_mode = p.host_gradient
    grads_nvme = p.gradients == "nvme"
    host_gradients = {"fp32": FP32 * c.owned, "compute": pb * c.offloaded}.get(grad_mode, 0.0)
    offloading = p.optimizer != "none"
    host = Breakdown.of(
        [
            ("optimizer state", k_off * c.offloaded if p.optimizer == "cpu" else 0.0),
            ("parameters", pb * c.resting_params if p.params == "cpu" else 0.0),
            ("gradients", host_gradients),
            ("transfer rings", 2 * ring * FP32 * c.ring_chunk if offloading else 0.0),
            (
                "gradient ring",
                ring * FP32 * c.ring_chunk if grad_mode in ("ring", "compute") else 0.0,
            ),
            ("nvme swap slots", ring * k_off * c.ring_chunk if p.optimizer == "nvme" else 0.0),
            ("gradient spill slots", ring * pb * c.ring_chunk if grads_nvme else 0.0),
            (
                "parameter staging",
                (w.prefetch_depth + 1) * unit / w.world_size * pb if p.params != "none" else 0.0,
            ),
        ]
    )
    nvme = Breakdown.of(
        [
            ("optimizer state", k_off * c.offloaded if p.optimizer == "nvme" else 0.0),
            ("parameters", pb * c.resting_params if p.params == "nvme" else 0.0),
            ("gradients", pb * c.grads if grads_nvme else 0.0),
        ]
    )
    return TierBytes(device=device, host=host, nvme=nvme)


def _device_gradients(p: Placement, c: _Counts, pb: float) -> float:
    """Built, the device keeps every reduced gradient shard until the step, unless they are on
    NVMe; the unbuilt design with offloaded parameters sends the offloaded part's out during
    backward (the module docstring)."""
    if p.gradients != "device":
        return 0.0
    if p.params == "none" or p.built:
        return pb * c.grads
    return pb * (c.owned - c.offloaded)
