"""``zerodp train``'s learning-rate schedule and what a resumed run follows (issue 17)."""

from __future__ import annotations

import argparse

import pytest

from zerodp.apps.cli.train import add_train_arguments, options_from_args
from zerodp.apps.train.schedule import Schedule, resumed_schedule

OLD = Schedule(lr=1e-3, warmup=2, total=40)
LONGER = Schedule(lr=1e-3, warmup=4, total=80)


def test_a_checkpoint_round_trips_its_schedule() -> None:
    assert Schedule.from_dict(OLD.to_dict()) == OLD
    assert Schedule.from_dict({"lr": 1e-3, "warmup": 2}) is None  # not one of ours
    assert Schedule.from_dict(None) is None


def test_the_same_schedule_resumes_silently() -> None:
    assert resumed_schedule(OLD, OLD, 20, new=False) == (OLD, None)
    assert resumed_schedule(OLD, None, 20, new=False) == (OLD, None)  # an older checkpoint


def test_more_steps_continue_the_checkpoints_schedule_without_a_jump() -> None:
    schedule, note = resumed_schedule(LONGER, OLD, 40, new=False)
    assert schedule == OLD
    assert [schedule.lr_at(s) for s in (40, 41, 60)] == [pytest.approx(1e-4)] * 3
    assert note == (
        "continuing the checkpoint's schedule: peak lr 0.001, 2 warm-up steps, cosine to 10% "
        "at step 40 (these options describe peak lr 0.001, 4 warm-up steps, cosine to 10% at "
        "step 80; pass --new-schedule to follow that from step 40 instead)"
    )


def test_a_new_schedule_is_followed_when_asked_and_the_jump_is_named() -> None:
    schedule, note = resumed_schedule(LONGER, OLD, 40, new=True)
    assert schedule == LONGER
    assert note is not None and note.endswith("at step 40 the rate goes from 0.0001 to 0.000587)")


def test_new_schedule_needs_resume() -> None:
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    args = parser.parse_args(["--new-schedule"])
    message = r"^--new-schedule applies to a resumed run: add --resume$"
    with pytest.raises(ValueError, match=message):
        options_from_args(args)
