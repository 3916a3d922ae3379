"""The configurations ``zerodp bench`` knows, and what theory says each one moves (pure).

Communication volume per step is in units of Ψ (the number of trainable parameters), counted as
in the ZeRO paper: an all-reduce moves 2Ψ (a reduce-scatter plus an all-gather), a
reduce-scatter, all-gather or broadcast of every parameter moves Ψ. ``comm_paper`` is the
paper's figure for the ZeRO stage the system implements; ``comm_impl`` is what this
implementation's algorithm moves, read from its source (zerodp's own traffic is also measured
by its ledger; the peers' is not measured).
"""

from __future__ import annotations

from dataclasses import dataclass

REFERENCE = "ddp"
"""Every ratio and the parity check are against DistributedDataParallel."""

PRECISIONS = ("fp32", "bf16")
# auto: NCCL with CUDA, gloo on CPU; gloo: gloo on CUDA too (several ranks may share one GPU).
BACKENDS = ("auto", "gloo")


@dataclass(frozen=True, slots=True)
class System:
    """One configuration of the benchmark."""

    name: str  # as given to --configs
    family: str  # "zerodp", "torch" or "deepspeed": who implements it
    label: str  # what it is, for the table
    zero_stage: int  # the ZeRO stage its memory corresponds to (0: plain data parallelism)
    comm_paper: float  # paper's volume per step for that stage, in Ψ
    comm_impl: float  # what this implementation moves per step, in Ψ
    comm_note: str  # how comm_impl comes about
    # Built with ``zerodp.sharded_init()`` (never whole in memory), as a model that does not
    # fit is built for ZeRO-Infinity; the same initial values ([Note: sharded construction]).
    sharded_init: bool = False


SYSTEMS: tuple[System, ...] = (
    System("ddp", "torch", "DistributedDataParallel", 0, 2, 2, "all-reduce of the gradients"),
    System(
        "plain",
        "torch",
        "plain PyTorch, no wrapper (world size 1 only)",
        0,
        0,
        0,
        "none: the overhead baseline for one device",
    ),
    System("zero0", "zerodp", "zerodp stage 0", 0, 2, 2, "all-reduce of the gradients"),
    System("zero1", "zerodp", "zerodp stage 1", 1, 2, 2, "reduce-scatter grads, all-gather params"),
    System("zero2", "zerodp", "zerodp stage 2", 2, 2, 2, "reduce-scatter grads, all-gather params"),
    System(
        "zero3",
        "zerodp",
        "zerodp stage 3",
        3,
        3,
        3,
        "all-gather params in forward and backward, reduce-scatter grads",
    ),
    System(
        "zero2-offload",
        "zerodp",
        "zerodp stage 2, optimizer offloaded to the CPU",
        2,
        2,
        2,
        "as stage 2; the optimizer step runs on the host (ZeroConfig.offload.optimizer='cpu')",
    ),
    System(
        "zero3-offload",
        "zerodp",
        "zerodp stage 3, optimizer offloaded to the CPU",
        3,
        3,
        3,
        "as stage 3; the optimizer step runs on the host (ZeroConfig.offload.optimizer='cpu')",
    ),
    System(
        "zero3-infinity",
        "zerodp",
        "zerodp stage 3, parameters, gradients and optimizer state on NVMe (ZeRO-Infinity)",
        3,
        3,
        3,
        "as stage 3; shards, gradient shards and optimizer state in files (offload "
        "params/gradients/optimizer='nvme')",
        sharded_init=True,
    ),
    System(
        "zro",
        "torch",
        "torch ZeroRedundancyOptimizer + DDP",
        1,
        2,
        3,
        "DDP all-reduce (2) + each owner broadcasts its updated parameters (1)",
    ),
    System(
        "fsdp2",
        "torch",
        "FSDP2 fully_shard, reshard_after_forward=True",
        3,
        3,
        3,
        "all-gather per block in forward and again in backward, reduce-scatter grads",
    ),
    System(
        "fsdp2-noreshard",
        "torch",
        "FSDP2 fully_shard, reshard_after_forward=False",
        3,
        3,
        2,
        "all-gather per block in forward only (kept until backward), reduce-scatter grads",
    ),
    System(
        "deepspeed1",
        "deepspeed",
        "DeepSpeed ZeRO stage 1",
        1,
        2,
        3,
        "default use_multi_rank_bucket_allreduce: all-reduce grad buckets (2), all-gather (1)",
    ),
    System(
        "deepspeed2",
        "deepspeed",
        "DeepSpeed ZeRO stage 2",
        2,
        2,
        3,
        "default use_multi_rank_bucket_allreduce: all-reduce grad buckets (2), all-gather (1)",
    ),
    System(
        "deepspeed3",
        "deepspeed",
        "DeepSpeed ZeRO stage 3",
        3,
        3,
        3,
        "all-gather params in forward and backward, reduce-scatter grads",
    ),
)

BY_NAME = {s.name: s for s in SYSTEMS}
KNOWN = tuple(BY_NAME)


def parse_configs(text: str) -> list[str]:
    """``"ddp,zero1"`` -> ``["ddp", "zero1"]``; ``"all"`` -> every configuration. Unknown or
    repeated names raise ``ValueError``."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if names == ["all"]:
        return list(KNOWN)
    if not names:
        raise ValueError("--configs is empty")
    unknown = [n for n in names if n not in KNOWN]
    if unknown:
        choices = ", ".join(["all", *KNOWN])
        raise ValueError(f"unknown config(s) {unknown}; choose from {choices}")
    if len(set(names)) != len(names):
        raise ValueError(f"repeated config in {names}")
    return names
