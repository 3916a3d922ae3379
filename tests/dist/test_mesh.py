"""ZeRO over the data-parallel dimension of a DP x TP device mesh: 4 ranks as 2 x 2.

``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``: the DP groups are {0, 2} and
{1, 3}, the TP groups {0, 1} and {2, 3}. The DP groups are not contiguous, so a global rank used
where a group rank belongs (a broadcast source, an owned slice) shows as a wrong value or a hang.
zerodp gets ``process_group=mesh["dp"]``; the model issues its own TP collectives.

- ``TPMLP`` is one TP rank's half of ``FullMLP`` in Megatron's layout. Each DP rank trains on its
  own batch, both TP ranks of a DP rank on the same one. After every step the TP shards,
  gathered and reassembled, match ``FullMLP`` trained in one process on the global batch (the
  mean of the two DP ranks' losses), within ``zerotest.TOL``; zerodp's ledger holds exactly the
  traffic of a 2-rank run (the TP all-reduces are the model's, not zerodp's).
- Clipping: under TP, ``clip_grad_norm_`` returns the norm of this TP rank's shards only
  ([Note: data-parallel sub-groups] in comm/groups.py), so the TP model trains unclipped and
  the test pins the norm returned. GPT-2, replicated over TP, is clipped against torch.
- Checkpoints: two DP groups saving into one root would overwrite each other; the second to
  claim the root raises ([Note: one data-parallel group per root] in checkpoint/save.py).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from emulation import Emulation, masters_error
from emulation import adamw as emulation_adamw
from hf_models import build as build_hf
from hf_models import global_batches, hf_loss
from test_hf_models import OPTIMIZERS, TOLERANCE, config, max_error
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from zerotest import (
    Pair,
    adamw_two_groups,
    assert_close,
    batches,
    build,
    full,
    mse,
    reference_step,
)

import zerodp

TIMEOUT = 120.0
DP, TP = 2, 2
# Odd sizes: the 2-rank layout pads differently from a 4-rank one (see ``expected_traffic``).
D_IN, HIDDEN, D_OUT = 5, 10, 3
SHARD = HIDDEN // TP


@functools.cache
def _mesh() -> DeviceMesh:
    """One mesh per world (its groups are made once; the pool keeps the worker alive)."""
    return init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))


def _coords() -> tuple[int, int]:
    """(DP rank, TP rank) of this process."""
    mesh = _mesh()
    return mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's reduce-from-tensor-parallel region: sum the partial outputs over TP forward,
    pass the gradient through backward. (``torch.distributed.nn.functional.all_reduce`` sums
    the gradient over TP too, which doubles it when, as here, every TP rank computes the same
    loss from the reduced output.)"""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor) -> torch.Tensor:
        out = partial.clone()
        dist.all_reduce(out, group=_mesh()["tp"].get_group())
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class FullMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class TPMLP(nn.Module):
    """TP rank ``tp``'s half of ``full``: fc1 column-parallel (hidden units ``rows`` of fc1),
    fc2 row-parallel (the same units' inputs of fc2, no bias), the partial outputs summed over
    TP, then fc2's bias, replicated on every TP rank. The TP group is looked up, not held: a
    ProcessGroup cannot be deep-copied (the bf16 emulation copies the model)."""

    def __init__(self, full: FullMLP, tp: int) -> None:
        super().__init__()
        rows = slice(tp * SHARD, (tp + 1) * SHARD)
        self.fc1 = nn.Linear(D_IN, SHARD)
        self.fc2 = nn.Linear(SHARD, D_OUT, bias=False)
        self.bias = nn.Parameter(full.fc2.bias.detach().clone())
        with torch.no_grad():
            self.fc1.weight.copy_(full.fc1.weight[rows])
            self.fc1.bias.copy_(full.fc1.bias[rows])
            self.fc2.weight.copy_(full.fc2.weight[:, rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.fc2(torch.tanh(self.fc1(x)))
        return _ReduceFromTP.apply(partial) + self.bias


def reassembled(model: nn.Module) -> FullMLP:
    """The full MLP from every TP rank's shard (a collective over DP at stage 3, over TP)."""
    group = _mesh()["tp"].get_group()
    out = FullMLP()
    with full(model), torch.no_grad():
        p = dict(model.named_parameters())
        out.fc1.weight.copy_(_gather(p["fc1.weight"], 0, group))
        out.fc1.bias.copy_(_gather(p["fc1.bias"], 0, group))
        out.fc2.weight.copy_(_gather(p["fc2.weight"], 1, group))
        biases = _gather(p["bias"][None], 0, group)
        assert torch.equal(biases[0], biases[1]), "the replicated bias differs between TP ranks"
        out.fc2.bias.copy_(biases[0])
    return out


def _gather(t: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(TP)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim)


def _cfg(stage: int, **kw: Any) -> zerodp.ZeroConfig:
    units = ("Linear",) if stage == 3 else ()  # a unit per Linear; the root holds the bias
    return zerodp.ZeroConfig(
        stage=stage, bucket_bytes=96, stage3=zerodp.Stage3(unit_classes=units), **kw
    )


def _tp_pair(stage: int) -> Pair:
    _, tp = _coords()
    ref = build(FullMLP)  # the same full MLP on every rank; the TP shards slice it
    model = TPMLP(ref, tp)
    opt = adamw_two_groups(list(model.parameters()))
    model, opt = zerodp.initialize(model, opt, _cfg(stage), process_group=_mesh()["dp"])
    return Pair(model, opt, ref, adamw_two_groups(list(ref.parameters())))


def _shard_norm(ref: FullMLP, tp: int) -> float:
    """The gradient norm of TP rank ``tp``'s shard of the reference (bias included)."""
    rows = slice(tp * SHARD, (tp + 1) * SHARD)
    grads = [
        ref.fc1.weight.grad[rows],
        ref.fc1.bias.grad[rows],
        ref.fc2.weight.grad[:, rows],
        ref.fc2.bias.grad,
    ]
    return torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])).item()


