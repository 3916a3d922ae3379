"""The memory a rank uses, measured by device ([Note: memory meters], issue 17): RSS on CPU, the
CUDA allocator on a GPU, one interface. The CUDA path runs here without a GPU, on a fake
allocator."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from zerodp.apps.bench.probe import PhaseProbe
from zerodp.memory import CudaMeter, RssMeter, meter_for


class FakeAllocator:
    """torch.cuda's statistics for one device, driven by the test."""

    def __init__(self) -> None:
        self.allocated, self.peak, self.reserved = 100, 100, 4096
        self.devices: set[torch.device] = set()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def seen(value: str) -> Callable[[torch.device], int]:
            def read(device: torch.device) -> int:
                self.devices.add(device)
                return int(getattr(self, value))

            return read

        def reset(device: torch.device) -> None:
            self.devices.add(device)
            self.peak = self.allocated

        monkeypatch.setattr(torch.cuda, "memory_allocated", seen("allocated"))
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", seen("peak"))
        monkeypatch.setattr(torch.cuda, "memory_reserved", seen("reserved"))
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)


def test_the_meter_is_chosen_by_device() -> None:
    cuda = torch.device("cuda", 1)  # only a name: nothing touches CUDA until a reading
    assert isinstance(meter_for(cuda), CudaMeter) and meter_for(cuda).source == "CUDA allocated"
    assert isinstance(meter_for(torch.device("cpu")), RssMeter)
    assert meter_for(torch.device("cpu")).source == "RSS"


def test_a_cuda_rank_is_measured_by_its_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeAllocator()
    fake.install(monkeypatch)
    cuda = torch.device("cuda", 1)
    probe = PhaseProbe(meter_for(cuda))
    assert probe.resettable and probe.setup_peak == 100
    probe.begin()
    fake.allocated, fake.peak = 300, 900  # a phase that peaked at 900 and ends holding 300
    assert probe.end() == {"now": 300, "peak": 900, "reserved": 4096}
    probe.begin()  # the next phase's peak starts from what is held
    assert probe.end()["peak"] == 300
    assert fake.devices == {cuda}  # the rank's own device, never the current one by default


def test_a_cpu_rank_is_measured_by_its_rss() -> None:
    meter = meter_for(torch.device("cpu"))
    now = meter.current()
    assert now is not None and now > 10 * 2**20  # this interpreter with torch loaded
    block = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, touched
    peak, after = meter.peak(), meter.current()
    assert peak is not None and after is not None
    assert peak >= after >= now + 60 * 2**20
    assert meter.reserved() is None
    del block


def test_the_categories_count_what_the_meter_measures() -> None:
    """On a GPU the allocator does not see host memory: tensors elsewhere count 0 there, and
    offloaded model states count only their part on the device (seen on an H200: the
    zero2-offload row counted 11,577 MiB of host optimizer state against an 11,078 MiB CUDA
    peak). On CPU, RSS measures host memory: the host copies count too."""
    from dataclasses import replace

    from zerodp import MemoryReport
    from zerodp.apps.bench.peers import measured_categories
    from zerodp.apps.bench.probe import tensor_bytes

    host = [torch.zeros(10), torch.zeros(3, dtype=torch.bfloat16)]
    assert tensor_bytes(host, set(), "cuda") == 0
    seen: set[tuple[str, int]] = set()
    assert tensor_bytes([*host, host[0][2:]], seen, "cpu") == 46  # a view: its storage once
    assert tensor_bytes(host, seen, "cpu") == 0  # already counted

    report = MemoryReport(
        rank=0, world_size=2, stage=3, num_params=8, padded_numel=8, parameters=16,
        gradients=16, optimizer_state=96, master_parameters=32, optimizer_scalar_bytes=0,
        comm_buffers=0, frozen_parameters=0, step_transient=0, precision="bf16", theory=None,
    )  # fmt: skip
    kept = {"parameters": 16, "gradients": 16, "optimizer_state": 96}
    assert measured_categories(report, "cuda") == measured_categories(report, "cpu") == kept
    offloaded = replace(
        report, offload="cpu", optimizer_on_device=24, host_gradients=32, host_parameters=8
    )
    on_gpu = {"parameters": 16, "gradients": 16, "optimizer_state": 24}
    assert measured_categories(offloaded, "cuda") == on_gpu
    in_rss = {"parameters": 24, "gradients": 48, "optimizer_state": 96}
    assert measured_categories(offloaded, "cpu") == in_rss
