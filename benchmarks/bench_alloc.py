"""Allocations per training step: zerodp stages 0-3 against DDP (ZeRO-R's contiguous buffers).

Every configuration trains the same GPT preset on the same batch in N local ranks (CPU/gloo on
127.0.0.1, ranks started with ``torch.multiprocessing``). Each step (``zero_grad``, forward,
backward, ``step``) runs under ``zerodp.memory.alloc_trace.AllocationTrace``, i.e.
``torch.profiler`` with ``profile_memory=True``, which records every allocation torch's allocator
makes on the calling thread and on gloo's worker threads. The allocations are classified by size
against three thresholds, all in bytes of the parameters as the model stores them (the compute
dtype):

* ``param``: the largest single trainable parameter tensor,
* ``1/N``: the trainable parameters' bytes divided by the world size (a shard),
* ``model``: the trainable parameters' bytes.

Steady state is every step after ``--warmup`` (default 2: the first step creates the
optimizer state). The parent prints a Markdown table (the per-step mean over the steady-state steps
on the rank with the most allocation bytes, and whether every steady-state step allocated the
same count and bytes on every rank) and the ops behind the largest allocations, and writes every
step of every rank to ``--json``.

    python3 benchmarks/bench_alloc.py                          # tiny preset, fp32, 2 ranks
    python3 benchmarks/bench_alloc.py --precision bf16 --json runs/alloc-bf16.json

DDP is ``DistributedDataParallel(model)`` with torch's defaults (``zero_grad`` sets gradients to
``None``, so autograd allocates them each step) and the same fused AdamW kernel that zerodp
selects for its pieces, so that the comparison is about gradient and parameter storage.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zerodp.memory.alloc_trace import AllocationTrace

KNOWN_CONFIGS = ("ddp", "zero0", "zero1", "zero2", "zero3")
THRESHOLDS = ("param", "shard", "model")
PHASES = ("zero_grad", "forward", "backward", "step")
"""``other``: allocations outside the four (there are none with the step functions here)."""
_LABELS = {"param": ">= param", "shard": ">= 1/N", "model": ">= model"}
MIB = 2**20


# -- pure helpers (no torch, no process group) ----------------------------------------------------


def parse_configs(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in KNOWN_CONFIGS]
    if not names or unknown or len(set(names)) != len(names):
        raise ValueError(f"--configs: a list of distinct names from {', '.join(KNOWN_CONFIGS)}")
    return names


def summarize_config(per_rank: Sequence[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """One config's steady-state figures from every rank's per-step records."""
    steady = [rk["steps"][warmup:] for rk in per_rank]
    if not steady or not steady[0]:
        raise ValueError("no steady-state steps: --steps must exceed --warmup")
    # The rank that allocates most per step speaks for the config (ranks differ in stage 1-3).
    worst = max(range(len(steady)), key=lambda r: sum(s["all"]["bytes"] for s in steady[r]))
    rows = steady[worst]
    n = len(rows)

    def mean(key: str, field: str) -> float:
        return sum(s[key][field] for s in rows) / n

    out: dict[str, Any] = {
        "rank": per_rank[worst]["rank"],
        "count": mean("all", "count"),
        "bytes": mean("all", "bytes"),
        "largest": max(s["all"]["largest"] for s in rows),
        "peak_live": max(s["peak_live"] for s in rows),
        "retained": max(s["retained"] for s in rows),
        "steady": all(
            (s["all"]["count"], s["all"]["bytes"]) == (r[0]["all"]["count"], r[0]["all"]["bytes"])
            for r in steady
            for s in r
        ),
        "top_ops": rows[-1]["top_ops"],
    }
    for key in THRESHOLDS:
        out[key] = {"count": mean(key, "count"), "bytes": mean(key, "bytes")}
    out["phases"] = {}
    for ph in (*PHASES, "other"):
        recs = [s["phases"][ph] for s in rows]
        out["phases"][ph] = {
            "count": sum(r["all"]["count"] for r in recs) / n,
            "bytes": sum(r["all"]["bytes"] for r in recs) / n,
            "largest": max(r["all"]["largest"] for r in recs),
            **{
                k: {f: sum(r[k][f] for r in recs) / n for f in ("count", "bytes")}
                for k in THRESHOLDS
            },
            "top_ops": recs[-1]["top_ops"],
        }
    return out


def _mib(n: float) -> str:
    return f"{n / MIB:.3f}"


def _count(n: float) -> str:
    return f"{n:.0f}" if float(n).is_integer() else f"{n:.1f}"


def format_table(report: dict[str, Any]) -> str:
    meta = report["meta"]
    t = meta["thresholds"]
    lines = [
        f"Allocations per steady-state step ({meta['preset']}, {meta['precision']}, "
        f"N={meta['world_size']}, batch {meta['batch']}x{meta['seq_len']}, "
        f"{meta['steps'] - meta['warmup']} steps after {meta['warmup']} warm-up; "
        f"Ψ={meta['num_params']:,}; bucket_bytes={meta['bucket_bytes']:,})",
        f"thresholds: param = largest parameter {t['param']:,} B; 1/N = {t['shard']:,} B; "
        f"model = {t['model']:,} B (compute dtype)",
        "",
        "| config | allocs | MiB | >= param (n / MiB) | >= 1/N (n / MiB) | >= model (n / MiB) "
        "| largest MiB | peak live MiB | retained MiB | steady |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, s in report["configs"].items():
        cells = [f"{_count(s[k]['count'])} / {_mib(s[k]['bytes'])}" for k in THRESHOLDS]
        lines.append(
            f"| {name} | {_count(s['count'])} | {_mib(s['bytes'])} | {' | '.join(cells)} "
            f"| {_mib(s['largest'])} | {_mib(s['peak_live'])} | {_mib(s['retained'])} "
            f"| {'yes' if s['steady'] else 'NO'} |"
        )
    lines += [
        "",
        "By phase: allocations per step, n / MiB (of which >= param: n / MiB; largest KiB)",
        "",
        "| config | " + " | ".join(PHASES) + " |",
        "|---|" + "---:|" * len(PHASES),
    ]
    for name, s in report["configs"].items():
        cells = []
        for ph in PHASES:
            p = s["phases"][ph]
            cells.append(
                f"{_count(p['count'])} / {_mib(p['bytes'])} ({_count(p['param']['count'])} / "
                f"{_mib(p['param']['bytes'])}; {p['largest'] / 1024:.0f})"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Largest allocations by op in zero_grad + step (last step): op bytes x count"]
    for name, s in report["configs"].items():
        ops = [
            f"{ph}: {op} {size:,} x{count}"
            for ph in ("zero_grad", "step", "other")
            for op, size, count in s["phases"][ph]["top_ops"]
        ]
        lines.append(f"  {name}: {'; '.join(ops) or 'none'}")
    return "\n".join(lines)


# -- the ranks ------------------------------------------------------------------------------------


def _build(config: str, args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(model, optimizer, step function) for ``config``."""
    import torch

    import zerodp
    from zerodp.apps.models.gpt import GPT, get_config

    torch.manual_seed(0)
    model = GPT(get_config(args.preset))
    if config == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if args.precision != "fp32":
            model = model.to(torch.bfloat16)
        ddp = DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, fused=True)

        def ddp_step(x: Any, y: Any, trace: AllocationTrace) -> None:
            trace.step(opt.zero_grad, lambda: ddp(x, y)[1], lambda loss: loss.backward(), opt.step)

        return ddp, opt, ddp_step
    cfg = zerodp.ZeroConfig(
        stage=int(config[4:]), precision=args.precision, bucket_bytes=args.bucket_bytes
    )
    model, zopt = zerodp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg)

    def zero_step(x: Any, y: Any, trace: AllocationTrace) -> None:
        trace.step(
            zopt.zero_grad, lambda: model(x, y)[1], zopt.backward, zopt.step, zopt.wait_params
        )

    return model, zopt, zero_step


