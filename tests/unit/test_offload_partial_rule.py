"""Which part partial offload keeps on the device, and what ``"auto"`` resolves to ([Note: partial
offload] in zerodp/offload/partial.py). The run itself: tests/dist/test_offload_partial.py."""

from __future__ import annotations

import pytest
import torch

from zerodp.offload.partial import AUTO_SHARE, auto_fraction, kept_prefix, resolve_fraction


@pytest.mark.parametrize(
    ("sizes", "fraction", "kept"),
    [
        ([10, 20, 30, 40], 1.0, 0),  # full offload keeps nothing
        ([10, 20, 30, 40], 0.9, 1),  # 10 of 100 on the device: exactly the first
        ([10, 20, 30, 40], 0.91, 0),  # 9 of 100: not even the first
        ([10, 20, 30, 40], 0.7, 2),  # 30: the first two
        ([10, 20, 30, 40], 0.5, 2),  # 50: the third would make 60
        ([10, 20, 30, 40], 0.0, 4),  # "auto" found room for everything
        ([50, 1, 1], 0.6, 0),  # a prefix: a large first item keeps the rest off the device
        ([], 0.5, 0),
    ],
)
def test_kept_prefix(sizes: list[int], fraction: float, kept: int) -> None:
    assert kept_prefix(sizes, fraction) == kept


def test_auto_fraction_from_free_memory() -> None:
    # 1e6 owned elements at 12 B: half of 6e6 free bytes holds 250,000 of them.
    assert auto_fraction(6_000_000, 1_000_000, 12.0) == pytest.approx(0.75)
    assert AUTO_SHARE == 0.5
    assert auto_fraction(10**12, 1_000_000, 12.0) == 0.0  # everything fits: nothing offloaded
    assert auto_fraction(0, 1_000_000, 12.0) == 1.0  # no free memory: all of it
    assert auto_fraction(10**9, 0, 12.0) == 1.0  # nothing to keep


def test_resolve_fraction() -> None:
    cpu = torch.device("cpu")
    assert resolve_fraction(0.25, cpu, 1000, 12.0) == 0.25
    assert resolve_fraction(1, cpu, 1000, 12.0) == 1.0
    # On a CPU-only machine the "device" is host memory: "auto" offloads all of it.
    assert resolve_fraction("auto", cpu, 1000, 12.0) == 1.0
