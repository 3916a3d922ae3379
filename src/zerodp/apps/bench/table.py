"""From the ranks' raw results to the report (JSON) and its tables (Markdown): pure functions.

Input, per configuration: its status, and for each launch ("round") the list of per-rank dicts
``runner.rank_main`` returned. A step's time is the slowest rank's; phases are rank 0's. Memory
columns come from the rank with the highest peak RSS (one consistent row), the per-rank values
are in the JSON.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from zerodp.apps.bench.operators import format_profile_table
from zerodp.apps.bench.stats import (
    fmt_mib,
    fmt_ms,
    fmt_ratio,
    fmt_sci,
    max_over_ranks,
    phase_medians,
    summarize,
)
from zerodp.apps.bench.systems import BY_NAME, REFERENCE
from zerodp.apps.bench.tolerance import judge, tolerance

PHASES = ("zero_grad", "forward", "backward", "step", "total")
OPTIMIZER = "optimizer"  # the torch optimizer's own update, within "step" (runner.OptimizerClock)
CATEGORIES = ("parameters", "gradients", "optimizer_state", "buffers")
RankResult = Mapping[str, Any]


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
        s["memory"]["forward"]["peak"] - s["memory"]["zero_grad"]["rss"]
        for s in rank["steps"][warmup:]
        if s["memory"]["forward"].get("peak") and s["memory"]["zero_grad"].get("rss")
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


# -- tables ---------------------------------------------------------------------------------------


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _header(names: Sequence[str]) -> list[str]:
    return [_row(names), "|" + "---|" * len(names)]


def _parity_cell(p: Mapping[str, Any] | None) -> str:
    """``model-relative (worst tensor); loss-curve relative, verdict``; "identical" when every
    bit agrees."""
    if p is None:
        return "-"
    if p["max_abs_diff"] == 0 and not p["mismatched_names"]:
        return "identical"
    verdict = "ok" if p["passed"] else "FAIL"
    loss = p.get("loss_rel_diff")
    loss_cell = "-" if loss is None else fmt_sci(loss)
    return f"{fmt_sci(p['model_rel_diff'])} ({fmt_sci(p['max_rel_diff'])}); {loss_cell} {verdict}"


def format_time_table(report: Mapping[str, Any]) -> str:
    head = ["config", "system", "median ms", "min ms", "IQR/median", "vs DDP", "per round"]
    head += [f"{p} ms" for p in (*PHASES[:-1], OPTIMIZER)]
    head += ["vs DDP: params rel diff (worst tensor); loss rel diff, verdict"]
    rows = _header(head)
    for name, c in report["configs"].items():
        if "step_time_s" not in c:
            why = c["status"] + (f" ({c['reason']})" if c.get("reason") else "")
            rows.append(_row([name, c["system"], why] + ["-"] * (len(head) - 3)))
            continue
        s, ph = c["step_time_s"], c["phases_median_s"]
        cells = [name, c["system"], fmt_ms(s["median"]), fmt_ms(s["min"])]
        cells += [f"{s['iqr_rel'] * 100:.1f}%", fmt_ratio(c.get("ratio_to_ddp"))]
        cells.append(", ".join(f"{r:.2f}" for r in c.get("round_ratios_to_ddp", [])) or "-")
        cells += [fmt_ms(ph.get(p)) for p in (*PHASES[:-1], OPTIMIZER)]
        cells.append(_parity_cell(c["parity_vs_ddp"]))
        rows.append(_row(cells))
    return "\n".join(rows)


def format_memory_table(report: Mapping[str, Any]) -> str:
    head = ["config", "params", "grads", "optim state", "buffers", "model states"]
    head += ["RSS baseline", "peak RSS", "other at peak", "saved for backward", "forward +RSS"]
    head += ["peak in"]
    rows = _header(head)
    for name, c in report["configs"].items():
        if "memory_bytes" not in c:
            continue
        m, r = c["memory_bytes"], c["rss_bytes"]
        cells = [name] + [fmt_mib(m[k]) for k in (*CATEGORIES, "model_states")]
        cells += [fmt_mib(r["baseline"]), fmt_mib(r["peak_steps"]), fmt_mib(r["other_at_peak"])]
        cells += [fmt_mib(r.get("saved_for_backward")), fmt_mib(r["forward_growth"])]
        rows.append(_row([*cells, str(r["peak_where"])]))
    return "\n".join(rows)


def format_phase_memory_table(report: Mapping[str, Any]) -> str:
    """Where the peak happens: RSS before the model existed, after set-up, the peak within each
    phase (largest over the timed steps) and at the end, for the rank with the highest peak."""
    head = ["config", "baseline", "after set-up", "set-up peak"]
    head += [f"{p} peak" for p in PHASES[:-1]] + ["end"]
    rows = _header(head)
    for name, c in report["configs"].items():
        r = c.get("rss_bytes")
        if r is None:
            continue
        peaks = r.get("phase_peaks_timed", {})
        cells = [name, fmt_mib(r["baseline"]), fmt_mib(r["setup"]), fmt_mib(r["peak_setup"])]
        cells += [fmt_mib(peaks.get(p)) for p in PHASES[:-1]] + [fmt_mib(r["end"])]
        rows.append(_row(cells))
    return "\n".join(rows)


def peak_breakdown(c: Mapping[str, Any]) -> dict[str, int | None] | None:
    """Peak RSS of the rank with the highest peak, split at the end of the last step's forward
    pass (every activation alive) into: the runtime (baseline RSS), the tensors held then by
    category (model states; buffers), the activations (saved for backward and still held), what
    glibc kept after frees (allocator), the rest (autograd graph, Python objects, other heaps;
    negative where free heap was never resident), and how far RSS rose after that forward
    (gradients, gathered parameters and scratch of backward and step, wherever it peaked)."""
    r = c.get("rss_bytes") or {}
    end = r.get("forward_end") or {}
    if r.get("baseline") is None or end.get("rss") is None or "parameters" not in end:
        return None
    states = sum(end.get(k) or 0 for k in ("parameters", "gradients", "optimizer_state"))
    parts = {
        "baseline": r["baseline"],
        "model_states": states,
        "buffers": end.get("buffers"),
        "activations": end.get("saved_alive"),
        "allocator_free": end.get("heap_free"),
    }
    parts["rest"] = end["rss"] - sum(v or 0 for v in parts.values())
    parts["after_forward"] = r["peak_steps"] - end["rss"]
    return parts


def format_breakdown_table(report: Mapping[str, Any]) -> str:
    head = ["config", "peak RSS", "= runtime", "+ model states", "+ buffers"]
    head += ["+ activations", "+ allocator free", "+ rest", "+ rise after forward"]
    rows = _header(head)
    for name, c in report["configs"].items():
        parts = peak_breakdown(c)
        if parts is None:
            continue
        cells = [name, fmt_mib(c["rss_bytes"]["peak_steps"])]
        rows.append(_row(cells + [fmt_mib(v) for v in parts.values()]))
    return "\n".join(rows)


def format_comm_table(report: Mapping[str, Any]) -> str:
    head = ["config", "measured Ψ/step", "implementation Ψ", "paper Ψ", "how"]
    rows = _header([*head, "measured by collective"])
    for name, c in report["configs"].items():
        cm = c["comm"]
        measured = cm.get("measured_psi")
        cells = [name, "-" if measured is None else f"{measured:.3f}"]
        cells += [f"{cm['implementation_psi']:g}", f"{cm['paper_psi']:g}", cm["how"]]
        rows.append(_row([*cells, ledger_cell(cm.get("measured"))]))
    return "\n".join(rows)


def ledger_cell(stats: Mapping[str, Any] | None) -> str:
    """zerodp's ledger of the last step (``CommStats.to_dict()``): calls and MiB per collective
    kind; "-" for the peers, whose traffic is not measured."""
    if not stats or "bytes" not in stats:
        return "-"
    kinds = stats["bytes"].items()
    return ", ".join(f"{k} {stats['calls'][k]}x {fmt_mib(n)} MiB" for k, n in kinds)


def format_meta(meta: Mapping[str, Any]) -> str:
    keys = ("preset", "num_params", "world_size", "precision", "batch", "seq_len", "steps")
    parts = [f"{k}={meta[k]}" for k in (*keys, "warmup", "rounds", "backend") if k in meta]
    if "loadavg_start" in meta and "loadavg_end" in meta:
        parts.append(f"loadavg {meta['loadavg_start'][0]:.2f}->{meta['loadavg_end'][0]:.2f}")
    return ", ".join(parts)


def format_nvme(report: Mapping[str, Any]) -> list[str]:
    lines = []
    for name, c in report["configs"].items():
        n = c.get("nvme")
        if not n:
            continue
        step, disk, secs = n["per_step"], n["disk"], n["disk_seconds_per_step"]
        median = (c.get("step_time_s") or {}).get("median")
        rss = c["rss_bytes"]["peak_steps"]
        lines.append(
            f"- {name}: read {step['read_bytes'] / 2**30:.2f} GiB, wrote "
            f"{step['written_bytes'] / 2**30:.2f} GiB per step; disk "
            f"{disk['disk_read_bytes_per_s'] / 1e9:.2f} GB/s read, "
            f"{disk['disk_write_bytes_per_s'] / 1e9:.2f} GB/s write ({n['directory']}): "
            f"{secs['read'] + secs['write']:.2f} s of disk time per step against "
            f"{median:.2f} s per step; peak RSS {rss / c['num_params']:.2f} B/param"
        )
    return lines


def format_report(report: Mapping[str, Any]) -> str:
    cuda = [
        f"- {n}: {fmt_mib(c['rss_bytes']['cuda_peak'])} MiB"
        for n, c in report["configs"].items()
        if c.get("rss_bytes", {}).get("cuda_peak") is not None
    ]
    out = [
        f"zerodp bench: {format_meta(report['meta'])}",
        "",
        "Step time (zero_grad+forward+backward+step, per step the slowest rank; phases rank 0; "
        "optimizer: the torch optimizer's own update within step, CPU only):",
        "",
        format_time_table(report),
        "",
        f"Parity with DDP ({report['meta']['precision']}), judged on the "
        f"{tolerance(report['meta']['precision']).describe()} (why: [Note: parity tolerances] "
        "in zerodp/apps/bench/tolerance.py).",
        "",
        "Memory per rank, MiB (tensors held after a step; RSS of the rank with the highest peak):",
        "",
        format_memory_table(report),
        "",
        "RSS per rank by phase, MiB (rank with the highest peak; phase peaks over timed steps):",
        "",
        format_phase_memory_table(report),
        "",
        "Where the peak goes, MiB (same rank, split at the end of the last step's forward pass; "
        "activations: saved for backward and still held; allocator free: glibc's freed-but-kept "
        "bytes):",
        "",
        format_breakdown_table(report),
        "",
        "Activations per rank, the paper's estimate (12·h·b·s·L values, logits not counted): "
        f"{fmt_mib(report['meta'].get('activation_bytes_estimate'))} MiB",
        "",
        "Communication per step in units of Ψ (zerodp measured by its ledger; peers: theory):",
        "",
        format_comm_table(report),
    ]
    if cuda:
        out += ["", "Peak CUDA memory allocated during the steps (max over ranks):", *cuda]
    nvme = format_nvme(report)
    if nvme:
        title = "NVMe traffic per timed step, rank 0, and the disk measured in the same run:"
        out += ["", title, *nvme]
    profile = format_profile_table(report)
    if profile:
        title = "Top operators by median self CPU ms per step (torch.profiler, rank 0):"
        out += ["", title, "", profile]
    return "\n".join(out)