# -- the tensor-parallel MLP ---------------------------------------------------------------------


def case_tp_mlp(stage: int) -> dict[str, Any]:
    """Three AdamW steps of ZeRO over mesh["dp"]; parity, the ledger, the DP-only norm."""
    dp, tp = _coords()
    pair = _tp_pair(stage)
    traffic, norms = [], []
    for step in range(3):
        data = batches(step, DP, 3, [(D_IN,), (D_OUT,)])
        reference_step(pair, mse(data), DP, step=False)
        mse(data)(pair.model, dp).backward()
        # max_norm so large that the coefficient is exactly 1: what the norm is, nothing more.
        norms.append((pair.opt.clip_grad_norm_(1e9).item(), _shard_norm(pair.ref, tp)))
        pair.ref_opt.step()
        pair.ref_opt.zero_grad()
        pair.opt.step()
        pair.opt.zero_grad()
        stats = pair.opt.comm_stats()
        assert stats is not None
        traffic.append((stats.elements, stats.bytes))
        assert_close(reassembled(pair.model), pair.ref, what=f"step {step}")
    eng = pair.opt.engine
    return {
        "traffic": traffic,
        "norms": norms,
        "members": eng.comm.members,
        "world_size": eng.comm.world_size,
        "owned": sum(op.piece.param_range.numel for op in eng.pieces),
    }


