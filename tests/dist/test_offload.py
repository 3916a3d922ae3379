"""Optimizer offload (``ZeroConfig.offload.optimizer="cpu"``, issue 15): exact, overlapped,
ordered, bounded (checkpoints, adoption, reads and edits: test_offload_state.py).

Parity: on CPU the offloaded step runs the same kernels on the same values as the device step
([Note: offloaded step] in zerodp/offload/runner.py), so parameters and optimizer state must be
**bitwise** those of the run without offload, at every stage, precision and world size, with
clipping, accumulation and an LR scheduler that rewrites ``lr`` while the CPU still steps.
"""

from __future__ import annotations

import time

import pytest
import torch
from offloadtest import (
    STAGES,
    TIMEOUT,
    gpt_batch,
    mismatch,
    model_loss,
    offload_config,
    tiny_gpt,
    train,
)
from zerotest import rank_world

import zerodp
import zerodp.engine as engine_module
from zerodp.offload.chunks import chunk_numel
from zerodp.streams import StreamError
from zerodp.streams.cpu import CpuStreams


def case_parity(kind: str, precisions: tuple[str, ...]) -> list[str]:
    """GPT-2 at stage 3 with its biases and norms persistent (replicated), the others without."""
    persist = 64 if kind == "gpt2" else 0
    differ = []
    for stage in STAGES:
        for precision in precisions:
            want, want_state, _ = train(kind, offload_config(stage, precision, "none", persist))
            got, got_state, report = train(kind, offload_config(stage, precision, "cpu", persist))
            assert report.offload == "cpu" and report.host > 0, "the run was not offloaded"
            if stage == 3:
                assert (report.persistent_parameters > 0) == bool(persist), "persistent ones?"
            wrong = mismatch(want, want_state, got, got_state)
            if wrong:
                differ.append(f"stage {stage} {precision}: {wrong}")
    return differ


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize(
    ("kind", "precisions"),
    [("gpt", ("fp32", "bf16", "fp16")), ("gpt2", ("fp32", "bf16")), ("llama", ("fp32",))],
)
def test_bitwise_parity_with_the_device_step(world, world_size, kind, precisions):
    results = world(world_size).run(case_parity, kind, precisions, timeout=TIMEOUT)
    assert results == [[]] * world_size


def case_host_gradients(root: str, kind: str) -> list[str]:
    """The host gradient as a ring on the cpu tier, and whole on NVMe (``host_gradients``,
    the other way round from their defaults): bitwise the device step, and the ring's bytes
    are two slots (half of the two transfer rings of two slots each), the whole 4 B per
    owned element."""
    differ = []
    for stage in STAGES:
        for tier, how in (("cpu", "ring"), ("nvme", "full")):
            path = root if tier == "nvme" else None
            config = offload_config(
                stage, "bf16", tier, path=path, ring_buckets=2, host_gradients=how
            )
            want, want_state, _ = train(kind, offload_config(stage, "bf16", "none"))
            got, got_state, report = train(kind, config)
            wrong = mismatch(want, want_state, got, got_state)
            if wrong:
                differ.append(f"stage {stage} {tier} {how}: {wrong}")
            if tier == "cpu":  # in host memory: 4 B of fp32 masters per owned element
                whole, ring = report.master_parameters, report.host_buffers // 2
            if report.host_gradients != (whole if how == "full" else ring):
                differ.append(f"stage {stage} {tier} {how}: {report.host_gradients} B")
    return differ


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_host_gradient_ring_or_whole_is_exact(world, tmp_path, kind):
    assert world(2).run(case_host_gradients, str(tmp_path), kind, timeout=TIMEOUT) == [[], []]


# -- ordering: no bucket is read before its update landed, and the step does overlap ----------


class SlowStreams(CpuStreams):
    """CPU streams whose copies back to the device take ``delay`` s each (or fail at copy
    ``fail_at``): the forward must still see every update."""

    def __init__(self, delay: float, fail_at: int | None = None) -> None:
        super().__init__()
        self.delay = delay
        self.fail_at = fail_at
        self.copies = 0

    def side(self, name):  # type: ignore[no-untyped-def]
        stream = super().side(name)
        if name != "offload-h2d" or getattr(stream, "slowed", False):
            return stream
        submit = stream.submit

        def slow_submit(fn, uses=()):  # type: ignore[no-untyped-def]
            def slow():  # type: ignore[no-untyped-def]
                self.copies += 1
                if self.copies == self.fail_at:
                    raise OSError("injected copy failure")
                time.sleep(self.delay)
                return fn()

            return submit(slow, uses)

        stream.submit = slow_submit  # type: ignore[method-assign]
        stream.slowed = True  # type: ignore[attr-defined]
        return stream


def _with_streams(streams: CpuStreams):
    original = engine_module.make_streams
    engine_module.make_streams = lambda device: streams  # type: ignore[assignment]
    return original


def _watch(model: torch.nn.Module, opt, seen: dict, ref: dict | None, step: list[int]):
    """A forward pre-hook on every module with parameters, after zerodp's: what it reads."""
    overlapped = [0]

    def hook(module, args, name):  # type: ignore[no-untyped-def]
        landing = opt.engine.landing
        if landing is not None and landing.pending:
            overlapped[0] += 1
        for pname, p in module.named_parameters(recurse=False):
            key = (step[0], name, pname)
            if ref is None:
                seen[key] = p.detach().clone()
            elif not torch.equal(p.detach(), ref[key]):
                seen[key] = "stale"

    for name, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            module.register_forward_pre_hook(lambda m, a, name=name: hook(m, a, name))
    return overlapped


