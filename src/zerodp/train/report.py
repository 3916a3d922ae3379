"""The report of a ``zerodp train`` run: ``report.json``, ``report.png`` and a terminal summary.

Everything here is a pure function of the per-stage ``RunResult`` s that the training loop
gathers on rank 0 (no process group, no tensors), so it is unit-tested on made-up numbers.

Units: memory in bytes (the summary prints MB = 1e6 bytes, as the estimator's GB = 1e9);
communication in the ZeRO paper's units (see ``COMM_UNIT``), per rank and per optimizer step.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from zerodp.memory.estimator import comm_buffer_bytes

MB = 1e6

MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer_state", "comm_buffers")
_CATEGORY_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "comm_buffers": "comm buffers",
}

COMM_UNIT = (
    "elements per rank per optimizer step, in the ZeRO paper's units: a reduce-scatter counts "
    "its input, an all-gather its output, an all-reduce twice (it is a reduce-scatter plus an "
    "all-gather); bytes = those elements times their element size"
)

JSON_NAME = "report.json"
PNG_NAME = "report.png"

_SMOOTH_STEPS = 10  # "final loss" is the mean of the last steps: one batch's loss is noisy


@dataclass(slots=True)
class RunResult:
    """What one stage's run produced, as plain values (rank 0 holds the gathered ones)."""

    stage: int
    status: str = "ok"  # "ok" or "skipped"
    note: str = ""  # why a stage was skipped
    first_step: int = 0  # > 0 when resumed from a checkpoint
    losses: list[float] = field(default_factory=list)  # per step, mean over ranks
    grad_norms: list[float] = field(default_factory=list)  # per step; empty without --clip
    lrs: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)  # seconds, rank 0's clock
    tokens_per_step: int = 0  # all ranks together
    num_params: int = 0  # Ψ
    element_size: int = 4  # bytes of one parameter element (the compute dtype)
    reduce_element_size: int = 4  # bytes of one element gradients are reduced in
    bucket_bytes: int = 0
    largest_unit_bytes: int = 0  # the largest stage-3 gather unit, in parameter bytes
    memory: list[dict[str, Any]] = field(default_factory=list)  # MemoryReport.to_dict() per rank
    comm: dict[str, Any] | None = None  # CommStats.to_dict() of the last step
    comm_volumes: list[int] = field(default_factory=list)  # volume of every step
    skipped_steps: int = 0  # steps skipped for non-finite gradients (mixed precision)
    loss_scale: float | None = None  # fp16's loss scale at the end
    sample_prompt: str = ""
    sample_text: str = ""

    @classmethod
    def skipped(cls, stage: int, note: str) -> RunResult:
        return cls(stage=stage, status="skipped", note=note)


