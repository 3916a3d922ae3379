"""``OffloadConfig``: which model states live off the device (ZeRO-Offload, ZeRO-Infinity).

A nested policy of ``ZeroConfig`` ([Note: nested policies] in nesting.py); the checks that
need the stage (optimizer offload at stages 1-3, parameter offload at stage 3) are in
``ZeroConfig.__post_init__``. The mechanism is ``zerodp/offload`` ([Note: offloaded step] in
offload/runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from zerodp.config.checks import check_choice, check_positive_int, field_path
from zerodp.config.nesting import Policy

TIERS = ("none", "cpu", "nvme")
GRADIENT_TIERS = ("device", "nvme")
HOST_GRADIENTS = ("auto", "full", "ring")


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadConfig(Policy):
    """Where the optimizer state and the parameters of this rank's shard are kept."""

    PATH: ClassVar[str] = "ZeroConfig.offload"

    optimizer: str = "none"
    """``"none"``: fp32 masters and optimizer state on the device. ``"cpu"``: in host memory,
    and the optimizer step runs on the CPU, one bucket at a time as its reduced gradient shard
    arrives, while the next forward starts with the buckets already updated (stages 1-3; exact:
    the same values as without offload). ``"nvme"``: in files under ``path``."""

    params: str = "none"
    """Stage 3: where the parameter shards rest between gathers: ``"cpu"`` in host memory,
    ``"nvme"`` in a file under ``path``; the device then holds only the units gathered now.
    Needs ``optimizer`` offloaded too (the step writes the updates into the shards' home)."""

    gradients: str = "device"
    """Stage 3: where this rank's reduced gradient shard waits for the step. ``"device"``: in
    memory on the device (the compute dtype, Ψ/N elements). ``"nvme"`` (ZeRO-Infinity): each
    reduce-scatter's result is written to a file under ``path`` as it arrives during backward
    and read back chunk by chunk by the offloaded step, so the device holds no gradient shard
    at all. Exact, except that ``clip_grad_norm_`` sums the norm in a different order (within
    fp32 rounding). Needs ``optimizer`` offloaded (the step that reads them runs on the host)."""

    path: str | None = None
    """Directory for the ``"nvme"`` tier's files (one per rank and tensor group, private to the
    run, removed at exit). Required by ``"nvme"`` and refused otherwise."""

    optimizer_fraction: float | str = 1.0
    """Partial offload: the fraction of this rank's optimizer state (masters and moments) that
    ``optimizer`` offloads, in (0, 1]. The rest, the parameters the next forward reads first
    (which backward reduces last), keeps its state on the device and is stepped there while
    the CPU steps the offloaded part ([Note: partial offload] in offload/partial.py). Whole
    parameters (stage 3: whole units) are kept, the longest such prefix within the remaining
    fraction. ``"auto"``: as much on the device as half of its free memory at ``initialize``
    holds (1.0 on a CPU-only machine, where the device is host memory). Exact at every
    fraction. Needs ``optimizer`` offloaded, and the gradients on the device."""

    host_gradients: str = "auto"
    """How the offloaded step holds the fp32 gradients it steps in host memory. ``"full"``: a
    copy of this rank's whole offloaded gradient (4 B per parameter), so ``step()`` returns as
    soon as the gradients are copied out and the CPU step overlaps the next forward. ``"ring"``:
    ``ring_buckets`` chunks only, so host memory holds 4 B per parameter less, and ``step()``
    returns when all but the last ``ring_buckets`` chunks are stepped (the device keeps its
    gradients until the host has pulled them). ``"auto"``: ``"full"`` for ``optimizer="cpu"``,
    ``"ring"`` for ``"nvme"`` (whose point is host memory). Needs ``optimizer`` offloaded."""

    ring_buckets: int = 4
    """Host transfer buffers per direction, each one bucket's owned slice: what bounds the
    pinned memory of the copies (the gradients to the host, the updated parameters back)."""

    def __post_init__(self) -> None:
        check_choice(self, "optimizer", TIERS)
        check_choice(self, "params", TIERS)
        check_choice(self, "gradients", GRADIENT_TIERS)
        check_choice(self, "host_gradients", HOST_GRADIENTS)
        check_positive_int(self, "ring_buckets")
        _check_fraction(self)
        if self.host_gradients != "auto" and self.optimizer == "none":
            raise ValueError(
                f"{field_path(self, 'host_gradients')}={self.host_gradients!r} is only used by "
                f"the offloaded step, but {field_path(self, 'optimizer')}='none': drop it or "
                "offload the optimizer"
            )
        nvme = "nvme" in (self.optimizer, self.params, self.gradients)
        if self.path is not None and not isinstance(self.path, str):
            raise ValueError(f"{field_path(self, 'path')} must be a directory; got {self.path!r}")
        if nvme and not self.path:
            raise ValueError(
                f"{field_path(self, 'path')} is required by the 'nvme' tier: give a directory "
                "on a local disk for the offloaded state"
            )
        if self.path is not None and not nvme:
            raise ValueError(
                f"{field_path(self, 'path')}={self.path!r} is only used by the 'nvme' tier, "
                f"but {field_path(self, 'optimizer')}={self.optimizer!r}, "
                f"{field_path(self, 'params')}={self.params!r} and "
                f"{field_path(self, 'gradients')}={self.gradients!r}: drop it or choose 'nvme'"
            )

    @property
    def optimizer_offloaded(self) -> bool:
        return self.optimizer != "none"

    @property
    def params_offloaded(self) -> bool:
        return self.params != "none"

    @property
    def gradients_offloaded(self) -> bool:
        return self.gradients != "device"

    @property
    def host_gradient_ring(self) -> bool:
        """The offloaded step's host gradient is a ring (``host_gradients``, resolved)."""
        if self.host_gradients == "auto":
            return self.optimizer == "nvme"
        return self.host_gradients == "ring"


