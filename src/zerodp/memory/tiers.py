"""Bytes one rank holds on each tier (device, host, NVMe) under an offload placement.

Pure arithmetic, in the layout zerodp's offload uses ([Note: offloaded step] in
offload/runner.py, [Note: partial offload] in offload/partial.py). Per parameter Ψ, world size
N, compute dtype of p bytes (2 for bf16), optimizer bytes K (12 for mixed-precision Adam: fp32
masters and two moments), this rank's owned slice Ψ/N (stages 1-3), a bucket's owned slice
``c`` (``bucket_bytes / p / N`` elements), ``R`` ring buckets and the offloaded fraction f of
the owned optimizer state (1 unless partial):

- ``optimizer="cpu"``: host holds K·f·Ψ/N of masters and moments, an fp32 copy of the
  offloaded part's gradient (4·f·Ψ/N; with ``host_gradients="ring"`` R slots of 4·c bytes
  instead) and two transfer rings (to and from the device) of R slots of 4·c bytes: 16 B per
  offloaded parameter plus 2·R·4·c. The device keeps parameters, gradients and the kept
  (1 - f) part of the optimizer state.
- ``optimizer="nvme"`` ([Note: optimizer state on NVMe] in offload/swap.py): the offloaded
  K·f·Ψ/N are in files; the host keeps R swap slots of K·c bytes, the fp32 gradient ring (by
  default; ``host_gradients="full"``: the whole 4·f·Ψ/N) and the transfer rings.
- ``params="cpu"|"nvme"`` (stage 3): the parameter shards of the offloaded units (f·p·Ψ/N)
  rest on that tier, the kept units' on the device; the device holds the gathered units in
  flight, activations and every reduced gradient shard until the step.
- ``gradients="nvme"`` (stage 3, f = 1): the reduced gradient shards (p·Ψ/N) are written to a
  file as backward produces them; the host keeps R spill slots of p·c bytes besides the step's
  fp32 gradient, and the device none of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from zerodp.config.offload import GRADIENT_TIERS, HOST_GRADIENTS, TIERS
from zerodp.memory.activations import gpt_activation_bytes, gpt_working_bytes
from zerodp.memory.estimator import (
    GPTShape,
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
    receive_fraction: float = 0.0
    """Reduce-scatter receive buffers per staging bucket ((N-1)/N with gloo on CPU, else 0)."""

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
    host_gradients: str = "auto"
    """The offloaded step's fp32 gradient in host memory (``OffloadConfig.host_gradients``):
    ``"full"``, ``"ring"``, or ``"auto"`` (full for ``"cpu"``, a ring for ``"nvme"``)."""

    def __post_init__(self) -> None:
        for name in ("optimizer", "params"):
            if getattr(self, name) not in TIERS:
                raise ValueError(f"Placement.{name} must be one of {', '.join(TIERS)}")
        if self.gradients not in GRADIENT_TIERS:
            raise ValueError(f"Placement.gradients must be one of {', '.join(GRADIENT_TIERS)}")
        if self.host_gradients not in HOST_GRADIENTS:
            raise ValueError(f"Placement.host_gradients must be one of {', '.join(HOST_GRADIENTS)}")
        if self.host_gradients != "auto" and self.optimizer == "none":
            raise ValueError("Placement.host_gradients needs an offloaded optimizer")
        if self.gradients != "device" and (self.stage != 3 or self.optimizer == "none"):
            raise ValueError("gradients on NVMe need stage 3 and an offloaded optimizer")
        if self.gradients != "device" and self.optimizer_fraction != 1.0:
            raise ValueError("gradients on NVMe need the whole optimizer offloaded (fraction 1)")
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
        if self.params != "none" and self.optimizer == "none":
            raise ValueError("offloaded parameters need an offloaded optimizer")

    @property
    def offloaded(self) -> float:
        """The fraction of the owned optimizer state off the device (0 without offload)."""
        return 0.0 if self.optimizer == "none" else self.optimizer_fraction

    @property
    def host_gradient(self) -> str:
        """How the offloaded step's fp32 gradient waits on the host: ``"none"`` (no offloaded
        step), ``"fp32"`` (a whole copy of the offloaded part), ``"ring"`` (R chunk slots,
        pulled from the device or the spill file as the step goes)."""
        if self.optimizer == "none":
            return "none"
        if self.host_gradients == "auto":
            return "ring" if self.optimizer == "nvme" else "fp32"
        return "ring" if self.host_gradients == "ring" else "fp32"

    def label(self) -> str:
        """Short text: ``optimizer=cpu:0.5 params=cpu s3 ckpt``, ``no offload s2``; a host
        gradient other than the tier's default is named (``hostgrad=ring``)."""
        parts = []
        if self.optimizer != "none":
            fraction = "" if self.optimizer_fraction == 1.0 else f":{self.optimizer_fraction:g}"
            parts.append(f"optimizer={self.optimizer}{fraction}")
            if self.host_gradients != "auto":
                default = "ring" if self.optimizer == "nvme" else "fp32"
                if self.host_gradient != default:
                    parts.append(f"hostgrad={self.host_gradients}")
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
        receive_fraction=w.receive_fraction,
    )
    activations = working = 0.0
    if w.shape is not None:
        s = w.shape
        activations = gpt_activation_bytes(
            s, dtype_bytes=int(pb), checkpointing=p.checkpointing
        )  # the loss's fp32 log-softmax included ([Note: GPT activations])
        # The logits the caller holds and the backward's gradients of them, or one block's
        # ([Note: backward working set]): the margin a fit needs.
        working = gpt_working_bytes(s, dtype_bytes=int(pb))
    # Stage 3 with the parameters offloaded: the kept units' shards stay on the device.
    params_off = pb * c.resting_params * p.offloaded if p.params != "none" else 0.0
    device = Breakdown.of(
        [
            ("parameters", pb * c.resting_params - params_off),
            ("gradients", pb * c.grads if p.gradients == "device" else 0.0),
            ("optimizer state", k_device * on_device_states),
            # Mixed precision: one bucket's fp32 scratch for the check and clip over every
            # gradient, and under partial offload another for the kept part's device step.
            (
                "step scratch",
                FP32 * c.chunk * (1 + (0 < c.offloaded < c.owned)) if w.mixed else 0.0,
            ),
            ("gradient staging", staging),
            ("gathered units", (w.prefetch_depth + 1) * unit * pb if p.stage == 3 else 0.0),
            ("unit gradients", unit * pb if p.stage == 3 else 0.0),
            ("activations", activations),
            ("backward working set", working),
        ]
    )
    grad_mode = p.host_gradient
    grads_nvme = p.gradients == "nvme"
    offloading = p.optimizer != "none"
    host = Breakdown.of(
        [
            ("optimizer state", k_off * c.offloaded if p.optimizer == "cpu" else 0.0),
            ("parameters", params_off if p.params == "cpu" else 0.0),
            ("gradients", FP32 * c.offloaded if grad_mode == "fp32" else 0.0),
            ("transfer rings", 2 * ring * FP32 * c.ring_chunk if offloading else 0.0),
            ("gradient ring", ring * FP32 * c.ring_chunk if grad_mode == "ring" else 0.0),
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
            ("parameters", params_off if p.params == "nvme" else 0.0),
            ("gradients", pb * c.grads if grads_nvme else 0.0),
        ]
    )
    return TierBytes(device=device, host=host, nvme=nvme)
