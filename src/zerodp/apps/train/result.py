"""What one stage's ``zerodp train`` run produced (``RunResult``), and the figures derived from
its curves alone: the loss summary and the throughput.

Plain values only (no process group, no tensors): rank 0 holds the gathered ones, and the tests
build them from made-up numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

SMOOTH_STEPS = 10  # "final loss" is the mean of the last steps: one batch's loss is noisy


@dataclass(slots=True)
class RunResult:
    """What one stage's run produced, as plain values (rank 0 holds the gathered ones)."""

    stage: int
    first_step: int = 0  # > 0 when resumed from a checkpoint
    losses: list[float] = field(default_factory=list)  # per step, mean over ranks
    grad_norms: list[float] = field(default_factory=list)  # per step; empty without --clip
    lrs: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)  # seconds, rank 0's clock
    tokens_per_step: int = 0  # all ranks together
    num_params: int = 0  # Ψ (of this rank's slices under tensor parallelism)
    model_params: int = 0  # of the whole model (0: Ψ)
    element_size: int = 4  # bytes of one parameter element (the compute dtype)
    reduce_element_size: int = 4  # bytes of one element gradients are reduced in
    bucket_bytes: int = 0
    receive_fraction: float = 0.0  # reduce-scatter receive buffers per staging bucket
    config: dict[str, Any] = field(default_factory=dict)  # ZeroConfig.to_dict() of the run
    activations_theory: float = 0.0  # the estimator's activations per rank (theory.py)
    working_theory: float = 0.0  # the estimator's backward working set per rank (theory.py)
    memory: list[dict[str, Any]] = field(default_factory=list)  # MemoryReport.to_dict() per rank
    comm: dict[str, Any] | None = None  # CommStats.to_dict() of the last step
    comm_volumes: list[int] = field(default_factory=list)  # volume of every step
    tp_comm: dict[str, Any] | None = None  # the last step's tensor-parallel CommStats.to_dict()
    skipped_steps: int = 0  # steps skipped for non-finite gradients (mixed precision)
    loss_scale: float | None = None  # fp16's loss scale at the end
    sample_prompt: str = ""
    sample_text: str = ""


def loss_summary(losses: Sequence[float]) -> dict[str, float | None]:
    if not losses:
        return {"first": None, "last": None, "final": None}
    tail = losses[-SMOOTH_STEPS:]
    return {"first": losses[0], "last": losses[-1], "final": sum(tail) / len(tail)}


def throughput(step_times: Sequence[float], tokens_per_step: int) -> dict[str, float | None]:
    """Tokens per second of all ranks together. The first step is left out when there are
    others: it pays one-off costs (allocator warm-up, lazy initialisation) a long run does not."""
    timed = list(step_times[1:] if len(step_times) > 1 else step_times)
    seconds = sum(timed)
    return {
        "tokens_per_s": tokens_per_step * len(timed) / seconds if seconds > 0 else None,
        "step_time_s": seconds / len(timed) if timed else None,
        "total_time_s": sum(step_times),
    }
