"""``report.png`` of a ``zerodp train`` run, a pure function of the report dictionary:

- the loss curve of each stage;
- the peak memory per rank, measured by what held it (model states by kind, buffers, stage 3's
  gathered parameters, activations, the rest at the peak, the runtime) beside the estimator's
  prediction of the same, numbers on the bars;
- the bytes each rank communicated per step, by collective, beside the paper's volume;
- tokens/s per step and the model FLOP/s they mean (MFU where the device's peak is known);
- the text sampled from the trained model.

matplotlib is imported only when a figure is drawn.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, NamedTuple

from zerodp.apps.train.summary import run_title
from zerodp.apps.train.theory import MB, PEAK_CATEGORIES, PEAK_LABELS

COLORS = {
    "parameters": "tab:blue",
    "gradients": "tab:orange",
    "optimizer_state": "tab:green",
    "comm_buffers": "tab:red",
    "gathered": "tab:purple",
    "activations": "tab:brown",
    "rest": "tab:gray",
    "runtime": "lightgray",
}
COLLECTIVE_COLORS = ("tab:cyan", "tab:olive", "tab:pink", "tab:purple", "tab:gray")
SMALL = 7  # font size of the numbers on bars


def plot_report(report: dict[str, Any], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, and no GUI toolkit needed
    import matplotlib.pyplot as plt

    done = report["runs"]
    fig = plt.figure(figsize=(18, 10))
    grid = fig.add_gridspec(2, 3, height_ratios=(1.15, 1.0))
    _plot_loss(fig.add_subplot(grid[0, 0]), done)
    _plot_memory(fig.add_subplot(grid[0, 1]), done)
    _plot_comm(fig.add_subplot(grid[0, 2]), done)
    _plot_throughput(fig.add_subplot(grid[1, 0]), done, report["environment"])
    _memory_table(fig.add_subplot(grid[1, 1]), done)
    _plot_sample(fig.add_subplot(grid[1, 2]), done)
    fig.suptitle(run_title(report))
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
            label=f"stage {entry['stage']}: final {entry['loss']['final']:.3f}",
            linewidth=max(0.8, 2.5 - 0.6 * i),
            linestyle="-" if i == 0 else (0, (4, 2 + i)),
        )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte)")
    ax.set_title("loss (final: mean of the last 10 steps)")
    ax.legend(fontsize=8)


class Bar(NamedTuple):
    label: str
    measured: dict[str, Any]
    theory: dict[str, Any]


def memory_bars(done: list[dict[str, Any]], max_bars: int = 6) -> list[Bar]:
    """(label, measured peak, predicted peak) per bar: every rank of every run when that fits
    in ``max_bars``, else the rank with the highest peak of each run. A run without a measured
    peak (an older report) shows the model states at rest instead."""
    every = [(e, row) for e in done for row in e["memory"]]
    if len(every) > max_bars:
        every = [(e, max(e["memory"], key=_peak_total)) for e in done]
    return [
        Bar(
            f"stage {e['stage']}\nrank {row['rank']}",
            row.get("peak") or row["measured"],
            row.get("peak_theory") or row["theory"] or {},
        )
        for e, row in every
    ]


def _peak_total(row: dict[str, Any]) -> float:
    return float((row.get("peak") or row["measured"])["total"])


def _plot_memory(ax: Any, done: list[dict[str, Any]]) -> None:
    bars = memory_bars(done)
    width = 0.36
    top = max(
        [b.measured.get("total") or 0 for b in bars] + [b.theory.get("total") or 0 for b in bars]
    )
    top = top / MB or 1.0
    for side, (offset, hatch) in enumerate(((-width / 2, ""), (width / 2, "//"))):
        bottoms = [0.0] * len(bars)
        for name in PEAK_CATEGORIES:
            values = [((b.theory if side else b.measured).get(name) or 0) / MB for b in bars]
            heights = [max(0.0, v) for v in values]  # a negative rest is printed, not drawn
            if not any(heights) and name not in ("rest",):
                continue
            xs = [i + offset for i in range(len(bars))]
            ax.bar(
                xs,
                heights,
                width,
                bottom=bottoms,
                color=COLORS[name],
                hatch=hatch,
                edgecolor="white" if side == 0 else "black",
                linewidth=0.5,
                label=PEAK_LABELS[name] if side == 0 and any(heights) else None,
            )
            for x, b, h, v in zip(xs, bottoms, heights, values, strict=True):
                if h >= 0.06 * top:  # a label only where it fits inside its segment
                    ax.text(x, b + h / 2, f"{v:.3g}", ha="center", va="center", fontsize=SMALL)
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
        for i, bar in enumerate(bars):
            total = (bar.theory if side else bar.measured).get("total")
            if total:
                word = "predicted" if side else "measured"
                ax.text(
                    i + offset,
                    bottoms[i] + 0.01 * top,
                    f"{word}\n{total / MB:.3g}",
                    ha="center",
                    va="bottom",
                    fontsize=SMALL,
                )
    source = next((b.measured.get("source") for b in bars if b.measured.get("source")), None)
    ax.set_ylim(0, top * 1.45)  # room for the totals and the legend
    ax.set_xticks(range(len(bars)), [bar.label for bar in bars], fontsize=8)
    ax.set_ylabel("MB per rank (1e6 bytes)")
    measured = f"measured peak ({source})" if source else "measured at rest"
    ax.set_title(f"memory per rank: {measured}, plain; estimator, hatched", fontsize=10)
    ax.legend(fontsize=7, ncol=2, loc="upper right")


def _memory_table(ax: Any, done: list[dict[str, Any]]) -> None:
    """The bars' numbers, every category readable however thin its segment: the rank with the
    highest peak of each run, measured beside predicted."""
    ax.axis("off")
    bars = memory_bars(done, max_bars=len(done))  # one per run
    rows: list[tuple[str, list[str]]] = [
        ("MB per rank", [b.label.replace("\n", " ").replace("rank ", "r") for b in bars]),
        ("", ["measured/pred." for _ in bars]),
    ]
    for name in (*PEAK_CATEGORIES, "total"):
        pairs = [(b.measured.get(name), b.theory.get(name)) for b in bars]
        rows.append((PEAK_LABELS.get(name, name), [f"{_mb(m)}/{_mb(t)}" for m, t in pairs]))
    # What the estimator predicts: the total less what was there before the model.
    pairs = [(_less_runtime(b.measured), b.theory.get("total")) for b in bars]
    rows.append(("total - runtime", [f"{_mb(m)}/{_mb(t)}" for m, t in pairs]))
    width = max(len(cell) for _, cells in rows for cell in cells) + 2
    lines = [
        f"{label:<17}" + "".join(f"{cell:>{width}}" for cell in cells) for label, cells in rows
    ]
    lines.append("runtime: the rank before its model existed (torch, Python, the data and,")
    lines.append("with --compare-stages, what earlier stages freed); rest < 0: that was reused")
    ax.set_title("memory by category (the bars' numbers)", fontsize=10, loc="left")
    ax.text(
        0.0,
        1.0,
        "\n".join(lines),
        family="monospace",
        fontsize=7.5,
        va="top",
        transform=ax.transAxes,
    )


def _less_runtime(measured: dict[str, Any]) -> float | None:
    total = measured.get("total")
    return None if total is None else total - (measured.get("runtime") or 0)


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / MB:.3g}"


def _plot_comm(ax: Any, done: list[dict[str, Any]]) -> None:
    runs = [e for e in done if e["comm"] is not None]
    width = 0.36
    kinds = sorted({k for e in runs for k in e["comm"]["last_step"]["bytes"]})
    top = max(
        [e["comm"]["measured_bytes"] for e in runs] + [e["comm"]["theory_bytes"] for e in runs],
        default=0,
    )
    top = top / MB or 1.0
    for i, e in enumerate(runs):
        bottom = 0.0
        for kind, color in zip(kinds, COLLECTIVE_COLORS, strict=False):
            # The paper's units: an all-reduce is a reduce-scatter and an all-gather.
            n = e["comm"]["last_step"]["bytes"].get(kind, 0) * (2 if kind == "all_reduce" else 1)
            label = kind.replace("_", "-") if i == 0 else None
            ax.bar(i - width / 2, n / MB, width, bottom=bottom, color=color, label=label)
            bottom += n / MB
        ax.text(
            i - width / 2,
            bottom + 0.01 * top,
            f"{bottom:.3g}",
            ha="center",
            va="bottom",
            fontsize=SMALL,
        )
        theory = e["comm"]["theory_bytes"] / MB
        label = "paper's volume" if i == 0 else None
        ax.bar(i + width / 2, theory, width, hatch="//", fill=False, label=label)
        ax.text(
            i + width / 2,
            theory + 0.01 * top,
            f"{e['comm']['formula']}\n{theory:.3g}",
            ha="center",
            va="bottom",
            fontsize=SMALL,
        )
    ax.set_ylim(0, top * 1.4)
    ax.set_xticks(range(len(runs)), [f"stage {e['stage']}" for e in runs])
    ax.set_ylabel("MB per rank per step (paper's units)")
    tp = [e["comm"].get("tensor_parallel") for e in runs]
    extra = ""
    if tp and tp[-1] is not None:  # ZeRO's traffic is drawn; the model's TP traffic is not
        nbytes = sum(n * (2 if k == "all_reduce" else 1) for k, n in tp[-1]["bytes"].items())
        extra = f"\n(ZeRO's; the model's tensor-parallel traffic besides: {nbytes / MB:.3g} MB)"
    ax.set_title(f"communication per step, by collective{extra}", fontsize=10)
    ax.legend(fontsize=7, loc="upper right")


def _plot_throughput(ax: Any, done: list[dict[str, Any]], env: dict[str, Any]) -> None:
    peak = env.get("peak_flops")  # one device's; the tokens/s are every rank's
    if peak:
        peak *= env.get("world_size", 1)
    for entry in done:
        times = entry["curves"].get("step_time_s") or []
        if not times:
            continue
        first = entry.get("first_step", 0)
        rate = [entry["tokens_per_step"] / t if t > 0 else 0.0 for t in times]
        mean = entry["throughput"]["tokens_per_s"] or 0.0
        (line,) = ax.plot(
            range(first + 1, first + len(rate) + 1),
            rate,
            linewidth=1.0,
            label=f"stage {entry['stage']}: {mean:,.0f} tokens/s" + _flops_text(entry, mean, peak),
        )
        ax.axhline(mean, color=line.get_color(), linestyle="--", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s (all ranks)")
    ax.set_ylim(bottom=0)
    ax.set_title(
        "throughput per step; dashed: the mean without the first step (one-off costs)",
        fontsize=10,
    )
    ax.legend(fontsize=7)


def _flops_text(entry: dict[str, Any], tokens_per_s: float, peak: float | None) -> str:
    """Model FLOP/s as 6Ψ per token (forward and backward; Ψ of the whole model, not of one
    tensor-parallel rank's slices), and MFU against every device's peak where it is known."""
    flops = 6 * (entry.get("model_params") or entry["num_params"]) * tokens_per_s
    text = f", {flops / 1e9:,.1f} GFLOP/s (6Ψ/token)"
    return text + (f", MFU {flops / peak:.1%}" if peak else "")


def _plot_sample(ax: Any, done: list[dict[str, Any]]) -> None:
    ax.axis("off")
    entry = done[-1]
    sample = entry.get("sample") or {}
    text = sample.get("text") or "(no sample: --sample-chars 0)"
    printable = "".join(c if c.isprintable() or c == "\n" else "?" for c in text)
    lines = [
        wrapped
        for line in printable.splitlines()
        for wrapped in textwrap.wrap(line, 64, replace_whitespace=False) or [""]
    ][:16]
    ax.set_title(
        f"sampled from the stage-{entry['stage']} model after prompt {sample.get('prompt', '')!r}",
        fontsize=10,
        loc="left",
    )
    ax.text(
        0.0, 1.0, "\n".join(lines), family="monospace", fontsize=8, va="top", transform=ax.transAxes
    )
