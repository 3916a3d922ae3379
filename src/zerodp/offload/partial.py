"""Partial offload: part of the optimizer state stays on the device and is stepped there.

[Note: partial offload]
``OffloadConfig.optimizer_fraction`` f < 1 offloads only a fraction f of this rank's optimizer
state (fp32 masters and moments); the rest keeps them on the device, as without offload. Which
part: the parameters the next forward reads first, which backward reduces last. So the CPU,
whose gradients arrive first, can start stepping its part while the last reductions run, and
the first layers of the next forward never wait for a host update.

The split is by whole segments, so that every segment's masters live in one place
(``Masters.kept``). Stages 1-2 group the trainable parameters into segments by, among other
things, whether their state is kept ([Note: segment grouping] in partition/build.py): the kept
ones are the longest prefix of the parameters in registration order (roughly forward order)
whose elements add up to at most (1 - f) of all of them. Stage 3 keeps whole units the same
way, in the order their forward runs (``ParamSync.update_order``), persistent parameters first;
a kept unit's shard stays on the device even when ``offload.params`` moves the others.

The step (``PartialStep``) checks and clips once, over every owned gradient, with the device
runner the full offload uses (the same norms, the same flags); steps the kept pieces on the
device with the runner of a step without offload (bitwise the same kernels, the check's clip
coefficients applied); casts their masters into the parameters (mixed precision); then hands
the offloaded pieces to ``OffloadStep`` ([Note: offloaded step] in runner.py). The device step
runs first and to its end: the user's optimizer steps every piece whose ``.grad`` is set, and
the host worker sets the offloaded pieces' only inside its own step.

``"auto"``: the kept part is what half of the device's free memory at ``initialize`` holds, at
K bytes per element (the estimator's optimizer multiplier: Adam 12 with fp32 masters, 8 in
fp32 training); 1.0 where the device is the CPU, whose memory the offload would not save.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from zerodp.memory.report import optimizer_bytes
from zerodp.offload.runner import OffloadStep
from zerodp.optim.clip import NormScope
from zerodp.optim.masters import Masters, ReducedGrads
from zerodp.optim.pieces import OptimPiece
from zerodp.optim.runner import StepRunner, make_runner
from zerodp.partition.segment import Segment
from zerodp.plan import Plan

AUTO_SHARE = 0.5  # of the free device memory, what "auto" gives the kept optimizer state


def kept_prefix(sizes: Sequence[int], fraction: float) -> int:
    """How many leading items (of these element counts) keep their optimizer state on the
    device when ``fraction`` of all elements is offloaded: the longest prefix within
    ``1 - fraction`` of the total."""
    if fraction >= 1.0:
        return 0
    everything = sum(sizes)
    budget = everything - fraction * everything  # (not (1 - f) * total: 1 - 0.9 < 0.1)
    kept = total = 0
    for size in sizes:
        total += size
        if total > budget:
            break
        kept += 1
    return kept


def auto_fraction(free_bytes: int, owned_numel: int, bytes_per_element: float) -> float:
    """``optimizer_fraction="auto"``: offload what ``AUTO_SHARE`` of the free device memory
    cannot hold (at ``bytes_per_element`` of optimizer state); 0 when all of it fits."""
    if owned_numel <= 0 or bytes_per_element <= 0:
        return 1.0
    fits = AUTO_SHARE * free_bytes / bytes_per_element
    return max(0.0, 1.0 - fits / owned_numel)


def resolve_fraction(
    value: float | str, device: torch.device, owned_numel: int, bytes_per_element: float
) -> float:
    """The fraction to offload: ``value``, or for ``"auto"`` what the device's free memory
    leaves (see the note)."""
    if value != "auto":
        return float(value)
    if device.type != "cuda":
        return 1.0  # the device is host memory: keeping state "on" it saves nothing
    free, _ = torch.cuda.mem_get_info(device)
    return auto_fraction(free, owned_numel, bytes_per_element)


class PartialStep:
    """See [Note: partial offload]. ``kept``: the device runner over the kept pieces (fp32:
    whole, mixed: chunked with ``host``'s check's clip coefficients); ``host``: the offloaded
    step over the others, whose check covers every piece."""

    writes_params = True  # the offloaded pieces land per bucket; the kept are cast here

    def __init__(self, kept: StepRunner, host: OffloadStep, masters: Masters) -> None:
        self.kept = kept
        self.host = host
        self.masters = masters

    def nonfinite(self, grads: ReducedGrads, inv_scale: float) -> bool:
        return self.host.nonfinite(grads, inv_scale)

    def clip(
        self,
        grads: ReducedGrads,
        inv_scale: float,
        used: list[list[bool]],
        max_norm: float,
        norm_type: float,
        scope: NormScope,
    ) -> torch.Tensor:
        return self.host.clip(grads, inv_scale, used, max_norm, norm_type, scope)

    def pending_factors(self) -> list[torch.Tensor]:
        return self.host.device.pending_factors()

    def bind(self, used: list[list[bool]]) -> None:
        self.kept.bind(used)

    def unbind(self) -> None:
        self.kept.unbind()

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        grads: ReducedGrads,
        inv_scale: float,
        used: list[list[bool]],
    ) -> None:
        self.kept.step(optimizer, grads, inv_scale, used)
        if not self.kept.writes_params:
            self.masters.publish(only=self.masters.kept)
        self.host.step(optimizer, grads, inv_scale, used)

    def reset(self) -> None:
        self.host.reset()
        self.kept.reset()

    @property
    def nbytes(self) -> int:
        return self.host.nbytes + self.kept.nbytes

    @property
    def host_nbytes(self) -> dict[str, int]:
        return self.host.host_nbytes

    @property
    def timing(self) -> dict[str, float] | None:
        return self.host.timing


def offload_fraction(
    plan: Plan,
    trainable: list[tuple[str, nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    world_size: int,
    precision: str,
) -> float:
    """What part of this rank's optimizer state to offload (1 without offload; see the note);
    ``precision``: the compute dtype's name (the optimizer's bytes per element depend on it)."""
    if plan.offload_optimizer == "none":
        return 1.0
    owned = sum(p.numel() for _, p in trainable) // world_size
    device = trainable[0][1].device if trainable else torch.device("cpu")
    per_element = optimizer_bytes(optimizer, precision)
    return resolve_fraction(plan.offload_fraction, device, owned, per_element)


def partial_step(
    plan: Plan,
    segments: list[Segment],
    pieces: list[OptimPiece],
    masters: Masters,
    step: OffloadStep,
) -> StepRunner:
    """``step`` alone, or with kept segments ``PartialStep`` over it and a device runner of
    theirs (clipped by ``step``'s check: its pending factors)."""
    if not masters.kept:
        return step
    kept = [op for op in pieces if not masters.on_host(op.seg)]
    device = make_runner(
        segments,
        kept,
        mixed=plan.mixed,
        sharded=plan.shard_optimizer,
        rank=masters.rank,
        factors=step.device.pending_factors,
    )
    return PartialStep(device, step, masters)


def offloaded_share(pieces: list[OptimPiece], kept: frozenset[int]) -> float:
    """Of this rank's optimizer elements, the share offloaded (the memory report's
    ``offload_fraction``)."""
    sizes = [(op.piece.flat_range.numel, op.seg in kept) for op in pieces]
    total = sum(n for n, _ in sizes)
    on_device = sum(n for n, is_kept in sizes if is_kept)
    return 1.0 - on_device / total if total else 1.0
