"""DeepSpeed checkpoint scenarios (``tests/unit/checkpoint/test_zero_optimizer.py``,
``test_universal_checkpoint.py``, ``TestZeroToFP32`` of ``runtime/zero/test_zero.py``) with
zerodp's public API: save, load at another world size or stage, consolidate; each against
uninterrupted unsharded training on the same global batches (AdamW, 1e-5 relative).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from ds_models import Frozen
from safetensors.torch import load_file
from test_deepspeed_scenarios import ADAM, cfg
from torch import nn
from zerotest import build, rank_world

import zerodp

TIMEOUT = 120.0
K = 2  # steps before and after the checkpoint
ROWS = 12  # global batch rows: splits evenly over 2 and 3 ranks


class Net(nn.Module):
    """``TestZeroToFP32``'s model: uneven sizes, a frozen first layer, an unused classifier."""

    def __init__(self, d: int = 3, n: int = 4) -> None:
        super().__init__()
        self.ll = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.classifier = nn.Linear(4, 1)  # never used (DeepSpeed's uneven-count trick)
        self.ll[0].requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.ll:
            x = layer(x)
        return F.cross_entropy(x, y)


def groups(model: nn.Module) -> list[dict]:
    """``test_2_param_groups``: weights and biases in two groups (frozen ones left out)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
    ]


def make(stage: int, seed: int, factory=Net) -> tuple[nn.Module, zerodp.ZeroOptimizer]:
    model = build(factory, seed)
    opt = torch.optim.AdamW(groups(model), lr=1e-2)
    return zerodp.initialize(model, opt, cfg(stage, ("Linear",)))


def data(step: int, rank: int, world: int, d: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(900 + step)
    x, y = torch.randn(ROWS, d, generator=g), torch.randint(0, d, (ROWS,), generator=g)
    per = ROWS // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def run(model, opt, start: int, stop: int, loss_fn=None) -> None:
    rank, world = rank_world() if isinstance(opt, zerodp.ZeroOptimizer) else (0, 1)
    for step in range(start, stop):
        x, y = data(step, rank, world)
        loss = model(x, y) if loss_fn is None else loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    with zerodp.full_parameters(model, writeback=False):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def reference(steps: int, factory=Net, loss_fn=None) -> dict[str, torch.Tensor]:
    model = build(factory, 0)
    opt = torch.optim.AdamW(groups(model), lr=1e-2)
    run(model, opt, 0, steps, loss_fn)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def rel_errors(got: dict, want: dict) -> dict[str, float]:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return {n: float((got[n] - want[n]).detach().norm() / want[n].detach().norm()) for n in want}


def steps_of(opt: zerodp.ZeroOptimizer) -> list[float]:
    return sorted({float(s["step"]) for s in opt.state_dict()["state"].values()})


# -- TestZeroToFP32 (1 and 2 param groups, frozen) --------------------------------------------


def case_zero_to_fp32(root: str, stage: int) -> dict:
    model, opt = make(stage, 0)
    run(model, opt, 0, K)
    path = zerodp.save_checkpoint(root, model, opt)
    return {"path": str(path), "state": {k: v.clone() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_consolidate_equals_trained_model(world, tmp_path: Path, stage):
    out = world(2).run(case_zero_to_fp32, str(tmp_path), stage, timeout=TIMEOUT)
    dest = tmp_path / "model.safetensors"
    zerodp.consolidate_checkpoint(out[0]["path"], dest)
    plain = load_file(dest)
    assert plain.keys() == out[0]["state"].keys()
    for k, v in out[0]["state"].items():
        assert torch.equal(plain[k], v), k  # bitwise: the masters are the model's values
    Net().load_state_dict(plain, strict=True)
    errs = rel_errors({k: plain[k] for k in reference(K)}, reference(K))
    assert max(errs.values()) <= ADAM, errs


# -- elastic / universal checkpoints: world 2 stage s -> world 3 stage s' ---------------------

PAIRS = [(0, 2), (1, 3), (2, 0), (3, 1), (3, 3)]


def case_save_all(root: str) -> None:
    for s, _ in PAIRS:
        model, opt = make(s, 0)
        run(model, opt, 0, K)
        zerodp.save_checkpoint(os.path.join(root, f"s{s}"), model, opt)


def case_load_all(root: str) -> list:
    out = []
    for s, s2 in PAIRS:
        model, opt = make(s2, 1)  # other weights: loading must replace them
        zerodp.load_checkpoint(os.path.join(root, f"s{s}"), model, opt)
        after_load = steps_of(opt)
        run(model, opt, K, 2 * K)
        out.append((after_load, steps_of(opt), full_params(model)))
    return out


def test_reshard_world2_to_world3_continues_like_unsharded(world, tmp_path: Path):
    world(2).run(case_save_all, str(tmp_path), timeout=TIMEOUT)
    results = world(3).run(case_load_all, str(tmp_path), timeout=TIMEOUT)
    want = reference(2 * K)
    for (s, s2), (after_load, after, params) in zip(PAIRS, results[0], strict=True):
        assert (after_load, after) == ([float(K)], [2.0 * K]), (s, s2, after_load, after)
        errs = rel_errors(params, want)
        assert max(errs.values()) <= ADAM, (s, s2, errs)


def case_same_world_stage_change(root: str) -> list[dict[str, float]]:
    out = []
    for s, s2 in [(3, 0), (0, 3), (2, 1), (1, 2)]:
        model, opt = make(s, 0)
        run(model, opt, 0, K)
        zerodp.save_checkpoint(os.path.join(root, f"{s}-{s2}"), model, opt)
        model, opt = make(s2, 1)
        zerodp.load_checkpoint(os.path.join(root, f"{s}-{s2}"), model, opt)
        run(model, opt, K, 2 * K)
        out.append(rel_errors(full_params(model), reference(2 * K)))
    return out


def test_stage_change_at_same_world_size(world, tmp_path: Path):
    """``TestZeROElasticCheckpoint.test_elastic_checkpoint_fixed_dp`` (and stage changes)."""
    for errs in world(2).run(case_same_world_stage_change, str(tmp_path), timeout=TIMEOUT)[0]:
        assert max(errs.values()) <= ADAM, errs


# -- TestZeROCheckpointFrozenWeights, load_module_only -------------------------------------------


def mse_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, F.one_hot(y, 10).float())


def case_frozen_checkpoint(root: str, stage: int) -> dict:
    rank, world = rank_world()

    def run10(model, opt, a, b):
        for step in range(a, b):
            x, y = data(step, rank, world, d=10)
            mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    model, opt = make(stage, 0, Frozen)
    run10(model, opt, 0, K)
    zerodp.save_checkpoint(root, model, opt)
    fresh, fopt = make(stage, 7, Frozen)  # other frozen values too
    zerodp.load_checkpoint(root, fresh, fopt)
    saved, loaded = full_params(model), full_params(fresh)
    same = all(torch.equal(saved[n], loaded[n]) for n in saved)
    run10(fresh, fopt, K, 2 * K)
    # load_module_only: the weights alone into a fresh optimizer (its Adam state starts over).
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    only, oopt = make(stage, 3, Frozen)
    zerodp.load_model_state_dict(only, oopt, plain)
    run10(only, oopt, K, 2 * K)
    return {"same": same, "resumed": full_params(fresh), "module_only": full_params(only)}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_frozen_weights_checkpoint_and_module_only_load(world, tmp_path: Path, stage):
    out = world(2).run(case_frozen_checkpoint, str(tmp_path), stage, timeout=TIMEOUT)[0]
    assert out["same"], "loaded state differs from the saved model"
    ref = build(Frozen, 0)
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2)

    def ref_run(opt, a, b):
        for step in range(a, b):
            x, y = data(step, 0, 1, d=10)
            mse_loss(ref(x), y).backward()
            opt.step()
            opt.zero_grad()

    ref_run(ref_opt, 0, K)
    frozen_before = ref.l2.weight.detach().clone()
    restart = torch.optim.AdamW(groups(ref), lr=1e-2)  # module only: a fresh Adam from step K
    saved = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_run(ref_opt, K, 2 * K)
    resumed = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref.load_state_dict(saved)
    ref_run(restart, K, 2 * K)
    module_only = {n: p.detach().clone() for n, p in ref.named_parameters()}
    assert torch.equal(out["resumed"]["l2.weight"], frozen_before)
    for key, want in (("resumed", resumed), ("module_only", module_only)):
        errs = rel_errors(out[key], want)
        assert max(errs.values()) <= ADAM, (key, errs)


# -- TestZeROSaveLoadEdgeCase ----------------------------------------------------------------


def case_edge_cases(root: str, stage: int) -> list:
    """Save before any step, load it into another model; load and immediately save again;
    save halfway through gradient accumulation (after a ``no_sync`` backward)."""
    rank, world = rank_world()
    model, opt = make(stage, 0)
    first = zerodp.save_checkpoint(os.path.join(root, "a"), model, opt)
    other, oopt = make(stage, 1)
    zerodp.load_checkpoint(first, other, oopt)
    second = zerodp.save_checkpoint(os.path.join(root, "b"), other, oopt)
    # Mid-accumulation save: the run must go on exactly as without it.
    runs = []
    for save in (False, True):
        m, o = make(stage, 0)
        run(m, o, 0, 1)
        x, y = data(1, rank, world)
        with m.no_sync():
            m(x, y).backward()
        if save:
            zerodp.save_checkpoint(os.path.join(root, "c"), m, o)
        x, y = data(2, rank, world)
        m(x, y).backward()
        o.step()
        o.zero_grad()
        runs.append(full_params(m))
    same = all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])
    return [str(first), str(second), same, os.path.join(root, "c")]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_save_load_edge_cases(world, tmp_path: Path, stage):
    first, second, same, mid = world(2).run(case_edge_cases, str(tmp_path), stage, timeout=TIMEOUT)[
        0
    ]
    assert same, "saving mid-accumulation changed the run"
    a = load_file(zerodp.consolidate_checkpoint(first, tmp_path / "a.st").path)
    b = load_file(zerodp.consolidate_checkpoint(second, tmp_path / "b.st").path)
    init = build(Net, 0).state_dict()
    assert a.keys() == b.keys() == init.keys()
    assert all(torch.equal(a[k], init[k]) and torch.equal(b[k], init[k]) for k in init)
    c = load_file(zerodp.consolidate_checkpoint(mid, tmp_path / "c.st").path)
    one_step = build(Net, 0)
    run(one_step, torch.optim.AdamW(groups(one_step), lr=1e-2), 0, 1)
    errs = rel_errors(
        {k: c[k] for k, _ in one_step.named_parameters()}, dict(one_step.named_parameters())
    )
    assert max(errs.values()) <= ADAM, errs  # the step-1 state: accumulated gradients not saved
