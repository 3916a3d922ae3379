"""Benchmark zerodp stages 0-2 against ``torch.nn.parallel.DistributedDataParallel``.

One run builds every configuration in the same ranks (same model init, same batches), warms
them up, then times their steps **interleaved**: at step ``t`` every configuration runs one step,
in an order rotated by ``t``, each step preceded by a barrier. Machine noise therefore hits every
configuration alike, and the per-step paired ratio to DDP cancels most of it.

A timed step is ``zero_grad + forward + backward + step`` (zerodp does real work in
``zero_grad``: it zeroes persistent gradient buffers, where DDP drops ``.grad``). The phases are
timed separately; zerodp's ``step`` is further split into the wait for the gradient reductions
(``opt.engine.finish_gradients()``, which ``step`` would call first anyway), the user's optimizer
(timed with torch's optimizer step hooks) and the rest (stages 1-2: the parameter all-gather).
DDP waits for its all-reduces at the end of ``backward``, so compare ``backward + wait``.

After the timed steps: a parity check (final parameters of every configuration vs DDP), the
bytes held per rank by category, and a short ``torch.profiler`` pass (top operators per step).

    python3 benchmarks/bench_stages.py --steps 20          # re-launches itself under torchrun
    torchrun --nproc-per-node 2 benchmarks/bench_stages.py  # or launch it yourself

Rank 0 prints the tables (Markdown) and writes the JSON (``--json``). The table/JSON formatting
is in pure functions (``format_*``; the statistics ``summarize``, ``paired_ratios`` etc. and the
DDP memory and parity helpers are shared with ``zerodp bench``, in ``zerodp.apps.bench``) tested by
``tests/unit/test_bench_format.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from zerodp.apps.bench import stats, systems
from zerodp.apps.bench.stats import (
    MIB,
    max_over_ranks,
    paired_ratios,
    percentile,
    round_order,
    summarize,
)
from zerodp.apps.bench.stats import fmt_mib as _mib
from zerodp.apps.bench.stats import fmt_ms as _ms
from zerodp.apps.bench.stats import fmt_ratio as _ratio
from zerodp.apps.bench.stats import fmt_sci as _sci

KNOWN_CONFIGS = ("ddp", "zero0", "zero1", "zero2", "local")
"""``local``: no communication at all (each rank trains alone): a compute-only lower bound."""
DEFAULT_CONFIGS = "ddp,zero0,zero1,zero2"
REFERENCE = "ddp"
PHASES = ("zero_grad", "forward", "backward", "wait", "optimizer", "gather", "total")
__all__ = ["max_over_ranks", "paired_ratios", "percentile", "round_order", "summarize"]


# -- pure helpers (no torch, no process group) ----------------------------------------------------


def parse_configs(text: str) -> list[str]:
    """``"ddp,zero1"`` -> ``["ddp", "zero1"]``; unknown or repeated names raise ``ValueError``."""
    return systems.parse_configs(text, KNOWN_CONFIGS, allow_all=False)


def stage_of(config: str) -> int | None:
    """``"zero2"`` -> 2; ``None`` for ``ddp`` / ``local``."""
    return int(config[4:]) if config.startswith("zero") else None


def phase_medians(phases: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Median over steps of each phase's seconds (phases missing in a step count as 0)."""
    return stats.phase_medians(phases, PHASES)


