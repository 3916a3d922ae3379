"""Starting ranks on this machine with torch's own elastic launcher: what ``zerodp train`` and
``zerodp bench`` share.

``launch_ranks`` runs a function in ``nproc`` local ranks through
``torch.distributed.launcher.api.elastic_launch`` (what torchrun uses inside): a local c10d
rendezvous on a free port, no restarts, ranks forked from a forkserver that has torch and the
``preload`` modules imported. If any rank raises, the agent stops all the others and
``RanksFailed`` carries the agent's ``{rank: ProcessFailure}``; ``describe_failure`` turns one
into text. The rank side decorates its entry point with ``record`` (re-exported here from
``comm/elastic.py``), which writes the error file ``describe_failure`` reads.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from signal import Signals
from typing import Any

from zerodp.comm.elastic import record

__all__ = ["LaunchInterrupted", "RanksFailed", "describe_failure", "launch_ranks", "record"]

# Loggers that would print each failing rank's traceback a second time (the launchers format
# their own) and the agent's routine shutdown warnings.
NOISY_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")
# What every rank imports first, preloaded in the forkserver (see ``start_method``).
_PRELOAD = ("torch", "torch.distributed", "torch._dynamo")


class RanksFailed(Exception):
    """A rank raised or died; the agent has stopped the others."""

    failures: dict[int, Any]  # rank -> torch's ProcessFailure

    def __init__(self, failures: dict[int, Any]) -> None:
        super().__init__(f"rank(s) {sorted(failures)} failed")
        self.failures = failures


class LaunchInterrupted(Exception):
    """The launch got a signal (Ctrl-C, a kill); the agent has stopped the ranks."""

    signal: Signals

    def __init__(self, sig: Signals) -> None:
        super().__init__(f"interrupted ({sig.name})")
        self.signal = sig


def launch_ranks(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    nproc: int,
    run_id: str,
    log_dir: Path,
    preload: Sequence[str],
    redirect_output: bool = False,
) -> dict[int, Any]:
    """Run ``fn(*args)`` in ``nproc`` ranks here and wait for them; their return values by
    local rank. ``log_dir``: the agent's own files (error files; with ``redirect_output`` the
    ranks' stdout and stderr too), which by default it leaves in /tmp/torchelastic_*."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # port 0: the agent picks a free one (as --standalone)
        max_restarts=0,  # a deterministic run that failed once fails again
        monitor_interval=0.1,
        start_method=start_method(preload),
        logs_specs=DefaultLogsSpecs(
            log_dir=str(log_dir), redirects=Std.ALL if redirect_output else Std.NONE
        ),
    )
    try:
        with quiet_loggers(NOISY_LOGGERS):
            returned = elastic_launch(config, fn)(*args)
    except ChildFailedError as exc:
        raise RanksFailed(exc.failures) from exc
    except SignalException as exc:
        raise LaunchInterrupted(exc.sigval) from exc
    return dict(returned)


def start_method(preload: Sequence[str]) -> str:
    """forkserver where available: one server process imports torch, torch._dynamo (which the
    first torch optimizer imports, ~3 s) and the ``preload`` modules (the rank's entry point)
    once, and every rank is a fork of it, instead of each rank importing them all again
    (spawn). The server never runs a torch op or touches CUDA, so forking it is safe, unlike
    forking this process. Elsewhere: spawn."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    ctx = multiprocessing.get_context("forkserver")
    # Takes effect when the server starts, i.e. at the first launch of this process.
    ctx.set_forkserver_preload([*_PRELOAD, *preload])
    return "forkserver"


@contextlib.contextmanager
def quiet_loggers(names: tuple[str, ...]) -> Iterator[None]:
    """Raise the named loggers to CRITICAL for the body, then restore their levels."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def describe_failure(failure: Any) -> tuple[str, str]:
    """(one-line error, traceback) of one ``ProcessFailure``; either may be all we know."""
    message = getattr(failure, "message", "")
    if isinstance(message, dict):  # from the rank's error file, written by @record
        text = str(message.get("message", ""))
        trace = str(message.get("extraInfo", {}).get("py_callstack", ""))
        return text or "error (no message)", trace
    exitcode = getattr(failure, "exitcode", None)
    signal_name = getattr(failure, "signal_name", None)
    how = f"exit code {exitcode}"
    if exitcode is not None and exitcode < 0 and callable(signal_name):
        how = f"killed by {signal_name()}"
    return f"{how}: {message}" if message else how, ""
