"""Progress bars of the long commands: drawn only for a person at a terminal (issue 17)."""

from __future__ import annotations

import io

import pytest

from zerodp.apps.progress import bar, shown


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("quiet", "stream", "drawn"),
    [(False, Terminal(), True), (True, Terminal(), False), (False, io.StringIO(), False)],
    ids=["terminal", "quiet", "not-a-terminal"],
)
def test_a_bar_is_drawn_only_at_a_terminal_and_not_quiet(
    quiet: bool, stream: io.StringIO, drawn: bool
) -> None:
    assert shown(quiet, stream) is drawn
    with bar(quiet=quiet, total=3, desc="work", file=stream) as b:
        b.update(3)
        b.write("a note", file=stream)
    text = stream.getvalue()
    assert "a note\n" in text  # notes are printed either way
    assert ("work: 100%" in text) is drawn
