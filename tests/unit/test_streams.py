"""The stream owner's contract ([Note: streams] in zerodp/streams/base.py), on every kind of
device this machine has (CPU always; CUDA when present), and that nothing else in zerodp creates
streams or events."""

from __future__ import annotations

import gc
import re
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

from zerodp.streams import StreamError, make_streams
from zerodp.streams.cpu import CpuStreams
from zerodp.streams.cuda import CudaStreams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SRC = Path(__file__).resolve().parents[2] / "src" / "zerodp"


@pytest.fixture(params=DEVICES)
def streams(request):
    s = make_streams(request.param)
    yield s
    s.close()


def test_side_stream_runs_in_order_and_returns_results(streams):
    side = streams.side("work")
    assert streams.side("work") is side  # one stream per name
    out = torch.zeros(8, device=streams.device)
    events = [side.submit(lambda i=i: out.add_(1).clone()[0] + i) for i in range(5)]
    assert [float(e.result()) for e in events] == [1.0 + 2 * i for i in range(5)]
    side.synchronize()
    assert torch.equal(out.cpu(), torch.full((8,), 5.0))


def test_a_stream_that_waits_for_an_event_sees_the_work_before_it(streams):
    a, b = streams.side("a"), streams.side("b")
    src = torch.zeros(1 << 16, device=streams.device)

    def slow_fill() -> None:
        time.sleep(0.05) if streams.device.type == "cpu" else None
        src.fill_(3.0)

    filled = a.submit(slow_fill)
    b.wait(filled)
    total = b.submit(lambda: src.sum())
    assert float(total.result()) == 3.0 * src.numel()


def test_compute_stream_waits_too(streams):
    side = streams.side("copy")
    host = torch.ones(4, device=streams.device)
    done = side.submit(lambda: host.mul_(7))
    streams.compute.wait(done)
    assert torch.equal(host.cpu(), torch.full((4,), 7.0))


def test_a_failure_is_raised_by_its_event_and_poisons_later_work(streams):
    side, other = streams.side("bad"), streams.side("good")
    ran = []

    def broken() -> None:
        raise ValueError("boom")

    first = side.submit(broken)
    later = side.submit(lambda: ran.append(1))
    message = "work on stream 'bad' failed: ValueError('boom')"
    with pytest.raises(StreamError, match=re.escape(message)) as info:
        first.wait()
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(StreamError, match=re.escape(message)):
        later.result()
    assert ran == []  # queued after the failure: not run
    assert other.submit(lambda: 5).result() == 5  # other streams go on


def test_cpu_side_work_overlaps_the_caller():
    streams = CpuStreams()
    release = threading.Event()
    event = streams.side("worker").submit(lambda: release.wait(10))
    assert not event.done()  # submit returned while the work still runs
    release.set()
    assert event.result() is True
    streams.close()


def test_cpu_uses_keep_tensors_alive_until_the_work_ran():
    streams = CpuStreams()
    side = streams.side("copy")
    release = threading.Event()
    side.submit(lambda: release.wait(10))
    t = torch.ones(3)
    ref = weakref.ref(t)
    done = side.submit(lambda: None, uses=[t])
    del t
    gc.collect()
    assert ref() is not None, "freed while queued work may still read it"
    release.set()
    done.wait()
    streams.close()
    gc.collect()
    assert ref() is None


def test_device_selection():
    assert isinstance(make_streams("cpu"), CpuStreams)
    assert isinstance(make_streams("meta"), CpuStreams)
    chosen = make_streams(torch.device("cuda", 0))  # no CUDA call: the index is given
    assert isinstance(chosen, CudaStreams) and chosen.device == torch.device("cuda", 0)


def test_host_buffers(streams):
    buf = streams.host_empty(10, torch.bfloat16)
    assert buf.shape == (10,) and buf.dtype == torch.bfloat16 and buf.device.type == "cpu"
    assert buf.is_pinned() == (streams.device.type == "cuda")


def test_only_the_stream_owner_creates_streams_and_events():
    pattern = re.compile(r"cuda\.(Stream|Event)\b|cuda\.stream\(|record_stream|pin_memory=")
    found = [
        f"{path.relative_to(SRC.parent)}:{n}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        if "streams" not in path.relative_to(SRC).parts
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, "create streams, events and pinned buffers through zerodp.streams:\n" + (
        "\n".join(found)
    )
    owner = (SRC / "streams" / "cuda.py").read_text(encoding="utf-8")
    assert pattern.search(owner)  # the pattern does match the owner's own code


def test_host_workers_are_threads_that_wait_for_device_work(streams):
    """A host worker runs on its own thread on every device (a CPU optimizer step must not hold
    up the caller) and may wait for a side stream's event."""
    side, host = streams.side("copy"), streams.host("cpu-work")
    assert streams.host("cpu-work") is host and host is not streams.side("cpu-work")
    src = torch.full((1 << 12,), 2.0, device=streams.device)
    dst = streams.host_empty(src.numel(), torch.float32)
    copied = side.submit(lambda: dst.copy_(src, non_blocking=True), uses=[src])
    caller = threading.get_ident()
    release = threading.Event()

    def work() -> tuple[int, float]:
        copied.wait()
        release.wait(10)
        return threading.get_ident(), float(dst.sum())

    done = host.submit(work)
    assert not done.done()  # the caller goes on while the host worker waits
    release.set()
    thread, total = done.result()
    assert thread != caller and total == 2.0 * src.numel()


def test_a_cpu_worker_lets_go_of_its_work_before_the_event_completes(monkeypatch) -> None:
    """The executor's worker holds its last work item until after the waiter woke; held
    there (here: 0.3 s, as a descheduled worker would), the work's tensors must already be
    free when ``wait`` returns (a leak check of tests/dist/test_offload_nvme.py failed once on
    a busy machine with tensors alive; this window is one way that happens)."""
    from concurrent.futures import thread

    original = thread._WorkItem.run

    def run_then_linger(self, *args):  # type: ignore[no-untyped-def]
        original(self, *args)
        time.sleep(0.3)  # the worker's frame still holds this work item

    monkeypatch.setattr(thread._WorkItem, "run", run_then_linger)
    streams = CpuStreams()
    try:
        used, read = torch.ones(1000), torch.ones(1000)
        gone = [weakref.ref(used), weakref.ref(read)]
        event = streams.side("d2h").submit(lambda t=read: t.sum().item(), uses=[used])
        del used, read
        assert event.result() == 1000.0
        gc.collect()
        assert [r() is None for r in gone] == [True, True], "the worker still holds the work"
    finally:
        streams.close()
