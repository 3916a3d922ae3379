"""Optimizer state on NVMe (``ZeroConfig.offload.optimizer="nvme"``, issue 15, ZeRO-Infinity):
exact, private files, bounded host memory, checkpoints in and out, failures that lose nothing.

Parity: the NVMe tier steps the same values with the same kernels as the device step, only
read from and written to files between steps ([Note: optimizer state on NVMe] in
zerodp/offload/swap.py), so parameters and optimizer state must be **bitwise** those of the run
without offload.
"""

from __future__ import annotations

import errno
import gc
import os

import hf_models
import pytest
import torch
from offloadtest import (
    STAGES,
    TIMEOUT,
    clipped_step,
    compare,
    full_params,
    model_loss,
    offload_config,
    state_values,
    tiny_gpt,
)
from zerotest import rank_world

import zerodp
import zerodp.offload.swapfile as swapfile
from zerodp.offload.swapfile import ALIGN, aligned
from zerodp.streams import StreamError


def case_parity(root: str, kind: str, precisions: tuple[str, ...]) -> list[str]:
    """``root``: the NVMe directory, the same on every rank (the configuration must agree;
    the files' names carry the rank, and they are unlinked at once)."""
    differ = []
    for stage in STAGES:
        for precision in precisions:
            config = offload_config(stage, precision, "nvme", path=root, ring_buckets=2)
            wrong, report = compare(kind, offload_config(stage, precision, "none"), config)
            assert report.offload == "nvme" and report.nvme > 0, "the run was not on NVMe"
            if wrong:
                differ.append(f"stage {stage} {precision}: {wrong}")
    return differ


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize(("kind", "precisions"), [("gpt", ("fp32", "bf16")), ("llama", ("fp32",))])
def test_bitwise_parity_with_the_device_step(world, tmp_path, world_size, kind, precisions):
    """Two ring slots, several buckets per segment: chunks reuse slots within a step."""
    results = world(world_size).run(case_parity, str(tmp_path), kind, precisions, timeout=TIMEOUT)
    assert results == [[]] * world_size


# -- the files and the memory ---------------------------------------------------------------------


def case_files_and_bytes(path: str, stage: int) -> dict:
    model = tiny_gpt()
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    config = offload_config(stage, "bf16", "nvme", path=path, ring_buckets=3)
    model, opt = zerodp.initialize(model, inner, config)
    clipped_step(model, opt, 0)
    report = opt.memory_report().to_dict()  # waits for the step's writes
    store = opt.engine.masters.store
    files = store.files
    out = {
        "listed": os.listdir(path),
        "groups": sorted(files),
        "modes": {k: f.mode for k, f in files.items()},
        "sizes": {k: os.fstat(f.fd).st_size for k, f in files.items()},
        "chunks": [c.numel for c in store.chunks],
        "report": report,
        "empty": [op.tensor.numel() for op in opt.engine.pieces],
        "state_empty": [
            v.numel()
            for st in inner.state.values()
            for k, v in st.items()
            if k != "step"  # the scalar stays in memory
        ],
    }
    fds = [f.fd for f in files.values()]
    opt.close()
    closed = []
    for fd in fds:
        try:
            os.fstat(fd)
        except OSError as exc:
            closed.append(exc.errno == errno.EBADF)
    out["closed"] = closed
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_files_are_private_and_host_bytes_exact(world, tmp_path, stage):
    """One file per rank and tensor group (masters, Adam's two moments), 0600, unlinked at
    creation (nothing is listed in the directory), each chunk's extent aligned to 4 KiB; the
    optimizer's tensors are empty between steps; host memory is the rings only: the gradient
    ring and the two transfer rings (3 slots of the largest chunk in fp32 each) and 3 slots per
    group of its aligned extent. Closing closes the files."""
    for r in world(2).run(case_files_and_bytes, str(tmp_path), stage, timeout=TIMEOUT):
        assert r["listed"] == []
        assert r["groups"] == ["exp_avg", "exp_avg_sq", "masters"]
        assert set(r["modes"].values()) == {0o600}
        extent = sum(aligned(4 * n) for n in r["chunks"])
        assert set(r["sizes"].values()) == {extent} and extent % ALIGN == 0
        largest = max(r["chunks"])
        rep = r["report"]
        assert rep["nvme"] == 3 * extent
        assert rep["master_parameters"] == 0
        assert rep["optimizer_state"] == rep["optimizer_scalar_bytes"]  # step counters only
        assert rep["host_gradients"] == 3 * 4 * largest
        assert rep["host_buffers"] == 2 * 3 * 4 * largest + 3 * 3 * aligned(4 * largest)
        assert rep["host"] == rep["optimizer_state"] + rep["host_gradients"] + rep["host_buffers"]
        assert set(r["empty"]) == {0} and set(r["state_empty"]) == {0}
        assert r["closed"] == [True] * 3


