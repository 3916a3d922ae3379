"""``bound_host_allocator`` ([Note: host allocator] in zerodp/offload/host_memory.py)."""

from __future__ import annotations

import pytest

from zerodp.offload import host_memory


class FakeLibc:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


def test_sets_a_fixed_1_mib_mmap_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeLibc()
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setattr(host_memory, "_libc", lambda: fake)
    assert host_memory.bound_host_allocator() is True
    assert fake.calls == [(-3, 1 << 20)]


def test_a_threshold_the_user_chose_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeLibc()
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    monkeypatch.setattr(host_memory, "_libc", lambda: fake)
    assert host_memory.bound_host_allocator() is False
    assert fake.calls == []


def test_without_glibc_nothing_happens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setattr(host_memory, "_libc", lambda: None)
    assert host_memory.bound_host_allocator() is False


def test_this_machine_has_glibc_mallopt() -> None:
    """The CI machines run Linux with glibc: the real call is made there."""
    assert host_memory._libc() is not None