def build_report(
    *,
    meta: Mapping[str, Any],
    times: Mapping[str, Sequence[float]],
    phases: Mapping[str, Sequence[Mapping[str, float]]],
    memory: Mapping[str, Mapping[str, Any]],
    parity: Mapping[str, Mapping[str, float] | None],
    comm: Mapping[str, Any] | None = None,
    profile: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything rank 0 writes as JSON. ``times``: per config, per-step seconds (already the
    max over ranks); ``phases``: per config, per-step phase seconds (rank 0)."""
    ratios = paired_ratios(times)
    ref = times.get(REFERENCE)
    ref_median = statistics.median(ref) if ref else None
    configs: dict[str, Any] = {}
    for name, ts in times.items():
        s = summarize(ts)
        configs[name] = {
            "stage": stage_of(name),
            "step_time_s": s,
            "ratio_to_ddp": s["median"] / ref_median if ref_median else None,
            "paired_ratio_to_ddp": ratios.get(name),
            "phases_median_s": phase_medians(phases.get(name, [])),
            "memory_bytes": dict(memory.get(name, {})),
            "parity_vs_ddp": parity.get(name),
            "comm_last_step": (comm or {}).get(name),
            "step_times_s": list(ts),
        }
    return {"meta": dict(meta), "configs": configs, "profile": dict(profile or {})}


def format_table(report: Mapping[str, Any]) -> str:
    """The main Markdown table: step time, ratio to DDP, bytes per rank, parity."""
    head = (
        "| config | median ms | min ms | IQR/median | vs DDP (medians) | vs DDP (paired, p25-p75) "
        "| params MiB | grads MiB | optim MiB | buffers MiB | model states MiB | max rel diff "
        "vs DDP |"
    )
    rows = [head, "|" + "---|" * 12]
    for name, c in report["configs"].items():
        s = c["step_time_s"]
        pr = c["paired_ratio_to_ddp"]
        paired = "-" if pr is None else f"{pr['median']:.3f} ({pr['p25']:.3f}-{pr['p75']:.3f})"
        mem = c["memory_bytes"]
        parity = c["parity_vs_ddp"]
        rows.append(
            f"| {name} | {_ms(s['median'])} | {_ms(s['min'])} | {s['iqr_rel'] * 100:.1f}% "
            f"| {_ratio(c['ratio_to_ddp'])} | {paired} "
            f"| {_mib(mem.get('parameters'))} | {_mib(mem.get('gradients'))} "
            f"| {_mib(mem.get('optimizer_state'))} | {_mib(mem.get('comm_buffers'))} "
            f"| {_mib(mem.get('model_states'))} "
            f"| {_sci(None if parity is None else parity['max_rel_diff'])} |"
        )
    return "\n".join(rows)


def format_phase_table(report: Mapping[str, Any]) -> str:
    """Median milliseconds per phase (rank 0). ``wait``: zerodp's wait for in-flight gradient
    reductions before the optimizer (DDP waits inside ``backward``); ``gather``: the rest of
    ``step`` (stages 1-2: the parameter all-gather)."""
    rows = ["| config | " + " | ".join(PHASES) + " |", "|" + "---|" * (len(PHASES) + 1)]
    for name, c in report["configs"].items():
        ph = c["phases_median_s"]
        rows.append(f"| {name} | " + " | ".join(_ms(ph.get(p)) for p in PHASES) + " |")
    return "\n".join(rows)


def top_operators(
    samples: Sequence[Mapping[str, float]], calls: Mapping[str, float], top: int = 15
) -> list[dict[str, Any]]:
    """Per operator, the median over profiled steps of its self milliseconds (an operator absent
    from a step counts 0 there), largest first: a step where the rank was descheduled inside
    one operator does not make that operator look expensive."""
    if not samples:
        return []
    names = {k for s in samples for k in s}
    med = {k: statistics.median(s.get(k, 0.0) for s in samples) for k in names}
    ranked = sorted(names, key=lambda k: (-med[k], k))[:top]
    return [
        {"name": k, "self_ms_per_step": med[k], "calls_per_step": calls.get(k, 0)} for k in ranked
    ]


def format_profile_table(profile: Mapping[str, Any], top: int = 8) -> str:
    """One line per configuration: its top operators and their self CPU ms per step."""
    if not profile:
        return ""
    lines = []
    for name, ops in profile.items():
        shown = ", ".join(f"{op['name']} {op['self_ms_per_step']:.0f}" for op in ops[:top])
        lines.append(f"- **{name}** (ms/step): {shown}")
    return "\n".join(lines)


def format_meta(meta: Mapping[str, Any]) -> str:
    keys = ("preset", "num_params", "world_size", "batch", "seq_len", "steps", "warmup")
    parts = [f"{k}={meta[k]}" for k in keys if k in meta]
    if "loadavg_start" in meta and "loadavg_end" in meta:
        parts.append(f"loadavg {meta['loadavg_start'][0]:.2f}->{meta['loadavg_end'][0]:.2f}")
    return ", ".join(parts)


def format_comm(report: Mapping[str, Any]) -> str:
    """zerodp's ledger for the last step: calls and MiB per collective kind."""
    lines = []
    for name, c in report["configs"].items():
        st = c.get("comm_last_step")
        if not st:
            continue
        kinds = ", ".join(
            f"{kind} {st['calls'][kind]}x {_mib(st['bytes'][kind])} MiB" for kind in st["bytes"]
        )
        lines.append(f"- {name}: {kinds}")
    return "\n".join(lines)


def format_report(report: Mapping[str, Any]) -> str:
    out = [
        f"zerodp bench_stages: {format_meta(report['meta'])}",
        "",
        "Step time (zero_grad+forward+backward+step; per step the slowest rank), memory per rank:",
        "",
        format_table(report),
        "",
        "Median phase times, ms (rank 0):",
        "",
        format_phase_table(report),
    ]
    comm = format_comm(report)
    if comm:
        out += ["", "Collectives of the last step (zerodp ledger, model data):", "", comm]
    prof = format_profile_table(report.get("profile", {}))
    if prof:
        out += [
            "",
            "Top operators by median self CPU ms per step (torch.profiler, rank 0):",
            "",
            prof,
        ]
    return "\n".join(out)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=15, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration first")
    p.add_argument("--world-size", type=int, default=2, help="ranks (when not under torchrun)")
    p.add_argument("--preset", default="bench25m", help="zerodp.apps.models.gpt preset")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"from {','.join(KNOWN_CONFIGS)}")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="bucket MiB (zerodp and DDP)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--profile-steps", type=int, default=3, help="torch.profiler steps (0: off)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default="bench_stages.json", help="where rank 0 writes results")
    args = p.parse_args(argv)
    args.config_list = parse_configs(args.configs)
    if args.steps < 1 or args.warmup < 0 or args.world_size < 1 or args.batch < 1:
        p.error("need --steps >= 1, --warmup >= 0, --world-size >= 1, --batch >= 1")
    return args


