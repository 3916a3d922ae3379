"""The watchdog's message from published positions (pure: no processes)."""

from __future__ import annotations

import time

from zerodp.comm.diagnosis import Record, explain
from zerodp.comm.watchdog import Arrival

NOW = time.time()


def _rec(seq: int, op: str, step: int, phase: str, **kw: object) -> Record:
    values: dict[str, object] = {
        "seq": seq,
        "op": op,
        "step": step,
        "phase": phase,
        "waiting": False,
        "since": time.time() - 3.0,  # explain() measures ages from its own clock
        "error_kind": "",
        "error": "",
        "at": NOW,
    }
    values.update(kw)
    return Record(**values)  # type: ignore[arg-type]


def test_the_first_failed_rank_is_the_cause() -> None:
    me = Arrival(7, "all_reduce", 2, "backward")
    records = {
        0: _rec(7, "all_reduce", 2, "backward", error_kind="error", error="all_reduce #7"),
        1: _rec(6, "broadcast", 2, "forward", error_kind="failed", error="KeyError: 'x'", at=NOW),
        2: _rec(6, "broadcast", 2, "forward", error_kind="failed", error="OSError: y", at=NOW + 1),
    }
    message, late, failed = explain(0, me, 0.5, records, RuntimeError("closed"), False, 300.0, 3)
    assert failed == 1 and late == []
    assert message.startswith(
        "zerodp: rank 1 failed first, step 3, forward: KeyError: 'x'; rank 0 was in "
        "all_reduce #7 (step 3, backward)\nthe collective failed on this rank: closed\n"
    )
    assert "  rank 2: failed with OSError: y (step 3, forward)\n" in message


def test_late_ranks_are_those_that_did_not_reach_the_collective() -> None:
    me = Arrival(9, "reduce_scatter", 4, "backward")
    records = {
        0: _rec(9, "reduce_scatter", 4, "backward", waiting=True),
        1: _rec(8, "all_gather", 4, "between steps"),
        3: _rec(9, "reduce_scatter", 4, "backward", waiting=True),
    }
    message, late, failed = explain(0, me, 5.0, records, RuntimeError("t"), True, 5.0, 4)
    assert (late, failed) == ([1, 2], None)
    lines = message.split("\n")
    assert lines[0] == (
        "zerodp: rank 0 waited 5.0 s in reduce_scatter #9 (step 5, backward); late: rank(s) "
        "1, 2, which did not reach it"
    )
    assert (
        lines[2]
        == "  rank 0: waiting in reduce_scatter #9 for 3.0 s (step 5, backward)   <- this rank"
    )
    assert lines[3].startswith("  rank 1: after step 4, in the training loop's own code for 3.")
    assert lines[3].endswith("s; last collective all_gather #8   <- late")
    assert lines[4].startswith("  rank 2: no position published") and lines[4].endswith("<- late")
    assert "ZeroConfig.watchdog_s (5 s) is how long a rank waits for the others; a late" in message


def test_a_rank_that_others_gave_up_on_says_it_was_late() -> None:
    me = Arrival(12, "all_reduce", 3, "optimizer step")
    gave_up = {"error_kind": "gave up", "error": "reduce_scatter #11 after 2.0 s", "late": (1,)}
    records = {0: _rec(11, "reduce_scatter", 3, "backward", **gave_up)}
    message, late, _ = explain(1, me, 2.0, records, RuntimeError("t"), True, 2.0, 2)
    assert late == [1]
    assert message.startswith(
        "zerodp: rank 1 (this rank) was late: rank(s) 0 gave up waiting for it in "
        "reduce_scatter #11 (step 4, backward); it is now in all_reduce #12 (step 4, optimizer "
        "step)\n"
    )


def test_different_collectives_at_different_steps() -> None:
    me = Arrival(20, "all_gather", 4, "checkpoint save")
    records = {1: _rec(20, "all_reduce", 4, "backward", waiting=True)}
    message, late, failed = explain(0, me, 2.0, records, RuntimeError("t"), True, 2.0, 2)
    assert (late, failed) == ([], None)
    assert message.split("\n")[:3] == [
        "zerodp: rank 0 was in all_gather #20 (checkpoint save after step 4); every rank "
        "reached it",
        "ranks issued different collectives as #20: rank 0 all_gather, rank 1 all_reduce",
        "ranks are at different steps (rank 0 after step 4, rank 1 in step 5): every rank must "
        "run the same number of optimizer steps, and the same collectives, before a "
        "checkpoint, an evaluation or the end",
    ]


def test_a_sub_group_names_its_global_ranks() -> None:
    """In the DP group {1, 3} of a 2 x 2 mesh, group rank 1 is global rank 3: say so."""
    me = Arrival(5, "all_gather", 1, "forward")
    records = {0: _rec(5, "all_gather", 1, "forward", waiting=True)}
    message, late, _ = explain(0, me, 2.0, records, RuntimeError("t"), True, 2.0, 2, (1, 3))
    assert late == [1]
    assert message.split("\n")[1] == (
        "ranks are those of zerodp's process group; as global ranks: 0 is 1, 1 is 3"
    )
    world, _, _ = explain(0, me, 2.0, records, RuntimeError("t"), True, 2.0, 2, (0, 1))
    assert "global ranks" not in world
