"""Pure statistics and number formatting of ``zerodp bench`` (no torch, no process group).

Step times are summarised by the median and minimum, the noise as interquartile range over
median, and the step time of a run as the slowest rank's.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

MIB = 2**20


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (``q`` in [0, 100]) of a non-empty sequence."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(times: Sequence[float]) -> dict[str, float]:
    """Robust summary of step times in seconds: median, min, quartiles, and the noise as the
    interquartile range relative to the median (``iqr_rel``)."""
    med = statistics.median(times)
    p25, p75 = percentile(times, 25), percentile(times, 75)
    return {
        "n": len(times),
        "median": med,
        "min": min(times),
        "max": max(times),
        "mean": statistics.fmean(times),
        "p25": p25,
        "p75": p75,
        "iqr_rel": (p75 - p25) / med if med > 0 else 0.0,
    }


def phase_medians(phases: Sequence[Mapping[str, float]], order: Sequence[str]) -> dict[str, float]:
    """Median over steps of each phase's seconds, in ``order`` (phases missing in a step count
    as 0; phases never seen are left out)."""
    if not phases:
        return {}
    names = [p for p in order if any(p in s for s in phases)]
    return {p: statistics.median(s.get(p, 0.0) for s in phases) for p in names}


def max_over_ranks(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Step ``i``'s time is the slowest rank's: that is when the job could move on."""
    return [max(ts) for ts in zip(*per_rank, strict=True)]


def round_order(configs: Sequence[str], step: int) -> list[str]:
    """The order in which the configurations run at ``step``: rotated by one each step, so each
    runs in each position equally often (no configuration always follows the same one)."""
    k = step % len(configs) if configs else 0
    return list(configs[k:]) + list(configs[:k])


# -- table cells: "-" (or "n/a") where there is no value ------------------------------------------


def fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def fmt_mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / MIB:.1f}"


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def fmt_sci(value: float | None) -> str:
    if value is None:
        return "n/a"
    return "0" if value == 0 else f"{value:.1e}"
