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
from hf_models import global_batches
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from zerotest import TOL, full, sgd_momentum

import zerodp
from zerodp.apps.models.gpt import GPT, GPTConfig
from zerodp.apps.models.gpt_tp import tensor_parallel_gpt
from zerodp.memory import GPTShape, gpt_block_params, gpt_param_count, gpt_saved_bytes
from zerodp.memory.saved import SavedForBackward
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


def case_parity(stage: int, tied: bool, clip: float | None = None) -> dict[str, Any]:
    """Three SGD-momentum steps: parity with the full GPT, the TP ledger, the logits' shape;
    with ``clip``, both clipped to that norm ([Note: norms under tensor parallelism])."""
    dp = _mesh()["dp"].get_local_rank()
    shape = SHAPE if tied else GPTConfig(**{**SHAPE.__dict__, "tie_embeddings": False})
    model, opt, ref = _pair(stage, shape)
    ref_opt = _sgd(ref)
    tp = _tp()
    errors, losses, norms = [], [], []
    for step in range(3):
        ids, targets = _batch(step)
        _, ref_loss = ref(ids, targets)
        assert ref_loss is not None
        ref_loss.backward()
        if clip is not None:
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).item()
        ref_opt.step()
        ref_opt.zero_grad()
        tp.ledger.end_step()
        logits, loss = model(_rows(ids, dp), _rows(targets, dp))
        assert loss is not None
        loss.backward()
        if clip is not None:
            norms.append((opt.clip_grad_norm_(clip).item(), want))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        errors.append(max_error(joined(model), ref))
    traffic = tp.ledger.end_step()
    return {
        "errors": errors,
        "norms": norms,
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


CLIP = 0.5  # below the norms of these steps (about 1.5): every step is clipped


@pytest.mark.parametrize("stage", [1, 3])
def test_clipping_spans_dp_and_tp(world, stage):
    """The norm of the whole model, each whole parameter once: the reference's, on every rank;
    parity (and whole parameters identical across TP) after clipped steps."""
    out = world(DP * TP).run(case_parity, stage, True, CLIP, timeout=TIMEOUT)
    for rank, o in enumerate(out):
        assert max(o["errors"]) <= TOL_TP, (rank, o["errors"])
        for got, want in o["norms"]:
            assert want > CLIP, "the step was not clipped"
            assert abs(got - want) <= 1e-5 * want, (rank, got, want)


def test_untied_head_stage3(world):
    out = world(DP * TP).run(case_parity, 3, False, timeout=TIMEOUT)
    for rank, o in enumerate(out):
        assert max(o["errors"]) <= TOL_TP, (rank, o["errors"])


# -- activations saved for backward ([Note: GPT activations] in memory/activations.py) ---------


def case_saved(dtype: torch.dtype, checkpoint: bool) -> tuple[int, int]:
    """(bytes a split GPT's training forward saves for its backward, the formula's); the
    parameters per TP rank are ``gpt_param_count``'s."""
    torch.manual_seed(0)
    shape = GPTConfig(vocab_size=96, seq_len=8, n_layer=2, n_head=4, n_embd=48)
    model = tensor_parallel_gpt(GPT(shape), _tp()).to(dtype)
    for block in model.blocks if checkpoint else []:
        zerodp.checkpoint_wrapper(block)
    ids, targets = _batch(0)
    ids, targets = ids[:3, :8] % 96, targets[:3, :8] % 96
    meter = SavedForBackward(model.parameters())
    with meter:
        loss = model(ids, targets)[1]
    assert loss is not None
    loss.backward()
    gpt = GPTShape(layers=2, hidden=48, vocab=96, seq_len=8, micro_batch=3, heads=4)
    params = sum(p.numel() for p in model.parameters())
    assert params == gpt_param_count(gpt, tensor_parallel=TP), params
    block = sum(p.numel() for p in model.blocks[0].parameters())
    assert block == gpt_block_params(gpt, tensor_parallel=TP), block
    size = torch.finfo(dtype).bits // 8
    return meter.nbytes, gpt_saved_bytes(
        gpt, dtype_bytes=size, checkpointing=checkpoint, tensor_parallel=TP
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_saved_activations_are_the_formula(world, dtype, checkpoint):
    for measured, formula in world(DP * TP).run(case_saved, dtype, checkpoint, timeout=TIMEOUT):
        assert measured == formula, (measured, formula)


# -- partitioned activation checkpoints ([Note: partitioned checkpoints]) ------------------------


def case_partitioned(stage: int, partition: bool) -> dict[str, Any]:
    """Blocks checkpointed, their inputs partitioned over TP or not: parity with the full GPT
    (trained without checkpointing), the checkpoint bytes a rank keeps after a forward, the TP
    traffic of a step."""
    from zerodp.activations import offload_of

    dp = _mesh()["dp"].get_local_rank()
    activations = zerodp.Activations(checkpoint=("Block",), partition=partition)
    model, opt, ref = _pair(stage, activations=activations)
    ref_opt = _sgd(ref)
    store = offload_of(model.blocks[0])
    tp = _tp()
    errors, kept, device = [], [], []
    for step in range(3):
        ids, targets = _batch(step)
        _step(ref, ref_opt, ids, targets)
        tp.ledger.end_step()
        meter = SavedForBackward(model.parameters())
        with meter:
            _, loss = model(_rows(ids, dp), _rows(targets, dp))
        assert loss is not None
        kept.append(store.resident_bytes() if store is not None else None)
        # What the forward left on the device: autograd's tensors and the store's slices.
        device.append(meter.alive_bytes() + (kept[-1] or 0))
        meter.release()
        loss.backward()
        opt.step()
        opt.zero_grad()
        errors.append(max_error(joined(model), ref))
    return {
        "errors": errors,
        "kept": kept,
        "device": device,
        "tp": tp.ledger.end_step().elements,
    }


@pytest.mark.parametrize("stage", [1, 3])
def test_partitioned_checkpoints(world, stage):
    plain = world(DP * TP).run(case_partitioned, stage, False, timeout=TIMEOUT)
    split = world(DP * TP).run(case_partitioned, stage, True, timeout=TIMEOUT)
    btc = PER_RANK * SHAPE.seq_len * SHAPE.n_embd
    layers = SHAPE.n_layer
    for rank in range(DP * TP):
        for o in (plain[rank], split[rank]):
            assert max(o["errors"]) <= TOL_TP, (rank, o["errors"])
        # Each block's input, [B, T, C] fp32, kept as one slice of TP.
        assert split[rank]["kept"] == [layers * btc * 4 // TP] * 3, split[rank]["kept"]
        assert plain[rank]["kept"] == [None] * 3
        gpt = GPTShape(
            layers=layers,
            hidden=SHAPE.n_embd,
            vocab=SHAPE.vocab_size,
            seq_len=SHAPE.seq_len,
            micro_batch=PER_RANK,
            heads=SHAPE.n_head,
        )
        for o, partitioned in ((plain[rank], False), (split[rank], True)):
            formula = gpt_saved_bytes(
                gpt,
                dtype_bytes=4,
                checkpointing=True,
                tensor_parallel=TP,
                partitioned=partitioned,
            )
            assert o["device"] == [formula] * 3, (partitioned, o["device"], formula)
        # A recompute re-runs the attention's row-parallel all-reduce of its block, not the
        # MLP's: torch's non-reentrant checkpoint stops once it has every tensor the backward
        # saved, and nothing saved that last output. Partitioning adds one all-gather of each
        # block's input: 7.6% of the step's TP volume here (the paper's units: an all-reduce
        # counts twice).
        base = btc * (1 + 2 * layers + 2 * layers + 1) + 3 * PER_RANK * SHAPE.seq_len
        assert plain[rank]["tp"] == {"all_reduce": base + layers * btc}, plain[rank]["tp"]
        want = {"all_reduce": base + layers * btc, "all_gather": layers * btc}
        assert split[rank]["tp"] == want, split[rank]["tp"]


# -- checkpoints ([Note: tensor-parallel checkpoints] in checkpoint/tensor_parallel.py) -----------


def _step(model: nn.Module, opt: Any, ids: torch.Tensor, targets: torch.Tensor) -> None:
    _, loss = model(ids, targets)
    assert loss is not None
    loss.backward()
    opt.step()
    opt.zero_grad()


def _ref_steps(ref: nn.Module, ref_opt: Any, steps: range) -> None:
    for step in steps:
        _step(ref, ref_opt, *_batch(step))


def case_checkpoints(root: str) -> dict[str, Any]:
    """DP 2 x TP 2 at stage 2 saves after two steps; each TP pair, as DP 1 x TP 2 at stage 3,
    loads it, matches the saved slices bit for bit, and its next step (the whole global batch
    on one DP rank) matches the full GPT's third step; rank 0 consolidates the full model; a
    full state_dict loads into a split model."""
    dp, rank = _mesh()["dp"].get_local_rank(), dist.get_rank()
    model, opt, ref = _pair(2)
    ref_opt = _sgd(ref)
    for step in range(2):
        ids, targets = _batch(step)
        _step(model, opt, _rows(ids, dp), _rows(targets, dp))
    _ref_steps(ref, ref_opt, range(2))
    path = zerodp.save_checkpoint(root, model, opt)
    saved = joined(model)
    # One DP group per rank: each TP pair {0, 1} and {2, 3} is a whole DP 1 x TP 2 run.
    alone = [dist.new_group([r]) for r in range(DP * TP)][rank]
    torch.manual_seed(7)  # other weights: the load must replace all of them
    small = tensor_parallel_gpt(GPT(SHAPE), _tp())
    small, small_opt = zerodp.initialize(small, _sgd(small), _config(3), process_group=alone)
    zerodp.load_checkpoint(root, small, small_opt)
    loaded = joined(small)
    same = all(torch.equal(loaded[n], saved[n]) for n in saved)
    _step(small, small_opt, *_batch(2))
    _ref_steps(ref, ref_opt, range(2, 3))
    out: dict[str, Any] = {"path": str(path), "same": same, "error": max_error(joined(small), ref)}
    # Full weights (pretrained, say) into a split model: each rank keeps its slices.
    torch.manual_seed(9)
    fresh = tensor_parallel_gpt(GPT(SHAPE), _tp())
    fresh, fresh_opt = zerodp.initialize(fresh, _sgd(fresh), _config(3), _mesh()["dp"])
    zerodp.load_model_state_dict(fresh, fresh_opt, ref.state_dict())
    now = joined(fresh)
    out["pretrained"] = all(torch.equal(now[n], q) for n, q in ref.named_parameters())
    if rank == 0:
        full_file = f"{root}/full.safetensors"
        zerodp.consolidate_checkpoint(root, full_file)
        from safetensors.torch import load_file

        consolidated = load_file(full_file)
        out["consolidated"] = sorted(n for n in saved if torch.equal(consolidated[n], saved[n]))
        out["keys"] = sorted(consolidated)
    return out


def test_checkpoints_reshard_over_dp_and_consolidate(world, tmp_path):
    out = world(DP * TP).run(case_checkpoints, str(tmp_path), timeout=TIMEOUT)
    for rank, o in enumerate(out):
        assert o["path"] == str(tmp_path / f"tp{rank % TP}" / "step-00000002"), o["path"]
        assert o["same"], f"rank {rank}: the loaded slices are not the saved ones"
        assert o["error"] <= TOL_TP, (rank, o["error"])
        assert o["pretrained"], f"rank {rank}: the full state_dict was not sliced"
    torch.manual_seed(0)
    names = sorted(n for n, _ in GPT(SHAPE).named_parameters())
    assert out[0]["keys"] == names
    assert out[0]["consolidated"] == names  # every tensor the saved full one, bit for bit


def case_partial_save(root: str) -> dict[str, Any]:
    """TP rank 1's newest step is missing (its save failed): every rank loads the newest step
    both TP ranks saved, and consolidation takes that step too; one tp<r> alone is refused."""
    from zerodp.checkpoint import faults

    rank, tp_rank = dist.get_rank(), _tp().rank
    model, opt, _ = _pair(1)
    ids, targets = _batch(0)
    _step(model, opt, _rows(ids, 0), _rows(targets, 0))
    zerodp.save_checkpoint(root, model, opt, keep_last=1)
    _step(model, opt, _rows(ids, 0), _rows(targets, 0))

    def disk_full(rank: int, index: int, count: int, flush: Any) -> None:
        raise OSError("No space left on device")

    faults.hooks.writing_rank_file = disk_full if tp_rank == 1 else None
    try:
        failed = _error(lambda: zerodp.save_checkpoint(root, model, opt, keep_last=1))
    finally:
        faults.hooks.writing_rank_file = None
    fresh, fresh_opt, _ = _pair(1)
    zerodp.load_checkpoint(root, fresh, fresh_opt)
    out: dict[str, Any] = {"steps": fresh_opt.steps, "failed": failed.splitlines()[0]}
    if rank == 0:
        out["consolidated"] = zerodp.consolidate_checkpoint(root, f"{root}/full.st").step
        out["one_part"] = _error(lambda: zerodp.consolidate_checkpoint(f"{root}/tp0", "x.st"))
    return out


def test_a_step_some_tp_rank_lacks_is_passed_over(world, tmp_path):
    """The second save fails on TP rank 1 (its disk is full): every rank raises; keep_last=1
    prunes only once every TP rank has the new step, so step 1 survives and is loaded."""
    out = world(DP * TP).run(case_partial_save, str(tmp_path), timeout=TIMEOUT)
    assert [o["steps"] for o in out] == [1, 1, 1, 1]
    for o in out:
        assert o["failed"] == (
            f"CheckpointError: save_checkpoint({tmp_path}) failed on tensor-parallel rank(s) "
            "[1]; the steps every TP rank saved stay loadable (load_checkpoint takes the newest "
            "of them):"
        ), o["failed"]
    assert (tmp_path / "tp0" / "step-00000002").is_dir()  # published before TP rank 1 failed
    assert out[0]["consolidated"] == 1
    step = tmp_path / "tp0" / "step-00000002"
    assert out[0]["one_part"] == (
        f"CheckpointError: cannot consolidate {step}: it holds tensor-parallel rank 0's slices "
        "of a model split 2 ways; consolidate the directory that holds tp0/, tp1/, ... (the "
        "slices are joined into the full model)"
    )


# -- misuse ----------------------------------------------------------------------------------------


def _error(fn: Any) -> str:
    try:
        fn()
    except (ValueError, zerodp.CheckpointError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def case_misuse(root: str) -> list[str]:
    """Each misuse raises naming the problem and the fix, before the model changes."""
    from zerodp.tensor_parallel import Colwise, VocabEmbedding, parallelize

    tp = _tp()
    torch.manual_seed(0)
    gpt = GPT(SHAPE)
    before = {n: p.clone() for n, p in gpt.state_dict().items()}
    errors = [
        _error(
            lambda: parallelize(
                gpt, tp, {"blocks.*.attn.c_attn": Colwise(chunks=3), "blocks.*.mlp.fc": Colwise()}
            )
        ),
        _error(lambda: parallelize(gpt, tp, {"wte": Colwise()})),
        _error(lambda: tensor_parallel_gpt(GPT(GPTConfig(64, 16, 1, 3, 48)), tp)),
        _error(lambda: tensor_parallel_gpt(GPT(GPTConfig(64, 16, 1, 4, 32, dropout=0.1)), tp)),
    ]
    unchanged = all(torch.equal(before[n], t) for n, t in gpt.state_dict().items())
    errors.append(f"unchanged: {unchanged}")
    model, opt, _ = _pair(1)
    errors.append(_error(lambda: tensor_parallel_gpt(model, tp)))
    zerodp.save_checkpoint(root, model, opt)
    torch.manual_seed(0)
    plain = GPT(SHAPE)
    plain, plain_opt = zerodp.initialize(plain, _sgd(plain), _config(1))
    errors.append(_error(lambda: tensor_parallel_gpt(plain, tp)))
    errors.append(_error(lambda: zerodp.load_checkpoint(root, plain, plain_opt)))
    alone = [dist.new_group([r]) for r in range(DP * TP)][dist.get_rank()]
    torch.manual_seed(0)
    one = tensor_parallel_gpt(GPT(SHAPE), TensorParallel(alone))  # "split" one way
    one, one_opt = zerodp.initialize(one, _sgd(one), _config(1), process_group=alone)
    errors.append(_error(lambda: zerodp.load_checkpoint(root, one, one_opt)))
    activations = zerodp.Activations(checkpoint=("Block",), partition=True)
    unsplit = GPT(SHAPE)
    config = _config(1, activations=activations)
    errors.append(_error(lambda: zerodp.initialize(unsplit, _sgd(unsplit), config)))
    # Tied weights: split alike they stay one parameter; split one way only, refused.
    tied = _Tied()
    parallelize(tied, tp, {"emb": VocabEmbedding(), "head": Colwise(gather_output=True)})
    errors.append(f"tied: {tied.emb.weight is tied.head.weight}, {tuple(tied.emb.weight.shape)}")
    errors.append(_error(lambda: parallelize(_Tied(), tp, {"emb": VocabEmbedding()})))
    # A submodule split, the model given to initialize not.
    outer = nn.Sequential(tensor_parallel_gpt(GPT(SHAPE), tp))
    errors.append(_error(lambda: zerodp.initialize(outer, _sgd(outer), _config(1))))
    # P_a of a module whose input is split (the row-parallel projections' is): refused.
    rows = zerodp.Activations(checkpoint=("Linear",), partition=True)
    model, opt, _ = _pair(1, activations=rows)
    ids, targets = _batch(0)
    errors.append(_error(lambda: model(_rows(ids, 0), _rows(targets, 0))))
    return errors


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight


def test_misuse_is_refused(world, tmp_path):
    out = world(DP * TP).run(case_misuse, str(tmp_path), timeout=TIMEOUT)
    errors = out[0]
    assert errors[0].startswith(
        "ValueError: the tensor-parallel plan names 'blocks.*.mlp.fc', which matches no module "
        "of GPT (its modules include ['wte', "
    ), errors[0]
    assert errors[1] == "ValueError: Colwise splits an nn.Linear; wte is of class Embedding", (
        errors[1]
    )
    assert errors[2] == "ValueError: n_head=3 cannot be split over 2 tensor-parallel ranks"
    assert errors[3] == (
        "ValueError: tensor parallelism of the shipped GPT runs without dropout (dropout=0.1); "
        "set GPTConfig.dropout=0"
    )
    assert errors[4] == "unchanged: True"
    assert errors[5] == "ValueError: the model is split over a tensor-parallel group already"
    assert errors[6] == (
        "ValueError: parallelize the model before zerodp.initialize: zerodp shards the "
        "tensor-parallel slices over the data-parallel group, not the other way round"
    )
    assert errors[7] == (
        f"CheckpointError: cannot load checkpoint {tmp_path}; nothing was changed:\n  every rank: "
        f"{tmp_path} holds the checkpoints of a model split over a tensor-parallel group (tp0/, "
        "tp1/, ...) and this model is not split: parallelize it the same way, or consolidate "
        "the checkpoint (zerodp.consolidate_checkpoint) and load the full state_dict"
    ), errors[7]
    assert errors[8] == (
        f"CheckpointError: cannot load checkpoint {tmp_path}; nothing was changed:\n  every "
        "rank: the checkpoint was saved at tensor-parallel size 2, the model is split 1 ways: "
        "consolidate it (zerodp.consolidate_checkpoint), then load the full state_dict into the "
        "newly split model (load_model_state_dict)"
    ), errors[8]
    assert errors[9] == (
        "ValueError: ZeroConfig.activations.partition=True partitions checkpoints over the "
        "model's tensor-parallel group, and this model is not split: split it with "
        "zerodp.tensor_parallel.parallelize before zerodp.initialize"
    ), errors[9]
    assert errors[10] == "tied: True, (4, 4)", errors[10]
    assert errors[11] == (
        "ValueError: tied parameters must be split alike, or untied first: emb.weight "
        "Split(dim=0, chunks=1), head.weight whole (give both modules styles that split the "
        "weight the same way, e.g. VocabEmbedding and Colwise for a tied embedding and head)"
    ), errors[11]
    assert errors[12] == (
        "ValueError: 0 was split with zerodp.tensor_parallel.parallelize and the model given to "
        "zerodp.initialize was not: parallelize the model you pass to initialize (the plan's "
        "names then start with '0.')"
    ), errors[12]
    assert errors[13] == (
        "ValueError: Activations(partition=True): a checkpointed module's input differs "
        "between the tensor-parallel ranks (its input is split, as a row-parallel layer's is); "
        "partition only modules whose input every TP rank holds whole (transformer layers)"
    ), errors[13]
    for rank, o in enumerate(out[1:], 1):  # the paths in the messages are the same root
        assert o == errors, (rank, o)


# -- a Hugging Face Llama, split by a plan of its module names ---------------------------------


def _llama_plan() -> dict[str, Any]:
    from zerodp.tensor_parallel import Colwise, Rowwise, VocabEmbedding

    attn, mlp = "model.layers.*.self_attn", "model.layers.*.mlp"
    return {
        "model.embed_tokens": VocabEmbedding(),  # with padding_idx (pad_token_id=2)
        f"{attn}.[qkv]_proj": Colwise(),
        f"{attn}.o_proj": Rowwise(),
        f"{mlp}.gate_proj": Colwise(),
        f"{mlp}.up_proj": Colwise(),
        f"{mlp}.down_proj": Rowwise(),
        "lm_head": Colwise(gather_output=True),  # Hugging Face's loss takes the full logits
    }


def _llama() -> nn.Module:
    from hf_models import _quiet, llama_config
    from transformers import LlamaForCausalLM

    _quiet()
    config = llama_config()
    config.num_key_value_heads = 2  # one key/value head per TP rank
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def case_llama(stage: int, partition: bool) -> dict[str, Any]:
    """Three SGD-momentum steps of a Llama split by ``_llama_plan`` (``partition``: its layers
    checkpointed, their inputs partitioned over TP): parity with the full one; then greedy
    generation (different prompts on the two DP ranks) equal to the full model's."""
    from hf_models import global_batches

    from zerodp.tensor_parallel import parallelize

    dp = _mesh()["dp"].get_local_rank()
    ref = _llama()
    model = parallelize(copy.deepcopy(ref), _tp(), _llama_plan())
    activations = zerodp.Activations(checkpoint=("LlamaDecoderLayer",), partition=True)
    extra = {"activations": activations} if partition else {}
    model, opt = zerodp.initialize(model, _sgd(model), _config(stage, **extra), _mesh()["dp"])
    ref_opt = _sgd(ref)
    errors, gathered = [], []
    for step in range(3):
        data = global_batches("llama", step, DP)
        (sum(ref(**d).loss for d in data) / DP).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        _tp().ledger.end_step()
        model(**data[dp]).loss.backward()
        opt.step()
        opt.zero_grad()
        gathered.append(_tp().ledger.end_step().elements.get("all_gather", 0))
        errors.append(max_error(joined(model), ref))
    g = torch.Generator().manual_seed(100 + dp)
    ids = torch.randint(3, 64, (2, 3 + 2 * dp), generator=g)
    kwargs = {"attention_mask": torch.ones_like(ids), "do_sample": False, "num_beams": 1}
    out = model.generate(input_ids=ids, max_new_tokens=4 + 3 * dp, **kwargs)
    want = ref.generate(input_ids=ids, max_new_tokens=4 + 3 * dp, **kwargs)
    return {"errors": errors, "generated": torch.equal(out, want), "gathered": gathered}


@pytest.mark.parametrize(("stage", "partition"), [(2, False), (3, True)])
def test_hf_llama_dp2_tp2_matches_the_full_llama(world, stage, partition):
    out = world(DP * TP).run(case_llama, stage, partition, timeout=TIMEOUT)
    config = _llama().config
    seq = next(iter(global_batches("llama", 0, DP)[0].values())).shape
    # The head's logits [B, T, V] gathered for the loss; partitioned: each layer's input
    # [B, T, H] too, once per step.
    logits = seq[0] * seq[1] * config.vocab_size
    inputs = config.num_hidden_layers * seq[0] * seq[1] * config.hidden_size
    for rank, o in enumerate(out):
        assert max(o["errors"]) <= TOL_TP, (rank, o["errors"])
        assert o["generated"], f"rank {rank}: greedy generation differs from the full model's"
        assert o["gathered"] == [logits + (inputs if partition else 0)] * 3, o["gathered"]