def _padded(numels: Sequence[int], n: int, align: int = 4) -> int:
    """A segment's flat size on ``n`` ranks ([Note: flat buffers]): every parameter starts on a
    multiple of ``align`` elements (16 bytes of fp32) and the end is rounded to ``n * align``."""
    end = 0
    for k in numels:
        end = -(-end // align) * align + k
    return -(-end // (n * align)) * (n * align)


def expected_traffic(stage: int, n: int, first: bool = False) -> dict[str, int]:
    """Model-data elements per step of ZeRO on ``n`` ranks for ``TPMLP``. Segments hold the
    parameters in reversed registration order (partition/build.py); stage 3 has one per unit:
    the root (the bias), fc1, fc2."""
    bias, fc2_w, fc1_b, fc1_w = D_OUT, D_OUT * SHARD, SHARD, SHARD * D_IN
    if stage < 3:
        psi = _padded([bias, fc2_w, fc1_b, fc1_w], n)
        if stage == 0:
            return {"all_reduce": psi}
        return {"reduce_scatter": psi, "all_gather": psi}
    root, fc1, fc2 = _padded([bias], n), _padded([fc1_b, fc1_w], n), _padded([fc2_w], n)
    # fc2 is gathered in forward and again in backward, the root once (it is held until the end
    # of backward, params/hooks.py), and after the first step (which records the order) fc2,
    # the last unit of the forward, once (kept into the backward: Stage3.keep_last_units). fc1
    # once: its input needs no gradient, so its backward reads no parameter ([Note: backward
    # without parameters] in params/saved.py). Each is reduce-scattered once.
    kept = 0 if first else fc2
    return {"all_gather": root + fc1 + 2 * fc2 - kept, "reduce_scatter": root + fc1 + fc2}


def check_tp_mlp(out: list[dict[str, Any]], stage: int) -> None:
    want = expected_traffic(stage, DP)
    assert want != expected_traffic(stage, DP * TP), "sizes do not tell 2 from 4 ranks"
    groups = {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}
    psi = SHARD * D_IN + SHARD + D_OUT * SHARD + D_OUT
    for rank, o in enumerate(out):
        assert o["members"] == groups[rank] and o["world_size"] == DP, (rank, o["members"])
        for step, (elements, nbytes) in enumerate(o["traffic"]):
            expected = expected_traffic(stage, DP, first=True) if step == 0 else want
            assert elements == expected, (stage, rank, step, elements, expected)
            assert nbytes == {kind: 4 * k for kind, k in expected.items()}, (rank, nbytes)
        for got, shard in o["norms"]:
            assert abs(got - shard) <= 1e-5 * shard, f"rank {rank}: norm {got} vs shard {shard}"
    if stage > 0:  # the two ranks of each DP group own the TP shard's Ψ between them
        for a, b in [(0, 2), (1, 3)]:
            assert out[a]["owned"] + out[b]["owned"] == psi, (out[a]["owned"], out[b]["owned"])
    # TP ranks see different norms: the DP-group norm is not the model's under TP.
    assert out[0]["norms"][0][0] != out[1]["norms"][0][0]


def case_tp_mlp_bf16(stage: int) -> float:
    """bf16 over mesh["dp"] against the 2-rank protocol emulated on this TP shard: bitwise."""
    dp, tp = _coords()
    model = TPMLP(build(FullMLP), tp)
    emu = Emulation(model, "bf16", stage, DP, scale=1.0)
    opt = emulation_adamw(model.parameters())
    model, zopt = zerodp.initialize(model, opt, _cfg(stage, precision="bf16"), _mesh()["dp"])
    for step in range(3):
        data = batches(step, DP, 3, [(D_IN,), (D_OUT,)])
        emu.step(mse(data))
        mse(data)(model, dp).backward()
        zopt.step()
        zopt.zero_grad()
        err = masters_error(zopt, emu)
        assert err == 0.0, f"step {step}: masters differ from the emulation by {err:.3e}"
    return err


# -- a Hugging Face model replicated over TP -----------------------------------------------------

CLIP = 0.1  # below GPT-2's gradient norms here: every step is clipped


def case_gpt2_replicated(root: str) -> list[tuple[float, float]]:
    """GPT-2 at stage 3 over mesh["dp"], the same model and batch on both TP ranks: parity with
    the 2-rank reference, clipping included; the TP replicas bit-identical. Then TP rank 0's DP
    group alone saves (the replicas are identical), and every rank loads that checkpoint."""
    dp, tp = _coords()
    make_opt = OPTIMIZERS["adamw"]
    ref, model = build_hf("gpt2"), build_hf("gpt2")
    model, opt = zerodp.initialize(
        model, make_opt(list(model.parameters())), config("gpt2", 3), _mesh()["dp"]
    )
    pair = Pair(model, opt, ref, make_opt(list(ref.parameters())))
    norms = [_clipped_step(pair, step, dp) for step in range(2)]
    saved = _flat(model)
    assert torch.equal(*_gather(saved[None], 0, _mesh()["tp"].get_group())), "TP replicas differ"
    if tp == 0:
        zerodp.save_checkpoint(root, model, opt)
    dist.barrier()  # TP rank 1's DP group must not look for the checkpoint before it is written
    _clipped_step(pair, 2, dp)
    assert not torch.equal(_flat(model), saved)
    zerodp.load_checkpoint(root, model, opt)
    assert torch.equal(_flat(model), saved), "the loaded model is not the saved one"
    return norms


def _clipped_step(pair: Pair, step: int, dp: int) -> tuple[float, float]:
    """One clipped step of the zerodp model and the reference; (zerodp's norm, torch's)."""
    loss = hf_loss(global_batches("gpt2", step, DP))
    reference_step(pair, loss, DP, step=False)
    want = torch.nn.utils.clip_grad_norm_(pair.ref.parameters(), CLIP).item()
    pair.ref_opt.step()
    pair.ref_opt.zero_grad()
    loss(pair.model, dp).backward()
    got = pair.opt.clip_grad_norm_(CLIP).item()
    pair.opt.step()
    pair.opt.zero_grad()
    err = max_error(pair.model, pair.ref)
    assert err <= TOLERANCE["adamw"], f"step {step}: max relative error {err:.3e}"
    return got, want


def _flat(model: nn.Module) -> torch.Tensor:
    with full(model):
        return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


# -- checkpoints of the TP model -----------------------------------------------------------------


def case_tp_checkpoints(root: str) -> str:
    """Each TP rank's DP group saves to its own directory and loads its own shards back; then
    both DP groups save into one root: the second to claim it raises. Returns "saved" or the
    error."""
    dp, tp = _coords()
    pair = _tp_pair(2)
    _tp_step(pair, 0, dp)
    mine = Path(root) / f"tp{tp}"
    zerodp.save_checkpoint(mine, pair.model, pair.opt)
    saved = reassembled(pair.model)
    _tp_step(pair, 1, dp)
    zerodp.load_checkpoint(mine, pair.model, pair.opt)
    back = reassembled(pair.model)
    for (name, p), q in zip(back.named_parameters(), saved.parameters(), strict=True):
        assert torch.equal(p, q), f"{name} after loading {mine} is not the saved one"
    try:
        zerodp.save_checkpoint(Path(root) / "shared", pair.model, pair.opt)
    except zerodp.CheckpointError as e:
        return str(e)
    return "saved"


def _tp_step(pair: Pair, step: int, dp: int) -> None:
    data = batches(step, DP, 3, [(D_IN,), (D_OUT,)])
    reference_step(pair, mse(data), DP)
    mse(data)(pair.model, dp).backward()
    pair.opt.step()
    pair.opt.zero_grad()


# -- groups zerodp refuses -----------------------------------------------------------------------


def case_refused_groups() -> list[str]:
    """A 2-D mesh, something that is not a group, and a group this rank is not in."""
    not_mine = dist.new_group([0, 1])  # every rank calls new_group; ranks 2, 3 are not in it
    groups: list[Any] = [_mesh(), "dp"] + ([not_mine] if dist.get_rank() >= 2 else [])
    errors = []
    for group in groups:
        model = build(FullMLP)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            zerodp.initialize(model, opt, zerodp.ZeroConfig(), process_group=group)
        except (TypeError, ValueError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    return errors


# -- tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tp_mlp_matches_the_full_mlp(world, stage):
    check_tp_mlp(world(DP * TP).run(case_tp_mlp, stage, timeout=TIMEOUT), stage)


def test_tp_mlp_bf16_matches_the_protocol(world):
    world(DP * TP).run(case_tp_mlp_bf16, 2, timeout=TIMEOUT)


def test_replicated_hf_model_stage3(world, tmp_path):
    for norms in world(DP * TP).run(case_gpt2_replicated, str(tmp_path), timeout=TIMEOUT):
        for got, want in norms:
            assert want > CLIP, "the step was not clipped"
            assert abs(got - want) <= 1e-5 * want, (got, want)


def test_one_dp_group_per_checkpoint_root(world, tmp_path):
    out = world(DP * TP).run(case_tp_checkpoints, str(tmp_path), timeout=TIMEOUT)
    # Ranks {0, 2} and {1, 3} are the two DP groups: one saved, the other raised on both ranks.
    assert out[0] == out[2] and out[1] == out[3], out
    assert sorted([out[0], out[1]])[1] == "saved", out
    error = out[0] if out[0] != "saved" else out[1]
    saver, loser = ((0, 2), (1, 3)) if out[0] == "saved" else ((1, 3), (0, 2))
    shared = tmp_path / "shared"
    assert f"{shared} is the checkpoint root of another data-parallel group of this job " in error
    assert f"(global ranks {list(saver)}); this group (global ranks {list(loser)})" in error
    assert 'save each tensor-parallel rank to its own directory (e.g. f"{root}/tp{tp_rank}")' in (
        error
    )
    manifest = zerodp.checkpoint.read_manifest(zerodp.checkpoint.resolve_checkpoint(shared))
    assert manifest.world_size == DP


def test_refused_groups(world):
    mesh_error = (
        "ValueError: process_group is a 2-D DeviceMesh (dimensions ('dp', 'tp')); zerodp "
        'shards over the data-parallel group only: pass that dimension, e.g. mesh["dp"]'
    )
    type_error = (
        "TypeError: process_group must be None (the default group), a "
        'torch.distributed.ProcessGroup or a 1-D DeviceMesh such as mesh["dp"]; got str'
    )
    for rank, errors in enumerate(world(DP * TP).run(case_refused_groups, timeout=TIMEOUT)):
        expected = [mesh_error, type_error]
        if rank >= 2:
            expected.append(
                f"ValueError: this process (global rank {rank}) is not a member of the "
                "process_group given to zerodp: call zerodp.initialize on the members of that "
                "group only, each with the data-parallel group it belongs to"
            )
        assert errors == expected, (rank, errors)