def _live_storages() -> dict[int, tuple[int, str]]:
    """Every distinct storage a live Python tensor holds (CPU: all the memory the run's
    tensors take): its bytes, and one of its tensors' shape and dtype."""
    gc.collect()
    storages = {}
    for o in gc.get_objects():
        # ``type``, not ``isinstance``: that reads ``__class__``, which some objects warn on.
        if not issubclass(type(o), torch.Tensor):
            continue
        try:
            s = o.untyped_storage()
            storages[s.data_ptr()] = (s.nbytes(), f"{tuple(o.shape)} {o.dtype}")
        except RuntimeError:  # fake tensors a compiled test left behind: no memory of theirs
            continue
    return storages


def _model(kind: str) -> torch.nn.Module:
    """The tiny GPT (105k parameters), or a Llama of 300k: at 4 B/param far more than what
    every run keeps outside the report (placeholders, the last loss, gloo: ~40 KB)."""
    if kind == "gpt":
        return tiny_gpt()
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(hf_models.llama_config(hidden_size=128, intermediate_size=256))


def case_nothing_outside_the_report(root: str) -> list[tuple[str, int, int, list]]:
    """(what ran, its parameters, bytes alive beyond the memory report's device + host, the
    largest storages that were not alive before)."""
    runs = [
        ("gpt", 1, "bf16", "nvme", {}),
        ("gpt", 2, "fp32", "nvme", {}),
        ("gpt", 3, "bf16", "nvme", {"params": "nvme"}),
        ("llama", 3, "fp32", "nvme", {"params": "nvme"}),
        ("gpt", 3, "bf16", "nvme", {"params": "nvme", "gradients": "nvme"}),
        ("llama", 3, "fp32", "cpu", {"gradients": "nvme"}),
        ("gpt", 2, "bf16", "cpu", {}),
        ("gpt", 3, "bf16", "cpu", {"params": "cpu"}),
    ]
    out = []
    for kind, stage, precision, tier, extra in runs:
        before = _live_storages()
        model = _model(kind)
        numel = sum(p.numel() for p in model.parameters())
        inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
        path = root if "nvme" in (tier, *extra.values()) else None
        config = offload_config(stage, precision, tier, path=path, ring_buckets=2, **extra)
        model, opt = zerodp.initialize(model, inner, config)
        rank, world = rank_world()
        for step in range(2):
            opt.backward(model_loss(kind, model, step, rank, world))
            opt.step()
            opt.zero_grad()
        with zerodp.full_parameters(model):  # gathers into fresh buffers, dropped at the end
            pass
        report = opt.memory_report()
        after = _live_storages()
        total = sum(n for n, _ in after.values()) - sum(n for n, _ in before.values())
        new = sorted((v for k, v in after.items() if k not in before), reverse=True)[:4]
        what = f"{kind} stage {stage} {precision} {tier} {extra}"
        out.append((what, numel, total - report.device - report.host, new))
        opt.close()
        del model, opt, inner
    return out


def test_nothing_outside_the_memory_report_stays_alive(world, tmp_path):
    """After two steps and a ``full_parameters`` block (its gathers fill fresh buffers), the
    tensors alive are what the memory report counts, give or take 64 KiB (the parameters'
    placeholders, the last loss, gloo's), for every tier: on NVMe the initial fp32 masters (and
    at stage 3 with the parameters on NVMe, the shards) are written to the files and dropped.
    Two leaks this caught: the optimizer's tensors were views that kept every initial master
    alive (4 B/param, 420 KB for the GPT), and the NVMe read ring's events kept the last
    gathers' buffers."""
    for results in world(2).run(case_nothing_outside_the_report, str(tmp_path), timeout=TIMEOUT):
        for what, numel, beyond, new in results:
            assert beyond < 64 * 1024 < numel, (what, beyond, numel, new)


# -- checkpoints, state_dict and edits: everything outside the step ------------------------------


def _snapshot(model, opt) -> tuple[dict, list]:  # type: ignore[no-untyped-def]
    return full_params(model), state_values(opt)


def _run(offload: str, path: str | None):  # type: ignore[no-untyped-def]
    model = tiny_gpt()
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    extra = {"path": path} if path else {}
    return zerodp.initialize(model, inner, offload_config(2, "bf16", offload, **extra))


def _edit_and_step(model, opt, step: int) -> None:  # type: ignore[no-untyped-def]
    with zerodp.full_parameters(model, writeback=True), torch.no_grad():
        model.ln_f.weight.mul_(0.5)  # written back to the masters, on NVMe here
    clipped_step(model, opt, step)