# -- theory -----------------------------------------------------------------------------------


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
    buffers = comm_buffer_bytes(
        run.stage,
        bucket_numel * run.element_size,
        largest_unit_bytes=run.largest_unit_bytes,
        param_bytes=run.element_size,
        reduce_bytes=run.reduce_element_size,
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


# -- the report dictionary --------------------------------------------------------------------


def build_report(
    options: dict[str, Any], environment: dict[str, Any], runs: Sequence[RunResult]
) -> dict[str, Any]:
    """The content of ``report.json``: options, environment, and one entry per stage run."""
    entries = [_run_entry(run) for run in runs]
    report: dict[str, Any] = {
        "format": "zerodp.train-report.v1",
        "options": options,
        "environment": environment,
        "units": {"memory": "bytes per rank", "comm": COMM_UNIT},
        "runs": entries,
    }
    if len(runs) > 1:
        report["comparison"] = compare_runs(runs)
    return report


def _run_entry(run: RunResult) -> dict[str, Any]:
    entry: dict[str, Any] = {"stage": run.stage, "status": run.status}
    if run.status != "ok":
        entry["note"] = run.note
        return entry
    entry.update(
        num_params=run.num_params,
        first_step=run.first_step,
        tokens_per_step=run.tokens_per_step,
        loss=loss_summary(run.losses),
        curves={"loss": run.losses, "grad_norm": run.grad_norms, "lr": run.lrs},
        throughput=throughput(run.step_times, run.tokens_per_step),
        memory=[
            {"rank": m["rank"], "measured": memory_measured(m), "theory": memory_theory(run, m)}
            for m in run.memory
        ],
        memory_report=run.memory,
        comm=comm_entry(run),
        skipped_steps=run.skipped_steps,
        loss_scale=run.loss_scale,
        sample={"prompt": run.sample_prompt, "text": run.sample_text},
    )
    return entry


def loss_summary(losses: Sequence[float]) -> dict[str, float | None]:
    if not losses:
        return {"first": None, "last": None, "final": None}
    tail = losses[-_SMOOTH_STEPS:]
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


def comm_entry(run: RunResult) -> dict[str, Any] | None:
    if run.comm is None:
        return None
    theory_elements = comm_theory_elements(run.stage, run.num_params)
    return {
        "unit": COMM_UNIT,
        "formula": f"{comm_theory_multiplier(run.stage)}Ψ",
        "measured_elements": int(run.comm["volume_elements"]),
        "theory_elements": theory_elements,
        "measured_bytes": comm_volume_bytes(run.comm),
        "theory_bytes": comm_theory_bytes(
            run.stage, run.num_params, run.element_size, run.reduce_element_size
        ),
        "steady": len(set(run.comm_volumes)) <= 1,  # every step moved the same volume
        "last_step": run.comm,
    }


def compare_runs(runs: Sequence[RunResult]) -> dict[str, Any]:
    """How far each stage's loss curve is from the first stage's, step by step."""
    done = [r for r in runs if r.status == "ok"]
    if not done:
        return {"reference_stage": None, "max_abs_loss_diff": {}}
    ref = done[0]
    # Runs have equal lengths; strict=False only keeps a malformed input from raising here.
    diffs = {
        str(r.stage): max(
            (abs(a - b) for a, b in zip(r.losses, ref.losses, strict=False)), default=0.0
        )
        for r in done
    }
    return {"reference_stage": ref.stage, "max_abs_loss_diff": diffs}


# -- terminal summary -------------------------------------------------------------------------


def format_mb(num_bytes: float | None) -> str:
    """Bytes as MB (1e6), to about 3 significant figures: 13234567 -> "13.2", 482304 ->
    "0.48"."""
    if num_bytes is None:
        return "n/a"
    value = num_bytes / MB
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) >= 0.01:
        return f"{value:.2f}"
    return f"{value:.2g}"


