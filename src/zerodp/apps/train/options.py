"""What one ``zerodp train`` run was asked to do: a frozen, picklable record of the options.

It travels from the command line to every rank (pickled by the launcher, or rebuilt from the same
argv under ``torchrun``), so it holds only plain values, never torch objects. Also here, shared by
the ranks and the launcher: the environment variables they read and the ``ErrorNote`` a failing
rank leaves for the launcher.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from zerodp.apps.models.gpt import Block, get_config
from zerodp.apps.train.schedule import Schedule
from zerodp.config import Activations, OffloadConfig, ZeroConfig

DEFAULT_CPU_WORLD_SIZE = 2

MIB = 2**20
DEFAULT_BUCKET_BYTES = ZeroConfig().bucket_bytes
MIN_AUTO_BUCKET_BYTES = 64 * 2**10  # below this, per-collective latency dominates

CHECKPOINTED = {"none": (), "full": (Block.__name__,), "offload": (Block.__name__,)}
"""``--activation-checkpointing``: the GPT's module classes ``ZeroConfig.activations`` checkpoints
(every transformer block: each keeps only its input, [Note: activation checkpointing]); with
"offload" that input waits in host memory ([Note: checkpoint offload])."""

FAIL_AT_ENV = "ZERODP_TRAIN_FAIL_AT"
"""Test-only: ``"RANK:STEP"`` makes that rank raise at that step, to exercise failure reporting."""

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
"""Set by torchrun (and torch's elastic agent) for every worker it starts."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainOptions:
    """Options of one run; ``stages`` has one stage, or several for ``--compare-stages``."""

    stages: tuple[int, ...] = (2,)
    compare_stages: bool = False
    precision: str = "fp32"
    preset: str = "small"
    world_size: int | None = None  # None: 2 ranks on CPU, one per GPU with CUDA
    steps: int = 200
    batch: int = 8
    grad_accum: int = 1
    clip: float = 1.0
    lr: float = 1e-3
    bucket_mb: float | None = None  # None: see bucket_bytes_for
    offload_optimizer: str = "none"  # ZeroConfig.offload.optimizer
    offload_params: str = "none"  # ZeroConfig.offload.params
    offload_gradients: str = "device"  # ZeroConfig.offload.gradients
    offload_dir: str | None = None  # ZeroConfig.offload.path (the "nvme" tier's directory)
    offload_fraction: float | str = 1.0  # ZeroConfig.offload.optimizer_fraction
    offload_host_gradients: str = "auto"  # ZeroConfig.offload.host_gradients
    activation_checkpointing: str = "none"  # "full"/"offload": ZeroConfig.activations
    tensor_parallel: int = 1  # ranks each GPT is split over (Megatron); ZeRO over world / this
    checkpoint_dir: str | None = None  # save here (every checkpoint_every steps and at the end)
    checkpoint_every: int = 0  # 0: only at the end
    resume: str | None = None  # a checkpoint or a checkpoint root to resume from
    new_schedule: bool = False  # resuming: follow these options' schedule, not the checkpoint's
    seed: int = 0
    out: str | None = None  # None: runs/train-<timestamp>, resolved by the launcher or rank 0
    sample_chars: int = 200
    quiet: bool = False  # no progress bar (also off when standard error is not a terminal)

    def bucket_bytes_for(self, param_bytes: int) -> int:
        """``--bucket-mb``; by default ZeroConfig's 32 MiB, but at most 1/8 of the model's
        ``param_bytes``. A small model then still has several buckets (reduction overlaps
        backward), and stage 2's two staging buckets (3/8 of the model at N=2 with the half of
        each its reduce-scatter receives into on gloo CPU) stay below the gradient memory it
        saves (1/2 of the model at N=2)."""
        if self.bucket_mb is not None:
            return max(1, int(self.bucket_mb * MIB))
        return max(MIN_AUTO_BUCKET_BYTES, min(DEFAULT_BUCKET_BYTES, param_bytes // 8))

    def offload_config(self) -> OffloadConfig:
        """``--offload-optimizer``, ``--offload-params``, ``--offload-gradients``,
        ``--offload-fraction``, ``--offload-host-gradients`` and ``--offload-dir``, validated
        (``ValueError`` with ``OffloadConfig``'s message)."""
        return OffloadConfig(
            optimizer=self.offload_optimizer,
            params=self.offload_params,
            gradients=self.offload_gradients,
            path=self.offload_dir,
            optimizer_fraction=self.offload_fraction,
            host_gradients=self.offload_host_gradients,
        )

    def zero_config(self, stage: int, param_bytes: int) -> ZeroConfig:
        """The ``ZeroConfig`` of ``stage``'s run for a model of ``param_bytes`` (the one place
        the options become a config: the ranks build it, the launcher checks it up front)."""
        return ZeroConfig(
            stage=stage,
            precision=self.precision,
            bucket_bytes=self.bucket_bytes_for(param_bytes),
            offload=self.offload_config(),
            activations=Activations(
                checkpoint=CHECKPOINTED[self.activation_checkpointing],
                offload="cpu" if self.activation_checkpointing == "offload" else "none",
            ),
        )

    def check_tensor_parallel(self, world_size: int) -> None:
        """``--tensor-parallel`` against the world and the preset (``ValueError`` says which)."""
        tp = self.tensor_parallel
        if tp == 1:
            return
        if world_size % tp:
            raise ValueError(
                f"--tensor-parallel {tp} does not divide the world size {world_size}: the "
                "world is data-parallel groups of that many tensor-parallel ranks"
            )
        gpt = get_config(self.preset)
        for name, value in (("n_head", gpt.n_head), ("vocab_size", gpt.vocab_size)):
            if value % tp:
                raise ValueError(
                    f"--tensor-parallel {tp} does not divide preset {self.preset}'s "
                    f"{name}={value}: each rank holds an equal share"
                )

    @property
    def warmup_steps(self) -> int:
        """Linear learning-rate warm-up: 5% of the run, at least one step."""
        return max(1, self.steps // 20)

    def schedule(self) -> Schedule:
        """The learning-rate schedule these options describe (a resumed run may follow its
        checkpoint's instead: ``checkpoints.resume``)."""
        return Schedule(lr=self.lr, warmup=self.warmup_steps, total=self.steps)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["stages"] = list(self.stages)
        return d


def under_torchrun(environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """Whether this process is a worker started by torchrun / torch's elastic agent."""
    env = os.environ if environ is None else environ
    return all(name in env for name in TORCHRUN_ENV)


def parse_fail_at(value: str | None) -> tuple[int, int] | None:
    """``"1:2"`` -> (rank 1, step 2); ``None`` or ``""`` -> no injected failure."""
    if not value:
        return None
    rank, sep, step = value.partition(":")
    if not sep or not rank.strip().isdigit() or not step.strip().isdigit():
        raise ValueError(f"{FAIL_AT_ENV} must look like RANK:STEP (e.g. 1:2); got {value!r}")
    return int(rank), int(step)


@dataclass(frozen=True, slots=True)
class ErrorNote:
    """What a failing rank tells the local launcher: its error, and when (``time.time_ns``)."""

    rank: int
    time_ns: int
    summary: str  # "ExceptionType: message"
    traceback: str
