"""What each stage shards and how it communicates, resolved once from a ``ZeroConfig``."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from zerodp.config import ZeroConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ALIGN_BYTES = 16  # every parameter and every rank's slice starts 16-byte aligned (vector loads)


class ReduceMode(enum.Enum):
    """How stages 0-2 hold and reduce gradients (``grads.reducer`` describes each)."""

    ALL_REDUCE = "all_reduce"
    SCATTER_IN_PLACE = "scatter_in_place"
    SCATTER_STAGED = "scatter_staged"


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    stage: int
    reduce_mode: ReduceMode
    shard_optimizer: bool  # optimizer state (and masters) only for the owned slice
    gather_params: bool  # all-gather the updated slices after each step (stages 1-3)
    shard_params: bool  # parameters sharded at rest, gathered per unit (stage 3)
    bucket_bytes: int
    compute_dtype: torch.dtype  # dtype of the model's parameters and gradients
    reduce_dtype: torch.dtype  # dtype gradients are summed in across ranks
    mixed: bool  # separate fp32 masters (see [Note: mixed precision] in optim/masters.py)
    loss_scaling: bool  # fp16: scale the loss, skip non-finite steps, adapt the scale
    check_finite: bool  # check the step's gradients: fp16 (loss scaler), else Precision.nonfinite
    offload_optimizer: str  # "none", "cpu", "nvme": where masters and optimizer state live
    offload_params: str  # stage 3: where the parameter shards rest
    offload_gradients: str  # stage 3: "device", or "nvme": the reduced shards wait in a file
    offload_fraction: float | str  # of the optimizer state, what is offloaded, or "auto"
    offload_ring: int  # host transfer buffers per direction (OffloadConfig.ring_buckets)
    offload_grad_ring: bool  # the offloaded step's fp32 host gradient is a ring, not whole
    offload_path: str | None  # the "nvme" tier's directory

    def bucket_numel(self, dtype: torch.dtype) -> int:
        return max(1, self.bucket_bytes // _element_size(dtype))

    @staticmethod
    def align(dtype: torch.dtype) -> int:
        return max(1, ALIGN_BYTES // _element_size(dtype))


def resolve(config: ZeroConfig) -> Plan:
    precision = config.precision
    modes = {
        0: ReduceMode.ALL_REDUCE,
        1: ReduceMode.SCATTER_IN_PLACE,
        2: ReduceMode.SCATTER_STAGED,
        3: ReduceMode.SCATTER_STAGED,  # per unit, by zerodp.params (see params/reduce.py)
    }
    return Plan(
        stage=config.stage,
        reduce_mode=modes[config.stage],
        shard_optimizer=config.stage >= 1,
        # Stage 3 gathers units on demand; only its persistent parameters are gathered here.
        gather_params=config.stage >= 1,
        shard_params=config.stage == 3,
        bucket_bytes=config.bucket_bytes,
        compute_dtype=DTYPES[precision.compute],
        reduce_dtype=DTYPES[precision.reduce],
        mixed=precision.compute != "fp32",
        loss_scaling=precision.compute == "fp16",
        check_finite=precision.compute == "fp16" or precision.nonfinite != "ignore",
        offload_optimizer=config.offload.optimizer,
        offload_params=config.offload.params,
        offload_gradients=config.offload.gradients,
        offload_fraction=config.offload.optimizer_fraction,
        offload_ring=config.offload.ring_buckets,
        offload_grad_ring=config.offload.host_gradient_ring,
        offload_path=config.offload.path,
    )


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
