"""What the ZeRO paper predicts for a ``zerodp train`` run, and the units both sides are in.

Memory in bytes per rank, by category (``MEMORY_CATEGORIES``; the summary and the figure show
MB = 1e6 bytes, as the estimator's GB = 1e9); communication in the paper's units (see
``COMM_UNIT``), per rank and per optimizer step.
"""

from __future__ import annotations

from typing import Any

from zerodp.apps.models.gpt import GPTConfig, memory_shape
from zerodp.apps.train.result import RunResult
from zerodp.config import Activations
from zerodp.memory import comm_buffer_bytes, gpt_saved_bytes, gpt_working_bytes

MB = 1e6

MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer_state", "comm_buffers")
CATEGORY_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "comm_buffers": "comm buffers",
}

PEAK_CATEGORIES = (*MEMORY_CATEGORIES, "gathered", "activations", "rest", "runtime")
"""The measured peak per rank, by what held it ([Note: memory meters] in
zerodp/memory/meter.py): the model states and buffers at rest, stage 3's gathered parameters
(their peak), the activations the last forward saved for backward, the rest at the peak
(temporaries, gradients in flight, allocator slack) and, on CPU, the runtime before the model
was built (torch, Python, the data)."""
PEAK_LABELS = {
    **CATEGORY_LABELS,
    "gathered": "gathered params",
    "activations": "activations",
    "rest": "rest at the peak",
    "runtime": "runtime",
}

COMM_UNIT = (
    "elements per rank per optimizer step, in the ZeRO paper's units: a reduce-scatter counts "
    "its input, an all-gather its output, an all-reduce twice (it is a reduce-scatter plus an "
    "all-gather); bytes = those elements times their element size"
)


def comm_theory_multiplier(stage: int) -> int:
    """The paper's per-step volume in units of Ψ: 2 for stages 0-2 (an all-reduce, or a
    reduce-scatter plus an all-gather), 3 for stage 3 (parameters are gathered twice)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be one of 0, 1, 2, 3; got {stage!r}")
    return 3 if stage == 3 else 2


def comm_theory_elements(stage: int, num_params: int) -> int:
    return comm_theory_multiplier(stage) * num_params


def comm_theory_bytes(stage: int, num_params: int, param_bytes: int, reduce_bytes: int) -> int:
    """The paper's volume in bytes: gradients travel in the reduce dtype (one reduce-scatter,
    or an all-reduce counted as two), parameters in the compute dtype (one all-gather in stages
    1-2, two in stage 3). In fp32 both are 4 bytes; in bf16 with fp32 reduction 4 and 2."""
    if stage == 0:
        return 2 * num_params * reduce_bytes
    gathers = comm_theory_multiplier(stage) - 1
    return num_params * (reduce_bytes + gathers * param_bytes)


def comm_volume_bytes(comm: dict[str, Any]) -> int:
    """Bytes of a ``CommStats.to_dict()`` in the paper's units (all-reduce counted twice)."""
    return sum(n * (2 if kind == "all_reduce" else 1) for kind, n in comm["bytes"].items())


