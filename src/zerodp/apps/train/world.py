"""Where a ``zerodp train`` rank sits in the data-parallel world: joining the process group
from torchrun's environment variables, sharing the node's cores, and the environment the report
records."""

from __future__ import annotations

import os
import platform
import socket
from dataclasses import dataclass
from typing import Any

import torch

import zerodp
from zerodp.comm import Communicator, DeviceMesh, dp_tp_mesh, init_from_env

PG_TIMEOUT_S = 600.0  # a hung collective becomes an error after this, not a silent hang


@dataclass(frozen=True, slots=True)
class RankContext:
    """Where this process sits in the world."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    # A DP x TP run (--tensor-parallel): this rank's data-parallel coordinates and its mesh;
    # the TP ranks of one DP rank train on the same batches.
    dp_rank: int = 0
    tensor_parallel: int = 1
    mesh: DeviceMesh | None = None

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tensor_parallel


def join_world(tensor_parallel: int = 1) -> RankContext:
    local_rank, local_world, device = local_placement()
    if device.type == "cpu":
        limit_threads(local_world)
    init_from_env(timeout_s=PG_TIMEOUT_S)
    world = Communicator(None)
    mesh = dp_tp_mesh(tensor_parallel, device.type) if tensor_parallel > 1 else None
    return RankContext(
        rank=world.rank,
        world_size=world.world_size,
        local_rank=local_rank,
        local_world_size=local_world,
        device=device,
        backend=world.backend,
        dp_rank=mesh["dp"].get_local_rank() if mesh is not None else world.rank,
        tensor_parallel=tensor_parallel,
        mesh=mesh,
    )


def local_placement() -> tuple[int, int, torch.device]:
    """(local rank, ranks on this node, device) from the launcher's environment; on CUDA the
    rank's own GPU (by local rank) becomes the current device. Ranks beyond the node's GPUs
    share them, round robin: gloo carries that (``zerodp bench --backend gloo``), NCCL refuses
    it with its own error. Shared with ``zerodp bench``."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if not torch.cuda.is_available():
        return local_rank, local_world, torch.device("cpu")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return local_rank, local_world, device


def limit_threads(local_world_size: int) -> None:
    """Share the cores between the ranks of this node. Ranks each using every core (torch's
    default) oversubscribe the CPU and run several times slower. An explicit OMP_NUM_THREADS
    (torchrun sets 1) is left alone."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    torch.set_num_threads(cores_per_rank(local_world_size))


def cores_per_rank(local_world_size: int) -> int:
    """This process's cores (its affinity mask on Linux) divided among the node's ranks."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_world_size))


def environment(ctx: RankContext, seq_len: int, precision: str) -> dict[str, Any]:
    return {
        "world_size": ctx.world_size,
        "data_parallel": ctx.dp_size,
        "tensor_parallel": ctx.tensor_parallel,
        "nodes": max(1, ctx.world_size // max(1, ctx.local_world_size)),
        "backend": ctx.backend,
        "device": ctx.device.type,
        "seq_len": seq_len,
        "torch": torch.__version__,
        "zerodp": zerodp.__version__,
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "threads_per_rank": torch.get_num_threads(),
        **device_peak(ctx.device, precision),
    }


# Dense peak FLOP/s of the devices whose datasheet we know, by name and compute dtype: what MFU
# is measured against (SXM parts; fp32 without TF32, torch's default for matmuls).
PEAK_FLOPS = {
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
}


def device_peak(device: torch.device, precision: str) -> dict[str, Any]:
    """The device's name and, where ``PEAK_FLOPS`` knows it, its dense peak FLOP/s in
    ``precision`` (``None`` otherwise: a CPU's depends on cores and clocks we do not model)."""
    if device.type != "cuda":
        return {"device_name": platform.processor() or platform.machine(), "peak_flops": None}
    name = torch.cuda.get_device_name(device)
    known = next((peaks for key, peaks in PEAK_FLOPS.items() if key in name), None)
    return {"device_name": name, "peak_flops": None if known is None else known.get(precision)}
