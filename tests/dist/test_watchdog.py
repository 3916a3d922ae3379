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
from zerodp.apps.models.gpt import GPT, PRESETS

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


def _two_steps(stage: int) -> tuple[int, Any, Any]:
    """This rank, and the tiny GPT with its optimizer after two steps (watchdog: 2 s)."""
    import torch.distributed as dist

    model = _gpt()
    config = zerodp.ZeroConfig(stage=stage, watchdog_s=WATCHDOG_S)
    model, opt = zerodp.initialize(model, torch.optim.AdamW(model.parameters()), config)
    for step in range(2):
        _train_step(model, opt, dist.get_rank(), step)
    return dist.get_rank(), model, opt


def _error_of(fn: Any) -> tuple[str, str, tuple[int, ...], float]:
    """(exception type, message, late ranks, seconds) of what ``fn`` raised."""
    start = time.monotonic()
    try:
        fn()
    except zerodp.CollectiveError as e:
        return type(e).__name__, str(e), e.late, time.monotonic() - start
    except Exception as e:  # returned so that the test shows what it was
        return type(e).__name__, str(e), (), time.monotonic() - start
    return "none", "", (), time.monotonic() - start


def _raised_and_caught(stage: int) -> tuple[str, str, tuple[int, ...], float]:
    """Rank 1's own code raises in the forward of step 3; a notebook or a retry wrapper keeps
    its process alive, so no excepthook runs: the others name it late, in that forward."""

    rank, model, opt = _two_steps(stage)

    def boom(module: Any, args: Any) -> None:
        raise ValueError("boom")

    if rank == 1:
        model.blocks[1].register_forward_pre_hook(boom)
        return _error_of(lambda: _train_step(model, opt, rank, 2))
    return _error_of(lambda: _train_step(model, opt, rank, 2))


@pytest.mark.parametrize("stage", [0, 3])
def test_rank_that_raised_is_named_with_its_step_and_phase(stage: int) -> None:
    out = run_world(_raised_and_caught, 2, stage, timeout=60)
    assert out[1][:2] == ("ValueError", "boom"), out[1]
    kind, message, late, seconds = out[0]
    assert kind == "CollectiveError" and late == (1,), message
    assert "late: rank(s) 1, which did not reach it" in message, message
    assert "rank 1: step 3, forward for" in message, message
    assert WATCHDOG_S <= seconds < WATCHDOG_S + 3, seconds


def _stalled(stage: int, sleep_s: float) -> tuple[str, str, tuple[int, ...], float]:

    rank, model, opt = _two_steps(stage)

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


_DYING_SCRIPT = """
import os, sys, torch, torch.distributed as dist
import zerodp
from zerodp.apps.models.gpt import GPT, PRESETS

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = GPT(PRESETS["tiny"])
model, opt = zerodp.initialize(
    model, torch.optim.AdamW(model.parameters()), zerodp.ZeroConfig(stage=STAGE)
)

def boom(module, args):
    raise ValueError("boom in the user's layer")

for step in range(4):
    if step == 2 and rank == 1:
        model.blocks[0].register_forward_pre_hook(boom)
    g = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, 256, (2, 16), generator=g)
    _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad()
print("finished", flush=True)
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(script: str, world: int, timeout: float) -> list[tuple[int, str]]:
    """Run ``script`` as ``world`` real ranks (what torchrun starts, without its agent, which
    would kill the survivors as soon as one rank exits); (exit code, stderr) per rank."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    env["WORLD_SIZE"] = str(world)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    out = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            _, err = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            out.append((p.returncode, err))
    finally:
        for p in procs:
            p.kill()
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_dead_rank_is_named_with_its_exception_step_and_phase(stage: int) -> None:
    out = _launch(_DYING_SCRIPT.replace("STAGE", str(stage)), 3, timeout=90)
    code, err = out[1]
    assert code == 1 and "ValueError: boom in the user's layer" in err, err[-2000:]
    for rank in (0, 2):
        code, err = out[rank]
        assert code == 1, (rank, err[-2000:])
        assert "zerodp.comm.watchdog.CollectiveError: zerodp: rank 1 failed first, step 3, " in err
        assert "forward: ValueError: boom in the user's layer; rank " in err, err[-3000:]
        assert "rank 1: failed with ValueError: boom in the user's layer (step 3, forward)" in err


def _uneven_steps_then_save(stage: int, root: str) -> tuple[str, str, tuple[int, ...], float]:

    rank, model, opt = _two_steps(stage)
    zerodp.save_checkpoint(root, model, opt)

    def uneven() -> None:
        for step in range(2, 4 + rank):  # rank 1 runs one step more
            _train_step(model, opt, rank, step)
        zerodp.save_checkpoint(root, model, opt)

    return _error_of(uneven)


def _resume_is_exact(stage: int, root: str) -> float:
    """Max abs difference between 4 uninterrupted steps and step 2's checkpoint + 2 steps."""
    import os

    import torch.distributed as dist

    rank = dist.get_rank()
    config = zerodp.ZeroConfig(stage=stage)
    models = []
    for resume in (False, True):
        model = _gpt()
        model, opt = zerodp.initialize(model, torch.optim.AdamW(model.parameters()), config)
        if resume:
            zerodp.load_checkpoint(root, model, opt)
            assert opt.engine.steps == 2, opt.engine.steps
        for step in range(2 if resume else 0, 4):
            _train_step(model, opt, rank, step)
        models.append(model)
    leftovers = sorted(os.listdir(root))
    assert leftovers == ["latest", "step-00000002"], leftovers
    with zerodp.full_parameters(models[0]), zerodp.full_parameters(models[1]):
        pairs = zip(models[0].parameters(), models[1].parameters(), strict=True)
        return max(float((a - b).abs().max()) for a, b in pairs)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_uneven_steps_then_save(stage: int, tmp_path: Any) -> None:
    """Rank 1 runs one step more, then every rank saves: every rank raises naming the step
    mismatch within the watchdog's bound, and the previous checkpoint resumes bit-identically."""
    out = run_world(_uneven_steps_then_save, 2, stage, str(tmp_path), timeout=60)
    for rank, (kind, message, _, seconds) in enumerate(out):
        assert "anks are at different steps (rank 0 after step 4, rank 1 in step 5)" in message
        if stage == 3:  # met at the first parameter check, before any wait
            assert kind == "RuntimeError", (rank, kind, message)
            assert "rank 0 saves or loads a checkpoint; rank 1 all-gathers" in message, message
            assert seconds < WATCHDOG_S, (rank, seconds)
        else:
            assert kind == "CollectiveError", (rank, kind, message)
            assert "rank 0: checkpoint save after step 4 for" in message, message
            assert WATCHDOG_S <= seconds < WATCHDOG_S + 3, (rank, seconds)
    assert run_world(_resume_is_exact, 2, stage, str(tmp_path), timeout=60) == [0.0, 0.0]
