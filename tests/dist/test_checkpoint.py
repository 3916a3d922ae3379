"""Sharded checkpoints on real ranks: round trip, exact resume, resharding, consolidation,
crash safety and bad checkpoints (src/zerodp/checkpoint, docs/checkpoints.md)."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from config_0_1 import saved_by_0_1
from harness import RankFailure, WorldPool, run_world
from safetensors.torch import load_file
from torch import nn

import zerodp
from zerodp import Stage3
from zerodp.apps.models.gpt import GPT, get_config
from zerodp.checkpoint import (
    CheckpointError,
    consolidate_checkpoint,
    faults,
    load_checkpoint,
    load_model_state_dict,
    read_manifest,
    save_checkpoint,
)
from zerodp.checkpoint.integrity import CHECKSUMS, parse_checksums, sha256_file, write_checksums

World = Callable[[int], WorldPool]
VOCAB, DIM, SEQ, GLOBAL_BATCH = 16, 8, 5, 12  # 12 rows split evenly over 1, 2, 3 or 4 ranks
K = 3  # steps before and after the checkpoint


class Net(nn.Module):
    """Small, but with everything a checkpoint must carry: two optimizer groups, a tied weight
    (two state_dict names), a frozen layer, a trainable parameter the optimizer does not hold,
    dropout (RNG) and buffers (one int64 scalar)."""

    def __init__(self, hidden: int = 24, dropout: float = 0.0, bonus: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.l1 = nn.Linear(DIM, hidden)
        self.l2 = nn.Linear(hidden, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.gate = nn.Parameter(torch.rand(DIM) + 0.5)  # trainable, never given to the optimizer
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.drop = nn.Dropout(dropout)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("ema", torch.zeros(DIM))
        if bonus:
            self.bonus = nn.Parameter(torch.zeros(2))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        if self.training:
            with torch.no_grad():
                self.calls += 1
                self.ema.mul_(0.9).add_(x.mean((0, 1)), alpha=0.1)
        h = self.drop(torch.relu(self.l1(x)))
        x = self.norm(x + self.l2(h)) + self.frozen(x) * self.gate
        return self.head(x)


def make_optimizer(model: Net) -> torch.optim.Optimizer:
    decay = [model.emb.weight, model.l1.weight, model.l2.weight]
    plain = [model.l1.bias, model.l2.bias, model.norm.weight, model.norm.bias]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-2)


def build_config(stage: int, precision: str = "fp32") -> zerodp.ZeroConfig:
    # Many buckets, so pieces cut parameters. Stage 3: every layer is a unit; the tied
    # embedding / head weight then lives in the root unit, `gate` (never optimized) stays
    # persistent and `frozen` replicated.
    units = ("Linear", "Embedding", "LayerNorm") if stage == 3 else ()
    return zerodp.ZeroConfig(
        stage=stage, bucket_bytes=256, precision=precision, stage3=Stage3(unit_classes=units)
    )


def build(stage: int, seed: int, precision: str = "fp32", **net: Any) -> tuple[nn.Module, Any]:
    torch.manual_seed(seed)
    model = Net(**net)
    return zerodp.initialize(model, make_optimizer(model), build_config(stage, precision))


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s share of the global batch of ``step`` (the same data at any world size)."""
    g = torch.Generator().manual_seed(1000 + step)
    rows = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    per = GLOBAL_BATCH // world
    part = rows[rank * per : (rank + 1) * per]
    return part[:, :-1], part[:, 1:]


