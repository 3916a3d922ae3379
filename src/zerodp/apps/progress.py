"""Progress bars of the long commands (``train``, ``bench``, ``consolidate``): tqdm on
standard error, shown only where a person watches it.

A bar is off under ``--quiet`` and when standard error is not a terminal (a log file, CI, a
pipe), where its redraws would be noise; the command's own result lines are printed either way.
"""

from __future__ import annotations

import sys
from typing import IO, Any

QUIET_HELP = "no progress bar (it is also off when standard error is not a terminal)"


def shown(quiet: bool, stream: IO[str] | None = None) -> bool:
    """Whether a bar is drawn: not ``quiet``, and ``stream`` (standard error) is a terminal."""
    stream = sys.stderr if stream is None else stream
    return not quiet and stream.isatty()


def bar(*, quiet: bool, **tqdm_kwargs: Any) -> Any:
    """A ``tqdm`` bar on standard error, disabled unless ``shown``; ``tqdm_kwargs`` as tqdm's
    (``total``, ``desc``, ``unit``, ...). Its ``write`` prints whether or not it is shown."""
    from tqdm import tqdm

    kwargs: dict[str, Any] = {"file": sys.stderr, "dynamic_ncols": True, "mininterval": 0.5}
    kwargs.update(tqdm_kwargs)
    return tqdm(disable=not shown(quiet, kwargs["file"]), **kwargs)
