"""The terminal summary of a ``zerodp train`` run: one block per stage, and a table comparing the
stages when there are several. A pure function of the report dictionary (``report.build_report``).
"""

from __future__ import annotations

from typing import Any

from zerodp.apps.train.result import SMOOTH_STEPS
from zerodp.apps.train.theory import CATEGORY_LABELS, MB, MEMORY_CATEGORIES


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


def run_title(report: dict[str, Any]) -> str:
    """What ran, in one line: the report's figure title and the summary's first words."""
    o, env = report["options"], report["environment"]
    checkpointing = o.get("activation_checkpointing", "none")  # absent in older reports
    extra = f", activation checkpointing {checkpointing}" if checkpointing != "none" else ""
    tp = env.get("tensor_parallel", 1)  # absent in older reports
    mesh = f"DP {env['world_size'] // tp} x TP {tp}, " if tp > 1 else ""
    return (
        f"zerodp train: preset {o['preset']}, {o['precision']}{extra}, {env['world_size']} "
        f"ranks ({mesh}{env['backend']}, {env['device']})"
    )


def _header_line(report: dict[str, Any]) -> str:
    o, env = report["options"], report["environment"]
    accum = f" x {o['grad_accum']} micro-batches" if o["grad_accum"] > 1 else ""
    return (
        f"{run_title(report)}, {o['steps']} steps of "
        f"{o['batch']}x{env['seq_len']} tokens per rank{accum}, seed {o['seed']}"
    )


def _run_lines(entry: dict[str, Any]) -> list[str]:
    stage = entry["stage"]
    loss, tp = entry["loss"], entry["throughput"]
    resumed = f", resumed at step {entry['first_step']}" if entry.get("first_step") else ""
    skipped = entry.get("skipped_steps", 0)
    if skipped:
        resumed += f", {skipped} steps skipped for non-finite gradients"
    lines = [
        f"Stage {stage}: {_params(entry)}{resumed}",
        f"  loss {loss['first']:.3f} -> {loss['final']:.3f} (mean of the last "
        f"{min(SMOOTH_STEPS, len(entry['curves']['loss']))} steps, all ranks)",
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


def _params(entry: dict[str, Any]) -> str:
    whole = entry.get("model_params") or entry["num_params"]
    if whole == entry["num_params"]:
        return f"{whole:,} parameters (Ψ)"
    return f"{entry['num_params']:,} parameters (Ψ) per tensor-parallel rank, {whole:,} in all"


def _memory_lines(per_rank: list[dict[str, Any]]) -> list[str]:
    names = [*MEMORY_CATEGORIES, "total"]
    header = "  rank" + "".join(CATEGORY_LABELS.get(n, n).rjust(18) for n in names)
    lines = ["  memory per rank in MB (1e6 bytes), measured / theory:", header]
    for row in per_rank:
        theory = row["theory"] or {}
        cells = [
            f"{format_mb(row['measured'][n])} / {format_mb(theory.get(n))}".rjust(18) for n in names
        ]
        lines.append(f"  {row['rank']:>4}" + "".join(cells))
    lines.append(
        "  comm buffers: two staging buckets in the reduce dtype (stages 2-3, and every stage"
        " when gradients are reduced in another dtype than they are stored in; where gloo"
        " reduce-scatters CPU tensors, each with a receive buffer of (N-1)/N of it)"
    )
    return lines + _peak_lines(per_rank) + _tier_lines(per_rank)


def _peak_lines(per_rank: list[dict[str, Any]]) -> list[str]:
    """The measured peak of each rank ([Note: memory meters] in zerodp/memory/meter.py) beside
    the estimator's prediction of what it can predict (all but the runtime; as the rest, the
    backward's working set)."""
    rows = [r for r in per_rank if r.get("peak")]
    if not rows:
        return []
    lines = [f"  peak memory per rank in MB, measured ({rows[0]['peak']['source']}) / predicted:"]
    for row in rows:
        peak, predicted = row["peak"], row.get("peak_theory") or {}
        lines.append(
            f"  {row['rank']:>4}  {format_mb(peak['total'])}: before the model "
            f"{format_mb(peak['runtime'])}, activations {format_mb(peak['activations'])} / "
            f"{format_mb(predicted.get('activations'))}, gathered {format_mb(peak['gathered'])} / "
            f"{format_mb(predicted.get('gathered'))}, rest {format_mb(peak['rest'])} / "
            f"{format_mb(predicted.get('rest'))}; without "
            f"what was there before the model {format_mb(peak['total'] - peak['runtime'])} / "
            f"{format_mb(predicted.get('total'))}"
        )
    return lines


def _tier_lines(per_rank: list[dict[str, Any]]) -> list[str]:
    """Offloaded runs: where the bytes are (the optimizer state column above is what stays in
    memory of it: in host memory with "cpu", only step counters with "nvme")."""
    rows = [r for r in per_rank if r.get("offload", "none") != "none"]
    if not rows:
        return []
    lines = [f"  optimizer offloaded to {rows[0]['offload']!r}; MB per rank by tier:"]
    for row in rows:
        t = row["tiers"]
        lines.append(
            f"  {row['rank']:>4}  device {format_mb(t['device'])}, host {format_mb(t['host'])}"
            + (f", nvme {format_mb(t['nvme'])}" if row["offload"] == "nvme" else "")
        )
    return lines


def _comm_lines(comm: dict[str, Any] | None) -> list[str]:
    if comm is None:
        return ["  communication: none recorded"]
    kinds = ", ".join(
        f"{kind} {format_count(n)}" for kind, n in sorted(comm["last_step"]["elements"].items())
    )
    theory = comm["theory_elements"]
    ratio = f" (measured/theory {comm['measured_elements'] / theory:.3f})" if theory else ""
    steady = "" if comm["steady"] else " (varied between steps)"
    return [
        f"  communication per step{steady}: measured {format_count(comm['measured_elements'])} "
        f"elements = {format_mb(comm['measured_bytes'])} MB vs theory {comm['formula']} = "
        f"{format_count(theory)} elements = {format_mb(comm['theory_bytes'])} MB{ratio}",
        f"    by collective: {kinds or 'none'}; units: paper's (all-reduce counted twice)",
        *_tp_lines(comm.get("tensor_parallel")),
    ]


def _tp_lines(tp: dict[str, Any] | None) -> list[str]:
    """The model's tensor-parallel traffic, which ZeRO's counts above leave out."""
    if tp is None:
        return []
    kinds = ", ".join(f"{kind} {format_count(n)}" for kind, n in sorted(tp["elements"].items()))
    return [
        f"  tensor-parallel traffic per step and rank (the model's, besides ZeRO's): "
        f"{format_count(tp['volume_elements'])} elements = "
        f"{format_mb(sum(n * (2 if k == 'all_reduce' else 1) for k, n in tp['bytes'].items()))}"
        f" MB ({kinds})"
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