def _check_fraction(offload: OffloadConfig) -> None:
    value = offload.optimizer_fraction
    name = field_path(offload, "optimizer_fraction")
    if value == "auto":
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not 0.0 < float(value) <= 1.0:  # also NaN
        raise ValueError(
            f"{name} must be 'auto' or a number in (0, 1] (1 offloads all of it); got {value!r}"
        )


def check_offload_stage(offload: OffloadConfig, stage: int) -> None:
    """The stage-dependent rules, then the one between the two tiers (called by
    ``ZeroConfig``)."""
    if offload.optimizer_offloaded and stage == 0:
        raise ValueError(
            f"{field_path(offload, 'optimizer')}={offload.optimizer!r} needs stage 1, 2 or 3 "
            "(stage 0 keeps the whole optimizer state on every rank): set stage >= 1"
        )
    if offload.params_offloaded and stage != 3:
        raise ValueError(
            f"{field_path(offload, 'params')}={offload.params!r} needs stage 3 (only stage 3 "
            f"shards the parameters); got stage {stage}"
        )
    if offload.params_offloaded and not offload.optimizer_offloaded:
        raise ValueError(
            f"{field_path(offload, 'params')}={offload.params!r} needs the optimizer offloaded "
            f"too: set {field_path(offload, 'optimizer')} to 'cpu' or 'nvme' (the step writes "
            "the updates into the shards' home; fp32 masters on the device would also take more "
            "memory than the parameters offloaded)"
        )
    if offload.gradients_offloaded and stage != 3:
        raise ValueError(
            f"{field_path(offload, 'gradients')}={offload.gradients!r} needs stage 3 (stages "
            f"1-2 keep their gradients where the backward writes them); got stage {stage}"
        )
    if offload.gradients_offloaded and not offload.optimizer_offloaded:
        raise ValueError(
            f"{field_path(offload, 'gradients')}={offload.gradients!r} needs the optimizer "
            f"offloaded too: set {field_path(offload, 'optimizer')} to 'cpu' or 'nvme' (the "
            "offloaded step is what reads the gradients back from the files)"
        )
    _check_partial(offload)


def _check_partial(offload: OffloadConfig) -> None:
    """What partial offload (``optimizer_fraction`` below 1) needs."""
    if offload.optimizer_fraction == 1.0:
        return
    name = f"{field_path(offload, 'optimizer_fraction')}={offload.optimizer_fraction!r}"
    if not offload.optimizer_offloaded:
        raise ValueError(
            f"{name} needs the optimizer offloaded: set {field_path(offload, 'optimizer')} "
            "to 'cpu' or 'nvme', or drop it"
        )
    if offload.gradients_offloaded:
        raise ValueError(
            f"{name} keeps part of the optimizer step on the device, which reads its gradients "
            f"there: set {field_path(offload, 'gradients')} to 'device', or the fraction to 1"
        )