def format_count(n: float) -> str:
    """3257856 -> "3.26M"; 120576 -> "121k"; 950 -> "950"."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.3g}{suffix}" if value < 1000 else f"{value:,.0f}{suffix}"
    return f"{n:g}"


def format_summary(report: dict[str, Any]) -> str:
    """The terminal summary: one block per run, plus the comparison table when there are
    several stages."""
    lines = [_header_line(report)]
    for entry in report["runs"]:
        lines += ["", *_run_lines(entry)]
    if "comparison" in report:
        lines += ["", *format_compare_table(report)]
    return "\n".join(lines)


def _header_line(report: dict[str, Any]) -> str:
    o, env = report["options"], report["environment"]
    accum = f" x {o['grad_accum']} micro-batches" if o["grad_accum"] > 1 else ""
    return (
        f"zerodp train: preset {o['preset']}, {o['precision']}, {env['world_size']} ranks "
        f"({env['backend']}, {env['device']}), {o['steps']} steps of "
        f"{o['batch']}x{env['seq_len']} tokens per rank{accum}, seed {o['seed']}"
    )


def _run_lines(entry: dict[str, Any]) -> list[str]:
    stage = entry["stage"]
    if entry["status"] != "ok":
        return [f"Stage {stage}: skipped ({entry['note']})"]
    loss, tp = entry["loss"], entry["throughput"]
    resumed = f", resumed at step {entry['first_step']}" if entry.get("first_step") else ""
    skipped = entry.get("skipped_steps", 0)
    if skipped:
        resumed += f", {skipped} steps skipped for non-finite gradients"
    lines = [
        f"Stage {stage}: {entry['num_params']:,} parameters (Ψ){resumed}",
        f"  loss {loss['first']:.3f} -> {loss['final']:.3f} (mean of the last "
        f"{min(_SMOOTH_STEPS, len(entry['curves']['loss']))} steps, all ranks)",
        f"  throughput {_tokens_per_s(tp['tokens_per_s'])} tokens/s (all ranks), "
        f"{_seconds(tp['step_time_s'])} per step, {_seconds(tp['total_time_s'])} in all",
        *_memory_lines(entry["memory"]),
        *_comm_lines(entry["comm"]),
    ]
    sample = entry["sample"]
    if sample["text"]:
        lines.append(f"  sample (prompt {sample['prompt']!r}):")
        lines += ["    | " + line for line in (sample["prompt"] + sample["text"]).splitlines()]
    return lines


def _memory_lines(per_rank: list[dict[str, Any]]) -> list[str]:
    names = [*MEMORY_CATEGORIES, "total"]
    header = "  rank" + "".join(_CATEGORY_LABELS.get(n, n).rjust(18) for n in names)
    lines = ["  memory per rank in MB (1e6 bytes), measured / theory:", header]
    for row in per_rank:
        theory = row["theory"] or {}
        cells = [
            f"{format_mb(row['measured'][n])} / {format_mb(theory.get(n))}".rjust(18) for n in names
        ]
        lines.append(f"  {row['rank']:>4}" + "".join(cells))
    lines.append(
        "  comm buffers: two staging buckets in the reduce dtype (stage 2, and every stage when"
        " gradients are reduced in another dtype than they are stored in)"
    )
    return lines


def _comm_lines(comm: dict[str, Any] | None) -> list[str]:
    if comm is None:
        return ["  communication: none recorded"]
    kinds = ", ".join(
        f"{kind} {format_count(n)}" for kind, n in sorted(comm["last_step"]["elements"].items())
    )
    ratio = comm["measured_elements"] / comm["theory_elements"] if comm["theory_elements"] else 0
    steady = "" if comm["steady"] else " (varied between steps)"
    return [
        f"  communication per step{steady}: measured {format_count(comm['measured_elements'])} "
        f"elements = {format_mb(comm['measured_bytes'])} MB vs theory {comm['formula']} = "
        f"{format_count(comm['theory_elements'])} elements = {format_mb(comm['theory_bytes'])} MB"
        f" (measured/theory {ratio:.3f})",
        f"    by collective: {kinds or 'none'}; units: paper's (all-reduce counted twice)",
    ]


def format_compare_table(report: dict[str, Any]) -> list[str]:
    """One row per stage: the loss curves coincide while model-state memory per rank falls.
    Memory is that of the rank holding the most; comm buffers are apart, being a constant
    set by the bucket size rather than a share of the model."""
    diffs = report["comparison"]["max_abs_loss_diff"]
    ref = report["comparison"]["reference_stage"]
    pair = "MB (meas/theory)"
    header = (
        f"{'stage':>5}{'final loss':>12}{f'max |Δloss| vs {ref}':>19}{'tokens/s':>10}"
        f"{'model states ' + pair:>32}{'comm buffers ' + pair:>32}{'comm/step ' + pair:>29}"
    )
    lines = ["Stages compared on the same seed and data (memory per rank):", header]
    for entry in report["runs"]:
        stage = entry["stage"]
        if entry["status"] != "ok":
            lines.append(f"{stage:>5}  skipped: {entry['note']}")
            continue
        worst = max(entry["memory"], key=lambda row: row["measured"]["total"])
        measured, theory = worst["measured"], worst["theory"] or {}
        comm = entry["comm"] or {}
        lines.append(
            f"{stage:>5}{entry['loss']['final']:>12.4f}{diffs[str(stage)]:>19.2e}"
            f"{_tokens_per_s(entry['throughput']['tokens_per_s']):>10}"
            f"{_pair_mb(measured['model_states'], theory.get('model_states')):>32}"
            f"{_pair_mb(measured['comm_buffers'], theory.get('comm_buffers')):>32}"
            f"{_pair_mb(comm.get('measured_bytes'), comm.get('theory_bytes')):>29}"
        )
    return lines


def _pair_mb(a: float | None, b: float | None) -> str:
    return f"{format_mb(a)} / {format_mb(b)}"


def _tokens_per_s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def _seconds(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.1f} s"


# -- files ------------------------------------------------------------------------------------


def write_report(report: dict[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``report.json`` and ``report.png`` into ``out_dir`` (created if needed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / JSON_NAME, out / PNG_NAME
    json_path.write_text(json.dumps(_finite(report), indent=2) + "\n", encoding="utf-8")
    plot_report(report, png_path)
    return json_path, png_path


def _finite(value: Any) -> Any:
    """JSON has no NaN/inf (json.dumps would write invalid JSON): they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def plot_report(report: dict[str, Any], path: str | Path) -> None:
    """Loss curves, memory per rank by category (measured vs theory) and bytes per step."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, and no GUI toolkit needed
    import matplotlib.pyplot as plt

    done = [e for e in report["runs"] if e["status"] == "ok"]
    fig, (ax_loss, ax_mem, ax_comm) = plt.subplots(1, 3, figsize=(17, 5))
    _plot_loss(ax_loss, done)
    _plot_memory(ax_mem, done)
    _plot_comm(ax_comm, done)
    o = report["options"]
    fig.suptitle(
        f"zerodp train: preset {o['preset']}, {o['precision']}, "
        f"{report['environment']['world_size']} ranks"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_loss(ax: Any, done: list[dict[str, Any]]) -> None:
    # Later stages are drawn thinner and dashed so that coinciding curves stay visible.
    for i, entry in enumerate(done):
        first = entry.get("first_step", 0)
        ax.plot(
            range(first + 1, first + len(entry["curves"]["loss"]) + 1),
            entry["curves"]["loss"],
            label=f"stage {entry['stage']}",
            linewidth=max(0.8, 2.5 - 0.6 * i),
            linestyle="-" if i == 0 else (0, (4, 2 + i)),
        )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte)")
    ax.set_title("loss")
    ax.legend()


class Bar(NamedTuple):
    label: str
    measured: dict[str, Any]
    theory: dict[str, Any]


def memory_bars(done: list[dict[str, Any]], max_bars: int = 8) -> list[Bar]:
    """(label, measured, theory) per bar: every rank of every run when that fits in
    ``max_bars``, else the rank with the most memory of each run."""
    every = [(e, row) for e in done for row in e["memory"]]
    if len(every) > max_bars:
        every = [(e, max(e["memory"], key=lambda r: r["measured"]["total"])) for e in done]
    return [
        Bar(f"stage {e['stage']}\nrank {row['rank']}", row["measured"], row["theory"] or {})
        for e, row in every
    ]


def _plot_memory(ax: Any, done: list[dict[str, Any]]) -> None:
    bars = memory_bars(done)
    width = 0.38
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red")
    top = 0.0
    for side, (offset, hatch) in enumerate(((-width / 2, ""), (width / 2, "//"))):
        bottoms = [0.0] * len(bars)
        for name, color in zip(MEMORY_CATEGORIES, colors, strict=True):
            heights = [((bar.theory if side else bar.measured).get(name) or 0) / MB for bar in bars]
            label = _CATEGORY_LABELS[name] if side == 0 else None
            ax.bar(
                [i + offset for i in range(len(bars))],
                heights,
                width,
                bottom=bottoms,
                color=color,
                hatch=hatch,
                edgecolor="white" if side == 0 else "black",
                label=label,
            )
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
        top = max([top, *bottoms])
    ax.set_ylim(0, top * 1.25 or 1.0)  # headroom for the legend
    ax.set_xticks(range(len(bars)), [bar.label for bar in bars], fontsize=8)
    ax.set_ylabel("MB per rank (1e6 bytes)")
    ax.set_title("memory per rank: measured (plain) vs theory (hatched)")
    ax.legend(fontsize=8)


def _plot_comm(ax: Any, done: list[dict[str, Any]]) -> None:
    with_comm = [e for e in done if e["comm"] is not None]
    width = 0.38
    xs = range(len(with_comm))
    measured = [e["comm"]["measured_bytes"] / MB for e in with_comm]
    theory = [e["comm"]["theory_bytes"] / MB for e in with_comm]
    ax.bar([x - width / 2 for x in xs], measured, width, label="measured")
    ax.bar([x + width / 2 for x in xs], theory, width, hatch="//", label="theory (2Ψ, 3Ψ)")
    ax.set_ylim(0, max([*measured, *theory], default=0.0) * 1.25 or 1.0)  # legend room
    ax.set_xticks(list(xs), [f"stage {e['stage']}" for e in with_comm])
    ax.set_ylabel("MB per rank per step (paper's units)")
    ax.set_title("communication per step")
    ax.legend(fontsize=8)
