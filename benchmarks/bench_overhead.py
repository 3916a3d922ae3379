"""Where a data-parallel step's time goes: compute alone, compute beside another rank, and each
system's communication and overhead on top (issue 5: "find out where the time goes").

In one 2-rank gloo world (one intra-op thread per rank) it interleaves, step by step in an order
rotated each step, the same model, batch and fused AdamW under:

* ``solo``: rank 0 trains a plain model while rank 1 waits at a barrier: compute with a core
  to itself (the issue's "floor");
* ``pair``: both ranks train a plain model, no communication: compute beside another rank
  (shared caches and memory bandwidth);
* ``ddp``: ``DistributedDataParallel`` (same optimizer);
* ``zero0`` .. ``zero3``: zerodp with its defaults.

Every step starts after a barrier; a step's time is rank 0's, split into zero_grad, forward,
backward and step. Then, optionally, ``torch.profiler`` over a few steps of one configuration
ranks operators by self CPU time (rank 0).

    python3 benchmarks/bench_overhead.py --preset bench25m --steps 8 --json overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

PHASES = ("zero_grad", "forward", "backward", "step")


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="bench25m")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--configs", default="solo,pair,ddp,zero0,zero1,zero2,zero3")
    p.add_argument("--bucket-mb", type=float, default=32.0)
    p.add_argument("--profile", default="", help="configuration to profile after timing")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--json", default="")
    return p.parse_args(argv)


class System:
    """One configuration: a model, its optimizer, and how a step runs."""

    def __init__(self, name: str, args: argparse.Namespace, rank: int) -> None:
        import zerodp
        from zerodp.apps.models.gpt import GPT, get_config

        self.name = name
        self.active = name != "solo" or rank == 0
        torch.manual_seed(0)
        model: nn.Module = GPT(get_config(args.preset))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
        if name == "ddp":
            model = nn.parallel.DistributedDataParallel(
                model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True
            )
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
        elif name.startswith("zero"):
            # "zero3+stage3.check_unit_order=False": a stage and ZeroConfig overrides, nested
            # fields by their dotted path (bool/int/str values)
            stage, *overrides = name[4:].split("+")
            values: dict[str, Any] = {"stage": int(stage)}
            values["bucket_bytes"] = int(args.bucket_mb * 2**20)
            for o in overrides:
                _override(values, o)
            cfg = zerodp.ZeroConfig.from_dict(values)
            model, opt = zerodp.initialize(model, opt, cfg)
        self.model, self.opt = model, opt

    def step(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        times: dict[str, float] = {}
        if not self.active:
            return dict.fromkeys(PHASES, 0.0)
        t = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        times["zero_grad"] = time.perf_counter() - t
        t = time.perf_counter()
        _, loss = self.model(x, y)
        times["forward"] = time.perf_counter() - t
        t = time.perf_counter()
        loss.backward()
        times["backward"] = time.perf_counter() - t
        t = time.perf_counter()
        self.opt.step()
        times["step"] = time.perf_counter() - t
        return times


def _override(values: dict[str, Any], text: str) -> None:
    """Set ``"stage3.prefetch_depth=2"`` in ``values`` (a ZeroConfig dict)."""
    key, value = text.split("=")
    parsed: Any = {"True": True, "False": False}.get(value, value)
    *parents, leaf = key.split(".")
    for part in parents:
        values = values.setdefault(part, {})
    values[leaf] = int(parsed) if isinstance(parsed, str) and parsed.isdigit() else parsed


def _rank(rank: int, args: argparse.Namespace, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    from zerodp.apps.data.corpus import BatchSampler, load_corpus
    from zerodp.apps.models.gpt import get_config

    cfg = get_config(args.preset)
    sampler = BatchSampler(load_corpus(), args.batch, cfg.seq_len, 0, rank, 2)
    names = args.configs.split(",")
    systems = {n: System(n, args, rank) for n in names}
    times: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for step in range(args.warmup + args.steps):
        x, y = sampler.batch_at(step)
        for k in range(len(names)):
            name = names[(k + step) % len(names)]
            dist.barrier()
            phases = systems[name].step(x, y)
            if step >= args.warmup:
                times[name].append(phases)
    profile = _profile(systems[args.profile], sampler, args, rank) if args.profile else []
    dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "profile": profile}, f)
    dist.destroy_process_group()


def _profile(
    system: System, sampler: Any, args: argparse.Namespace, rank: int
) -> list[dict[str, Any]]:
    from torch.profiler import ProfilerActivity, profile

    import zerodp

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in range(args.profile_steps):
            x, y = sampler.batch_at(1000 + step)
            dist.barrier()
            system.step(x, y)
        if isinstance(system.opt, zerodp.ZeroOptimizer):
            system.opt.wait_params()  # no gather in flight when the profiler stops (alloc_trace)
    rows = []
    for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]:
        rows.append(
            {
                "op": e.key,
                "calls": e.count // args.profile_steps,
                "self_ms_per_step": e.self_cpu_time_total / 1e3 / args.profile_steps,
            }
        )
    return rows


def _table(times: dict[str, list[dict[str, float]]]) -> list[dict[str, Any]]:
    def med(rows: list[dict[str, float]], key: Callable[[dict[str, float]], float]) -> float:
        return statistics.median(key(r) for r in rows) * 1e3

    out = []
    base = med(times["ddp"], lambda r: sum(r.values())) if "ddp" in times else None
    for name, rows in times.items():
        total = med(rows, lambda r: sum(r.values()))
        row: dict[str, Any] = {"config": name, "median_ms": round(total, 1)}
        row["vs_ddp"] = round(total / base, 3) if base else None
        for ph in PHASES:
            row[ph] = round(med(rows, lambda r, ph=ph: r[ph]), 1)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        init = f"file://{os.path.join(tmp, 'store')}"
        load0 = os.getloadavg()[0]
        mp.spawn(_rank, args=(args, init, out), nprocs=2, join=True)
        load1 = os.getloadavg()[0]
        with open(out) as f:
            result = json.load(f)
    rows = _table(result["times"])
    print(f"preset {args.preset}, batch {args.batch}x per rank, 2 ranks x 1 thread, gloo; ")
    print(f"{args.steps} timed steps per config, load average {load0:.2f} -> {load1:.2f}\n")
    print("| config | median ms | vs DDP | zero_grad | forward | backward | step |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['config']} | {r['median_ms']} | {r['vs_ddp']} | {r['zero_grad']} | "
            f"{r['forward']} | {r['backward']} | {r['step']} |"
        )
    if result["profile"]:
        print(f"\nProfile of {args.profile} (rank 0), self CPU ms per step:\n")
        print("| op | calls/step | self ms/step |")
        print("|---|---|---|")
        for p in result["profile"]:
            print(f"| {p['op']} | {p['calls']} | {p['self_ms_per_step']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "load": [load0, load1], "rows": rows, **result}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