def train(model: nn.Module, opt: Any, start: int, stop: int, rank: int, world: int) -> list[float]:
    losses = []
    for step in range(start, stop):
        if step == 1:  # a hyperparameter change (before the save) the checkpoint must carry
            opt.param_groups[0]["lr"] = 5e-3
        x, y = batch(step, rank, world)
        loss = F.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))
        if isinstance(opt, zerodp.ZeroOptimizer):
            opt.backward(loss)  # = loss.backward() except under fp16 (loss scaling)
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def rank_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def snapshot(model: nn.Module, opt: Any) -> dict[str, Any]:
    engine = opt.engine
    state = {}
    for op in engine.pieces:
        st = engine.optimizer.state.get(op.tensor, {})
        key = (op.name, op.piece.param_range.start, op.piece.param_range.stop)
        state[key] = {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
    params = {id(p) for p in model.parameters()}
    # Buffers are replicated with rank 0's authoritative (broadcast before each forward): other
    # ranks' local copies are not saved. state_dict() on every rank: stage 3 gathers.
    mine = {k for k, v in model.state_dict(keep_vars=True).items() if id(v) in params}
    full = model.state_dict()
    sd = full if dist.get_rank() == 0 else {k: v for k, v in full.items() if k in mine}
    return {
        "model": {k: v.detach().clone() for k, v in sd.items()},
        "state": state,
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "steps": engine.steps,
        "loss_scale": opt.loss_scale,
        "skipped": opt.skipped_steps,
        # The optimizer's fp32 masters (mixed precision) or parameter slices (fp32).
        "masters": [op.tensor.detach().clone() for op in engine.pieces],
    }


def assert_same(a: Any, b: Any, what: str) -> None:
    """Bitwise equality of nested snapshots, with a message (asserts in ranks are not
    rewritten by pytest)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{what}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{what}[{k!r}]")
    elif isinstance(a, (list, tuple)) and not isinstance(a, str):
        assert len(a) == len(b), f"{what}: lengths {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{what}[{i}]")
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: {a} != {b}"
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


def release(*models: nn.Module) -> None:
    for m in models:
        m.zero_engine.remove()


# --- round trip and exact resume, stages 0-3, one world ----------------------------------------


ROUND_TRIPS = [
    (0, "fp32"),
    (1, "fp32"),
    (2, "fp32"),
    (3, "fp32"),
    (1, "bf16"),
    (2, "fp16"),
    (0, "bf16"),
    (3, "bf16"),
]


def _round_trip_and_resume(root: str) -> None:
    rank, world = rank_world()
    for stage, precision in ROUND_TRIPS:
        where = f"stage {stage} {precision}"
        path = os.path.join(root, f"s{stage}{precision}")
        model, opt = build(stage, seed=0, precision=precision, dropout=0.1)
        torch.manual_seed(100 + rank)  # per-rank dropout streams
        straight = train(model, opt, 0, 2 * K, rank, world)
        final = snapshot(model, opt)
        release(model)

        model, opt = build(stage, seed=0, precision=precision, dropout=0.1)
        torch.manual_seed(100 + rank)
        first = train(model, opt, 0, K, rank, world)
        save_checkpoint(path, model, opt, extra={"epoch": 7, "rank": rank})
        saved, rng_saved = snapshot(model, opt), torch.get_rng_state()
        after = train(model, opt, K, 2 * K, rank, world)
        assert_same(first + after, straight, f"{where}: saving changed the run")
        release(model)

        # Other weights: loading must replace them.
        fresh, fopt = build(stage, seed=1, precision=precision, dropout=0.1)
        torch.manual_seed(12345)
        extra = load_checkpoint(path, fresh, fopt)
        assert extra == {"epoch": 7, "rank": rank}, f"{where}: extra {extra}"
        assert_same(snapshot(fresh, fopt), saved, f"{where}: round trip")
        assert_same(torch.get_rng_state(), rng_saved, f"{where}: RNG state")
        resumed = train(fresh, fopt, K, 2 * K, rank, world)
        assert_same(resumed, straight[K:], f"{where}: losses after resume")
        assert_same(snapshot(fresh, fopt), final, f"{where}: state after resume")

        plain = {k: v.clone() for k, v in fresh.state_dict().items()}
        other, oopt = build(stage, seed=2, precision=precision)
        load_model_state_dict(other, oopt, plain)
        assert_same(dict(other.state_dict()), plain, f"{where}: load_model_state_dict")
        release(fresh, other)


def test_round_trip_and_exact_resume_stages_0_to_3(world: World, tmp_path: Path) -> None:
    world(2).run(_round_trip_and_resume, str(tmp_path), timeout=60)
    for stage, precision in ROUND_TRIPS:
        root = tmp_path / f"s{stage}{precision}"
        assert (root / "latest").read_text().strip() == f"step-{K:08d}"
        names = sorted(p.name for p in (root / f"step-{K:08d}").iterdir())
        assert names == [
            "checksums.sha256",
            "common.safetensors",
            "manifest.json",
            "rank-00000.safetensors",
            "rank-00001.safetensors",
        ]


# --- new processes; a save killed midway --------------------------------------------------------


def _save_continue_then_crash(root: str, results: str) -> None:
    """Save at step K, train on (the reference), then die in the middle of the next save."""
    rank, world = rank_world()
    model, opt = build(2, seed=0, dropout=0.1)
    torch.manual_seed(100 + rank)
    train(model, opt, 0, K, rank, world)
    save_checkpoint(root, model, opt, extra={"sampler": K})
    losses = train(model, opt, K, 2 * K, rank, world)
    torch.save((losses, dict(model.state_dict())), os.path.join(results, f"ref{rank}.pt"))
    faults.hooks.writing_rank_file = _rank_1_dies_halfway
    try:
        save_checkpoint(root, model, opt)
    finally:
        faults.hooks.writing_rank_file = None


def _rank_1_dies_halfway(rank: int, index: int, count: int, flush: Callable[[], None]) -> None:
    """Rank 1 exits abruptly halfway through writing its file, as a killed process would."""
    if rank == 1 and index == count // 2:
        flush()
        os._exit(17)


def _resume_in_new_processes(root: str) -> tuple[Any, list[float], dict[str, torch.Tensor]]:
    rank, world = rank_world()
    model, opt = build(2, seed=1, dropout=0.1)
    extra = load_checkpoint(root, model, opt)
    losses = train(model, opt, K, 2 * K, rank, world)
    save_checkpoint(root, model, opt)  # a later save clears the crashed one's debris
    return extra, losses, dict(model.state_dict())


def test_killed_save_keeps_previous_and_resume_in_new_processes(tmp_path: Path) -> None:
    root, results = tmp_path / "ckpt", tmp_path / "results"
    results.mkdir()
    # A long grace: rank 0 survives (its collective fails with zerodp.CollectiveError naming
    # rank 1) and removes the temporary directory before the harness stops it.
    with pytest.raises(RankFailure, match="exited with code 17"), WorldPool(2, grace=20) as pool:
        pool.run(_save_continue_then_crash, str(root), str(results), timeout=60)
    assert sorted(p.name for p in root.iterdir()) == ["latest", f"step-{K:08d}"]
    assert (root / "latest").read_text().strip() == f"step-{K:08d}"

    resumed = run_world(_resume_in_new_processes, 2, str(root), timeout=60)
    for rank, (extra, losses, state) in enumerate(resumed):
        ref_losses, ref_state = torch.load(results / f"ref{rank}.pt", weights_only=True)
        assert extra == {"sampler": K}
        assert losses == ref_losses, "losses after resuming in new processes differ"
        assert_same(state, ref_state if rank == 0 else _params_only(state, ref_state), "state")
    assert sorted(p.name for p in root.iterdir()) == [
        "latest",
        f"step-{K:08d}",
        f"step-{2 * K:08d}",
    ]


def _params_only(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    # Buffers of ranks > 0 are local (rank 0's are saved and broadcast before each forward).
    return {k: (ref[k] if k not in ("calls", "ema") else state[k]) for k in state}


# --- resharding: N ranks at stage s -> M ranks at stage s', against an unsharded reference --------


def _train_and_save(root: str, stage: int) -> None:
    rank, world = rank_world()
    model, opt = build(stage, seed=0)
    train(model, opt, 0, K, rank, world)
    save_checkpoint(root, model, opt)


def _load_and_train(root: str, stage: int) -> dict[str, Any]:
    rank, world = rank_world()
    out: dict[str, Any] = {}
    model, opt = build(stage, seed=1)
    with pytest.raises(CheckpointError) as info:  # first: resharding refused when not allowed
        load_checkpoint(root, model, opt, allow_reshard=False)
    out["refused"] = str(info.value)
    load_checkpoint(root, model, opt)
    train(model, opt, K, 2 * K, rank, world)
    with zerodp.full_parameters(model, writeback=False):  # stage 3: gather to read
        out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def reference_params() -> dict[str, torch.Tensor]:
    """Unsharded training of the same model on the same global batches."""
    torch.manual_seed(0)
    model = Net()
    opt = make_optimizer(model)
    train(model, opt, 0, 2 * K, 0, 1)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_close_to_reference(params: dict[str, torch.Tensor]) -> None:
    ref = reference_params()
    assert params.keys() == ref.keys()
    for name, p in params.items():
        rel = (p - ref[name]).norm() / ref[name].norm()
        assert rel <= 1e-6, f"{name}: relative error {rel:.2e}"


@pytest.mark.parametrize(
    ("before", "after"), [((4, 2), (2, 1)), ((2, 1), (3, 2)), ((2, 3), (3, 1)), ((4, 1), (3, 3))]
)
def test_reshard_matches_unsharded_reference(
    world: World, tmp_path: Path, before: tuple[int, int], after: tuple[int, int]
) -> None:
    (n, s), (m, s2) = before, after
    world(n).run(_train_and_save, str(tmp_path), s, timeout=60)
    results = world(m).run(_load_and_train, str(tmp_path), s2, timeout=60)
    path = tmp_path / f"step-{K:08d}"
    expected = (
        f"cannot load checkpoint {tmp_path}; nothing was changed:\n  every rank: the checkpoint "
        f"was saved at world size {n} and stage {s}, this run has world size {m} and stage {s2}; "
        "pass allow_reshard=True to reshard"
    )
    assert path.is_dir()
    for r in results:
        assert r["refused"] == expected
    assert_close_to_reference(results[0]["params"])


# --- a checkpoint saved by zerodp 0.1 (flat config) -----------------------------------------------

# What 0.1's flat ZeroConfig.to_dict() held for build(2, ...)'s config.
CONFIG_0_1 = saved_by_0_1(stage=2, bucket_bytes=256)


def _as_saved_by_0_1(step: Path) -> None:
    """Put 0.1's flat config in the manifest, and its new digest in the checksum file."""
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["config"] == json.loads(json.dumps(build_config(2).to_dict()))
    manifest["config"] = CONFIG_0_1
    (step / "manifest.json").write_text(json.dumps(manifest, indent=1))
    digests = parse_checksums((step / CHECKSUMS).read_bytes())
    digests["manifest.json"] = sha256_file(step / "manifest.json")
    write_checksums(step, digests)


def _load_without_warnings(root: str) -> dict[str, torch.Tensor]:
    rank, world = rank_world()
    model, opt = build(2, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        load_checkpoint(root, model, opt)
    train(model, opt, K, 2 * K, rank, world)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_checkpoint_of_0_1_with_a_flat_config_loads(world: World, tmp_path: Path) -> None:
    world(2).run(_train_and_save, str(tmp_path), 2, timeout=60)
    step = tmp_path / f"step-{K:08d}"
    _as_saved_by_0_1(step)
    results = world(2).run(_load_without_warnings, str(tmp_path), timeout=60)
    assert_close_to_reference(results[0])
    current = json.loads(json.dumps(build_config(2).to_dict()))
    later = {"offload", "activations"}  # policies added after 0.1: a 0.1 manifest lacks them
    for field in ("keep_last_units", "skip_backward_gathers"):  # nor these, added later
        current["stage3"].pop(field)
    assert read_manifest(step).config == {k: v for k, v in current.items() if k not in later}


# --- consolidation --------------------------------------------------------------------------------


def _save_for_consolidation(root: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    rank, world = rank_world()
    model, opt = build(2, seed=0)
    train(model, opt, 0, 2, rank, world)
    save_checkpoint(os.path.join(root, "net"), model, opt)
    torch.manual_seed(0)
    gpt = GPT(get_config("tiny"))
    gpt, gopt = zerodp.initialize(
        gpt, torch.optim.AdamW(gpt.parameters()), zerodp.ZeroConfig(stage=1)
    )
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(rank))
    _, loss = gpt(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    gopt.step()
    save_checkpoint(os.path.join(root, "gpt"), gpt, gopt)
    release(model, gpt)
    return dict(model.state_dict()), dict(gpt.state_dict())


def _note(calls: list[tuple[int, int]], done: int, total: int) -> None:
    calls.append((done, total))


def test_consolidate_equals_state_dict(world: World, tmp_path: Path) -> None:
    from zerodp.apps.cli.consolidate import add_parser

    net_sd, gpt_sd = world(2).run(_save_for_consolidation, str(tmp_path), timeout=60)[0]
    for name, sd, plain in (("net", net_sd, Net()), ("gpt", gpt_sd, GPT(get_config("tiny")))):
        out = tmp_path / f"{name}.safetensors"
        calls: list[tuple[int, int]] = []
        result = consolidate_checkpoint(tmp_path / name, out, progress=partial(_note, calls))
        assert result.tensors == len(sd)
        loaded = load_file(out)
        assert_same(loaded, sd, name)
        # The progress callback: once per tensor, bytes so far of all the tensors' bytes.
        tensor_bytes = sum(t.numel() * t.element_size() for t in loaded.values())
        assert len(calls) == len(sd) and {total for _, total in calls} == {tensor_bytes}
        assert [done for done, _ in calls] == sorted(done for done, _ in calls)
        assert calls[-1][0] == tensor_bytes
        plain.load_state_dict(loaded, strict=True)
    assert "head.weight" in net_sd and "frozen.weight" in net_sd  # tied alias, frozen layer

    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["consolidate", str(tmp_path / "net"), str(tmp_path / "b.st"), "--dtype", "bf16"]
    )
    assert args.func(args) == 0
    bf16 = load_file(tmp_path / "b.st")
    assert_same(
        bf16,
        {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in net_sd.items()},
        "bf16",
    )


# --- bad checkpoints: the same clear error on every rank, nothing changed -------------------------


def _bad_loads(cases: list[tuple[str, str, int, dict[str, Any], bool]]) -> dict[str, str]:
    rank, world = rank_world()
    messages = {}
    for label, path, stage, net, allow in cases:
        model, opt = build(stage, seed=5, **net)
        train(model, opt, 0, 1, rank, world)
        before, rng_before = snapshot(model, opt), torch.get_rng_state()
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(path, model, opt, allow_reshard=allow)
        messages[label] = str(info.value)
        assert_same(snapshot(model, opt), before, f"{label}: state changed")
        assert_same(torch.get_rng_state(), rng_before, f"{label}: RNG changed")
        release(model)
    return messages


def test_bad_checkpoints_raise_the_same_error_everywhere(world: World, tmp_path: Path) -> None:
    good = tmp_path / "good"
    world(2).run(_train_and_save, str(good), 2, timeout=60)
    step = good / f"step-{K:08d}"
    variants = {}
    for label in ("missing", "truncated", "corrupted"):
        variants[label] = tmp_path / label
        shutil.copytree(step, variants[label])
    (variants["missing"] / "rank-00001.safetensors").unlink()
    truncated = variants["truncated"] / "rank-00000.safetensors"
    size = truncated.stat().st_size
    os.truncate(truncated, size - 100)
    corrupted = variants["corrupted"] / "rank-00001.safetensors"
    data = bytearray(corrupted.read_bytes())
    data[len(data) // 2] ^= 0xFF
    corrupted.write_bytes(bytes(data))

    cases = [
        ("missing", str(variants["missing"]), 2, {}, True),
        ("truncated", str(variants["truncated"]), 2, {}, True),
        ("corrupted", str(variants["corrupted"]), 2, {}, True),
        ("shapes", str(good), 2, {"hidden": 25}, True),
        ("names", str(good), 2, {"bonus": True}, True),
        ("stage", str(good), 1, {}, False),
    ]
    results = world(2).run(_bad_loads, cases, timeout=60)
    assert results[0] == results[1], "ranks raised different errors"

    import hashlib

    digest = hashlib.sha256(bytes(data)).hexdigest()[:16]
    saved = hashlib.sha256((step / "rank-00001.safetensors").read_bytes()).hexdigest()[:16]
    change = "does not match its checksum (file changed or truncated after saving"
    advice = "; load an earlier checkpoint"
    expected = {
        "missing": (
            f"rank 1: checkpoint {variants['missing']}: rank-00001.safetensors is missing{advice}"
        ),
        "truncated": (
            f"rank 0: checkpoint {variants['truncated']}: rank-00000.safetensors {change}: "
            f"expected {size} bytes, found {size - 100}){advice}"
        ),
        "corrupted": (
            f"rank 1: checkpoint {variants['corrupted']}: rank-00001.safetensors {change}: "
            f"expected sha256 {saved}..., got {digest}...){advice}"
        ),
        "shapes": (
            "every rank: parameter 'l1.weight' has shape (25, 8) in the model but (24, 8) in the "
            "checkpoint\n  every rank: parameter 'l1.bias' has shape (25,) in the model but (24,) "
            "in the checkpoint\n  every rank: parameter 'l2.weight' has shape (8, 25) in the "
            "model but (8, 24) in the checkpoint"
        ),
        "names": "every rank: parameters in the model but not in the checkpoint: 'bonus'",
        "stage": (
            "every rank: the checkpoint was saved at world size 2 and stage 2, this run has world "
            "size 2 and stage 1; pass allow_reshard=True to reshard"
        ),
    }
    for label, path, *_ in cases:
        header = f"cannot load checkpoint {path}; nothing was changed:\n  "
        assert results[0][label] == header + expected[label], label
