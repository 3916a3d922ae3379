"""Tensor parallelism of the shipped GPT ([Note: tensor parallelism] in tensor_parallel/group.py)
with ZeRO over the data-parallel group: 4 ranks as DP 2 x TP 2 on gloo.

The mesh is ``init_device_mesh("cpu", (2, 2), ("dp", "tp"))``: DP groups {0, 2} and {1, 3},
TP groups {0, 1} and {2, 3}. Every rank builds the same full GPT under one seed; each TP rank
keeps its slices (``tensor_parallel_gpt``) and zerodp shards them over ``mesh["dp"]``. The
reference is that full GPT trained in one process on the global batch (both DP ranks' rows).
After every step the slices, gathered over TP and joined, match the reference within
``TOL_TP``, and the parameters every TP rank holds whole (norms, the position embedding, the
row-parallel biases) are bit-identical across the TP group.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from zerotest import TOL, full, sgd_momentum

import zerodp
from zerodp.apps.models.gpt import GPT, GPTConfig
from zerodp.apps.models.gpt_tp import tensor_parallel_gpt
from zerodp.tensor_parallel import TensorParallel, join_slices, layout_of

TIMEOUT = 240.0
DP, TP = 2, 2
PER_RANK = 2  # sequences per DP rank
SHAPE = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_embd=32)
# The TP model sums partial products over ranks (and the loss over vocabulary slices) in another
# order than the full model; measured 3.8e-7 after three steps, within fp32 parity's bound.
TOL_TP = TOL


@functools.cache
def _mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))


@functools.cache
def _tp() -> TensorParallel:
    return TensorParallel(_mesh()["tp"])


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ``[DP * PER_RANK, seq]`` ids and targets, a few -1 (as
    many in each DP rank's rows: the mean of their means is then the global mean)."""
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, SHAPE.vocab_size, (DP * PER_RANK, SHAPE.seq_len), generator=g)
    targets = torch.randint(0, SHAPE.vocab_size, (DP * PER_RANK, SHAPE.seq_len), generator=g)
    targets[::PER_RANK, :3] = -1
    return ids, targets


def _rows(t: torch.Tensor, dp: int) -> torch.Tensor:
    return t[dp * PER_RANK : (dp + 1) * PER_RANK]


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    # Not Adam: its first steps divide by the gradient's magnitude, so a gradient that is zero
    # in exact arithmetic (the key bias) turns rounding noise into a full-size update.
    return sgd_momentum(list(model.parameters()))


def _config(stage: int, **kw: Any) -> zerodp.ZeroConfig:
    return zerodp.ZeroConfig(stage=stage, bucket_bytes=4096, **kw)


def joined(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full parameters of a TP model: split ones gathered over TP and joined, whole ones
    checked bit-identical across TP (a collective over DP at stage 3, over TP always)."""
    layout = layout_of(model)
    assert layout is not None
    tp = layout.tp
    group = _mesh()["tp"].get_group()
    out = {}
    with full(model), torch.no_grad():
        for name, p in model.named_parameters():
            parts = [torch.empty_like(p) for _ in range(tp.size)]
            dist.all_gather(parts, p.detach().contiguous(), group=group)
            split = layout.splits.get(name)
            if split is None:
                assert all(torch.equal(parts[0], q) for q in parts), f"{name} differs across TP"
                out[name] = parts[0]
            else:
                out[name] = join_slices(parts, split)
    return out


def max_error(got: dict[str, torch.Tensor], ref: nn.Module) -> float:
    worst = 0.0
    for name, q in ref.named_parameters():
        p = got[name]
        assert p.shape == q.shape, (name, p.shape, q.shape)
        scale = q.norm().item() or 1.0
        worst = max(worst, (p - q).norm().item() / scale)
    return worst


def _pair(stage: int, shape: GPTConfig = SHAPE, **kw: Any) -> tuple[nn.Module, Any, GPT]:
    torch.manual_seed(0)
    ref = GPT(shape)
    model = tensor_parallel_gpt(copy.deepcopy(ref), _tp())
    model, opt = zerodp.initialize(
        model, _sgd(model), _config(stage, **kw), process_group=_mesh()["dp"]
    )
    return model, opt, ref


def case_parity(stage: int, tied: bool) -> dict[str, Any]:
    """Three SGD-momentum steps: parity with the full GPT, the TP ledger, the logits' shape."""
    dp = _mesh()["dp"].get_local_rank()
    shape = SHAPE if tied else GPTConfig(**{**SHAPE.__dict__, "tie_embeddings": False})
    model, opt, ref = _pair(stage, shape)
    ref_opt = _sgd(ref)
    tp = _tp()
    errors, losses = [], []
    for step in range(3):
        ids, targets = _batch(step)
        _, ref_loss = ref(ids, targets)
        assert ref_loss is not None
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        tp.ledger.end_step()
        logits, loss = model(_rows(ids, dp), _rows(targets, dp))
        assert loss is not None
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        errors.append(max_error(joined(model), ref))
    traffic = tp.ledger.end_step()
    return {
        "errors": errors,
        "losses": losses,
        "logits": tuple(logits.shape),
        "tp_elements": traffic.elements,
        "generated": tuple(model(_rows(ids, dp))[0].shape),
    }


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gpt_dp2_tp2_matches_the_full_gpt(world, stage):
    out = world(DP * TP).run(case_parity, stage, True, timeout=TIMEOUT)
    for rank, o in enumerate(out):
        assert max(o["errors"]) <= TOL_TP, (rank, o["errors"])
        assert o["logits"] == (PER_RANK, SHAPE.seq_len, SHAPE.vocab_size // TP)
        assert o["generated"] == (PER_RANK, SHAPE.seq_len, SHAPE.vocab_size)
    # TP ranks of one DP rank compute the same loss, bit for bit.
    assert out[0]["losses"] == out[1]["losses"] and out[2]["losses"] == out[3]["losses"]
    assert out[0]["losses"] != out[2]["losses"]
    # All-reduces over TP per step, [B, T, C] each: the embedding's and the two row-parallel
    # layers' of each block in forward, the two column-parallel layers' of each block and the
    # head's in backward; and three [B, T] vectors of the loss (max, target logit, sum of exp).
    btc = PER_RANK * SHAPE.seq_len * SHAPE.n_embd
    layers = SHAPE.n_layer
    want = btc * (1 + 2 * layers + 2 * layers + 1) + 3 * PER_RANK * SHAPE.seq_len
    assert out[0]["tp_elements"] == {"all_reduce": want}, out[0]["tp_elements"]


def test_untied_head_stage3(world):
    out = world(DP * TP).run(case_parity, 3, False, timeout=TIMEOUT)
    for rank, o in enumerate(out):
        assert max(o["errors"]) <= TOL_TP, (rank, o["errors"])
