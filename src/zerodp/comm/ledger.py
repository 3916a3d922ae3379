"""The communication ledger: what every collective moved, per kind and per optimizer step.

Counting convention (the paper's): a reduce-scatter counts its *input* elements, an all-gather its
*output* elements, an all-reduce its elements once under ``all_reduce`` and twice in ``volume``
(a ring all-reduce is a reduce-scatter plus an all-gather). Small agreement collectives (flags,
norms, the used-parameter bitmap) are ``control`` traffic and kept apart, so the model-data
counts can be asserted exactly against Ψ.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

MODEL = "model"
CONTROL = "control"


@dataclass(frozen=True, slots=True)
class CommStats:
    """Totals over one window (normally one optimizer step)."""

    elements: dict[str, int]  # model-data elements by collective kind
    bytes: dict[str, int]  # model-data bytes by collective kind
    calls: dict[str, int]  # model-data collective calls by kind
    control_elements: int
    control_calls: int

    @property
    def volume(self) -> int:
        """Model-data elements in the paper's units: all-reduce counts twice."""
        return sum(n * (2 if kind == "all_reduce" else 1) for kind, n in self.elements.items())

    def to_dict(self) -> dict[str, object]:
        return {
            "elements": dict(self.elements),
            "bytes": dict(self.bytes),
            "calls": dict(self.calls),
            "volume_elements": self.volume,
            "control_elements": self.control_elements,
            "control_calls": self.control_calls,
        }


@dataclass
class CommLedger:
    """Accumulates collective traffic; ``end_step`` closes a window and starts the next."""

    _elements: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    _bytes: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    _calls: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    _control_elements: int = 0
    _control_calls: int = 0
    steps: list[CommStats] = field(default_factory=list)

    def record(self, kind: str, numel: int, element_size: int, category: str = MODEL) -> None:
        if category == CONTROL:
            self._control_elements += numel
            self._control_calls += 1
            return
        self._elements[kind] += numel
        self._bytes[kind] += numel * element_size
        self._calls[kind] += 1

    def current(self) -> CommStats:
        """Traffic since the last ``end_step``."""
        return CommStats(
            dict(self._elements),
            dict(self._bytes),
            dict(self._calls),
            self._control_elements,
            self._control_calls,
        )

    def end_step(self) -> CommStats:
        stats = self.current()
        self.steps.append(stats)
        del self.steps[:-100]  # bounded history: a long run must not grow memory
        self._elements.clear()
        self._bytes.clear()
        self._calls.clear()
        self._control_elements = 0
        self._control_calls = 0
        return stats

    @property
    def last_step(self) -> CommStats | None:
        return self.steps[-1] if self.steps else None
