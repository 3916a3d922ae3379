"""The report of a ``zerodp train`` run: ``report.json``, ``report.png`` and a terminal summary.

Everything here is a pure function of the per-stage ``RunResult`` s that the training loop
gathers on rank 0 (no process group, no tensors), so it is unit-tested on made-up numbers.

Modules: ``result`` (``RunResult``, loss summary, throughput), ``theory`` (the paper's memory
and traffic, and the units), this one (the report dictionary and its files), ``summary`` (the
terminal text), ``figures`` (``report.png``). The names of all of them are importable from here.

Units: memory in bytes (the summary prints MB = 1e6 bytes, as the estimator's GB = 1e9);
communication in the ZeRO paper's units (see ``COMM_UNIT``), per rank and per optimizer step.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zerodp.apps.train.figures import Bar, memory_bars, plot_report
from zerodp.apps.train.result import SMOOTH_STEPS, RunResult, loss_summary, throughput
from zerodp.apps.train.summary import format_compare_table, format_count, format_mb, format_summary
from zerodp.apps.train.theory import (
    CATEGORY_LABELS,
    COMM_UNIT,
    MB,
    MEMORY_CATEGORIES,
    comm_theory_bytes,
    comm_theory_elements,
    comm_theory_multiplier,
    comm_volume_bytes,
    memory_measured,
    memory_peak,
    memory_peak_theory,
    memory_theory,
)

__all__ = [
    "CATEGORY_LABELS",
    "COMM_UNIT",
    "JSON_NAME",
    "MB",
    "MEMORY_CATEGORIES",
    "PNG_NAME",
    "SMOOTH_STEPS",
    "Bar",
    "RunResult",
    "build_report",
    "comm_entry",
    "comm_theory_bytes",
    "comm_theory_elements",
    "comm_theory_multiplier",
    "comm_volume_bytes",
    "compare_runs",
    "format_compare_table",
    "format_count",
    "format_mb",
    "format_summary",
    "loss_summary",
    "memory_bars",
    "memory_measured",
    "memory_theory",
    "plot_report",
    "throughput",
    "write_report",
]

JSON_NAME = "report.json"
PNG_NAME = "report.png"


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
    # Every stage that ran is "ok" (a failing stage fails the command); the key stays for the
    # readers of format v1.
    entry: dict[str, Any] = {"stage": run.stage, "status": "ok"}
    entry.update(
        num_params=run.num_params,
        model_params=run.model_params or run.num_params,
        first_step=run.first_step,
        tokens_per_step=run.tokens_per_step,
        config=run.config,
        loss=loss_summary(run.losses),
        curves={
            "loss": run.losses,
            "grad_norm": run.grad_norms,
            "lr": run.lrs,
            "step_time_s": run.step_times,
        },
        throughput=throughput(run.step_times, run.tokens_per_step),
        memory=[
            {
                "rank": m.get("global_rank", m["rank"]),
                "measured": memory_measured(m),
                "theory": memory_theory(run, m),
                "peak": memory_peak(m),
                "peak_theory": memory_peak_theory(run, m),
                "tiers": {k: m.get(k, 0) for k in ("device", "host", "nvme")},
                "offload": m.get("offload", "none"),
            }
            for m in run.memory
        ],
        memory_report=run.memory,
        comm=comm_entry(run),
        skipped_steps=run.skipped_steps,
        loss_scale=run.loss_scale,
        sample={"prompt": run.sample_prompt, "text": run.sample_text},
    )
    return entry


def comm_entry(run: RunResult) -> dict[str, Any] | None:
    if run.comm is None:
        return None
    # One data-parallel rank has no one to talk to: the paper's volumes are for N > 1 (its 2Ψ
    # is 2Ψ(N-1)/N rounded up), and at N = 1 they are 0 (TP ranks of one DP rank do not count).
    alone = (run.memory[0].get("world_size", len(run.memory)) if run.memory else 1) == 1
    theory_bytes = comm_theory_bytes(
        run.stage, run.num_params, run.element_size, run.reduce_element_size
    )
    return {
        "unit": COMM_UNIT,
        "formula": "0 (one rank)" if alone else f"{comm_theory_multiplier(run.stage)}Ψ",
        "measured_elements": int(run.comm["volume_elements"]),
        "theory_elements": 0 if alone else comm_theory_elements(run.stage, run.num_params),
        "measured_bytes": comm_volume_bytes(run.comm),
        "theory_bytes": 0 if alone else theory_bytes,
        "steady": len(set(run.comm_volumes)) <= 1,  # every step moved the same volume
        "last_step": run.comm,
        "tensor_parallel": run.tp_comm,  # the model's own TP traffic, apart from ZeRO's
    }


def compare_runs(runs: Sequence[RunResult]) -> dict[str, Any]:
    """How far each stage's loss curve is from the first stage's, step by step."""
    ref = runs[0]
    # Runs have equal lengths; strict=False only keeps a malformed input from raising here.
    diffs = {
        str(r.stage): max(
            (abs(a - b) for a, b in zip(r.losses, ref.losses, strict=False)), default=0.0
        )
        for r in runs
    }
    return {"reference_stage": ref.stage, "max_abs_loss_diff": diffs}


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
