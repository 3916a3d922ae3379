"""The watchdog ([Note: watchdog] in comm/watchdog.py): a stalled rank, a rank that raised, a
rank whose process died, ranks at different steps. Each scenario leaves its process group
unusable (collectives of the late rank stay pending), so each runs in a fresh world; the bound
on the whole run is the harness's timeout, and each rank returns the error it raised."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from harness import run_world

import zerodp
from zerodp.models.gpt import GPT, PRESETS

WATCHDOG_S = 2.0


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(PRESETS["tiny"])


def _batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, PRESETS["tiny"].vocab_size, (2, 16), generator=g)


def _train_step(model: Any, opt: Any, rank: int, step: int) -> None:
    idx = _batch(rank, step)
    _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad()


def _error_of(fn: Any) -> tuple[str, str, tuple[int, ...], float]:
    """(exception type, message, late ranks, seconds) of what ``fn`` raised."""
    start = time.monotonic()
    try:
        fn()
    except zerodp.CollectiveError as e:
        return type(e).__name__, str(e), e.late, time.monotonic() - start
    except Exception as e:  # noqa: BLE001 - returned so that the test shows what it was
        return type(e).__name__, str(e), (), time.monotonic() - start
    return "none", "", (), time.monotonic() - start


def _stalled(stage: int, sleep_s: float) -> tuple[str, str, tuple[int, ...], float]:
    import torch.distributed as dist

    rank = dist.get_rank()
    model = _gpt()
    config = zerodp.ZeroConfig(stage=stage, watchdog_s=WATCHDOG_S)
    model, opt = zerodp.initialize(model, torch.optim.AdamW(model.parameters()), config)
    for step in range(2):
        _train_step(model, opt, rank, step)

    def third() -> None:
        if rank == 1:
            time.sleep(sleep_s)  # stuck in the training loop's own code (a data loader)
        _train_step(model, opt, rank, 2)
        _train_step(model, opt, rank, 3)

    return _error_of(third)


@pytest.mark.parametrize("stage", [2, 3])
def test_stalled_rank_is_named_on_every_rank(stage: int) -> None:
    out = run_world(_stalled, 3, stage, 4 * WATCHDOG_S, timeout=60)
    for rank in (0, 2):
        kind, message, late, seconds = out[rank]
        assert kind == "CollectiveError", (rank, kind, message)
        assert late == (1,), (rank, message)
        assert "late: rank(s) 1, which did not reach it" in message, message
        assert "step 3, backward" in message or "step 3, forward" in message, message
        assert "rank 1: after step 2, in the training loop's own code for" in message, message
        assert f"ZeroConfig.watchdog_s ({WATCHDOG_S:g} s)" in message, message
        assert WATCHDOG_S <= seconds < WATCHDOG_S + 3, (rank, seconds)
    kind, message, late, seconds = out[1]
    assert kind == "CollectiveError", message
    assert late == (1,), message
    assert "rank 1 (this rank) was late: rank(s) 0, 2 gave up waiting for it in" in message
