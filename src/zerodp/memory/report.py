"""The measured per-rank memory report, beside the theory from the same estimator formulas.

Measured numbers are the bytes of the tensors the engine actually holds (flat parameter buffers,
gradient buffers or shards, every tensor in the optimizer state, staging buffers), not a model of
them; the theory is ``estimator.model_state_bytes`` for the same Ψ, N, stage and optimizer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from zerodp.memory.estimator import ModelStateBytes, model_state_bytes, optimizer_multiplier

_OPTIMIZER_NAMES = {
    torch.optim.Adam: "adam",
    torch.optim.AdamW: "adamw",
    torch.optim.Adagrad: "adagrad",
    torch.optim.RMSprop: "rmsprop",
}


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """Bytes one rank holds, by category. ``theory`` is the paper's formula for the same run."""

    rank: int
    world_size: int
    stage: int
    num_params: int  # Ψ: trainable elements, no padding
    padded_numel: int  # Ψ plus alignment padding, as stored
    parameters: int  # trainable parameters (compute dtype), flat buffers
    gradients: int  # gradient buffers or owned gradient shards
    optimizer_state: int  # every tensor in the optimizer state, fp32 masters included
    master_parameters: int  # of which fp32 master copies (mixed precision; 0 in fp32)
    optimizer_scalar_bytes: int  # of which 0-dim tensors such as Adam's step counters
    comm_buffers: int  # bucket / staging buffers
    frozen_parameters: int  # requires_grad=False parameters, replicated, no optimizer state
    step_transient: int  # fp32 gradient scratch of the mixed-precision step (one bucket's slice)
    precision: str
    theory: ModelStateBytes | None  # None if the optimizer's K is not known
    # Stage 3 (0 otherwise). ``parameters`` is then this rank's shards plus the persistent ones.
    persistent_parameters: int = 0  # replicated small parameters (ZeroConfig.stage3.persist_numel)
    gathered_now: int = 0  # bytes of gathered (unsharded) unit parameters alive now
    gathered_peak: int = 0  # their peak since initialize (or engine.params.gatherer.reset_peak())
    gathered_bound: int = 0  # what the schedule guarantees gathered_peak stays below
    # Released CPU full buffers kept for the next gather; with the gathered bytes, under the
    # bound ([Note: reused gather memory] in params/reuse.py).
    gathered_cached: int = 0
    largest_unit: int = 0  # bytes of the largest unit, gathered
    # Optimizer offload (ZeroConfig.offload.optimizer): the optimizer state (masters included)
    # is then in host memory, with an fp32 copy of the owned gradients and the transfer rings.
    # On NVMe ("nvme"): ``optimizer_state`` is what stays in memory (step counters), the files
    # are ``nvme``, and the host gradient is a ring like the transfer buffers.
    offload: str = "none"
    host_gradients: int = 0
    host_buffers: int = 0
    nvme: int = 0
    # Parameter offload (stage 3, ZeroConfig.offload.params): ``parameters`` is then what stays
    # on the device (persistent parameters), the unit shards are ``host_parameters`` ("cpu") or
    # in a file counted in ``nvme`` ("nvme", whose read ring is in ``host_buffers``).
    params_offload: str = "none"
    host_parameters: int = 0
    # Gradient offload (stage 3, ZeroConfig.offload.gradients="nvme"): ``gradients`` is 0, the
    # shards are in a file counted in ``nvme`` (its ring in ``host_buffers``).
    gradients_offload: str = "device"
    # Partial offload (ZeroConfig.offload.optimizer_fraction < 1): of ``optimizer_state``, what
    # stays on the device (the kept segments' masters and state), and the fraction of this
    # rank's optimizer elements that is offloaded.
    optimizer_on_device: int = 0
    offload_fraction: float = 1.0

    @property
    def model_states(self) -> int:
        """In memory, device and host (what is on NVMe is not)."""
        return self.parameters + self.host_parameters + self.gradients + self.optimizer_state

    @property
    def host(self) -> int:
        """Bytes held in host memory for the offloaded step (0 without offload)."""
        if self.offload == "none":
            return 0
        state = self.optimizer_state - self.optimizer_on_device
        return state + self.host_gradients + self.host_buffers + self.host_parameters

    @property
    def device(self) -> int:
        """Bytes held on the device: every category above that is not in host memory (with
        stage 3's released gather memory kept for reuse)."""
        total = self.model_states + self.comm_buffers + self.frozen_parameters
        total += self.step_transient + self.gathered_cached
        total -= self.host_parameters
        if self.offload == "none":
            return total
        return total - self.optimizer_state + self.optimizer_on_device

    def _where(self) -> str:
        if not self.optimizer_on_device:
            return _WHERE[self.offload]
        return (
            f" ({self.optimizer_on_device:,} B on the device, "
            f"{self.offload_fraction:.0%} of the elements offloaded"
            + ("; the rest on NVMe)" if self.offload == "nvme" else " to host memory)")
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["model_states"] = self.model_states
        d["host"] = self.host
        d["device"] = self.device
        return d

    def table(self) -> str:
        """The report as text: one line per category, in bytes and MiB, with the paper's
        formula beside the model states (``str(report)`` is the same)."""
        theory = asdict(self.theory) if self.theory is not None else {}
        head = (
            f"rank {self.rank} of {self.world_size}, stage {self.stage}, {self.precision}: "
            f"Ψ = {self.num_params:,} trainable parameters ({self.padded_numel:,} stored)"
        )
        rows: list[tuple[str, int, str]] = [
            ("parameters", self.parameters, self._params_note(theory)),
            ("gradients", self.gradients, self._grads_note(theory)),
            (
                "optimizer state",
                self.optimizer_state,
                _theory_note(theory.get("optimizer_state"))
                + self._where()
                + f"; fp32 masters {self.master_parameters:,} B"
                f", step counters {self.optimizer_scalar_bytes:,} B",
            ),
            ("model states", self.model_states, _theory_note(self._theory_total(theory))),
            (
                "comm buffers",
                self.comm_buffers,
                "gradient staging pool: 2 buckets in the reduce dtype (where gloo reduce-"
                "scatters CPU tensors: each with a receive buffer of (N-1)/N of it), set by "
                "bucket_bytes, not by the model size"
                if self.comm_buffers
                else "none: gradients are reduced in place in their buffer",
            ),
            ("frozen parameters", self.frozen_parameters, "replicated"),
            (
                "step transient",
                self.step_transient,
                "fp32 gradient scratch: one bucket's owned slice, allocated once",
            ),
        ]
        if self.stage == 3:
            rows += [
                ("persistent params", self.persistent_parameters, "replicated, in parameters"),
                ("gathered now", self.gathered_now, "unit parameters gathered"),
                ("gathered peak", self.gathered_peak, f"bound {self.gathered_bound:,} B"),
                ("gathered cached", self.gathered_cached, "released, kept for the next gather"),
                ("largest unit", self.largest_unit, "gathered"),
            ]
        if self.params_offload == "cpu":
            rows.append(("host parameters", self.host_parameters, "unit shards, in host memory"))
        if self.offload != "none":
            rows += [
                ("host gradients", self.host_gradients, "fp32 copy of the owned gradients"),
                ("host rings", self.host_buffers, "transfer buffers, offload.ring_buckets"),
                (
                    "host total",
                    self.host,
                    "optimizer state + host gradients + rings"
                    + (" + host parameters" if self.host_parameters else ""),
                ),
                ("device total", self.device, "everything else above"),
            ]
        if self.nvme:
            what = [
                *(["masters and optimizer state"] if self.offload == "nvme" else []),
                *(["parameter shards"] if self.params_offload == "nvme" else []),
                *(["gradient shards"] if self.gradients_offload == "nvme" else []),
            ]
            rows.append(("nvme", self.nvme, " and ".join(what) + ", files in offload.path"))
        lines = [head]
        for label, value, note in rows:
            lines.append(f"  {label:<18}{value:>16,} B {value / 2**20:>10.3f} MiB   {note}")
        return "\n".join(lines)

    def _grads_note(self, theory: dict[str, Any]) -> str:
        if self.gradients_offload == "device":
            return _theory_note(theory.get("gradients"))
        return "none in memory: the owned gradient shards are on NVMe"

    def _params_note(self, theory: dict[str, Any]) -> str:
        if self.params_offload == "none":
            return _theory_note(theory.get("parameters"))
        where = "in host memory" if self.params_offload == "cpu" else "on NVMe"
        return f"on the device: persistent parameters only; the unit shards are {where}"

    def __str__(self) -> str:
        return self.table()

    @staticmethod
    def _theory_total(theory: dict[str, Any]) -> float | None:
        if not theory:
            return None
        return float(theory["parameters"] + theory["gradients"] + theory["optimizer_state"])


def _theory_note(value: float | None) -> str:
    return "" if value is None else f"theory {value:,.0f} B"


@dataclass(frozen=True, slots=True)
class Holdings:
    """What one rank holds, counted by the components that hold it: the report's only input
    (the engine builds it, ``ZeroEngine.holdings``)."""

    rank: int
    world_size: int
    stage: int
    precision: str
    num_params: int  # Ψ
    padded_numel: int
    param_dtype: torch.dtype
    parameters: int  # bytes, as MemoryReport's fields
    gradients: int
    masters: int
    comm_buffers: int
    frozen: int
    step_transient: int
    optimizer: torch.optim.Optimizer  # its state is counted here, tensor by tensor
    stage3: dict[str, int] = field(default_factory=dict)  # MemoryReport's stage-3 fields
    offload: str = "none"
    host: dict[str, int] = field(default_factory=dict)  # MemoryReport's host_* fields
    params_offload: str = "none"
    params_home: dict[str, int] = field(default_factory=dict)  # host_parameters, nvme
    gradients_offload: str = "device"
    kept: tuple[torch.Tensor, ...] = ()  # partial offload: the pieces stepped on the device
    kept_masters: int = 0  # and their fp32 master copies' bytes
    offload_fraction: float = 1.0


def measure(held: Holdings) -> MemoryReport:
    state_bytes, scalar_bytes = optimizer_state_bytes(held.optimizer)
    return MemoryReport(
        rank=held.rank,
        world_size=held.world_size,
        stage=held.stage,
        num_params=held.num_params,
        padded_numel=held.padded_numel,
        parameters=held.parameters,
        gradients=held.gradients,
        optimizer_state=state_bytes + held.masters,
        master_parameters=held.masters,
        optimizer_scalar_bytes=scalar_bytes,
        comm_buffers=held.comm_buffers,
        frozen_parameters=held.frozen,
        step_transient=held.step_transient,
        precision=held.precision,
        theory=_theory(held),
        offload=held.offload,
        params_offload=held.params_offload,
        gradients_offload=held.gradients_offload,
        optimizer_on_device=optimizer_state_bytes(held.optimizer, held.kept)[0] + held.kept_masters,
        offload_fraction=held.offload_fraction,
        **held.stage3,
        **_tiers(held.host, held.params_home),
    )


def _tiers(optimizer: dict[str, int], params: dict[str, int]) -> dict[str, int]:
    """The offloaded step's host and NVMe bytes, plus the parameter home's."""
    out = dict(optimizer)
    for key, value in params.items():
        out[key] = out.get(key, 0) + value
    return out


def _theory(held: Holdings) -> ModelStateBytes | None:
    name = _optimizer_name(held.optimizer)
    if name is None:
        return None
    elsize = torch.empty((), dtype=held.param_dtype).element_size()
    return model_state_bytes(
        held.num_params,
        held.world_size,
        held.stage,
        param_bytes=elsize,
        grad_bytes=elsize,
        optimizer_bytes_per_param=optimizer_multiplier(
            name, held.precision, offload=held.offload != "none"
        ),
    )


def _optimizer_name(opt: torch.optim.Optimizer) -> str | None:
    if isinstance(opt, torch.optim.SGD):
        return "sgd" if opt.defaults.get("momentum", 0) else "sgd-nomomentum"
    if isinstance(opt, torch.optim.RMSprop) and (
        opt.defaults.get("momentum", 0) or opt.defaults.get("centered", False)
    ):
        return None
    for cls, name in _OPTIMIZER_NAMES.items():
        if type(opt) is cls:
            if name in ("adam", "adamw") and opt.defaults.get("amsgrad", False):
                return None
            return name
    return None


def optimizer_bytes(opt: torch.optim.Optimizer, precision: str) -> float:
    """K, the optimizer-state bytes per element with fp32 masters where ``precision`` has
    them (the estimator's table; Adam's for an optimizer it does not know)."""
    return optimizer_multiplier(_optimizer_name(opt) or "adam", precision)


def optimizer_state_bytes(
    opt: torch.optim.Optimizer, params: tuple[torch.Tensor, ...] | None = None
) -> tuple[int, int]:
    """Bytes of every tensor in the optimizer's state (of ``params`` only, if given), and of
    those the 0-dim ones."""
    seen: set[int] = set()
    total = scalars = 0
    states = opt.state.values() if params is None else [opt.state.get(p, {}) for p in params]
    for state in states:
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.data_ptr() not in seen:
                if value.numel() > 0:
                    seen.add(value.data_ptr())
                total += _nbytes(value)
                if value.dim() == 0:
                    scalars += _nbytes(value)
    return total, scalars


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_WHERE = {"none": "", "cpu": " (in host memory)", "nvme": " (in memory; the rest on NVMe)"}
