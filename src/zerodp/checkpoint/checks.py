"""Checks on a checkpoint before anything is loaded: does the manifest hold together, does it fit
this model (whether the files are there and intact: ``integrity.py``). Each returns messages
(empty: fine) so that every rank can report its verdict to the others before any rank raises
(see ``load.py``)."""

from __future__ import annotations

from collections.abc import Sequence

from zerodp.checkpoint.manifest import Manifest, SavedPiece, sources_by_name
from zerodp.partition.layout import Range

# -- consistency of a manifest ------------------------------------------------------------------


def check_manifest(m: Manifest) -> list[str]:
    """Problems that make ``m`` unusable whatever the model: pieces that do not tile their
    parameter exactly, and per-parameter scalars that disagree between pieces."""
    problems: list[str] = []
    srcs = sources_by_name(m)
    for name, sources in srcs.items():
        rec = m.param(name)
        if rec is None:
            problems.append(f"pieces of '{name}' are saved but it is not among the parameters")
            continue
        problems += _tiling_problems(name, rec.numel, [s.range for s in sources])
        problems += _piece_state_problems(name, [s.piece for s in sources if s.piece is not None])
    for rank in m.ranks:
        if rank.file not in m.files:
            problems.append(f"rank {rank.rank}'s file {rank.file} has no size/checksum entry")
    return problems


def _tiling_problems(name: str, numel: int, ranges: list[Range]) -> list[str]:
    pos = 0
    for r in sorted(ranges):
        if r.start != pos:
            what = "overlap" if r.start < pos else "gap"
            return [f"saved ranges of '{name}' have a {what} at element {min(pos, r.start)}"]
        pos = r.stop
    if pos != numel:
        return [f"saved ranges of '{name}' cover {pos} of its {numel} elements"]
    return []


def _piece_state_problems(name: str, pieces: list[SavedPiece]) -> list[str]:
    """A parameter gets a gradient (and so a step) as a whole: its pieces must agree on
    scalar state such as Adam's ``step``, else resharding would have no single right value."""
    if not pieces:
        return []
    first = pieces[0]
    for pc in pieces[1:]:
        if pc.group != first.group:
            return [f"pieces of '{name}' are in different param groups ({first.group}, {pc.group})"]
        if set(pc.state) != set(first.state):
            return [
                f"pieces of '{name}' have different optimizer state keys: "
                f"{sorted(first.state)} at {_fmt(first.range)} vs {sorted(pc.state)} at "
                f"{_fmt(pc.range)}"
            ]
        for key, entry in pc.state.items():
            ref = first.state[key]
            if entry.kind != ref.kind or (entry.kind in ("scalar", "json") and entry != ref):
                return [
                    f"pieces of '{name}' disagree on optimizer state '{key}': "
                    f"{ref.to_json()} at {_fmt(first.range)} vs {entry.to_json()} at "
                    f"{_fmt(pc.range)}"
                ]
    return []


def _fmt(r: Range) -> str:
    return f"[{r.start}, {r.stop})"


def compare_structure(
    m: Manifest,
    params: Sequence[tuple[str, tuple[int, ...]]],
    buffers: Sequence[tuple[str, tuple[int, ...]]],
) -> list[str]:
    """What differs between the saved model and this one (names and shapes)."""
    problems = _compare_named(
        "parameter", [(p.name, p.shape) for p in m.params], params
    ) + _compare_named("buffer", [(b.name, b.shape) for b in m.buffers], buffers)
    return problems


def _compare_named(
    what: str,
    saved: Sequence[tuple[str, tuple[int, ...]]],
    current: Sequence[tuple[str, tuple[int, ...]]],
) -> list[str]:
    s, c = dict(saved), dict(current)
    problems = []
    missing = [n for n in s if n not in c]
    unexpected = [n for n in c if n not in s]
    if missing:
        problems.append(f"{what}s in the checkpoint but not in the model: {_names(missing)}")
    if unexpected:
        problems.append(f"{what}s in the model but not in the checkpoint: {_names(unexpected)}")
    for n in s:
        if n in c and tuple(s[n]) != tuple(c[n]):
            problems.append(
                f"{what} '{n}' has shape {tuple(c[n])} in the model but {tuple(s[n])} in the "
                "checkpoint"
            )
    return problems


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