def _run_watched(stage: int, offload: str, ref: dict | None, streams: CpuStreams | None):
    rank, world = rank_world()
    original = _with_streams(streams) if streams is not None else None
    try:
        model = tiny_gpt()
        inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model, opt = zerodp.initialize(model, inner, offload_config(stage, "fp32", offload))
        seen: dict = {}
        step = [0]
        overlapped = _watch(model, opt, seen, ref, step)
        for step[0] in range(4):
            opt.backward(model_loss("gpt", model, step[0], rank, world))
            opt.step()
            opt.zero_grad()
        opt.close()
    finally:
        if original is not None:
            engine_module.make_streams = original
    return seen, overlapped[0]


def case_ordering(stage: int) -> tuple[int, list, int]:
    ref, _ = _run_watched(stage, "none", None, None)
    seen, overlapped = _run_watched(stage, "cpu", ref, SlowStreams(delay=0.02))
    stale = sorted(k for k, v in seen.items() if v == "stale")
    return len(ref), stale, overlapped


@pytest.mark.parametrize("stage", STAGES)
def test_no_bucket_is_read_before_its_update_landed(world, stage):
    """Copies back to the device slowed to 20 ms each: every module still reads exactly the
    parameters of the run without offload (compared at each forward pre-hook), while the
    forward demonstrably starts before the last bucket landed."""
    for checked, stale, overlapped in world(2).run(case_ordering, stage, timeout=TIMEOUT):
        assert checked > 0 and stale == []
        assert overlapped > 0, "no forward ran while updates were still in flight"


def case_failure() -> str:
    rank, world = rank_world()
    original = _with_streams(SlowStreams(delay=0.0, fail_at=2))
    try:
        model = tiny_gpt()
        inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model, opt = zerodp.initialize(model, inner, offload_config(2, "fp32", "cpu"))
        opt.backward(model_loss("gpt", model, 0, rank, world))
        opt.step()
        try:
            model(**gpt_batch(1, rank, world))
        except StreamError as exc:
            message = str(exc)
        else:
            message = "no error"
        with pytest.raises(StreamError):
            opt.close()  # still removes its hooks; the failure is raised again
        assert not model._forward_pre_hooks, "close() left hooks behind"
        return message
    finally:
        engine_module.make_streams = original


def test_a_failed_copy_is_raised_by_the_next_reader_not_lost(world):
    expected = "work on stream 'offload-h2d' failed: OSError('injected copy failure')"
    assert world(2).run(case_failure, timeout=TIMEOUT) == [expected] * 2


# -- memory: exact host bytes --------------------------------------------------------------------


def case_host_bytes(
    stage: int, precision: str, host_gradients: str
) -> tuple[dict[str, int], int, int]:
    """The report after one step, and from the layout: the owned elements and the largest
    chunk (an owned bucket slice, cut every ``chunk_numel`` elements: [Note: offload
    chunks])."""
    rank, world = rank_world()
    model = tiny_gpt()
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    config = offload_config(stage, precision, "cpu", ring_buckets=3, host_gradients=host_gradients)
    model, opt = zerodp.initialize(model, inner, config)
    opt.backward(model_loss("gpt", model, 0, rank, world))
    opt.step()
    regions = [b.region(rank).numel for seg in opt.engine.segments for b in seg.layout.buckets]
    report = opt.memory_report().to_dict()
    opt.close()
    return report, sum(regions), min(max(regions), chunk_numel(opt.engine.plan.bucket_bytes))


@pytest.mark.parametrize(
    ("stage", "precision", "host_gradients"),
    [(1, "fp32", "auto"), (2, "bf16", "full"), (3, "bf16", "auto"), (2, "bf16", "ring")],
)
def test_host_bytes_are_exact(world, stage, precision, host_gradients):
    """Host: fp32 masters, Adam's two moments and an fp32 gradient of the owned slices (16 B per
    owned element, step counters aside) plus 2 rings of 3 slots, each the largest chunk in fp32
    (stage 3's unit slices are cut into several); the device keeps no optimizer state. With
    ``host_gradients="ring"`` the fp32 gradient is 3 such slots instead of the whole."""
    args = (case_host_bytes, stage, precision, host_gradients)
    for r, owned, largest in world(2).run(*args, timeout=TIMEOUT):
        assert r["master_parameters"] == 4 * owned
        ring = host_gradients == "ring"
        assert r["host_gradients"] == (3 * 4 * largest if ring else 4 * owned)
        moments = r["optimizer_state"] - r["master_parameters"] - r["optimizer_scalar_bytes"]
        assert moments == 8 * owned
        assert r["host_buffers"] == 2 * 3 * 4 * largest
        # The paper's K = 12 at every precision: offloaded masters are a copy, even in fp32.
        assert r["theory"]["optimizer_state"] == 12 * r["num_params"] / 2
        assert r["host"] == r["optimizer_state"] + r["host_gradients"] + r["host_buffers"]
        device = r["parameters"] + r["gradients"] + r["comm_buffers"] + r["step_transient"]
        assert r["device"] == device + r["frozen_parameters"] + r["gathered_cached"]
