"""The embedded default corpus and a deterministic, rank-aware batch sampler.

The corpus is the Python standard library's own ``*.py`` source, read as bytes: it ships with
every Python installation, so ``zerodp train`` and the tests need no download, and it is the same
on every machine with the same Python version. Tokens are bytes (vocabulary 256).

:class:`BatchSampler` draws the *global* batch of step ``t`` from a generator seeded by
``(seed, t)`` alone, and each rank takes its slice of rows. The global batch therefore does not
depend on how it is split across ranks, which is what lets sharded training be checked against a
single-process reference fed the concatenated batch.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

VOCAB_SIZE = 256
"""Byte-level tokens."""

DEFAULT_MAX_BYTES = 8 * 2**20
"""Default cap on the corpus size (8 MiB; the 3.11 stdlib has ~12 MB of non-test source)."""

# Directory names never descended into: test suites are packaged separately (or not at all) by
# some distributions, and third-party packages differ per machine; both would break determinism.
_SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages"})


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(stdlib_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """The ``*.py`` files making up the corpus, sorted by their path relative to ``stdlib_dir``.

    ``stdlib_dir`` defaults to this interpreter's standard library. Directories named ``test``,
    ``tests``, ``idle_test``, ``site-packages`` or ``dist-packages`` are skipped, and symlinked
    directories are not followed.
    """
    root = Path(stdlib_dir) if stdlib_dir is not None else _stdlib_dir()
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath, name)
                found.append((path.relative_to(root).as_posix(), path))
    # Sort on the relative POSIX path so the order is independent of the install prefix, the
    # OS path separator and os.walk's directory-listing order.
    found.sort(key=lambda item: item[0])
    return [path for _, path in found]


@functools.lru_cache(maxsize=4)
def _read_corpus(root: str, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    remaining = max_bytes
    for path in corpus_files(root):
        if remaining <= 0:
            break
        chunk = path.read_bytes()[:remaining]
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def load_corpus(
    max_bytes: int = DEFAULT_MAX_BYTES, stdlib_dir: str | os.PathLike[str] | None = None
) -> torch.Tensor:
    """The corpus as a 1-D ``uint8`` tensor of at most ``max_bytes`` byte tokens.

    Files from :func:`corpus_files` are concatenated in order and the result truncated to
    ``max_bytes``. The bytes are cached per process; each call returns a fresh tensor.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    root = Path(stdlib_dir) if stdlib_dir is not None else _stdlib_dir()
    data = _read_corpus(str(root), max_bytes)
    if not data:
        raise FileNotFoundError(
            f"no Python source found under {root}: the default corpus needs the standard "
            "library's .py files (some minimal/frozen Python builds omit them)"
        )
    # bytearray: a writable buffer, so frombuffer neither warns nor aliases the cached bytes.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def train_val_split(
    data: torch.Tensor, val_fraction: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a 1-D token tensor into (train, validation): the last ``val_fraction`` is validation.

    A contiguous tail rather than random positions, so no training window overlaps a validation
    window (except across the single boundary).
    """
    if data.dim() != 1:
        raise ValueError(f"expected a 1-D token tensor, got shape {tuple(data.shape)}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_val = int(len(data) * val_fraction)
    if n_val == 0 or n_val == len(data):
        raise ValueError(f"{len(data)} tokens are too few to split with {val_fraction=}")
    split = len(data) - n_val
    return data[:split], data[split:]


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a 1-D ``int64`` token tensor (model input dtype)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def decode(tokens: torch.Tensor | bytes | Sequence[int]) -> str:
    """Byte tokens back to text; invalid UTF-8 (e.g. a cut multi-byte char) becomes U+FFFD."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.flatten().tolist()
    try:
        raw = bytes(tokens)
    except ValueError as exc:  # a value outside 0..255 is not a byte token
        raise ValueError(f"decode expects byte tokens in [0, 255]: {exc}") from None
    return raw.decode("utf-8", errors="replace")


def _step_seed(seed: int, step: int) -> int:
    """A well-mixed 63-bit seed from ``(seed, step)``, identical on every machine and process.

    Hashing (rather than e.g. ``seed + step``) keeps streams of nearby seeds unrelated.
    """
    digest = hashlib.blake2b(f"zerodp:{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class BatchSampler:
    """Deterministic random windows of a 1-D token tensor, split across data-parallel ranks.

    At step ``t`` a global batch of ``world_size * batch_size`` windows is drawn with a
    ``torch.Generator`` seeded from ``(seed, t)`` only; rank ``r`` returns rows
    ``[r * batch_size, (r + 1) * batch_size)``. Hence the concatenation over ranks equals the
    batch of a single-process sampler with ``batch_size * world_size`` rows, for any split.

    ``next()`` (or iteration) returns ``(x, y)``: ``int64`` tensors ``[batch_size, seq_len]`` with
    ``y`` the next-token targets of ``x``.
    """

    def __init__(
        self,
        data: torch.Tensor,
        batch_size: int,
        seq_len: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if data.dim() != 1:
            raise ValueError(f"expected a 1-D token tensor, got shape {tuple(data.shape)}")
        if batch_size <= 0 or seq_len <= 0:
            raise ValueError(f"batch_size and seq_len must be positive: {batch_size}, {seq_len}")
        if len(data) <= seq_len:
            raise ValueError(f"{len(data)} tokens are too few for windows of {seq_len} + 1")
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank} of {world_size}")
        self.data = data
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.step = 0
        # Offsets of one window (input plus the one extra target token), reused every step.
        self._window = torch.arange(seq_len + 1)

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(x, y)`` for ``step``, without touching the step counter."""
        generator = torch.Generator().manual_seed(_step_seed(self.seed, step))
        global_rows = self.world_size * self.batch_size
        # randint's high is exclusive: the last start leaves room for seq_len + 1 tokens.
        starts = torch.randint(
            0, len(self.data) - self.seq_len, (global_rows,), generator=generator
        )
        mine = starts[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        windows = self.data[mine[:, None] + self._window].to(torch.int64)
        # Contiguous copies: collectives and some kernels reject strided views.
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's batch for the current step; then advance the step."""
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next()

    def state_dict(self) -> dict[str, Any]:
        """What is needed to resume the exact stream: the step counter and the seed."""
        return {"step": self.step, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`. The world size may differ from the saving run's: the
        global batches continue unchanged as long as ``world_size * batch_size`` is the same."""
        step, seed = int(state["step"]), int(state["seed"])
        if step < 0:
            raise ValueError(f"invalid sampler step {step}")
        self.step, self.seed = step, seed
