"""Checkpoint pieces that need no process group: manifest JSON, range math, manifest checks,
the streaming safetensors writer, checksums, and the checkpoint root's directory handling."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from zerodp import ZeroConfig
from zerodp.checkpoint import directory as fs
from zerodp.checkpoint.checks import check_manifest, compare_structure
from zerodp.checkpoint.integrity import (
    CHECKSUMS,
    check_file,
    format_checksums,
    parse_checksums,
    read_verified_manifest,
    write_checksums,
)
from zerodp.checkpoint.manifest import (
    COMMON_FILE,
    BufferRecord,
    CheckpointError,
    Manifest,
    ParamRecord,
    RankRecord,
    SavedPiece,
    StateEntry,
    decode,
    encode,
    plan_reads,
    read_manifest,
    sources_by_name,
    split_range,
)
from zerodp.checkpoint.tensorfile import ShardReader, TensorFileWriter, TensorSpec
from zerodp.partition.layout import Range


def adam_state(step: float = 3.0) -> dict[str, StateEntry]:
    return {
        "step": StateEntry("scalar", "float32", step),
        "exp_avg": StateEntry("elem", "float32"),
        "exp_avg_sq": StateEntry("elem", "float32"),
    }


def piece(name: str, a: int, b: int, step: float = 3.0) -> SavedPiece:
    return SavedPiece(name, Range(a, b), 0, "float32", adam_state(step))


def manifest(ranks: list[list[SavedPiece]]) -> Manifest:
    """Parameter ``w`` (2x5, sharded) and ``frozen`` (3, replicated), a buffer ``b``."""
    return Manifest(
        step=3,
        world_size=len(ranks),
        stage=1,
        precision="fp32",
        config={"stage": 1},
        optimizer={"class": "AdamW", "param_groups": [encode({"lr": 0.1, "betas": (0.9, 0.99)})]},
        scaler=None,
        params=(
            ParamRecord("w", (2, 5), "float32", "float32", True, True),
            ParamRecord("frozen", (3,), "float32", "float32", False, False),
        ),
        buffers=(BufferRecord("b", (), "int64"),),
        state_dict=(("w", "param", "w"), ("alias", "param", "w"), ("b", "buffer", "b")),
        ranks=tuple(
            RankRecord(r, f"rank-{r:05d}.safetensors", tuple(pcs), {}, None)
            for r, pcs in enumerate(ranks)
        ),
        files={f"rank-{r:05d}.safetensors": {"size": 1, "sha256": "x"} for r in range(len(ranks))},
    )


# --- manifest and range math -------------------------------------------------------------------


def test_manifest_json_round_trip(tmp_path: Path) -> None:
    m = manifest([[piece("w", 0, 4)], [piece("w", 4, 10)]])
    (tmp_path / "manifest.json").write_text(m.to_json())
    back = read_manifest(tmp_path)
    assert back == m
    assert decode(back.optimizer["param_groups"][0]) == {"lr": 0.1, "betas": (0.9, 0.99)}


def test_manifest_of_0_1_reads_its_flat_config_as_nested(tmp_path: Path) -> None:
    """zerodp 0.1 saved a flat ``ZeroConfig.to_dict()``; it reads as the nested form, with no
    DeprecationWarning (nobody can act on it), and stays unvalidated (a record of the run)."""
    flat = {"stage": 1, "precision": "bf16", "reduce_dtype": "fp32", "prefetch_depth": 1}
    m = dataclasses.replace(manifest([[piece("w", 0, 10)]]), config=flat)
    (tmp_path / "manifest.json").write_text(m.to_json())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = read_manifest(tmp_path)
    assert back.config == {
        "stage": 1,
        "precision": {"compute": "bf16", "reduce": "fp32"},
        "stage3": {"prefetch_depth": 1},
    }
    assert ZeroConfig.from_dict(back.config) == ZeroConfig(stage=1, precision="bf16")
    nested = dataclasses.replace(m, config=ZeroConfig(stage=3).to_dict())
    assert Manifest.from_json(nested.to_json()).config == json.loads(json.dumps(nested.config))


def test_read_manifest_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist: not a \\(complete\\) checkpoint"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format": "other"}')
    with pytest.raises(CheckpointError, match="not a zerodp checkpoint manifest"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format": "zerodp.checkpoint.v1"}')
    with pytest.raises(CheckpointError, match="is malformed \\(KeyError"):
        read_manifest(tmp_path)


@pytest.mark.parametrize("numel", [0, 1, 7, 10])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_split_range_tiles(numel: int, parts: int) -> None:
    r = Range(5, 5 + numel)
    chunks = [split_range(r, parts, i) for i in range(parts)]
    present = [c for c in chunks if c is not None]
    assert sum(c.numel for c in present) == numel
    assert all(a.stop == b.start for a, b in itertools.pairwise(present))
    assert (
        max((c.numel for c in present), default=0) - min((c.numel for c in present), default=0) <= 1
    )


def test_plan_reads_intersects_saved_ranges() -> None:
    m = manifest([[piece("w", 0, 4)], [piece("w", 4, 7)], [piece("w", 7, 10)]])
    sources = sources_by_name(m)
    reads = plan_reads(sources["w"], Range(3, 8))
    assert [(s.file, s.key, i) for s, i in reads] == [
        ("rank-00000.safetensors", "param/w/0-4", Range(3, 4)),
        ("rank-00001.safetensors", "param/w/4-7", Range(4, 7)),
        ("rank-00002.safetensors", "param/w/7-10", Range(7, 8)),
    ]
    (frozen,) = sources["frozen"]
    assert (frozen.file, frozen.key, frozen.range, frozen.piece) == (
        COMMON_FILE,
        "model/frozen",
        Range(0, 3),
        None,
    )


def test_check_manifest_finds_gaps_overlaps_and_inconsistent_steps() -> None:
    assert check_manifest(manifest([[piece("w", 0, 4)], [piece("w", 4, 10)]])) == []
    assert check_manifest(manifest([[piece("w", 0, 4)], [piece("w", 5, 10)]])) == [
        "saved ranges of 'w' have a gap at element 4"
    ]
    assert check_manifest(manifest([[piece("w", 0, 6)], [piece("w", 4, 10)]])) == [
        "saved ranges of 'w' have a overlap at element 4"
    ]
    assert check_manifest(manifest([[piece("w", 0, 4)]])) == [
        "saved ranges of 'w' cover 4 of its 10 elements"
    ]
    (problem,) = check_manifest(manifest([[piece("w", 0, 4)], [piece("w", 4, 10, step=2.0)]]))
    assert problem.startswith("pieces of 'w' disagree on optimizer state 'step'")


def test_compare_structure_names_every_difference() -> None:
    m = manifest([[piece("w", 0, 10)]])
    assert compare_structure(m, [("w", (2, 5)), ("frozen", (3,))], [("b", ())]) == []
    assert compare_structure(m, [("w", (5, 2)), ("new", (1,))], [("b", ())]) == [
        "parameters in the checkpoint but not in the model: 'frozen'",
        "parameters in the model but not in the checkpoint: 'new'",
        "parameter 'w' has shape (5, 2) in the model but (2, 5) in the checkpoint",
    ]


def test_encode_decode() -> None:
    value = {"betas": (0.9, 0.999), "lr": torch.tensor(0.5), "nested": [1, None, "x"]}
    back = decode(encode(value))
    assert back["betas"] == (0.9, 0.999)
    assert torch.equal(back["lr"], torch.tensor(0.5))
    assert back["nested"] == [1, None, "x"]
    with pytest.raises(TypeError, match="group 0\\['f'\\] of type object cannot be stored"):
        encode({"f": object()}, "group 0")


# --- the streaming safetensors writer and the reader ------------------------------------------


def test_writer_is_read_by_safetensors(tmp_path: Path) -> None:
    tensors = {
        "f32": torch.randn(3, 4),
        "bf16": torch.randn(5).to(torch.bfloat16),
        "i64": torch.tensor(7),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 3),
        "view": torch.arange(20.0)[5:12],  # a view into shared storage: written as itself
    }
    specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    path = tmp_path / "x.safetensors"
    with TensorFileWriter(path, specs, {"format": "pt"}) as w:
        for k, t in tensors.items():
            w.write(k, t)
        info = w.close()
    assert info.size == path.stat().st_size
    assert info.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    loaded = load_file(path)
    for k, t in tensors.items():
        assert loaded[k].dtype == t.dtype and torch.equal(loaded[k], t), k
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
    with ShardReader(tmp_path) as reader:
        assert torch.equal(reader.slice("x.safetensors", "view", 2, 5), torch.tensor([7.0, 8, 9]))


def test_writer_rejects_out_of_order_and_incomplete(tmp_path: Path) -> None:
    specs = [TensorSpec("a", torch.float32, (2,)), TensorSpec("b", torch.float32, (2,))]
    w = TensorFileWriter(tmp_path / "x", specs)
    with pytest.raises(RuntimeError, match="written out of order"):
        w.write("b", torch.zeros(2))
    with pytest.raises(RuntimeError, match="its header entry says"):
        w.write("a", torch.zeros(3))
    w.write("a", torch.zeros(2))
    with pytest.raises(RuntimeError, match="closed before these tensors were written: \\['b'\\]"):
        w.close()


def test_check_file_messages(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"0123456789")
    record = {"size": 10, "sha256": hashlib.sha256(b"0123456789").hexdigest()}
    where = f"checkpoint {tmp_path}:"
    change = "does not match its checksum (file changed or truncated after saving"
    assert check_file(tmp_path, "f", record) == ""
    assert check_file(tmp_path, "g", record) == f"{where} g is missing; load an earlier checkpoint"
    os.truncate(path, 8)
    assert check_file(tmp_path, "f", record, "consolidate") == (
        f"{where} f {change}: expected 10 bytes, found 8); consolidate an earlier checkpoint"
    )
    path.write_bytes(b"0123456780")
    assert check_file(tmp_path, "f", record) == (
        f"{where} f {change}: expected sha256 {record['sha256'][:16]}..., got "
        f"{hashlib.sha256(b'0123456780').hexdigest()[:16]}...); load an earlier checkpoint"
    )


def test_checksum_file_and_verified_manifest(tmp_path: Path) -> None:
    """The pieces of [Note: checkpoint checksums] the multi-rank tests do not reach: the
    ``sha256sum`` format and a malformed or incomplete checksum file."""
    m = dataclasses.replace(manifest([[piece("w", 0, 10)]]), checksums=CHECKSUMS)
    data = m.to_json().encode()
    (tmp_path / "manifest.json").write_bytes(data)
    digests = {"manifest.json": hashlib.sha256(data).hexdigest()}
    digests["rank-00000.safetensors"] = "x"  # as manifest() records it
    with pytest.raises(ValueError, match=r"^line 2 is not"):  # "x" is no SHA-256
        parse_checksums(format_checksums(digests))
    digests["rank-00000.safetensors"] = "a" * 64
    text = format_checksums(digests)
    lines = [f"{digests['manifest.json']}  manifest.json", f"{'a' * 64}  rank-00000.safetensors"]
    assert text == "".join(line + "\n" for line in lines).encode()
    assert parse_checksums(text) == digests
    assert parse_checksums(text.replace(b"  rank", b" *rank")) == digests  # binary-mode marker
    with pytest.raises(ValueError) as bad:
        parse_checksums(text + text)
    assert str(bad.value) == "line 3 is not '<sha256>  <file name>' or repeats a name"

    where, advice = f"checkpoint {tmp_path}:", "; load an earlier checkpoint"
    (tmp_path / CHECKSUMS).write_bytes(text)  # the manifest's "x" disagrees with "aaa..."
    with pytest.raises(CheckpointError) as info:
        read_verified_manifest(tmp_path)
    assert str(info.value) == (
        f"{where} checksums.sha256 and manifest.json disagree about rank-00000.safetensors{advice}"
    )
    (tmp_path / CHECKSUMS).write_bytes(text.splitlines(keepends=True)[1])
    with pytest.raises(CheckpointError) as info:
        read_verified_manifest(tmp_path)
    assert str(info.value) == f"{where} checksums.sha256 has no line for manifest.json{advice}"
    (tmp_path / CHECKSUMS).write_bytes(b"\xff\n")
    with pytest.raises(CheckpointError) as info:
        read_verified_manifest(tmp_path)
    assert str(info.value).startswith(f"{where} checksums.sha256 is malformed (")
    digests["rank-00000.safetensors"] = "x"
    write_checksums(tmp_path, digests)  # the writer does not check: the saver's digests are hex
    with pytest.raises(CheckpointError) as info:
        read_verified_manifest(tmp_path, "consolidate")
    assert str(info.value) == (
        f"{where} checksums.sha256 is malformed (line 2 is not '<sha256>  <file name>' or "
        "repeats a name); consolidate an earlier checkpoint"
    )
    files = {"rank-00000.safetensors": "b" * 64}
    m = dataclasses.replace(m, files={f: {"size": 1, "sha256": d} for f, d in files.items()})
    data = m.to_json().encode()
    (tmp_path / "manifest.json").write_bytes(data)
    write_checksums(tmp_path, {"manifest.json": hashlib.sha256(data).hexdigest()} | files)
    assert read_verified_manifest(tmp_path) == m
    assert read_manifest(tmp_path) == m  # the "checksums" key round-trips


# --- the checkpoint root -----------------------------------------------------------------------


def _fake_checkpoint(root: Path, step: int) -> Path:
    tmp = fs.make_tmp_dir(root, fs.step_dir_name(step))
    (tmp / "manifest.json").write_text("{}")
    final = root / fs.step_dir_name(step)
    fs.publish(tmp, final)
    fs.write_latest(root, final.name)
    return final


def test_publish_latest_prune_and_resolve(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        fs.resolve(root)
    for step in (1, 2, 3):
        _fake_checkpoint(root, step)
    assert fs.resolve(root) == root / "step-00000003"
    assert fs.resolve(root / "step-00000001") == root / "step-00000001"
    (root / "latest").unlink()  # crash between publishing and updating latest: newest wins
    assert fs.resolve(root) == root / "step-00000003"
    fs.write_latest(root, "step-00000002")
    removed = fs.prune(root, 1, "step-00000002")
    assert sorted(p.name for p in removed) == ["step-00000001"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000002", "step-00000003"]
    _fake_checkpoint(root, 3)  # re-saving a step replaces it
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000002", "step-00000003"]


def test_crashed_save_leaves_only_hidden_debris(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _fake_checkpoint(root, 1)
    debris = fs.make_tmp_dir(root, fs.step_dir_name(2))  # a save that never finished
    (debris / "rank-00000.safetensors").write_bytes(b"partial")
    assert fs.resolve(root) == root / "step-00000001"
    assert [d.name for _, d in fs.step_dirs(root)] == ["step-00000001"]
    fs.remove_stale(root)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000001"]
