"""What fits a machine: one placement's prediction, the fastest placement that fits, and the
largest GPT that fits with exact fp32 Adam.

Every placement here is exact mixed-precision Adam (fp32 masters and moments, the same update
as without offload); they differ only in where the bytes rest and so in time. The search tries
the optimizer on the device, in host memory or on NVMe (each with the host gradient whole or a
ring), the parameters on the device (any stage) or offloaded with the optimizer (stage 3), with
and without activation checkpointing, and for a partly offloaded optimizer the smallest
fraction (on a 1% grid) that fits the device: the device steps faster than the CPU, so keeping
more there is never slower.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from zerodp.memory.estimator import GPTShape
from zerodp.memory.machine import Machine
from zerodp.memory.step_time import StepTime, predict_step
from zerodp.memory.tiers import Placement, TierBytes, Workload, tier_bytes

GPT3_LAYOUTS: dict[str, tuple[int, int]] = {
    "1.3B": (24, 2048),
    "2.7B": (32, 2560),
    "6.7B": (32, 4096),
    "13B": (40, 5120),
}
"""(layers, hidden) of GPT-3's models (Brown et al. 2020, Table 2.1; 13B's 5140 rounded to
5120, a multiple of 128 as usually trained)."""

HIDDEN_PER_LAYER = 128
"""The shape rule of the largest-model search: hidden = 128 x layers, as GPT-3's 6.7B
(32 x 4096), 13B (40 x 5120) and 175B (96 x 12288)."""

_FRACTION_GRID = 100  # optimizer fractions are searched in steps of 1/100


def gpt3_shape(
    name: str, *, vocab: int = 32000, seq_len: int = 1024, micro_batch: int = 4
) -> GPTShape:
    """GPT-3's ``name`` ("1.3B", "2.7B", "6.7B", "13B") with this vocabulary and batch."""
    layers, hidden = GPT3_LAYOUTS[name]
    return GPTShape(
        layers=layers, hidden=hidden, vocab=vocab, seq_len=seq_len, micro_batch=micro_batch
    )


def scaled_gpt(
    layers: int, *, vocab: int = 32000, seq_len: int = 1024, micro_batch: int = 4
) -> GPTShape:
    """A GPT of ``layers`` blocks of hidden size 128 x layers (``HIDDEN_PER_LAYER``)."""
    return GPTShape(
        layers=layers,
        hidden=HIDDEN_PER_LAYER * layers,
        vocab=vocab,
        seq_len=seq_len,
        micro_batch=micro_batch,
    )


@dataclass(frozen=True, slots=True)
class Prediction:
    """One placement of one workload on one machine: bytes per tier, step time, fit."""

    workload: Workload
    placement: Placement
    bytes: TierBytes
    time: StepTime
    fits_device: bool
    fits_host: bool
    fits_nvme: bool

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host and self.fits_nvme

    @property
    def host_bytes_per_param(self) -> float:
        return self.bytes.host.total / self.workload.num_params


def predict(w: Workload, p: Placement, m: Machine) -> Prediction:
    b = tier_bytes(w, p)
    return Prediction(
        workload=w,
        placement=p,
        bytes=b,
        time=predict_step(w, p, m),
        fits_device=b.device.total <= m.device_usable_bytes,
        fits_host=b.host.total <= m.host_usable_bytes,
        fits_nvme=m.nvme_bytes is None or b.nvme.total <= m.nvme_bytes,
    )


def candidates(
    w: Workload,
    m: Machine,
    *,
    stage: int = 2,
    allow_nvme: bool = False,
    checkpointing: bool | None = None,
) -> Iterator[Placement]:
    """The placements the search compares. ``stage``: for the parameters on the device
    (offloaded parameters are stage 3); ``checkpointing``: ``None`` tries both."""
    tiers = ("cpu", "nvme") if allow_nvme else ("cpu",)
    ckpts = (False, True) if checkpointing is None else (checkpointing,)
    for ckpt in ckpts:
        yield Placement(stage=stage, checkpointing=ckpt)  # no offload
        for params in ("none", *tiers):
            st = 3 if params != "none" else stage
            for optimizer in tiers:
                if st == 0:
                    continue
                for grads in ("full", "ring"):
                    full = Placement(
                        optimizer=optimizer,
                        params=params,
                        stage=st,
                        checkpointing=ckpt,
                        host_gradients=grads,
                    )
                    yield full
                    if st == 3 and allow_nvme:  # the gradient shards off the device too
                        yield replace(full, gradients="nvme")
                    fraction = smallest_fraction(w, full, m)
                    if fraction is not None and 0 < fraction < 1:
                        yield replace(full, optimizer_fraction=fraction)


def smallest_fraction(w: Workload, p: Placement, m: Machine) -> float | None:
    """The smallest offloaded fraction (on a 1% grid) at which the device holds the rest, or
    ``None`` if the device cannot hold even the fully offloaded placement. The device bytes
    are affine in the fraction."""
    at = {f: tier_bytes(w, replace(p, optimizer_fraction=f)).device.total for f in (0.0, 1.0)}
    room = m.device_usable_bytes
    if at[1.0] > room:
        return None
    if at[0.0] <= room:
        return 0.0
    exact = (at[0.0] - room) / (at[0.0] - at[1.0])
    return min(1.0, math.ceil(exact * _FRACTION_GRID - 1e-9) / _FRACTION_GRID)


def cheapest_fit(w: Workload, m: Machine, **search: Any) -> Prediction | None:
    """The fastest placement that fits ``m`` (``candidates``' keywords), or ``None``."""
    fitting = [pr for pr in (predict(w, p, m) for p in candidates(w, m, **search)) if pr.fits]
    if not fitting:
        return None
    return min(fitting, key=lambda pr: pr.time.seconds)


def largest_fit(
    m: Machine,
    *,
    vocab: int = 32000,
    seq_len: int = 1024,
    micro_batch: int = 4,
    max_layers: int = 1024,
    settings: dict[str, Any] | None = None,
    **search: Any,
) -> Prediction | None:
    """The largest ``scaled_gpt`` that fits ``m`` with some placement (the fastest of them),
    or ``None`` if not even one layer does. ``settings``: ``Workload`` fields; ``search``:
    ``candidates``' keywords. Memory grows with the layers, so a bisection finds it."""

    def best(layers: int) -> Prediction | None:
        shape = scaled_gpt(layers, vocab=vocab, seq_len=seq_len, micro_batch=micro_batch)
        return cheapest_fit(Workload.gpt(shape, **(settings or {})), m, **search)

    lo, hi = 0, max_layers + 1  # best(lo) fits (or lo == 0), best(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if best(mid) is None:
            hi = mid
        else:
            lo = mid
    return best(lo) if lo else None
