"""What the watchdog says: every rank's published position, and the pure function that turns
them into one error message ([Note: watchdog] in watchdog.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

# Phases inside an optimizer step (numbered by the step they compute); others are between steps.
STEP_PHASES = ("forward", "backward", "gradient clipping", "optimizer step")


class ArrivalLike(Protocol):
    @property
    def seq(self) -> int: ...
    @property
    def op(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def phase(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Record:
    """One rank's position as published in the store."""

    seq: int  # collectives started on the group
    op: str  # the last one
    step: int  # optimizer steps completed
    phase: str
    waiting: bool  # in the wait of collective ``seq``
    since: float  # time.time() this state (the wait, or the code after the last wait) began
    error_kind: str  # "" | "failed" (an exception ended the process) | "gave up" | "error"
    error: str
    at: float  # time.time() of publication
    late: tuple[int, ...] = ()  # after a "gave up": the ranks it found late

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> Record:
        return cls(**{**values, "late": tuple(values.get("late", ()))})


def where(step: int, phase: str) -> str:
    if phase in STEP_PHASES:
        return f"step {step + 1}, {phase}"
    if phase == "between steps":
        return f"after step {step}, in the training loop's own code"
    return f"{phase} after step {step}"


def position(r: int, rec: Record | None, now: float) -> str:
    if rec is None:
        return f"rank {r}: no position published (it never reached zerodp, or its store is gone)"
    place = where(rec.step, rec.phase)
    if rec.error_kind == "failed":
        return f"rank {r}: failed with {rec.error} ({place})"
    if rec.waiting:
        text = f"rank {r}: waiting in {rec.op} #{rec.seq} for {now - rec.since:.1f} s ({place})"
    else:
        last = f"; last collective {rec.op} #{rec.seq}" if rec.seq else ""
        text = f"rank {r}: {place} for {now - rec.since:.1f} s{last}"
    if rec.error_kind == "gave up":
        text += f" [gave up waiting in {rec.error}]"
    elif rec.error_kind:
        text += f" [its collective failed: {rec.error}]"
    return text


def explain(
    me: int,
    arrival: ArrivalLike,
    waited: float,
    records: dict[int, Record],
    cause: BaseException,
    timed_out: bool,
    timeout_s: float | None,
    world: int,
    members: Sequence[int] = (),
) -> tuple[str, list[int], int | None]:
    """(message, late group ranks, first failed group rank). ``members``: the group's global
    ranks, named in the message where they differ from the group ranks (a DP group of a mesh)."""
    now = time.time()
    here = f"{arrival.op} #{arrival.seq} ({where(arrival.step, arrival.phase)})"
    others = {r: rec for r, rec in records.items() if r != me}
    failed = sorted((rec.at, r) for r, rec in others.items() if rec.error_kind == "failed")
    # Ranks that gave up waiting for this one: their pending collective may even have matched
    # this rank's, so this rank can be one collective further when it notices.
    waited_for_me = sorted(
        r for r, rec in others.items() if rec.error_kind == "gave up" and me in rec.late
    )
    late = sorted(r for r in range(world) if r != me and _behind(records.get(r), arrival.seq))
    first_failed = failed[0][1] if failed else None
    if first_failed is not None:
        rec = others[first_failed]
        head = (
            f"rank {first_failed} failed first, {where(rec.step, rec.phase)}: {rec.error}; "
            f"rank {me} was in {here}"
        )
        late = []
    elif waited_for_me:
        rec = others[waited_for_me[0]]
        head = (
            f"rank {me} (this rank) was late: rank(s) {_join(waited_for_me)} gave up waiting "
            f"for it in {rec.op} #{rec.seq} ({where(rec.step, rec.phase)}); it is now in {here}"
        )
        late = [me]
    elif late:
        verb = f"waited {waited:.1f} s in" if timed_out else "was in"
        head = f"rank {me} {verb} {here}; late: rank(s) {_join(late)}, which did not reach it"
    else:
        head = f"rank {me} was in {here}; every rank reached it"
    lines = [head, *_global_ranks(members)]
    ops = {r: rec.op for r, rec in records.items() if rec.seq == arrival.seq}
    ops[me] = arrival.op
    if len(set(ops.values())) > 1:
        detail = ", ".join(f"rank {r} {op}" for r, op in sorted(ops.items()))
        lines.append(f"ranks issued different collectives as #{arrival.seq}: {detail}")
    if not late and first_failed is None and not waited_for_me:
        lines += _different_steps(me, arrival, records)
    if not timed_out:
        lines.append(f"the collective failed on this rank: {first_line(cause)}")
    lines.append("where every rank is:")
    lines += ["  " + position(r, records.get(r), now) + _mark(r, me, late) for r in range(world)]
    if timed_out and timeout_s is not None:
        text = f"ZeroConfig.watchdog_s ({timeout_s:g} s) is how long a rank waits for the others"
        if late:
            text += (
                "; a late rank is stuck in its own code (data loading, a deadlock, a debugger) "
                "or raised an exception that did not end its process"
            )
        lines.append(text + ".")
    lines.append(
        "The process group cannot be used after this error: end the process and resume from "
        "the last checkpoint (zerodp.load_checkpoint)."
    )
    return "zerodp: " + "\n".join(lines), late, first_failed


def _different_steps(me: int, arrival: ArrivalLike, records: dict[int, Record]) -> list[str]:
    """When every rank arrived but they disagree, different step counts are the usual cause."""
    places = {r: _in_step(rec.step, rec.phase) for r, rec in records.items()}
    places[me] = _in_step(arrival.step, arrival.phase)
    if len(set(places.values())) == 1:
        return []
    detail = ", ".join(f"rank {r} {place}" for r, place in sorted(places.items()))
    return [
        f"ranks are at different steps ({detail}): every rank must run the same number of "
        "optimizer steps, and the same collectives, before a checkpoint, an evaluation or the end"
    ]


def _in_step(step: int, phase: str) -> str:
    return f"in step {step + 1}" if phase in STEP_PHASES else f"after step {step}"


def _behind(rec: Record | None, seq: int) -> bool:
    if rec is None:
        return True
    return rec.seq < seq and not rec.error_kind


def _mark(r: int, me: int, late: list[int]) -> str:
    marks = []
    if r == me:
        marks.append("this rank")
    if r in late:
        marks.append("late")
    return f"   <- {', '.join(marks)}" if marks else ""


def _global_ranks(members: Sequence[int]) -> list[str]:
    """Ranks here are group ranks; in a DP group {1, 3} of a mesh, "rank 1" is global rank 3."""
    if tuple(members) == tuple(range(len(members))):
        return []
    pairs = ", ".join(f"{r} is {g}" for r, g in enumerate(members))
    return [f"ranks are those of zerodp's process group; as global ranks: {pairs}"]


def _join(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def first_line(exc: BaseException) -> str:
    """An exception's first line, bounded (gloo's messages run long)."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
