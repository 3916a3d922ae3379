"""``opt.offload_timing()``: where an offloaded step's time goes ([Note: offload timing] in
src/zerodp/offload/timing.py), on real gloo ranks."""

from __future__ import annotations

import time

import torch
from offloadtest import TIMEOUT, model_loss, offload_config, tiny_gpt
from zerotest import rank_world

import zerodp

DELAY = 0.005  # seconds added to every host optimizer step call (one per chunk)


class SlowAdamW(torch.optim.AdamW):
    """AdamW whose every ``step`` call takes at least ``DELAY`` more: the host step calls it
    once per chunk, on its optimizer worker."""

    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        time.sleep(DELAY)
        return super().step(closure)


def case_timing(offload: str) -> tuple[list, int]:
    rank, world = rank_world()
    model = tiny_gpt()
    inner = SlowAdamW(model.parameters(), lr=3e-3)
    model, opt = zerodp.initialize(model, inner, offload_config(2, "bf16", offload))
    records = []
    for step in range(3):
        opt.backward(model_loss("gpt", model, step, rank, world))
        opt.step()
        opt.zero_grad()
        records.append(opt.offload_timing())
    chunks = len(opt.engine.runner.chunks) if offload != "none" else 0
    opt.close()
    return records, chunks


def test_the_offloaded_step_times_its_stages(world):
    """A step's record is complete when the next step starts: none after the first step.
    Every chunk passes each host stage once, and the optimizer stage's busy time holds the
    delay of each of its calls."""
    for records, chunks in world(2).run(case_timing, "cpu", timeout=TIMEOUT):
        assert records[0] is None, records[0]
        assert chunks > 1, f"{chunks} chunks: the pipeline is not exercised"
        for r in records[1:]:
            counts = [r["unpack_chunks"], r["optimizer_chunks"], r["cast_chunks"]]
            assert counts == [chunks] * 3, f"{counts} chunks timed, not {chunks} each"
            assert r["optimizer"] >= DELAY * chunks, f"optimizer busy {r['optimizer']:.4f} s"
            assert r["unpack"] > 0 and r["cast"] > 0, r
            # The host step runs 5 ms per chunk past step()'s return: the next forward waits.
            assert r["landing"] >= DELAY, f"landing {r['landing']:.4f} s"


def test_without_offload_there_is_no_timing(world):
    for records, _ in world(2).run(case_timing, "none", timeout=TIMEOUT):
        assert records == [None, None, None]
