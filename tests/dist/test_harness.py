"""Self-tests of the multi-rank harness (tests/dist/harness.py)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from harness import RankFailure, WorldPool, WorldTimeout, run_world

World = Callable[[int], WorldPool]

# --- functions run inside the ranks (module level so the workers can import them) -----------


def _allreduce_rank(scale: float, *, offset: float = 0.0) -> tuple[int, int, float]:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item() * scale + offset


def _pid() -> int:
    return os.getpid()


def _raise_on_rank1_while_rank0_waits() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.all_reduce(torch.ones(1))  # never completes: rank 1 is gone


def _raise_everywhere() -> None:
    raise RuntimeError(f"every rank fails, this is rank {dist.get_rank()}")


def _rank0_waits_for_absent_rank1() -> None:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))


def _exit_on_rank1() -> None:
    if dist.get_rank() == 1:
        os._exit(3)


def _print_rank() -> int:
    print(f"hello from rank {dist.get_rank()}")
    return dist.get_rank()


def _mutate_tensor(t: torch.Tensor) -> float:
    t.add_(dist.get_rank() + 1)  # each rank must get its own copy of the argument
    return t.item()


# --- tests ----------------------------------------------------------------------------------


def test_returns_each_ranks_value_in_rank_order(world: World) -> None:
    results = world(2).run(_allreduce_rank, 2.0, offset=0.5)
    assert results == [(0, 2, 2.5), (1, 2, 2.5)]


def test_pool_is_reused_between_runs(world: World) -> None:
    assert world(2).run(_pid) == world(2).run(_pid)


def test_arguments_are_copied_per_rank(world: World) -> None:
    assert world(2).run(_mutate_tensor, torch.zeros(1)) == [1.0, 2.0]


@pytest.mark.parametrize("world_size", [1, 3])
def test_other_world_sizes(world: World, world_size: int) -> None:
    expected = float(sum(range(world_size)))
    results = world(world_size).run(_allreduce_rank, 1.0)
    assert results == [(r, world_size, expected) for r in range(world_size)]


def test_failure_on_one_rank_reports_its_traceback_quickly(world: World) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        world(2).run(_raise_on_rank1_while_rank0_waits, timeout=60.0)
    elapsed = time.monotonic() - start

    message = str(info.value)
    assert info.value.ranks == (1,)
    assert "rank 1" in message
    assert "Traceback (most recent call last)" in message
    assert "ValueError: boom on purpose" in message
    # rank 0 was blocked in the collective: it is named, with its stack, not waited for.
    assert "rank 0 did not report" in message
    assert "all_reduce" in message
    assert elapsed < 15.0, f"took {elapsed:.1f}s; should stop shortly after the failure"


def test_every_failing_rank_is_reported(world: World) -> None:
    with pytest.raises(RankFailure) as info:
        world(2).run(_raise_everywhere)
    assert info.value.ranks == (0, 1)
    for rank in (0, 1):
        assert f"rank {rank} failed" in str(info.value)
        assert f"RuntimeError: every rank fails, this is rank {rank}" in str(info.value)


def test_dead_rank_is_reported(world: World) -> None:
    with pytest.raises(RankFailure, match="rank 1 failed") as info:
        world(2).run(_exit_on_rank1)
    assert "exited with code 3" in str(info.value)


def test_hang_raises_timeout_naming_the_hung_rank(world: World) -> None:
    start = time.monotonic()
    with pytest.raises(WorldTimeout) as info:
        world(2).run(_rank0_waits_for_absent_rank1, timeout=3.0)
    elapsed = time.monotonic() - start

    assert info.value.ranks == (0,)
    message = str(info.value)
    assert "ranks [0] of 2 did not answer within 3s" in message
    assert "_rank0_waits_for_absent_rank1" in message  # rank 0's Python stack
    assert elapsed < 10.0


def test_pool_restarts_after_failure(world: World) -> None:
    pids_before = world(2).run(_pid)
    with pytest.raises(RankFailure):
        world(2).run(_raise_everywhere)
    pids_after = world(2).run(_pid)
    assert set(pids_after).isdisjoint(pids_before)
    assert world(2).run(_allreduce_rank, 1.0) == [(0, 2, 1.0), (1, 2, 1.0)]


def test_rank_output_is_forwarded(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    assert world(2).run(_print_rank) == [0, 1]
    out = capsys.readouterr().out
    assert "[rank 0] hello from rank 0" in out
    assert "[rank 1] hello from rank 1" in out


def test_unsendable_function_is_rejected_without_breaking_the_pool(world: World) -> None:
    pool = world(2)
    pids = pool.run(_pid)
    with pytest.raises(TypeError, match="module-level function"):
        pool.run(lambda: None)
    assert pool.run(_pid) == pids


def test_run_world_is_one_shot() -> None:
    assert run_world(_allreduce_rank, 2, 1.0) == [(0, 2, 1.0), (1, 2, 1.0)]
