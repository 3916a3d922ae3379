"""From the ranks' raw results to the report (JSON): pure functions (its Markdown tables:
text.py).

Input, per configuration: its status, and for each launch ("round") the list of per-rank dicts
``runner.rank_main`` returned. A step's time is the slowest rank's; phases are rank 0's. Memory
columns come from the rank with the highest peak RSS (one consistent row), the per-rank values
are in the JSON.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from zerodp.apps.bench.stats import (
    max_over_ranks,
    phase_medians,
    summarize,
)
from zerodp.apps.bench.systems import BY_NAME, REFERENCE
from zerodp.apps.bench.tolerance import judge

PHASES = ("zero_grad", "forward", "backward", "step", "total")
OPTIMIZER = "optimizer"  # the torch optimizer's own update, within "step" (runner.OptimizerClock)
CATEGORIES = ("parameters", "gradients", "optimizer_state", "buffers")
RankResult = Mapping[str, Any]


def offload_medians(steps: Sequence[Mapping[str, Any]]) -> dict[str, float] | None:
    """Median over timed steps of each figure of the offloaded step's record ([Note: offload
    timing]); None without offload. Each step carries the record of the step before it."""
    records = [s["offload"] for s in steps if s.get("offload")]
    if not records:
        return None
    return {k: statistics.median(r[k] for r in records) for k in records[0]}


def round_times(ranks: Sequence[RankResult], warmup: int) -> list[float]:
    """Per timed step, the slowest rank's total seconds."""
    per_rank = [[s["times"]["total"] for s in r["steps"][warmup:]] for r in ranks]
    return max_over_ranks(per_rank)


def rss_summary(rank: RankResult, warmup: int) -> dict[str, Any]:
    """Where one rank's resident memory went: the runtime before the model existed, the set-up,
    the peak over all steps (and in which phase of which step), how far RSS rose during a
    forward pass above where it started (the largest over timed steps: activations kept for
    backward, less what the allocator could reuse from the previous step), and RSS at the end."""
    peak, where = 0, None
    for s in rank["steps"]:
        for phase, m in s["memory"].items():
            if (m.get("peak") or 0) > peak:
                peak, where = m["peak"], f"{phase} (step {s['step']})"
    growth = [
        s["memory"]["forward"]["peak"] - s["memory"]["zero_grad"]["now"]
        for s in rank["steps"][warmup:]
        if s["memory"]["forward"].get("peak") and s["memory"]["zero_grad"].get("now")
    ]
    counted = next((s for s in reversed(rank["steps"]) if "forward_end" in s), None)
    fwd_end = {} if counted is None else {**counted["memory"]["forward"], **counted["forward_end"]}
    cuda = [m.get("cuda_peak") for s in rank["steps"] for m in s["memory"].values()]
    timed = rank["steps"][warmup:] or rank["steps"]
    phase_peaks = {
        p: max((s["memory"][p].get("peak") or 0 for s in timed), default=0) for p in PHASES[:-1]
    }
    return {
        "baseline": rank.get("rss_baseline"),
        "setup": rank.get("rss_setup"),
        "peak_setup": rank.get("peak_rss_setup"),
        "peak_steps": peak,
        "peak_where": where,
        "peak_per_phase": rank.get("peak_resettable", False),
        "forward_growth": max(growth, default=None),
        "saved_for_backward": fwd_end.get("saved"),
        "phase_peaks_timed": phase_peaks,
        # At the end of the last step's forward pass (every activation alive): RSS, glibc's
        # heap (in use, freed-but-kept), the saved tensors still held, the tensors by category.
        "forward_end": fwd_end,
        "heap_used_baseline": (rank.get("heap_baseline") or {}).get("heap_used"),
        "end": rank.get("rss_end"),
        "cuda_peak": max((c for c in cuda if c is not None), default=None),
        "source": rank.get("memory_source", "RSS"),  # [Note: memory meters]
    }


def memory_row(rank: RankResult) -> dict[str, int | None]:
    mem = rank.get("memory") or {}
    out = {c: mem.get(c) for c in CATEGORIES}
    states = [out["parameters"], out["gradients"], out["optimizer_state"]]
    out["model_states"] = None if None in states else sum(s for s in states if s is not None)
    return out


def accounting(rss: Mapping[str, Any], mem: Mapping[str, int | None]) -> int | None:
    """Peak RSS not explained by the runtime (baseline) or the tensors held at rest: activations,
    per-step temporaries (gathered parameters, gradients in flight) and allocator slack."""
    held = (mem.get("model_states") or 0) + (mem.get("buffers") or 0)
    if rss.get("baseline") is None or not rss.get("peak_steps"):
        return None
    return int(rss["peak_steps"] - rss["baseline"] - held)