def memory_theory(run: RunResult, measured: dict[str, Any]) -> dict[str, float] | None:
    """The estimator's per-rank bytes by category for this run, or None if the optimizer's K
    is unknown to it (then the memory report has no theory either)."""
    states = measured.get("theory")
    if states is None:
        return None
    # A bucket holds bucket_bytes of parameters but never more than the model (else the
    # estimator's 2 x bucket_bytes would be the configured 32 MiB for a model of a few MB); its
    # staging copy is in the reduce dtype.
    bucket_numel = min(run.bucket_bytes // run.element_size, measured["padded_numel"])
    # The staging buckets only, as the report's comm_buffers: stage 3's gathered units are
    # their own category (``memory_peak_theory``: the schedule's bound). Counting them here
    # too predicted them twice.
    buffers = comm_buffer_bytes(
        run.stage,
        bucket_numel * run.element_size,
        param_bytes=run.element_size,
        reduce_bytes=run.reduce_element_size,
        receive_fraction=run.receive_fraction,
    )
    theory = {name: float(states[name]) for name in MEMORY_CATEGORIES[:3]}
    theory["comm_buffers"] = buffers
    return _with_totals(theory)


def memory_measured(measured: dict[str, Any]) -> dict[str, float]:
    return _with_totals({name: int(measured[name]) for name in MEMORY_CATEGORIES})


def _with_totals(values: dict[str, Any]) -> dict[str, Any]:
    """Adds ``model_states`` (what ZeRO's stages shard) and ``total`` (with comm buffers)."""
    values["model_states"] = sum(values[name] for name in MEMORY_CATEGORIES[:3])
    values["total"] = values["model_states"] + values["comm_buffers"]
    return values


def memory_peak(measured: dict[str, Any]) -> dict[str, Any] | None:
    """The measured peak of one rank split by ``PEAK_CATEGORIES`` (``rest`` is what the others
    do not explain, so it is negative only if the figures disagree), with ``total`` and the
    meter's ``source``; ``None`` where the peak was not measured."""
    process = measured.get("process") or {}
    if process.get("peak") is None:
        return None
    parts = {name: int(measured[name]) for name in MEMORY_CATEGORIES}
    # Stage 3 on CPU keeps released gather memory ([Note: reused gather memory]): at the peak
    # the gathered units sit in it, so what gathering holds is the larger of the two.
    gathered = (measured.get("gathered_peak") or 0, measured.get("gathered_cached") or 0)
    parts["gathered"] = int(max(gathered))
    parts["activations"] = int(process.get("activations") or 0)
    parts["runtime"] = int(process.get("baseline") or 0)
    parts["rest"] = int(process["peak"]) - sum(parts.values())
    return {**parts, "total": int(process["peak"]), "source": process.get("source", "RSS")}


def memory_peak_theory(run: RunResult, measured: dict[str, Any]) -> dict[str, Any] | None:
    """The estimator's prediction of the same peak: the model states and buffers
    (``memory_theory``), the gathered units the stage-3 schedule bounds, the activations the
    forward leaves (``run.activations_theory``, exact for the shipped GPT) and, as the rest, the
    backward's working set on top of them (``run.working_theory``: the margin ``zerodp
    estimate`` adds before it says "fits"); it has no figure for the runtime or for the
    allocator's slack, which the measured rest also holds."""
    at_rest = memory_theory(run, measured)
    if at_rest is None:
        return None
    parts = {name: float(at_rest[name]) for name in MEMORY_CATEGORIES}
    parts["gathered"] = float(measured.get("gathered_bound") or 0)
    parts["activations"] = float(run.activations_theory)
    parts["rest"] = float(run.working_theory)
    return {**parts, "total": sum(parts.values())}


def working_theory(gpt: GPTConfig, batch: int, dtype_bytes: int, tensor_parallel: int = 1) -> float:
    """The backward's working set of the shipped GPT per rank ([Note: backward working set] in
    memory/activations.py)."""
    shape = memory_shape(gpt, batch)
    return float(gpt_working_bytes(shape, dtype_bytes=dtype_bytes, tensor_parallel=tensor_parallel))


def activations_theory(
    gpt: GPTConfig,
    batch: int,
    dtype_bytes: int,
    activations: Activations,
    tensor_parallel: int = 1,
) -> float:
    """Activations one forward of the shipped GPT leaves on the device per rank, to the byte
    ([Note: GPT activations] in memory/activations.py), with the run's checkpointing,
    checkpoint offload and tensor parallelism."""
    shape = memory_shape(gpt, batch)
    checkpointing = bool(activations.checkpoint)
    on_device = activations.on_device if activations.offload != "none" else None
    return float(
        gpt_saved_bytes(
            shape,
            dtype_bytes=dtype_bytes,
            checkpointing=checkpointing,
            on_device=on_device,
            tensor_parallel=tensor_parallel,
        )
    )
