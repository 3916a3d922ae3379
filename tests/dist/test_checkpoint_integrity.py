"""Checkpoint checksums on real ranks ([Note: checkpoint checksums] in checkpoint/integrity.py).

Two checkpoints are saved (steps K and 2K) of two models: ``Net`` from test_checkpoint.py at
stage 2 (two param groups, a frozen layer and buffers, so ``common.safetensors`` holds data;
dropout, so the RNG matters) and a tiny Hugging Face GPT-2 at stage 3. Then each case damages a
copy of the step-2K checkpoint and, in one world: loading it raises a ``CheckpointError`` on
every rank that names the file, with the model, optimizer and RNG exactly as before; then the
intact step-K checkpoint in the same root loads into that same model and training resumes
bitwise as in the run that never failed. Consolidation refuses the same damaged checkpoints.
A checkpoint without a checksum file (as saved before this change) loads with a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import WorldPool
from hf_models import build as build_hf
from hf_models import global_batches, hf_loss
from test_checkpoint import K, assert_same, build, rank_world, release, snapshot, train
from torch import nn

import zerodp
from zerodp.checkpoint import (
    CheckpointError,
    UnverifiedCheckpointWarning,
    consolidate_checkpoint,
    load_checkpoint,
    save_checkpoint,
)

World = Callable[[int], WorldPool]
KINDS = ("net", "gpt2")
STEP_K, STEP_2K = f"step-{K:08d}", f"step-{2 * K:08d}"


def _make(kind: str, seed: int) -> tuple[nn.Module, Any]:
    if kind == "net":
        return build(2, seed=seed, dropout=0.1)
    model = build_hf("gpt2", seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    units = zerodp.Stage3(unit_classes=("GPT2Block",))
    config = zerodp.ZeroConfig(stage=3, bucket_bytes=4096, stage3=units)
    return zerodp.initialize(model, opt, config)


def _train(kind: str, model: nn.Module, opt: Any, start: int, stop: int) -> list[float]:
    rank, world = rank_world()
    if kind == "net":
        return train(model, opt, start, stop, rank, world)
    losses = []
    for step in range(start, stop):
        loss = hf_loss(global_batches("gpt2", step, world))(model, rank)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _save_two(tmp: str) -> None:
    """Per kind: train K steps, save, train K more (the run that never fails: its losses and
    final state are the reference), save again."""
    rank, _ = rank_world()
    for kind in KINDS:
        root = os.path.join(tmp, kind)
        model, opt = _make(kind, seed=0)
        torch.manual_seed(100 + rank)  # per-rank dropout streams
        _train(kind, model, opt, 0, K)
        save_checkpoint(root, model, opt)
        losses = _train(kind, model, opt, K, 2 * K)
        ref = {"losses": losses, "final": snapshot(model, opt)}
        torch.save(ref, os.path.join(tmp, f"{kind}-ref{rank}.pt"))
        save_checkpoint(root, model, opt)
        release(model)


def _damaged_loads(tmp: str, cases: list[tuple[str, str]]) -> tuple[dict[str, str], list[str]]:
    """Each case: the damaged checkpoint is refused with nothing changed; then the earlier one
    resumes exactly. Returns the error messages and the warnings of the old-format case."""
    rank, _ = rank_world()
    messages, warned = {}, []
    for label, kind in cases:
        ref = torch.load(os.path.join(tmp, f"{kind}-ref{rank}.pt"), weights_only=False)
        root = os.path.join(tmp, label)
        model, opt = _make(kind, seed=5)
        _train(kind, model, opt, 0, 1)
        before, rng_before = snapshot(model, opt), torch.get_rng_state()
        if label == "old-format":
            with warnings.catch_warnings():  # the documented way to refuse old checkpoints
                warnings.simplefilter("error", UnverifiedCheckpointWarning)
                with pytest.raises(CheckpointError) as info:
                    load_checkpoint(root, model, opt)
            messages[label] = str(info.value)
            assert_same(snapshot(model, opt), before, f"{label}: state changed")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                load_checkpoint(root, model, opt)
            warned = [str(w.message) for w in caught if w.category is UnverifiedCheckpointWarning]
            assert_same(snapshot(model, opt), ref["final"], f"{label}: loaded state")
        else:
            with pytest.raises(CheckpointError) as info:
                load_checkpoint(root, model, opt)
            messages[label] = str(info.value)
            assert_same(snapshot(model, opt), before, f"{label}: state changed")
            assert_same(torch.get_rng_state(), rng_before, f"{label}: RNG changed")
        # The earlier, intact checkpoint beside it: loads into the same model, resumes bitwise.
        load_checkpoint(os.path.join(root, STEP_K), model, opt)
        losses = _train(kind, model, opt, K, 2 * K)
        assert losses == ref["losses"], f"{label}: losses after resuming {losses} {ref['losses']}"
        assert_same(snapshot(model, opt), ref["final"], f"{label}: state after resuming")
        release(model)
    return messages, warned


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _flip(path: Path, offset: int) -> tuple[str, str]:
    """Flip one byte; return the short SHA-256 before and after."""
    data = bytearray(path.read_bytes())
    before = _sha(bytes(data))
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    return before, _sha(bytes(data))


def _damage(tmp: Path) -> dict[str, tuple[str, str]]:
    """Damaged copies of each root (both checkpoints; the newer one damaged): label -> (kind,
    the expected line of the error, after the rank prefix, without the checkpoint prefix)."""
    change = "does not match its checksum (file changed or truncated after saving"
    out: dict[str, tuple[str, str]] = {}

    def copy(label: str, kind: str) -> Path:
        shutil.copytree(tmp / kind, tmp / label)
        return tmp / label / STEP_2K

    step = copy("manifest-edited", "net")
    text = (step / "manifest.json").read_bytes()
    m = json.loads(text)
    m["optimizer"]["param_groups"][0]["__dict__"]["lr"] = 0.1
    m["step"] = 1000
    edited = json.dumps(m, indent=1).encode()
    (step / "manifest.json").write_bytes(edited)
    what = f"manifest.json {change}: expected sha256 {_sha(text)}..., got {_sha(edited)}...)"
    out["manifest-edited"] = ("net", "every rank: " + what)

    step = copy("manifest-truncated", "net")
    text = (step / "manifest.json").read_bytes()
    (step / "manifest.json").write_bytes(text[: len(text) // 2])
    what = f"{change}: expected sha256 {_sha(text)}..., got {_sha(text[: len(text) // 2])}...)"
    out["manifest-truncated"] = ("net", "every rank: manifest.json " + what)

    step = copy("rank-truncated", "net")
    size = (step / "rank-00001.safetensors").stat().st_size
    os.truncate(step / "rank-00001.safetensors", size - 100)
    what = f"{change}: expected {size} bytes, found {size - 100})"
    out["rank-truncated"] = ("net", "rank 1: rank-00001.safetensors " + what)

    step = copy("common-flipped", "net")
    common = step / "common.safetensors"
    before, after = _flip(common, common.stat().st_size - 3)  # in the tensor data
    what = f"{change}: expected sha256 {before}..., got {after}...)"
    out["common-flipped"] = ("net", "every rank: common.safetensors " + what)

    step = copy("checksums-missing", "net")
    (step / "checksums.sha256").unlink()
    what = "checksums.sha256 is missing, so manifest.json cannot be verified"
    out["checksums-missing"] = ("net", "every rank: " + what)

    step = copy("checksums-disagree", "net")
    sums = (step / "checksums.sha256").read_text().splitlines()
    i = next(i for i, line in enumerate(sums) if line.endswith("rank-00000.safetensors"))
    sums[i] = "0" * 64 + "  rank-00000.safetensors"
    (step / "checksums.sha256").write_text("\n".join(sums) + "\n")
    what = "checksums.sha256 and manifest.json disagree about rank-00000.safetensors"
    out["checksums-disagree"] = ("net", "every rank: " + what)

    step = copy("gpt2-rank-flipped", "gpt2")
    shard = step / "rank-00000.safetensors"
    before, after = _flip(shard, shard.stat().st_size // 2)
    what = f"{change}: expected sha256 {before}..., got {after}...)"
    out["gpt2-rank-flipped"] = ("gpt2", "rank 0: rank-00000.safetensors " + what)
    return out


def _old_format(tmp: Path) -> None:
    """A checkpoint as saved before the checksum file: no file, no ``checksums`` key."""
    shutil.copytree(tmp / "net", tmp / "old-format")
    step = tmp / "old-format" / STEP_2K
    (step / "checksums.sha256").unlink()
    m = json.loads((step / "manifest.json").read_bytes())
    del m["checksums"]
    (step / "manifest.json").write_text(json.dumps(m, indent=1))


def test_damaged_checkpoints_are_refused_everywhere(world: World, tmp_path: Path) -> None:
    world(2).run(_save_two, str(tmp_path), timeout=120)
    for kind in KINDS:
        step = tmp_path / kind / STEP_2K
        names = sorted(p.name for p in step.iterdir())
        assert names == [
            "checksums.sha256",
            "common.safetensors",
            "manifest.json",
            "rank-00000.safetensors",
            "rank-00001.safetensors",
        ], names
        if shutil.which("sha256sum"):  # the checksum file is coreutils' format
            subprocess.run(["sha256sum", "--quiet", "-c", "checksums.sha256"], cwd=step, check=True)

    expected = _damage(tmp_path)
    _old_format(tmp_path)
    cases = [(label, kind) for label, (kind, _) in expected.items()] + [("old-format", "net")]
    results = world(2).run(_damaged_loads, str(tmp_path), cases, timeout=240)
    assert results[0] == results[1], "ranks raised different errors"
    messages, warned = results[0]
    for label, (_, line) in expected.items():
        root = tmp_path / label
        who, what = line.split(": ", 1)
        assert messages[label] == (
            f"cannot load checkpoint {root}; nothing was changed:\n  {who}: checkpoint "
            f"{root / STEP_2K}: {what}; load an earlier checkpoint"
        ), label

    # An old checkpoint: loaded (and verified up to its manifest), with a warning that says so;
    # refused on every rank, with nothing changed, where that warning is made an error.
    warning = (
        f"checkpoint {tmp_path / 'old-format' / STEP_2K} has no checksums.sha256 (saved by a "
        "zerodp that did not checksum manifest.json): its manifest.json is not verified, its "
        "tensor files are; saving it again adds the checksums"
    )
    assert warned == [warning], warned
    assert messages["old-format"] == (
        f"cannot load checkpoint {tmp_path / 'old-format'}; nothing was changed:\n  every rank: "
        f"UnverifiedCheckpointWarning: {warning}"
    )

    # Consolidation refuses the same checkpoints, names the file, and writes nothing.
    out = tmp_path / "out.safetensors"
    for label, (_, line) in expected.items():
        path = tmp_path / label / STEP_2K
        with pytest.raises(CheckpointError) as info:
            consolidate_checkpoint(tmp_path / label, out)
        what = line.split(": ", 1)[1]
        assert str(info.value) == (
            f"cannot consolidate {path}:\n  checkpoint {path}: {what}; consolidate an earlier "
            "checkpoint"
        ), label
        assert not out.exists()
    consolidate_checkpoint(tmp_path / "manifest-edited" / STEP_K, out)  # the earlier one
    with pytest.warns(UnverifiedCheckpointWarning, match="has no checksums.sha256"):
        consolidate_checkpoint(tmp_path / "old-format", out)