def case_outside_the_step(root: str) -> list[str]:
    """A run without offload saves after 2 steps; an NVMe run loads it, edits a parameter,
    steps, saves; the run without offload does the same: equal. The NVMe run's checkpoint loads
    into a run without offload, and its ``state_dict`` into another NVMe run."""
    problems = []
    ref_model, ref = _run("none", None)
    for step in range(2):
        clipped_step(ref_model, ref, step)
    zerodp.save_checkpoint(f"{root}/a", ref_model, ref)
    nv_model, nv = _run("nvme", f"{root}/nvme")
    zerodp.load_checkpoint(f"{root}/a", nv_model, nv)
    for model, opt in ((ref_model, ref), (nv_model, nv)):
        _edit_and_step(model, opt, 2)
    want, got = _snapshot(ref_model, ref), _snapshot(nv_model, nv)
    if not (_equal(want[0], got[0]) and _equal(want[1], got[1])):
        problems.append("load + edit + step differs from the run without offload")
    zerodp.save_checkpoint(f"{root}/b", nv_model, nv)
    back_model, back = _run("none", None)
    zerodp.load_checkpoint(f"{root}/b", back_model, back)
    if not (_equal(got[0], _snapshot(back_model, back)[0])):
        problems.append("the NVMe run's checkpoint loads different parameters")
    other_model, other = _run("nvme", f"{root}/nvme")
    other.load_state_dict(nv.state_dict())
    if not _equal(got[1], _snapshot(other_model, other)[1]):
        problems.append("state_dict -> load_state_dict differs")
    for opt in (ref, nv, back, other):
        opt.close()
    return problems


def _equal(a, b) -> bool:  # type: ignore[no-untyped-def]
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_checkpoints_state_dict_and_edits(world, tmp_path):
    assert world(2).run(case_outside_the_step, str(tmp_path), timeout=TIMEOUT) == [[], []]


# -- failures ---------------------------------------------------------------------------------


def case_disk_full_in_a_step(root: str) -> tuple[str, bool]:
    """The disk fills up when the first step creates Adam's state files: the error names it,
    and the checkpoint saved before loads."""
    rank, world = rank_world()
    model, opt = _run("nvme", f"{root}/nvme")
    zerodp.save_checkpoint(f"{root}/ckpt", model, opt)
    saved_params = _snapshot(model, opt)[0]
    reserve = swapfile._reserve

    def full(fd: int, nbytes: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    swapfile._reserve = full  # type: ignore[assignment]
    message = "no error"
    try:
        opt.backward(model_loss("gpt", model, 0, rank, world))
        opt.step()
        model(**{"idx": torch.zeros(2, 8, dtype=torch.long)})
    except StreamError as exc:
        message = str(exc)
    finally:
        swapfile._reserve = reserve
    with pytest.raises(StreamError):
        opt.close()
    saved_model, saved = _run("none", None)
    zerodp.load_checkpoint(f"{root}/ckpt", saved_model, saved)
    same = _equal(saved_params, _snapshot(saved_model, saved)[0])
    saved.close()
    return message, same


def test_a_full_disk_in_a_step_is_named_and_the_last_checkpoint_loads(world, tmp_path):
    for r, (message, same) in enumerate(world(2).run(case_disk_full_in_a_step, str(tmp_path))):
        assert f"has no room for rank{r}-exp_avg" in message, message
        assert "(nothing was written; the last checkpoint is unaffected)" in message
        assert same


ADOPTION = (
    "zerodp: adding trainable parameters after initialize (unfreezing them, add_param_group) is "
    "not supported with the NVMe tier (ZeroConfig.offload.optimizer='nvme' or gradients='nvme') "
    "yet: make them trainable before zerodp.initialize, or keep those on 'cpu' / 'device'"
)


def case_adoption_refused(root: str) -> list[str]:
    rank, world = rank_world()
    model = tiny_gpt()
    model.ln_f.weight.requires_grad_(False)
    inner = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    config = offload_config(1, "fp32", "nvme", path=root)
    model, opt = zerodp.initialize(model, inner, config)
    errors = []
    with pytest.raises(NotImplementedError) as added:
        opt.add_param_group({"params": [model.ln_f.weight]})
    errors.append(str(added.value))
    model.ln_f.weight.requires_grad_(True)
    with pytest.raises(NotImplementedError) as unfrozen:
        model_loss("gpt", model, 0, rank, world)
    errors.append(str(unfrozen.value))
    opt.close()
    return errors


def test_adding_parameters_after_initialize_is_refused(world, tmp_path):
    results = world(1).run(case_adoption_refused, str(tmp_path), timeout=TIMEOUT)
    assert results == [[ADOPTION, ADOPTION]]
