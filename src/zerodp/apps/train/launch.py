"""Starting the ranks of ``zerodp train`` on this machine with torch's own elastic launcher.

The ranks are the same ``rank_main`` that ``torchrun -m zerodp.apps.train`` runs, started by
``comm.launch.launch_ranks`` (torch's ``elastic_launch``, what torchrun uses inside). If any rank
raises, the agent stops all the others; the failing rank's exception and traceback are shown to
the user (from the note every failing rank leaves, see ``format_failures``, else from the error
file ``@record`` wrote) and the command exits non-zero.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from zerodp.apps.train.options import ErrorNote, TrainOptions
from zerodp.comm.launch import LaunchInterrupted, RanksFailed, describe_failure, launch_ranks

_PRELOAD = ("zerodp.apps.train.loop",)
_MAX_TRACEBACKS = 2  # distinct errors shown in full; further failing ranks get one line each


def launch_local(options: TrainOptions, nproc: int) -> int:
    """Run ``nproc`` ranks here and wait for them; the exit status for the command."""
    from zerodp.apps.train.loop import rank_main

    with tempfile.TemporaryDirectory(prefix="zerodp-train-") as tmp:
        error_dir = Path(tmp, "errors")
        error_dir.mkdir()
        try:
            launch_ranks(
                rank_main,
                (options, str(error_dir)),
                nproc=nproc,
                run_id=f"zerodp-train-{uuid.uuid4().hex[:12]}",
                log_dir=Path(tmp, "agent"),  # removed with tmp
                preload=_PRELOAD,
            )
        except RanksFailed as exc:
            notes = read_error_notes(error_dir)
            print(format_failures(notes, exc.failures), file=sys.stderr, flush=True)
            return 1
        except LaunchInterrupted as exc:  # Ctrl-C or a kill: the agent has stopped the ranks
            name = exc.signal.name
            print(f"zerodp train: interrupted ({name}); all ranks stopped", file=sys.stderr)
            return 128 + int(exc.signal)
    return 0


def read_error_notes(directory: str | Path) -> list[ErrorNote]:
    """The notes failing ranks left in ``directory``, earliest first."""
    notes = []
    for path in Path(directory).glob("rank-*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            notes.append(ErrorNote(**json.loads(path.read_text(encoding="utf-8"))))
    return sorted(notes, key=lambda note: (note.time_ns, note.rank))


def format_failures(notes: list[ErrorNote], failures: dict[int, Any]) -> str:
    """What to tell the user after a failed run: the earliest rank error in full (the root
    cause), the errors it caused on other ranks in one line each, and what the agent knows of
    ranks that left no note (killed by a signal, say). Without notes: the agent's view alone.

    The agent reports only the first failed rank it notices, and once a rank dies the others'
    next collective fails too ("connection reset by peer"), so that first one is not always the
    root cause; the notes' nanosecond times settle it.
    """
    if not notes:
        return format_child_failure(failures)
    first, *others = notes
    ranks = ", ".join(str(rank) for rank in sorted({n.rank for n in notes} | set(failures)))
    lines = [
        f"zerodp train failed: rank(s) {ranks} exited with an error; all ranks stopped.",
        f"\n===== rank {first.rank} failed first: {first.summary}",
        first.traceback.rstrip(),
    ]
    lines += [f"\n===== then rank {n.rank}: {n.summary}" for n in others]
    noted = {n.rank for n in notes}
    for rank, failure in sorted(failures.items()):
        if rank not in noted:
            lines.append(f"\n===== rank {rank}: {describe_failure(failure)[0]}")
    return "\n".join(lines)


def format_child_failure(failures: dict[int, Any]) -> str:
    """A readable account of failed ranks, from the agent's ``{rank: ProcessFailure}``.

    The earliest failure comes first (the root cause: once one rank dies, others may fail in
    a collective with a secondary "connection closed" error or be stopped by the agent).
    """
    ordered = sorted(failures.items(), key=lambda item: (_timestamp(item[1]), item[0]))
    ranks = ", ".join(str(rank) for rank, _ in ordered)
    lines = [f"zerodp train failed: rank(s) {ranks} exited with an error; all ranks stopped."]
    shown: set[str] = set()
    for rank, failure in ordered:
        summary, trace = describe_failure(failure)
        if summary in shown or len(shown) >= _MAX_TRACEBACKS:
            lines.append(f"\n===== rank {rank}: {summary}")
            continue
        shown.add(summary)
        lines.append(f"\n===== rank {rank} failed: {summary}")
        if trace:
            lines.append(trace.rstrip())
    return "\n".join(lines)


def _timestamp(failure: Any) -> int:
    return int(getattr(failure, "timestamp", 0) or 0)
