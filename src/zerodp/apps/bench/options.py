"""What one ``zerodp bench`` invocation measures: a frozen, picklable record of the options.

It travels from the command line to every rank of every launch (pickled by torch's elastic
launcher), so it holds plain values only.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass, field
from typing import Any

from zerodp.apps.bench.systems import BACKENDS, KNOWN, PRECISIONS, parse_configs
from zerodp.apps.models.gpt import get_config
from zerodp.comm import GLOO_WITH_CUDA

MIB = 2**20


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchOptions:
    """Options of one benchmark; every configuration gets the same model, data and seed."""

    configs: tuple[str, ...] = KNOWN
    preset: str = "bench25m"
    world_size: int = 2
    precision: str = "fp32"
    steps: int = 10  # timed steps per configuration and round
    warmup: int = 2  # untimed steps first (the first step allocates optimizer state)
    batch: int = 4  # sequences per rank per step (of the preset's seq_len)
    bucket_mb: float = 25.0  # gradient/parameter bucket size for every system that has one
    rounds: int = 1  # each configuration is launched this many times, in rotated order
    threads: int = 0  # intra-op threads per rank; 0: the node's cores / ranks per node
    seed: int = 1234
    lr: float = 3e-4
    weight_decay: float = 0.1
    fused_adamw: bool = False  # AdamW(fused=True) for every system (zerodp picks it by itself)
    # Every system's transformer blocks checkpointed (zerodp.checkpoint_wrapper: non-reentrant
    # torch.utils.checkpoint of each block's forward), before the system wraps the model.
    activation_checkpointing: bool = False
    profile_steps: int = 0  # after the timed steps, this many under torch.profiler (operators)
    # zero3-infinity's files: a directory on the disk to measure (the temporary one by default)
    offload_dir: str = field(default_factory=tempfile.gettempdir)
    ring_buckets: int = 2  # offload rings (ZeroConfig.offload.ring_buckets)
    # "auto": NCCL with CUDA, gloo on CPU. "gloo": gloo on CUDA too, which carries CUDA tensors
    # and lets several ranks share one GPU (NCCL refuses that): for checks, not for speed.
    backend: str = "auto"

    def __post_init__(self) -> None:
        parse_configs(",".join(self.configs))  # raises ValueError naming the bad names
        get_config(self.preset)  # likewise for an unknown preset, before any rank starts
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        for name in ("world_size", "steps", "batch", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0 or self.threads < 0 or self.profile_steps < 0:
            raise ValueError("warmup, threads and profile_steps must be >= 0")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {self.bucket_mb}")

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * MIB))

    def process_backend(self, cuda: bool) -> str | None:
        """What ``init_process_group`` gets (None: its default for the device)."""
        if self.backend == "auto":
            return None
        return GLOO_WITH_CUDA if cuda else "gloo"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["configs"] = list(self.configs)
        return d
