"""``report.png`` of a ``zerodp train`` run: loss curves, memory per rank by category (measured
vs theory) and bytes communicated per step. A pure function of the report dictionary; matplotlib
is imported only when a figure is drawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from zerodp.apps.train.theory import CATEGORY_LABELS, MB, MEMORY_CATEGORIES


def plot_report(report: dict[str, Any], path: str | Path) -> None:
    """Loss curves, memory per rank by category (measured vs theory) and bytes per step."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, and no GUI toolkit needed
    import matplotlib.pyplot as plt

    done = report["runs"]
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
            label = CATEGORY_LABELS[name] if side == 0 else None
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
