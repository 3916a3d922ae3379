"""The bench report's Markdown tables and text: pure functions of the report ``table``
builds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from zerodp.apps.bench.operators import format_profile_table
from zerodp.apps.bench.stats import fmt_mib, fmt_ms, fmt_ratio, fmt_sci
from zerodp.apps.bench.table import CATEGORIES, OPTIMIZER, PHASES
from zerodp.apps.bench.tolerance import tolerance


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


def measured_as(report: Mapping[str, Any]) -> str:
    """What the memory columns measured: "RSS" (CPU) or "CUDA" (the allocator's allocated
    bytes), as the ranks' meters said ([Note: memory meters] in zerodp/memory/meter.py)."""
    sources = {c["rss_bytes"]["source"] for c in report["configs"].values() if "rss_bytes" in c}
    return "CUDA" if any(src.startswith("CUDA") for src in sources) else "RSS"


def format_memory_table(report: Mapping[str, Any]) -> str:
    head = ["config", "params", "grads", "optim state", "buffers", "model states"]
    src = measured_as(report)
    head += [f"{src} baseline", f"peak {src}", "other at peak", "saved for backward"]
    head += [f"forward +{src}"]
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
    if r.get("baseline") is None or end.get("now") is None or "parameters" not in end:
        return None
    states = sum(end.get(k) or 0 for k in ("parameters", "gradients", "optimizer_state"))
    parts = {
        "baseline": r["baseline"],
        "model_states": states,
        "buffers": end.get("buffers"),
        "activations": end.get("saved_alive"),
        "allocator_free": end.get("heap_free"),
    }
    parts["rest"] = end["now"] - sum(v or 0 for v in parts.values())
    parts["after_forward"] = r["peak_steps"] - end["now"]
    return parts


def format_breakdown_table(report: Mapping[str, Any]) -> str:
    head = ["config", f"peak {measured_as(report)}", "= runtime", "+ model states", "+ buffers"]
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
    if meta.get("activation_checkpointing"):
        parts.append("every block activation-checkpointed")
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


def format_offload(report: Mapping[str, Any]) -> str:
    """The offloaded step's own timing, where a configuration has one."""
    head = ["config", "step blocked ms", "unpack ms", "optimizer ms", "cast ms"]
    rows = _header([*head, "waiting for landings ms", "chunks"])
    found = False
    for name, c in report["configs"].items():
        t = c.get("offload_timing_s")
        if not t:
            continue
        found = True
        ms = [f"{t[k] * 1e3:.0f}" for k in ("blocked", "unpack", "optimizer", "cast", "landing")]
        rows.append(_row([name, *ms, f"{t['unpack_chunks']:.0f}"]))
    return "\n".join(rows) if found else ""


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
        f"Memory per rank, MiB (tensors held after a step; {measured_as(report)} of the rank "
        "with the highest peak):",
        "",
        format_memory_table(report),
        "",
        f"{measured_as(report)} per rank by phase, MiB (rank with the highest peak; phase peaks "
        "over timed steps):",
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
        f"{fmt_mib(report['meta'].get('activation_bytes_estimate'))} MiB; what this GPT's "
        "forward saves for its backward (stages 0-3 alike, [Note: GPT activations]): "
        f"{fmt_mib(report['meta'].get('activation_bytes_saved'))} MiB",
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
    offload = format_offload(report)
    if offload:
        title = (
            "Offloaded step, rank 0, median over timed steps: how long step() blocked until every "
            "gradient was in host memory, each host stage's work summed over chunks, and how long "
            "the caller then waited for updates to land (the next forward and the next step's "
            "start; NVMe reads and writes are not timed: [Note: offload timing]):"
        )
        out += ["", title, "", offload]
    profile = format_profile_table(report)
    if profile:
        title = "Top operators by median self CPU ms per step (torch.profiler, rank 0):"
        out += ["", title, "", profile]
    return "\n".join(out)
