"""What both local launchers (``zerodp train`` and ``zerodp bench``) share about torch's elastic
agent: silencing its noisy loggers during a launch, and describing a rank that failed."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

# Loggers that would print each failing rank's traceback a second time (the launchers format
# their own) and the agent's routine shutdown warnings.
NOISY_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")


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