def config_report(
    name: str,
    status: Mapping[str, Any],
    rounds: Sequence[Sequence[RankResult]],
    warmup: int,
    parity: Mapping[str, Any] | None,
    precision: str,
    reference_losses: Sequence[float] | None = None,
) -> dict[str, Any]:
    """Everything about one configuration (``rounds`` empty unless it ran); ``parity`` is
    judged with DDP's rank-0 losses (``reference_losses``: [Note: parity tolerances])."""
    system = BY_NAME[name]
    out: dict[str, Any] = {
        "system": system.label,
        "family": system.family,
        "zero_stage": system.zero_stage,
        "status": status.get("status", "ok"),
        "reason": status.get("reason"),
        "comm": {
            "paper_psi": system.comm_paper,
            "implementation_psi": system.comm_impl,
            "how": system.comm_note,
        },
    }
    if not rounds:
        return out
    first = rounds[0]
    times = [t for r in rounds for t in round_times(r, warmup)]
    rank0 = next(r for r in first if r["rank"] == 0)
    rss = [rss_summary(r, warmup) for r in first]
    top = max(range(len(first)), key=lambda i: rss[i]["peak_steps"])
    mem = memory_row(first[top])
    psi = rank0["num_params"]
    measured = rank0.get("comm")
    out["comm"]["measured"] = measured
    out["comm"]["measured_psi"] = measured["volume_elements"] / psi if measured else None
    losses = [s["loss"] for s in rank0["steps"]]
    out.update(
        {
            "num_params": psi,
            "step_time_s": summarize(times),
            "round_median_s": [statistics.median(round_times(r, warmup)) for r in rounds],
            "phases_median_s": phase_medians(
                [s["times"] for s in rank0["steps"][warmup:]], (*PHASES, OPTIMIZER)
            ),
            "memory_bytes": mem,
            "memory_bytes_per_rank": [memory_row(r) for r in first],
            "zerodp_memory_report": (first[top].get("memory") or {}).get("zerodp_report"),
            "rss_bytes": {**rss[top], "other_at_peak": accounting(rss[top], mem)},
            "rss_bytes_per_rank": rss,
            "parity_vs_ddp": None
            if parity is None
            else judge(parity, losses, reference_losses, precision),
            "losses_rank0": losses,
            "profile_rank0": rank0.get("profile"),
            # Step i carries step i-1's record: from the second timed step on, timed records.
            "offload_timing_s": offload_medians(rank0["steps"][warmup + 1 :]),
            "steps_per_rank": [r["steps"] for r in first],  # raw: times and RSS per phase
            "step_times_s": times,
            "nvme": rank0.get("nvme"),
        }
    )
    return out


def _rank0_phases(rounds: Sequence[Sequence[RankResult]], warmup: int) -> list[Mapping[str, float]]:
    """Rank 0's phase seconds of every timed step of every round (as the step times are)."""
    return [s["times"] for r in rounds for rk in r if rk["rank"] == 0 for s in rk["steps"][warmup:]]


def add_ratios(configs: dict[str, dict[str, Any]]) -> None:
    """``ratio_to_ddp`` (medians over all timed steps) and ``round_ratio_to_ddp`` (per launch
    round, config median / DDP median of the same round; their median), in place."""
    ref = configs.get(REFERENCE, {})
    if "step_time_s" not in ref:
        return
    for c in configs.values():
        if "step_time_s" not in c:
            continue
        c["ratio_to_ddp"] = c["step_time_s"]["median"] / ref["step_time_s"]["median"]
        pairs = zip(c["round_median_s"], ref["round_median_s"], strict=False)
        c["round_ratios_to_ddp"] = [a / b for a, b in pairs]
        c["round_ratio_to_ddp"] = statistics.median(c["round_ratios_to_ddp"])


def build_report(
    *,
    meta: Mapping[str, Any],
    order: Sequence[str],
    statuses: Mapping[str, Mapping[str, Any]],
    runs: Mapping[str, Sequence[Sequence[RankResult]]],
    parity: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any]:
    """The JSON ``zerodp bench`` writes. ``meta`` needs ``warmup`` and ``precision``."""
    reference = runs.get(REFERENCE) or []
    reference_losses = None
    if reference:
        rank0 = next(r for r in reference[0] if r["rank"] == 0)
        reference_losses = [s["loss"] for s in rank0["steps"]]
    configs = {
        name: config_report(
            name,
            statuses.get(name, {}),
            runs.get(name, []),
            meta["warmup"],
            parity.get(name),
            meta["precision"],
            reference_losses,
        )
        for name in order
    }
    if meta.get("world_size") == 1:  # the paper's volumes are for N > 1; one rank sends none
        for c in configs.values():
            c["comm"].update(paper_psi=0, implementation_psi=0, how="one rank: nothing to send")
    add_ratios(configs)
    return {"meta": dict(meta), "configs": configs}