def _thresholds(args: argparse.Namespace, world: int) -> dict[str, int]:
    import torch

    from zerodp.apps.models.gpt import GPT, get_config

    with torch.device("meta"):
        model = GPT(get_config(args.preset))
    elsize = 4 if args.precision == "fp32" else 2
    sizes = [p.numel() * elsize for p in model.parameters() if p.requires_grad]
    total = sum(sizes)
    return {"param": max(sizes), "shard": total // world, "model": total}


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    import torch
    import torch.distributed as dist

    from zerodp.apps.models.gpt import get_config
    from zerodp.memory.alloc_trace import AllocationTrace, classify, largest_by_op

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    thresholds = _thresholds(args, world)
    cfg = get_config(args.preset)
    seq = args.seq_len or cfg.seq_len
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randint(0, cfg.vocab_size, (args.batch, seq), generator=gen)
    y = torch.randint(0, cfg.vocab_size, (args.batch, seq), generator=gen)
    results: dict[str, Any] = {}
    for config in args.configs:
        model, opt, step = _build(config, args)
        steps = []
        for _ in range(args.steps):
            with AllocationTrace() as trace:
                step(x, y, trace)
            record = classify(trace.allocations, thresholds)
            steps.append(
                {
                    **record,
                    "peak_live": trace.peak_live,
                    "retained": trace.retained,
                    "top_ops": largest_by_op(trace.allocations),
                    "phases": {
                        (ph or "other"): {
                            **classify(trace.in_phase(ph), thresholds),
                            "top_ops": largest_by_op(trace.in_phase(ph), top=3),
                        }
                        for ph in (*PHASES, None)
                    },
                }
            )
        results[config] = {"rank": rank, "steps": steps}
        del model, opt, step
        gc.collect()
        dist.barrier()
    gathered: list[Any] = [None] * world
    dist.gather_object(results, gathered if rank == 0 else None, dst=0)
    if rank == 0:
        num = thresholds["model"] // (4 if args.precision == "fp32" else 2)
        report = {
            "meta": {
                "preset": args.preset,
                "precision": args.precision,
                "world_size": world,
                "batch": args.batch,
                "seq_len": seq,
                "steps": args.steps,
                "warmup": args.warmup,
                "bucket_bytes": args.bucket_bytes,
                "num_params": num,
                "thresholds": thresholds,
                "torch": torch.__version__,
                "threads_per_rank": args.threads,
                "command": " ".join(["benchmarks/bench_alloc.py", *sys.argv[1:]]),
            },
            "ranks": {c: [g[c] for g in gathered] for c in args.configs},
        }
        Path(out).write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from zerodp.config import ZeroConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--preset", default="tiny", help="a zerodp.apps.models.gpt preset (default tiny)"
    )
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--configs", type=parse_configs, default=list(KNOWN_CONFIGS))
    p.add_argument("--world-size", type=int, default=2)
    # Small by default so that no activation reaches the 1/N column for the tiny preset (the
    # largest is the fp32 logits, 2 x 32 x 256 x 4 B = 64 KiB): what remains there is the
    # engine's.
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32, help="0: the preset's")
    p.add_argument("--steps", type=int, default=6, help="steps per config, warm-up included")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--bucket-bytes", type=int, default=ZeroConfig().bucket_bytes)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", type=Path, default=None, help="write the full report here")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    import torch.multiprocessing as mp

    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="zerodp-alloc-") as tmp:
        out = os.path.join(tmp, "report.json")
        mp.spawn(rank_main, args=(args.world_size, _free_port(), args, out), nprocs=args.world_size)
        report: dict[str, Any] = json.loads(Path(out).read_text())
    report["configs"] = {
        c: summarize_config(per_rank, args.warmup) for c, per_rank in report["ranks"].items()
    }
    print(format_table(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
