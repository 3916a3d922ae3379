"""``zerodp bench --profile-steps N``: after the timed steps, N more steps of the configuration
under ``torch.profiler`` (CPU activities), one profiler per step, and its top operators.

Operators are ranked by the median over the profiled steps of their self CPU milliseconds (an
operator absent from a step counts 0 there), so a step in which the rank was descheduled inside
one operator does not make that operator look expensive. Every rank profiles (the ranks stay
alike); the report shows rank 0's.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

TOP = 15  # operators kept per configuration
SHOWN = 8  # of which the text report shows


def profile_steps(step: Callable[[int], None], first: int, count: int) -> list[dict[str, Any]]:
    """Run ``step(first + i)`` for ``count`` steps, each under its own profiler; the top
    operators (see ``top_operators``)."""
    from torch.profiler import ProfilerActivity, profile

    samples: list[dict[str, float]] = []
    calls: dict[str, float] = {}
    for i in range(count):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(first + i)
        sample = {}
        for event in prof.key_averages():
            if not event.key.startswith("ProfilerStep"):
                sample[event.key] = event.self_cpu_time_total / 1e3
                calls[event.key] = event.count
        samples.append(sample)
    return top_operators(samples, calls)


def top_operators(
    samples: Sequence[Mapping[str, float]], calls: Mapping[str, float], top: int = TOP
) -> list[dict[str, Any]]:
    """Per operator, the median over profiled steps of its self milliseconds, largest first."""
    if not samples:
        return []
    names = {k for s in samples for k in s}
    med = {k: statistics.median(s.get(k, 0.0) for s in samples) for k in names}
    ranked = sorted(names, key=lambda k: (-med[k], k))[:top]
    return [
        {"name": k, "self_ms_per_step": med[k], "calls_per_step": calls.get(k, 0)} for k in ranked
    ]


def format_profile_table(report: Mapping[str, Any], top: int = SHOWN) -> str:
    """One line per profiled configuration: its top operators and their self CPU ms per step;
    empty when nothing was profiled."""
    lines = []
    for name, c in report["configs"].items():
        ops = c.get("profile_rank0")
        if ops:
            shown = ", ".join(f"{op['name']} {op['self_ms_per_step']:.0f}" for op in ops[:top])
            lines.append(f"- **{name}** (ms/step): {shown}")
    return "\n".join(lines)
