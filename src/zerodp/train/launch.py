"""Starting the ranks of ``zerodp train`` on this machine with torch's own elastic launcher.

The ranks are the same ``rank_main`` that ``torchrun -m zerodp.train`` runs, started by
``torch.distributed.launcher.api.elastic_launch`` (what torchrun uses inside): a local c10d
rendezvous on a free port, no restarts, ranks forked from a forkserver that has torch imported.
If any rank raises, the agent stops all the others and raises ``ChildFailedError``; the failing
rank's exception and traceback are shown to the user (from the note every failing rank leaves,
see ``format_failures``, else from the error file ``@record`` wrote) and the command exits
non-zero.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from zerodp.train.agent import NOISY_LOGGERS, describe_failure, quiet_loggers
from zerodp.train.options import ErrorNote, TrainOptions

_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "zerodp.train.loop")
_MAX_TRACEBACKS = 2  # distinct errors shown in full; further failing ranks get one line each


def launch_local(options: TrainOptions, nproc: int) -> int:
    """Run ``nproc`` ranks here and wait for them; the exit status for the command."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from zerodp.train.loop import rank_main

    with tempfile.TemporaryDirectory(prefix="zerodp-train-") as tmp:
        error_dir = Path(tmp, "errors")
        error_dir.mkdir()
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc,
            run_id=f"zerodp-train-{uuid.uuid4().hex[:12]}",
            rdzv_backend="c10d",
            rdzv_endpoint="localhost:0",  # port 0: the agent picks a free one (as --standalone)
            max_restarts=0,  # a deterministic run that failed once fails again
            monitor_interval=0.1,
            start_method=_start_method(),
            # The agent's own files (error files), removed with tmp; by default it leaves a
            # /tmp/torchelastic_* directory behind on every run.
            logs_specs=DefaultLogsSpecs(log_dir=str(Path(tmp, "agent"))),
        )
        try:
            with quiet_loggers(NOISY_LOGGERS):
                elastic_launch(config, rank_main)(options, str(error_dir))
        except ChildFailedError as exc:
            notes = read_error_notes(error_dir)
            print(format_failures(notes, exc.failures), file=sys.stderr, flush=True)
            return 1
        except SignalException as exc:  # Ctrl-C or a kill: the agent has stopped the ranks
            name = exc.sigval.name
            print(f"zerodp train: interrupted ({name}); all ranks stopped", file=sys.stderr)
            return 128 + int(exc.sigval)
    return 0


def _start_method() -> str:
    """forkserver where available: one server process imports torch, torch._dynamo (which the
    first torch optimizer imports, ~3 s) and the loop once, and every rank is a fork of it,
    instead of each rank importing them all again (spawn). The server never runs a torch op or
    touches CUDA, so forking it is safe, unlike forking this process. Elsewhere: spawn."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    ctx = multiprocessing.get_context("forkserver")
    # Takes effect when the server starts, i.e. at the first launch of this process.
    ctx.set_forkserver_preload(list(_PRELOAD))
    return "forkserver"


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
