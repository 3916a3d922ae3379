"""Optimizer offload and the state around the step (issue 15): checkpoints of offloaded runs,
parameters adopted after ``initialize``, reads and edits between steps. Every comparison is
bitwise against the same run without offload, or between resumed runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from offloadtest import (
    STAGES,
    TIMEOUT,
    clipped_step,
    differing,
    fresh_run,
    full_params,
    offload_config,
    tiny_gpt,
)
from zerotest import rank_world

import zerodp

# -- checkpoints: the same format as any run, loading anywhere -----------------------------------


def case_save(root: str, stage: int, offload: str, precision: str) -> list[str]:
    model, opt = fresh_run(stage, offload, precision)
    for step in range(2):
        clipped_step(model, opt, step)
    saved = zerodp.save_checkpoint(root, model, opt)  # right after a step: nothing may be missed
    opt.close()
    return sorted(p.name for p in saved.iterdir())


def case_resume(roots: list[str], stage: int, precision: str) -> dict[str, dict[str, torch.Tensor]]:
    """Each checkpoint, loaded without and with offload, trained one more step."""
    out = {}
    for root in roots:
        for offload in ("none", "cpu"):
            model, opt = fresh_run(stage, offload, precision)
            zerodp.load_checkpoint(root, model, opt)
            clipped_step(model, opt, 2)
            out[f"{Path(root).name} loaded with offload={offload}"] = full_params(model)
            opt.close()
    return out


@pytest.mark.parametrize(
    ("stage", "resume_world", "precision"),
    [(2, 1, "bf16"), (3, 1, "bf16"), (1, 2, "bf16"), (2, 1, "fp32"), (3, 1, "fp32")],
)
def test_checkpoints_of_offloaded_runs_load_anywhere(
    world, tmp_path, stage, resume_world, precision
):
    """Saved by 2 ranks with and without offload (clipped): the same files with the same values;
    each resumes, offloaded or not, at another world size to the same parameters (fp32: the
    offloaded masters are a copy of the parameters, loaded as such)."""
    roots = [str(tmp_path / "none"), str(tmp_path / "cpu")]
    files = [
        world(2).run(case_save, r, stage, Path(r).name, precision, timeout=TIMEOUT) for r in roots
    ]
    assert files[0] == files[1]
    resumed = world(resume_world).run(case_resume, roots, stage, precision, timeout=TIMEOUT)[0]
    (first, want), *others = resumed.items()
    for what, got in others:
        assert all(torch.equal(want[n], got[n]) for n in want), f"{what} differs from {first}"


# -- parameters adopted after initialize --------------------------------------------------------


def _train_unfrozen(stage: int, offload: str) -> dict[str, torch.Tensor]:
    """``blocks.1`` frozen at ``initialize``, unfrozen after step 1; ``ln_f`` added as a new
    param group after step 2."""
    model = tiny_gpt()
    frozen = model.blocks[1]
    frozen.requires_grad_(False)
    head = [p for n, p in model.named_parameters() if n.startswith("ln_f")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("ln_f")]
    inner = torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.1)
    model, opt = zerodp.initialize(model, inner, offload_config(stage, "bf16", offload))
    for step in range(4):
        if step == 1:
            frozen.requires_grad_(True)
        if step == 2:
            opt.add_param_group({"params": head, "lr": 1e-2, "weight_decay": 0.0})
        clipped_step(model, opt, step)
    params = full_params(model)
    opt.close()
    return params


def case_adopted(stage: int) -> list[str]:
    want, got = _train_unfrozen(stage, "none"), _train_unfrozen(stage, "cpu")
    return differing(want, got)


@pytest.mark.parametrize("stage", STAGES)
def test_parameters_unfrozen_or_added_later_are_offloaded_too(world, stage):
    assert world(2).run(case_adopted, stage, timeout=TIMEOUT) == [[], []]


def case_one_rank_reads_the_optimizer() -> list[str]:
    """Rank 0 alone reads the memory report and the optimizer's state dict right after an
    offloaded step (no collective may be issued by that), then both ranks go on."""
    rank, _ = rank_world()
    model, opt = fresh_run(2, "cpu")
    out = []
    for step in range(3):
        clipped_step(model, opt, step)
        if rank == 0:
            report, state = opt.memory_report(), opt.state_dict()
            counts = {int(st["step"]) for st in state["state"].values()}
            out.append(f"{report.offload} {counts}")
    opt.close()
    return out


def test_one_rank_alone_may_read_the_optimizer_after_an_offloaded_step(world):
    """Complete (every piece's Adam step counted), and nothing hangs."""
    first, second = world(2).run(case_one_rank_reads_the_optimizer, timeout=TIMEOUT)
    assert first == ["cpu {1}", "cpu {2}", "cpu {3}"] and second == []


def _edited(stage: int, offload: str) -> dict[str, torch.Tensor]:
    model, opt = fresh_run(stage, offload)
    clipped_step(model, opt, 0)
    with zerodp.full_parameters(model):  # weight surgery between steps reaches the masters
        model.blocks[0].mlp.c_fc.weight.data[:3].mul_(0.5)
    clipped_step(model, opt, 1)
    params = full_params(model)
    opt.close()
    return params


def case_edits(stage: int) -> list[str]:
    want, got = _edited(stage, "none"), _edited(stage, "cpu")
    return differing(want, got)


@pytest.mark.parametrize("stage", STAGES)
def test_edits_inside_full_parameters_reach_the_offloaded_masters(world, stage):
    assert world(2).run(case_edits, stage, timeout=TIMEOUT) == [[], []]
