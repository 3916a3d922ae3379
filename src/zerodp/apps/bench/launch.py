"""The parent side of ``zerodp bench``: one launch of torch's elastic launcher per configuration.

Why one launch each, sequentially: a rank's peak RSS (``ru_maxrss``) is a process-lifetime
figure, and allocators keep freed memory, so configurations sharing a process would inherit each
other's peaks. The price is a start-up per configuration (a few seconds: ranks are forked from a
forkserver that has torch imported, started once per parent) and no step-by-step interleaving:
the machine's slow periods hit configurations unevenly. ``rounds > 1`` launches every
configuration again, in rotated order, and the report adds per-round ratios to DDP.

If a configuration fails (any rank raises), the launch stops its ranks, the row says so with the
rank's error, and the benchmark goes on with the next configuration.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zerodp.apps.bench import peers
from zerodp.apps.bench.options import BenchOptions
from zerodp.apps.bench.parity import ParityTracker
from zerodp.apps.bench.peers import adamw_kwargs
from zerodp.apps.bench.stats import round_order
from zerodp.apps.bench.systems import REFERENCE
from zerodp.apps.bench.table import build_report
from zerodp.apps.progress import bar
from zerodp.comm.launch import RanksFailed, describe_failure, launch_ranks

# Imported once in the forkserver that every rank is forked from. Only what all configurations
# need: a system's own modules are imported by its ranks, after the baseline RSS is read.
_PRELOAD = ("zerodp.apps.bench.runner",)
Log = Callable[[str], None]


def run_bench(
    options: BenchOptions, log: Log | None = None, *, quiet: bool = False
) -> dict[str, Any]:
    """Run every configuration of ``options`` and return the report (see ``table``); a
    progress bar over the launches unless ``quiet`` (or standard error is not a terminal)."""
    statuses: dict[str, dict[str, Any]] = {}
    runs: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in options.configs}
    parity = ParityTracker(REFERENCE)
    load_start, t_start = list(os.getloadavg()), time.perf_counter()
    launches = options.rounds * len(options.configs)
    with (
        tempfile.TemporaryDirectory(prefix="zerodp-bench-") as tmp,
        bar(quiet=quiet, total=launches, desc="bench", unit="run") as shown,
    ):
        say = log or (lambda msg: shown.write(msg, file=sys.stderr))
        for r in range(options.rounds):
            for name in round_order(list(options.configs), r):
                shown.set_postfix_str(name)
                if statuses.get(name, {}).get("status", "ok") != "ok":
                    shown.update(1)
                    continue  # not installed / not available / failed: no second try
                status, ranks = _one(options, name, Path(tmp), first=not runs[name], say=say)
                shown.update(1)
                statuses[name] = status
                if ranks:
                    runs[name].append(ranks)
                    if len(runs[name]) == 1 and "params_file" in ranks[0]:
                        parity.add(name, [rk["params_file"] for rk in ranks])
    meta = _meta(options, runs, load_start, time.perf_counter() - t_start)
    return build_report(
        meta=meta, order=options.configs, statuses=statuses, runs=runs, parity=parity.results
    )


def _one(
    options: BenchOptions, name: str, tmp: Path, first: bool, say: Log
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Launch configuration ``name`` once: (status, per-rank results sorted by rank)."""
    missing = peers.missing_dependency(name)
    if missing:
        say(f"[zerodp bench] {name}: not installed ({missing})")
        return {"status": "not installed", "reason": missing}, []
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    outcome = launch_config(options, name, tmp, save_params=first)
    took = time.perf_counter() - t0
    if isinstance(outcome, str):
        say(f"[zerodp bench] {name}: FAILED after {took:.0f} s: {outcome}")
        return {"status": "failed", "reason": outcome}, []
    ranks = sorted(outcome, key=lambda rk: rk["rank"])
    status = ranks[0]["status"]
    if status != "ok":
        say(f"[zerodp bench] {name}: {status} ({ranks[0].get('reason')})")
        return {"status": status, "reason": ranks[0].get("reason")}, []
    load_end = os.getloadavg()[0]
    say(f"[zerodp bench] {name}: done in {took:.0f} s (load {load:.2f} -> {load_end:.2f})")
    for rk in ranks:
        rk["launch"] = {"wall_s": took, "loadavg_start": load, "loadavg_end": load_end}
    return {"status": "ok"}, ranks


def launch_config(
    options: BenchOptions, name: str, tmp: Path, save_params: bool
) -> list[dict[str, Any]] | str:
    """Run ``runner.rank_main`` in ``options.world_size`` local ranks; their results, or the
    failing rank's error as one line."""
    from zerodp.apps.bench.runner import rank_main

    try:
        returned = launch_ranks(
            rank_main,
            (options, name, str(tmp), save_params),
            nproc=options.world_size,
            run_id=f"zerodp-bench-{name}-{uuid.uuid4().hex[:8]}",
            log_dir=tmp / "logs",
            preload=_PRELOAD,
            # The ranks' own output (DeepSpeed is chatty) goes to files; errors come back
            # through @record's error files.
            redirect_output=True,
        )
    except RanksFailed as exc:
        rank, failure = min(exc.failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
        return f"rank {rank}: {describe_failure(failure)[0]}"
    return list(returned.values())


def _meta(
    options: BenchOptions,
    runs: dict[str, list[list[dict[str, Any]]]],
    load: list[float],
    wall: float,
) -> dict[str, Any]:
    import torch

    from zerodp.apps.models.gpt import get_config, memory_shape
    from zerodp.memory import activation_bytes, dtype_bytes, gpt_saved_bytes

    cfg = get_config(options.preset)
    shape = memory_shape(cfg, options.batch)
    first = next((r[0][0] for r in runs.values() if r), {})
    return {
        **options.to_dict(),
        "seq_len": cfg.seq_len,
        # The paper's 12·h·b·s·L activation values per rank, to set beside "other at peak",
        # and what the shipped GPT's forward leaves exactly ([Note: GPT activations]).
        "activation_bytes_estimate": activation_bytes(
            shape,
            dtype_bytes=dtype_bytes(options.precision),
            checkpointing=options.activation_checkpointing,
        ),
        "activation_bytes_saved": gpt_saved_bytes(
            shape,
            dtype_bytes=dtype_bytes(options.precision),
            checkpointing=options.activation_checkpointing,
        ),
        "num_params": first.get("num_params"),
        "backend": first.get("backend"),
        "device": first.get("device"),
        "threads_per_rank": first.get("threads"),
        "optimizer": f"torch.optim.AdamW({adamw_kwargs(options)})",
        "torch": torch.__version__,
        "deepspeed": _version("deepspeed"),
        "zerodp": _version("zerodp"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "loadavg_start": load,
        "loadavg_end": list(os.getloadavg()),
        "wall_s": wall,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }


def _version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None