# -- launching -----------------------------------------------------------------------------------


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Re-run this script under torch's own launcher (``torch.distributed.run``)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    try:
        torchrun(
            [
                "--nnodes=1",
                f"--nproc-per-node={args.world_size}",
                "--master-addr=127.0.0.1",
                f"--master-port={_free_port()}",
                os.path.abspath(__file__),
                *argv,
            ]
        )
    except ChildFailedError as exc:
        print(f"bench_stages: a rank failed: {exc}", file=sys.stderr)
        return 1
    return 0


# -- the ranks -----------------------------------------------------------------------------------


class _Run:
    """One configuration in this rank: model, optimizer and timing records."""

    def __init__(self, name: str, args: argparse.Namespace, cfg: Any) -> None:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        import zerodp
        from zerodp.apps.models.gpt import GPT

        self.name = name
        self.stage = stage_of(name)
        torch.manual_seed(args.seed)  # same init for every configuration
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        self.module = model
        if name == "ddp":
            self.model: Any = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
            self.opt: Any = opt
        elif self.stage is not None:
            zc = zerodp.ZeroConfig(stage=self.stage, bucket_bytes=int(args.bucket_mb * MIB))
            self.model, self.opt = zerodp.initialize(model, opt, zc)
        else:  # local: no communication
            self.model, self.opt = model, opt
        inner = self.opt.inner if self.stage is not None else self.opt
        self._t_inner = 0.0
        self._t_pre = 0.0
        inner.register_step_pre_hook(self._pre_hook)
        inner.register_step_post_hook(self._post_hook)
        self.times: list[float] = []
        self.phases: list[dict[str, float]] = []
        self._barrier = dist.barrier

    def _pre_hook(self, *_: Any) -> None:
        self._t_pre = time.perf_counter()

    def _post_hook(self, *_: Any) -> None:
        self._t_inner = time.perf_counter() - self._t_pre

    def settle(self) -> None:
        """Wait for the parameter gather a zerodp step leaves in flight: a profiler must not stop
        while a gloo worker thread reports to it (``zerodp.memory.alloc_trace``)."""
        if self.stage is not None:
            self.opt.wait_params()

    def step(self, x: Any, y: Any, record: bool) -> None:
        self._barrier()
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        _, loss = self.model(x, y)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        if self.stage is not None:
            self.opt.engine.finish_gradients()  # what step() does first; timed apart
        self._t_inner = 0.0  # stays 0 if the optimizer step is skipped
        t4 = time.perf_counter()
        self.opt.step()
        t5 = time.perf_counter()
        if record:
            self.times.append(t5 - t0)
            self.phases.append(
                {
                    "zero_grad": t1 - t0,
                    "forward": t2 - t1,
                    "backward": t3 - t2,
                    "wait": t4 - t3,
                    "optimizer": self._t_inner,
                    "gather": max(0.0, t5 - t4 - self._t_inner),
                    "total": t5 - t0,
                }
            )

    def memory(self) -> dict[str, Any]:
        if self.stage is not None:
            return self.opt.memory_report().to_dict()
        from zerodp.apps.bench.peers import DDPPeer, Peer

        # DDP's bucket buffers are counted by the `zerodp bench` adapter (private API).
        peer = (DDPPeer if self.name == "ddp" else Peer)(self.module, self.model, self.opt, False)
        m = peer.memory()
        states = m["parameters"] + m["gradients"] + m["optimizer_state"]
        return {
            "parameters": m["parameters"],
            "gradients": m["gradients"],
            "optimizer_state": m["optimizer_state"],
            "comm_buffers": m["buffers"],
            "model_states": states,
            "num_params": sum(p.numel() for p in self.module.parameters()),
        }


