"""Per-rank memory of ZeRO data parallelism in theory: pure arithmetic, no torch.distributed.

Model states follow the ZeRO paper (Rajbhandari et al., Sec. 3.1 and 5, Figure 1, Table 1). A
model of Ψ parameters holds ``param_bytes·Ψ`` of parameters, ``grad_bytes·Ψ`` of gradients and
``K·Ψ`` of optimizer state on every rank; stage 1 of ZeRO-DP divides the optimizer state by the
data-parallel degree N, stage 2 the gradients too, stage 3 the parameters too. Mixed-precision
Adam is (2, 2, K=12): 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N bytes for stages 0-3.

Everything is in bytes, as floats: these are estimates, and Ψ/N need not be whole. The formulas
ignore the padding real sharding adds to make a flat buffer divisible by N (under N elements).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger(__name__)

STAGES = (0, 1, 2, 3)
PRECISIONS = ("fp32", "bf16", "fp16")

GB = 1e9
"""Bytes in the paper's GB. Table 1 is decimal: 7.5B params x 16 B = 120e9 B prints as "120"
(120e9 / 2**30 would be 111.8), and 1T x 16 B prints as "16000"."""

_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

OPTIMIZER_STATE_BYTES: dict[str, int] = {
    "adam": 8,  # exp_avg + exp_avg_sq, fp32
    "adamw": 8,
    "sgd": 4,  # momentum_buffer
    "sgd-nomomentum": 0,
    "adagrad": 4,  # sum
    "rmsprop": 4,  # square_avg (momentum>0 or centered=True would add 4 bytes each)
}
"""fp32 optimizer-state bytes per parameter, excluding any fp32 master copy of the parameters."""

_MASTER_COPY_BYTES = 4  # low-precision training keeps an fp32 master copy inside the optimizer


class BytesPerParam(NamedTuple):
    """Bytes per parameter of each model state; ``_asdict()`` feeds ``model_state_bytes``."""

    param_bytes: float
    grad_bytes: float
    optimizer_bytes_per_param: float


@dataclass(frozen=True, slots=True)
class ModelStateBytes:
    """Model-state bytes held by one rank."""

    parameters: float
    gradients: float
    optimizer_state: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state


def dtype_bytes(precision: str) -> int:
    """Bytes of one element of the compute dtype named by ``precision`` (fp32, bf16 or fp16)."""
    if precision not in _DTYPE_BYTES:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    return _DTYPE_BYTES[precision]


def optimizer_multiplier(
    optimizer: str, precision: str, *, k: float | None = None, offload: bool = False
) -> float:
    """The paper's K: optimizer-state bytes per parameter, fp32 master copy included (also in
    fp32 when the optimizer is offloaded: the host masters are then a copy of the parameters).

    ``k`` overrides the table (for an optimizer not listed, or a non-default configuration).
    """
    if k is not None:
        if not k >= 0:
            raise ValueError(f"K (optimizer bytes per parameter) must be >= 0; got {k!r}")
        return float(k)
    if optimizer not in OPTIMIZER_STATE_BYTES:
        allowed = ", ".join(OPTIMIZER_STATE_BYTES)
        raise ValueError(f"optimizer must be one of {allowed}; got {optimizer!r}")
    master = 0 if dtype_bytes(precision) == 4 and not offload else _MASTER_COPY_BYTES
    return float(OPTIMIZER_STATE_BYTES[optimizer] + master)


def bytes_per_param(precision: str, optimizer: str, *, k: float | None = None) -> BytesPerParam:
    """(param_bytes, grad_bytes, K) for a precision and optimizer: bf16 Adam is (2, 2, 12)."""
    size = dtype_bytes(precision)
    return BytesPerParam(float(size), float(size), optimizer_multiplier(optimizer, precision, k=k))


def model_state_bytes(
    num_params: float,
    world_size: int,
    stage: int,
    *,
    param_bytes: float,
    grad_bytes: float,
    optimizer_bytes_per_param: float,
) -> ModelStateBytes:
    """Per-rank bytes of parameters, gradients and optimizer state under ZeRO-DP ``stage``.

    Stage 0 replicates all three; each higher stage additionally divides one of them by
    ``world_size``, in the order optimizer state, gradients, parameters (paper Sec. 5.1-5.3).
    """
    _check_stage(stage)
    _check_world_size(world_size)
    if not num_params >= 0:
        raise ValueError(f"num_params must be >= 0; got {num_params!r}")
    if min(param_bytes, grad_bytes, optimizer_bytes_per_param) < 0:
        raise ValueError("bytes per parameter must be >= 0")

    def per_rank(bytes_each: float, sharded: bool) -> float:
        return num_params * bytes_each / (world_size if sharded else 1)

    return ModelStateBytes(
        parameters=per_rank(param_bytes, stage >= 3),
        gradients=per_rank(grad_bytes, stage >= 2),
        optimizer_state=per_rank(optimizer_bytes_per_param, stage >= 1),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTShape:
    """A standard GPT (GPT-2 layout): pre-LN blocks, 4h MLP, learned positions, tied LM head."""

    layers: int
    hidden: int
    vocab: int
    seq_len: int
    micro_batch: int = 1
    """Sequences per rank per forward; only activations depend on it."""
    heads: int = 0
    """Attention heads; 0: one per 64 of ``hidden`` (GPT-2's head size). Only the attention's
    log-sum-exp (b·a·s values per block) depends on it."""

    def __post_init__(self) -> None:
        if self.heads == 0:
            object.__setattr__(self, "heads", max(1, self.hidden // 64))
        for name in ("layers", "hidden", "vocab", "seq_len", "micro_batch", "heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTShape.{name} must be a positive integer; got {value!r}")


def gpt_block_params(
    shape: GPTShape, *, biases_and_norms: bool = True, tensor_parallel: int = 1
) -> int:
    """Parameters of one transformer block: 12h² weights (+ 13h biases and LayerNorms).

    Weights: QKV 3h², attention output h², MLP up 4h² and down 4h². Biases: 3h + h + 4h + h;
    two LayerNorms: 2 x 2h. Split over ``tensor_parallel`` = t ranks (Megatron's layout, the
    shipped GPT's ``tensor_parallel_gpt``): the weights and the QKV and MLP-up biases per rank
    are 1/t, the two output biases and the LayerNorms (6h) stay whole.
    """
    h, t = shape.hidden, tensor_parallel
    if not biases_and_norms:
        return 12 * h * h // t
    return (12 * h * h + 7 * h) // t + 6 * h


def gpt_param_count(
    shape: GPTShape, *, biases_and_norms: bool = True, tensor_parallel: int = 1
) -> int:
    """Parameters of a standard GPT: L·(12h² + 13h) + V·h + S·h + 2h.

    V·h is the token embedding, shared with the LM head (tied, so counted once); S·h the learned
    positions; 2h the final LayerNorm. With ``biases_and_norms=False`` the 13h and 2h terms are
    dropped, leaving the 12·L·h² + V·h + S·h that papers usually quote. GPT-2 XL (48, 1600,
    50257, 1024) gives 1,557,611,200, its published count. ``tensor_parallel``: one rank's
    share of the split model (``gpt_block_params``; the vocabulary split, the positions whole).
    """
    h, t = shape.hidden, tensor_parallel
    block = gpt_block_params(shape, biases_and_norms=biases_and_norms, tensor_parallel=t)
    blocks = shape.layers * block
    embeddings = shape.vocab * h // t + shape.seq_len * h
    final_norm = 2 * h if biases_and_norms else 0
    return blocks + embeddings + final_norm


def gpt_largest_unit_params(shape: GPTShape, *, tensor_parallel: int = 1) -> int:
    """Parameters of the largest stage-3 gather unit of a GPT.

    As in ``zerodp.apps.models.gpt``, each transformer block is a unit and the parameters outside
    the blocks (token and position embeddings, final LayerNorm) form the root unit; whichever is
    larger bounds the gathered bytes.
    """
    t = tensor_parallel
    root = shape.vocab * shape.hidden // t + shape.seq_len * shape.hidden + 2 * shape.hidden
    return max(gpt_block_params(shape, tensor_parallel=t), root)


def comm_buffer_bytes(
    stage: int,
    bucket_bytes: float,
    *,
    largest_unit_bytes: float = 0.0,
    prefetch_depth: int = 1,
    param_bytes: float = 4.0,
    reduce_bytes: float = 4.0,
    receive_fraction: float = 0.0,
) -> float:
    """Per-rank bytes of zerodp's communication buffers beyond the model states.

    ``bucket_bytes`` is counted in the parameters' dtype (``param_bytes`` per element). Stages 0
    and 1 reduce gradients in place in the gradient buffer: nothing extra, unless gradients are
    reduced in another dtype (``reduce_bytes``, e.g. fp32 for bf16 gradients), which goes
    through two staging buckets of that dtype. Stage 2 always reduce-scatters through two staging
    buckets (one filling while the other is in flight). Stage 3 adds the gathered full
    parameters of the unit in use and of ``prefetch_depth`` units gathered ahead of it, bounded
    by the largest unit. ``receive_fraction``: where reduce-scatters run point to point (gloo on
    CPU: (N-1)/N; 0 with NCCL), each staging bucket of stages 1-3 has a receive buffer of that
    fraction of it behind it.
    """
    _check_stage(stage)
    if not bucket_bytes >= 0 or not largest_unit_bytes >= 0 or prefetch_depth < 0:
        raise ValueError("bucket_bytes, largest_unit_bytes and prefetch_depth must be >= 0")
    if not param_bytes > 0 or not reduce_bytes > 0:
        raise ValueError("param_bytes and reduce_bytes must be > 0")
    if not 0 <= receive_fraction < 1:
        raise ValueError("receive_fraction must be in [0, 1)")
    staging = 2.0 * bucket_bytes * reduce_bytes / param_bytes
    if stage == 0:
        return staging if reduce_bytes != param_bytes else 0.0  # all-reduced: nothing received
    staging *= 1.0 + receive_fraction
    if stage == 1:
        return staging if reduce_bytes != param_bytes else 0.0
    if stage == 2:
        return staging
    return staging + (prefetch_depth + 1) * float(largest_unit_bytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class Overheads:
    """Per-rank memory besides model states: activations and communication buffers."""

    activation_bytes: float = 0.0
    bucket_bytes: float = 0.0
    largest_unit_bytes: float = 0.0
    """Bytes of the largest stage-3 gather unit, in the parameter dtype."""
    prefetch_depth: int = 1
    """Stage-3 units gathered ahead of the one in use."""
    working_bytes: float = 0.0
    """The backward's working set on top of the activations ([Note: backward working set] in
    activations.py): the margin ``fits`` adds."""
    receive_fraction: float = 0.0
    """Reduce-scatter receive buffers per staging bucket ((N-1)/N with gloo on CPU, else 0)."""


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Everything one rank holds at ``stage`` and ``world_size``, in bytes."""

    stage: int
    world_size: int
    model_states: ModelStateBytes
    activations: float
    buffers: float
    margin: float = 0.0  # the backward's working set

    @property
    def total(self) -> float:
        return self.model_states.total + self.activations + self.buffers

    @property
    def peak(self) -> float:
        """What the step's peak is predicted to be: the total and the margin."""
        return self.total + self.margin


def estimate_memory(
    num_params: float,
    world_size: int,
    stage: int,
    per_param: BytesPerParam,
    overheads: Overheads = Overheads(),  # frozen, so one shared default is safe
) -> MemoryEstimate:
    """Model states plus activations plus communication buffers for one rank."""
    states = model_state_bytes(num_params, world_size, stage, **per_param._asdict())
    buffers = comm_buffer_bytes(
        stage,
        overheads.bucket_bytes,
        largest_unit_bytes=overheads.largest_unit_bytes,
        prefetch_depth=overheads.prefetch_depth,
        receive_fraction=overheads.receive_fraction,
    )
    activations, margin = overheads.activation_bytes, overheads.working_bytes
    return MemoryEstimate(stage, world_size, states, activations, buffers, margin)


def fits(estimate: MemoryEstimate, device_bytes: float) -> bool:
    """Whether the estimate's total and margin (the predicted peak) fit in ``device_bytes``."""
    return estimate.peak <= device_bytes


def recommend_stage(
    device_bytes: float,
    num_params: float,
    world_size: int,
    per_param: BytesPerParam,
    overheads: Overheads = Overheads(),  # frozen, so one shared default is safe
) -> int | None:
    """The least-sharded stage whose total fits in ``device_bytes``, or ``None`` if none does.

    Least sharded first because each stage adds communication: stage 1 and 2 keep plain data
    parallelism's volume, stage 3 adds 50% (paper Sec. 7), so shard only as far as needed.
    """
    for stage in STAGES:
        if fits(estimate_memory(num_params, world_size, stage, per_param, overheads), device_bytes):
            return stage
    return None


def resolve_factory(spec: str) -> Callable[[], object]:
    """Import ``"package.module:attr"`` (attr may be dotted) and return that callable."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"expected 'module:function', got {spec!r}")
    target: object = importlib.import_module(module_name)
    for attr in attr_path.split("."):
        target = getattr(target, attr)
    if not callable(target):
        raise ValueError(f"{spec!r} is not callable")
    return target


def count_parameters(factory: Callable[[], nn.Module] | str) -> int:
    """Parameters of the module ``factory()`` builds, counted without allocating their storage.

    The factory runs under ``torch.device("meta")``, so tensors it creates without an explicit
    device have shapes but no data: a 100B-parameter model costs nothing to count. Parameters
    shared between modules (tied embeddings) count once, as ``Module.parameters()`` deduplicates.
    """
    import torch  # deferred: `zerodp estimate --params` must not pay for importing torch

    build = resolve_factory(factory) if isinstance(factory, str) else factory
    with torch.device("meta"):
        model = build()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"the factory returned {type(model).__name__}, not a torch.nn.Module")
    params = list(model.parameters())
    if any(p.device.type != "meta" for p in params):
        logger.warning("the factory placed some parameters on a real device; they were allocated")
    return sum(p.numel() for p in params)


def _check_stage(stage: int) -> None:
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"stage must be one of 0, 1, 2, 3; got {stage!r}")


def _check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer; got {world_size!r}")
