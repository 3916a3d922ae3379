"""The embedded corpus and the rank-split-invariant batch sampler."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from zerodp.apps.data import (
    BatchSampler,
    corpus_files,
    decode,
    encode,
    load_corpus,
    train_val_split,
)

SMALL = 256 * 1024  # bytes: enough for every property, fast to read


def test_corpus_is_deterministic_nonempty_bytes() -> None:
    data = load_corpus(max_bytes=SMALL)
    assert data.dim() == 1 and data.dtype == torch.uint8
    assert len(data) == SMALL
    assert torch.equal(data, load_corpus(max_bytes=SMALL))
    # A smaller cap is a prefix of a larger one.
    assert torch.equal(load_corpus(max_bytes=1000), data[:1000])
    text = decode(data[:4096])
    assert "def " in text or "import " in text


def test_load_corpus_returns_independent_tensors() -> None:
    a = load_corpus(max_bytes=64)
    a.zero_()
    assert load_corpus(max_bytes=64).any()


def test_corpus_files_sorted_and_skip_tests(tmp_path: Path) -> None:
    for rel in ["b.py", "a/z.py", "a/test/t.py", "tests/u.py", "site-packages/x/y.py", "c.txt"]:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rel.encode() + b"\n")
    rels = [p.relative_to(tmp_path).as_posix() for p in corpus_files(tmp_path)]
    assert rels == ["a/z.py", "b.py"]
    assert decode(load_corpus(max_bytes=100, stdlib_dir=tmp_path)) == "a/z.py\nb.py\n"
    assert decode(load_corpus(max_bytes=3, stdlib_dir=tmp_path)) == "a/z"


def test_real_stdlib_files_exclude_tests() -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = corpus_files()
    assert files and all(p.suffix == ".py" for p in files)
    rel_parts = [set(p.relative_to(root).parts) for p in files]
    assert not any({"test", "tests", "site-packages"} & parts for parts in rel_parts)


def test_empty_source_dir_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_corpus(stdlib_dir=tmp_path)


def test_encode_decode_round_trip() -> None:
    text = "héllo, wörld\n"
    tokens = encode(text)
    assert tokens.dtype == torch.int64 and int(tokens.max()) < 256
    assert decode(tokens) == text
    assert decode(b"\xc3") == "\ufffd"  # cut multi-byte char: replaced, not an exception
    with pytest.raises(ValueError):
        decode([300])


def test_train_val_split() -> None:
    data = torch.arange(100, dtype=torch.uint8)
    train, val = train_val_split(data, 0.1)
    assert len(train) == 90 and len(val) == 10
    assert torch.equal(torch.cat([train, val]), data)


def test_batches_are_shifted_int64_windows() -> None:
    data = load_corpus(max_bytes=SMALL)
    x, y = BatchSampler(data, batch_size=3, seq_len=32, seed=0).next()
    assert x.shape == y.shape == (3, 32)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    # Every row is a real window of the corpus.
    haystack = bytes(data.tolist())
    for row_x, row_y in zip(x, y, strict=True):
        window = bytes(row_x.tolist()) + bytes(row_y[-1:].tolist())
        assert window in haystack


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_global_batch_is_independent_of_world_size(world_size: int) -> None:
    data = load_corpus(max_bytes=SMALL)
    per_rank = 2
    reference = BatchSampler(data, per_rank * world_size, seq_len=16, seed=5)
    ranks = [
        BatchSampler(data, per_rank, seq_len=16, seed=5, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    for _ in range(3):
        ref_x, ref_y = reference.next()
        parts = [sampler.next() for sampler in ranks]
        assert torch.equal(torch.cat([x for x, _ in parts]), ref_x)
        assert torch.equal(torch.cat([y for _, y in parts]), ref_y)


def test_steps_and_seeds_differ() -> None:
    data = load_corpus(max_bytes=SMALL)
    sampler = BatchSampler(data, 4, 16, seed=0)
    first, second = sampler.next()[0], sampler.next()[0]
    assert not torch.equal(first, second)
    assert not torch.equal(first, BatchSampler(data, 4, 16, seed=1).next()[0])


def test_sampler_state_round_trip() -> None:
    data = load_corpus(max_bytes=SMALL)
    sampler = BatchSampler(data, 2, 16, seed=3)
    for _ in range(5):
        sampler.next()
    state = sampler.state_dict()
    expected = [sampler.next() for _ in range(3)]
    resumed = BatchSampler(data, 2, 16, seed=999)
    resumed.load_state_dict(state)
    for (ex, ey), (rx, ry) in zip(expected, [next(resumed) for _ in range(3)], strict=True):
        assert torch.equal(ex, rx) and torch.equal(ey, ry)
    assert resumed.state_dict() == {"step": 8, "seed": 3}


def test_sampler_validation() -> None:
    data = torch.zeros(10, dtype=torch.uint8)
    with pytest.raises(ValueError):
        BatchSampler(data, 1, 10, seed=0)
    with pytest.raises(ValueError):
        BatchSampler(data, 1, 4, seed=0, rank=2, world_size=2)
