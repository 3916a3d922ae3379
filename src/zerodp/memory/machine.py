"""``Machine``: the capacities and rates the offload cost model runs on, and the ``H100_BOX``
preset measured on one H100 machine. Pure data and arithmetic.

Rates are what one rank gets (on a box with several GPUs, divide the host's memory, CPU Adam
rate, memory copy rate and disk among its ranks). Bandwidths are bytes per second, decimal
(54e9 is "54 GB/s"); memory sizes are bytes.

[Note: H100_BOX]
Measured on that machine (one H100 SXM 80 GB, 16 CPU cores, 128 GiB host, a local NVMe):

- PCIe, pinned host memory: 54 GB/s each way, both ways at once (pageable: 15-20 GB/s; the
  offload rings are pinned, so pageable is not used);
- CPU AdamW, ``torch.optim.AdamW(fused=True)`` on 16 cores: 5.5e9 parameters/s (foreach: 1.1e9);
- host ``memcpy``: 104 GB/s (bytes copied per second: each byte read once and written once);
- NVMe: 2.2 GB/s write, 1.2 GB/s read.

Assumed, not measured (stated so that they can be overridden):

- device memory 79.6 GiB (what an H100 80 GB reports, 81,559 MiB), of which 3 GiB are kept for
  the CUDA context (~0.5 GiB), library workspaces and the caching allocator's fragmentation;
- host memory 128 GiB, of which 8 GiB are kept for the OS, the Python process with torch and
  the CUDA libraries, and data loading;
- device memory bandwidth 3.0e12 B/s for the device optimizer step (about 90% of the H100 SXM's
  3.35 TB/s);
- bf16 dense peak 989e12 FLOP/s (H100 SXM), at the model-FLOPs utilisation that reproduces the
  measured step of the 1.3B GPT without offload: 0.089 s for 4 x 1024 tokens, bf16, fused AdamW
  on the device (``calibrated_mfu``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from zerodp.memory.estimator import GPTShape, gpt_param_count

GiB = float(2**30)

FORWARD_BACKWARD_FLOPS = 6.0
"""FLOPs per parameter per token of a forward and backward (2 forward, 4 backward)."""

RECOMPUTE_FLOPS = 2.0
"""Extra FLOPs per parameter per token with activation checkpointing: a second forward."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Machine:
    """Capacities (bytes) and rates (bytes/s, parameters/s, FLOP/s) one rank gets."""

    name: str
    device_bytes: float
    """Device memory, all of it."""
    device_reserve_bytes: float
    """Of which not available to tensors (CUDA context, workspaces, fragmentation)."""
    host_bytes: float
    host_reserve_bytes: float
    """Of host memory, what the OS, the process itself and data loading keep."""
    nvme_bytes: float | None
    """Room in the NVMe directory; ``None``: not known (the NVMe tier is then not limited)."""
    pcie_bytes_per_s: float
    """Host-device copies from or to pinned memory, each way; both ways can run at once."""
    host_memcpy_bytes_per_s: float
    """Host memory copies: bytes copied per second (each read once and written once)."""
    cpu_adam_params_per_s: float
    """CPU (fused) Adam/AdamW: parameters stepped per second, all cores."""
    disk_read_bytes_per_s: float
    disk_write_bytes_per_s: float
    device_peak_flops: float
    """Dense peak of the compute dtype (bf16), FLOP/s."""
    mfu: float
    """Model-FLOPs utilisation: the fraction of the peak a training forward+backward achieves."""
    device_memory_bytes_per_s: float
    """Device memory bandwidth, for the (memory-bound) device optimizer step."""

    def __post_init__(self) -> None:
        for name in (
            "device_bytes",
            "host_bytes",
            "pcie_bytes_per_s",
            "host_memcpy_bytes_per_s",
            "cpu_adam_params_per_s",
            "disk_read_bytes_per_s",
            "disk_write_bytes_per_s",
            "device_peak_flops",
            "device_memory_bytes_per_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"Machine.{name} must be > 0; got {getattr(self, name)!r}")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"Machine.mfu must be in (0, 1]; got {self.mfu!r}")
        for name in ("device_reserve_bytes", "host_reserve_bytes"):
            if not 0 <= getattr(self, name) < getattr(self, name.replace("_reserve", "")):
                raise ValueError(f"Machine.{name} must be >= 0 and below the memory it is of")
        if self.nvme_bytes is not None and not self.nvme_bytes > 0:
            raise ValueError(f"Machine.nvme_bytes must be > 0 or None; got {self.nvme_bytes!r}")

    @property
    def device_flops(self) -> float:
        """FLOP/s a training forward+backward achieves: peak x MFU."""
        return self.device_peak_flops * self.mfu

    @property
    def device_usable_bytes(self) -> float:
        return self.device_bytes - self.device_reserve_bytes

    @property
    def host_usable_bytes(self) -> float:
        return self.host_bytes - self.host_reserve_bytes

    def with_overrides(self, **values: float | None) -> Machine:
        """This machine with the given fields replaced (``None`` values are ignored)."""
        return replace(self, **{k: v for k, v in values.items() if v is not None})  # type: ignore[arg-type]


def device_step_bytes(optimizer_bytes: float, param_bytes: float, mixed: bool) -> float:
    """Device memory traffic of the optimizer step per parameter (it is memory-bound).

    The fused kernel reads the fp32 gradient and reads and writes the masters (the parameters in
    fp32 training) and each state tensor: 4 + 2K with mixed precision (K includes the masters),
    4 + 2(K + 4) in fp32. Mixed precision adds the upcast of the gradient into the fp32 scratch
    (read p, write 4) and the cast of the masters into the parameters (read 4, write p).
    bf16 Adam: 4 + 24 + 12 = 40 B.
    """
    if mixed:
        return 4.0 + 2.0 * optimizer_bytes + 2.0 * (param_bytes + 4.0)
    return 4.0 + 2.0 * (optimizer_bytes + 4.0)


def training_flops(num_params: float, tokens: float, *, checkpointing: bool) -> float:
    """6·Ψ·tokens for a forward and backward; 8·Ψ·tokens with activation checkpointing."""
    per_token = FORWARD_BACKWARD_FLOPS + (RECOMPUTE_FLOPS if checkpointing else 0.0)
    return per_token * num_params * tokens


def calibrated_mfu(
    *,
    step_s: float,
    num_params: float,
    tokens: float,
    peak_flops: float,
    device_step_s: float,
) -> float:
    """The MFU at which a measured step without offload is reproduced: the step is the forward
    and backward (6·Ψ·tokens FLOPs) plus the device optimizer step, one after the other."""
    compute_s = step_s - device_step_s
    if not compute_s > 0:
        raise ValueError("the optimizer step alone takes longer than the measured step")
    return training_flops(num_params, tokens, checkpointing=False) / compute_s / peak_flops


CALIBRATION_SHAPE = GPTShape(layers=24, hidden=2048, vocab=32000, seq_len=1024, micro_batch=4)
"""The 1.3B GPT of the calibration (GPT-3's 1.3B shape with a 32,000-token vocabulary), at
4 sequences of 1024 tokens per step."""
CALIBRATION_STEP_S = 0.089
"""Its measured step on one H100 without offload: bf16, SDPA attention, fused AdamW on the
device."""

_H100_PEAK = 989e12
_H100_HBM = 3.0e12


def _h100_mfu() -> float:
    psi = float(gpt_param_count(CALIBRATION_SHAPE))
    step_bytes = device_step_bytes(12.0, 2.0, mixed=True)
    return calibrated_mfu(
        step_s=CALIBRATION_STEP_S,
        num_params=psi,
        tokens=CALIBRATION_SHAPE.micro_batch * CALIBRATION_SHAPE.seq_len,
        peak_flops=_H100_PEAK,
        device_step_s=psi * step_bytes / _H100_HBM,
    )


H100_FOREACH_ADAM_PARAMS_PER_S = 1.1e9
"""CPU AdamW with ``foreach=True`` on the H100 box's 16 cores: measured, for comparison only
(the offloaded step uses the fused kernel, ``cpu_adam_params_per_s``)."""
H100_CPU_CORES = 16

H100_BOX = Machine(
    name="H100_BOX",
    device_bytes=79.6 * GiB,
    device_reserve_bytes=3 * GiB,
    host_bytes=128 * GiB,
    host_reserve_bytes=8 * GiB,
    nvme_bytes=None,
    pcie_bytes_per_s=54e9,
    host_memcpy_bytes_per_s=104e9,
    cpu_adam_params_per_s=5.5e9,
    disk_read_bytes_per_s=1.2e9,
    disk_write_bytes_per_s=2.2e9,
    device_peak_flops=_H100_PEAK,
    mfu=_h100_mfu(),
    device_memory_bytes_per_s=_H100_HBM,
)
"""One H100 SXM 80 GB with 16 CPU cores, 128 GiB host memory and an NVMe: [Note: H100_BOX]."""