def _parity(run: _Run, ref: _Run) -> dict[str, float]:
    from zerodp.apps.bench.parity import compare_params

    found = compare_params(dict(run.module.named_parameters()), dict(ref.module.named_parameters()))
    return {k: v for k, v in found.items() if isinstance(v, float)}  # max-over-ranks-able


def _profile(runs: list[_Run], sampler: Any, first_step: int, steps: int) -> dict[str, Any]:
    """Profile ``steps`` more steps of every configuration, interleaved like the timed steps
    (one profiler per configuration step); per operator, the median over steps."""
    from torch.profiler import ProfilerActivity, profile

    samples: dict[str, list[dict[str, float]]] = {r.name: [] for r in runs}
    calls: dict[str, dict[str, float]] = {r.name: {} for r in runs}
    by_name = {r.name: r for r in runs}
    for i in range(steps):
        x, y = sampler.batch_at(first_step + i)
        for name in round_order(list(by_name), i):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                by_name[name].step(x, y, record=False)
                by_name[name].settle()
            sample = {}
            for e in prof.key_averages():
                if not e.key.startswith("ProfilerStep"):
                    sample[e.key] = e.self_cpu_time_total / 1e3
                    calls[name][e.key] = e.count
            samples[name].append(sample)
    return {name: top_operators(samples[name], calls[name]) for name in samples}


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import zerodp
    from zerodp.apps.data.corpus import BatchSampler, load_corpus
    from zerodp.apps.models.gpt import get_config, num_parameters

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = get_config(args.preset)
    sampler = BatchSampler(load_corpus(), args.batch, cfg.seq_len, args.seed, rank, world)
    runs = [_Run(name, args, cfg) for name in args.config_list]

    load_start = list(os.getloadavg())
    t_start = time.perf_counter()
    for step in range(args.warmup + args.steps):
        x, y = sampler.batch_at(step)
        for name in round_order(args.config_list, step):
            run = next(r for r in runs if r.name == name)
            run.step(x, y, record=step >= args.warmup)
    timed_wall = time.perf_counter() - t_start

    by_name = {r.name: r for r in runs}
    ref = by_name.get(REFERENCE)
    parity = {
        r.name: (_parity(r, ref) if ref is not None and r.name != "local" else None) for r in runs
    }
    memory = {r.name: r.memory() for r in runs}
    comm = {}
    for r in runs:
        if r.stage is not None:
            st = r.opt.comm_stats()
            comm[r.name] = None if st is None else st.to_dict()
    profile = {}
    if args.profile_steps > 0:
        profile = _profile(runs, sampler, args.warmup + args.steps, args.profile_steps)

    gathered: list[Any] = [None] * world
    local = {
        "times": {r.name: r.times for r in runs},
        "parity": parity,
    }
    dist.all_gather_object(gathered, local)
    if rank == 0:
        times = {name: max_over_ranks([g["times"][name] for g in gathered]) for name in by_name}
        parity_all = {
            name: (
                None
                if parity[name] is None
                else {k: max(g["parity"][name][k] for g in gathered) for k in parity[name]}
            )
            for name in by_name
        }
        meta = {
            "preset": args.preset,
            "num_params": num_parameters(runs[0].module),
            "world_size": world,
            "batch": args.batch,
            "seq_len": cfg.seq_len,
            "steps": args.steps,
            "warmup": args.warmup,
            "threads_per_rank": args.threads,
            "bucket_mb": args.bucket_mb,
            "configs": args.config_list,
            "optimizer": "AdamW(lr=3e-4, weight_decay=0.1), fp32",
            "backend": dist.get_backend(),
            "torch": torch.__version__,
            "zerodp": zerodp.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "timed_wall_s": timed_wall,
            "loadavg_start": load_start,
            "loadavg_end": list(os.getloadavg()),
            "env": {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "OMP_"))},
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        }
        report = build_report(
            meta=meta,
            times=times,
            phases={r.name: r.phases for r in runs},
            memory=memory,
            parity=parity_all,
            comm=comm,
            profile=profile,
        )
        print(format_report(report), flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=1)
            print(f"\nwrote {args.json}", flush=True)
    dist.barrier()
    for r in runs:  # zerodp models and engines reference each other: drop them before teardown
        if r.stage is not None:
            r.opt.engine.remove()
    runs.clear()
    dist.destroy_process_group()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if not _under_torchrun():
        return launch(args, argv)
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
