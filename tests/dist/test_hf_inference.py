"""Inference the way Hugging Face users run it: ``model.generate`` on every rank with different
prompts and lengths (stage 3 and stage 2), generation on one rank inside
``zerodp.full_parameters``, the clear error for what cannot work, uneven numbers of eval batches
per rank, and module buffers (broadcast in training forwards only). See docs/stage3.md,
"Inference and generate", and docs/design.md, "Buffers"."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from zerotest import batches, build, rank_world

import zerodp

TIMEOUT = 120.0  # a hang fails the test after this (the cases take a few seconds each)
FAST = 20.0  # seconds within which every rank must have raised


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2, eos_token_id=1,
        bos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg).eval()


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, eos_token_id=1, bos_token_id=1,
        pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
        num_heads=2, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return T5ForConditionalGeneration(cfg).eval()


MODELS: dict[str, Callable[[], nn.Module]] = {"gpt2": _gpt2, "llama": _llama, "t5": _t5}


def _config(stage: int) -> zerodp.ZeroConfig:
    # Tiny models: every transformer layer its own unit, and a large-enough leaf under the root
    # (Llama's untied lm_head) an attached unit, as in a real model.
    stage3 = zerodp.Stage3(unit_min_numel=1, leaf_unit_min_numel=512)
    return zerodp.ZeroConfig(stage=stage, stage3=stage3)


def _init(factory: Callable[[], nn.Module], stage: int) -> tuple[nn.Module, nn.Module]:
    """(zerodp model, unsharded reference): the same weights (same seed)."""
    ref = build(factory)
    model = build(factory)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, _ = zerodp.initialize(model, opt, _config(stage))
    return model, ref


def _prompt(rank: int) -> tuple[torch.Tensor, int]:
    """Different prompt lengths and numbers of new tokens on each rank."""
    length, new = (5, 4) if rank == 0 else (2, 9)
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(2, 64, (2, length), generator=g), new


def _greedy(model: nn.Module, ids: torch.Tensor, new: int) -> torch.Tensor:
    mask = torch.ones_like(ids)
    return model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, num_beams=1
    )


def case_generate_everywhere(name: str, stage: int) -> list[list[int]]:
    """``model.generate`` on every rank, different prompt lengths and ``max_new_tokens``: equal
    to the unsharded model's greedy generation."""
    rank, _ = rank_world()
    model, ref = _init(MODELS[name], stage)
    ids, new = _prompt(rank)
    out = _greedy(model, ids, new)
    expected = _greedy(ref, ids, new)
    assert torch.equal(out, expected), f"rank {rank}: {out.tolist()} != {expected.tolist()}"
    # Again: the first call must leave the model usable (nothing held, nothing in flight).
    again = _greedy(model, ids[:, :1], 3)
    assert torch.equal(again, _greedy(ref, ids[:, :1], 3)), f"rank {rank}: second generate"
    return out.tolist()


@pytest.mark.parametrize(("name", "stage"), [("gpt2", 3), ("llama", 3), ("t5", 3), ("llama", 2)])
def test_generate_on_every_rank_matches_unsharded(world, name, stage):
    world(2).run(case_generate_everywhere, name, stage, timeout=TIMEOUT)


def case_generate_on_rank_zero(name: str) -> int:
    """The documented recipe: every rank enters ``full_parameters``, rank 0 alone generates;
    inside, forward hooks issue no collective (the order check's exchanges do not move)."""
    rank, _ = rank_world()
    model, ref = _init(MODELS[name], 3)
    ids, new = _prompt(0)
    check = model.zero_engine.params.check
    with zerodp.full_parameters(model, writeback=False):
        before = check.calls
        if rank == 0:
            out = _greedy(model, ids, new)
            assert torch.equal(out, _greedy(ref, ids, new)), f"{out.tolist()}"
        exchanges = check.calls - before
    assert exchanges == 0, f"rank {rank}: {exchanges} order-check exchanges inside full_parameters"
    # Afterwards the model is sharded again and generates on every rank as usual.
    ids, new = _prompt(rank)
    assert torch.equal(_greedy(model, ids, new), _greedy(ref, ids, new)), f"rank {rank}: after"
    return exchanges


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_generate_on_one_rank_inside_full_parameters(world, name):
    assert world(2).run(case_generate_on_rank_zero, name, timeout=TIMEOUT) == [0, 0]


def _raises_fast(fn: Callable[[], object]) -> str:
    start = time.monotonic()
    try:
        fn()
    except RuntimeError as e:
        took = time.monotonic() - start
        assert took < FAST, f"raised after {took:.1f} s"
        return str(e)
    raise AssertionError("no error")


def case_generate_on_rank_zero_alone() -> str:
    """Rank 0 calls ``model.generate`` without the recipe while rank 1 evaluates a batch: every
    rank raises, naming the problem and the fix, instead of hanging."""
    rank, _ = rank_world()
    model, _ = _init(_gpt2, 3)
    ids, new = _prompt(0)
    if rank == 0:
        return _raises_fast(lambda: _greedy(model, ids, new))
    with torch.no_grad():
        return _raises_fast(lambda: model(ids))


def test_generate_on_one_rank_alone_raises_everywhere(world):
    for msg in world(2).run(case_generate_on_rank_zero_alone, timeout=TIMEOUT):
        assert msg.startswith(
            "zerodp stage 3: ranks diverged at a parameter collective: rank 0 starts "
            "model.generate; rank 1 starts a forward without gradients (eval / no_grad)."
        ), msg
        assert "with zerodp.full_parameters(model):" in msg, msg


class Scaled(nn.Module):
    """A model with a buffer used in forward (broadcasting buffers used to make every forward
    a collective)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.fc2 = nn.Linear(12, 3)
        self.register_buffer("scale", torch.tensor([1.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) * self.scale


def _stage_config(stage: int) -> zerodp.ZeroConfig:
    units = ("Linear",) if stage == 3 else ()
    return zerodp.ZeroConfig(stage=stage, bucket_bytes=96, stage3=zerodp.Stage3(unit_classes=units))


def _trained_pair(stage: int) -> tuple[nn.Module, zerodp.ZeroOptimizer, nn.Module]:
    """One synchronised training step on both; the step's parameter gather (stages 1-2) is left
    in flight, as after any real step."""
    rank, world = rank_world()
    ref = build(Scaled)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model = build(Scaled)
    model, opt = zerodp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), _stage_config(stage)
    )
    data = batches(0, world, 4, [(6,), (3,)])
    (sum(F.mse_loss(ref(x), y) for x, y in data) / world).backward()
    ref_opt.step()
    x, y = data[rank]
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    return model, opt, ref


def _eval_batches(rank: int) -> list[torch.Tensor]:
    """Three batches on rank 0, one on rank 1."""
    return [
        torch.randn(3, 6, generator=torch.Generator().manual_seed(k)) for k in range(3 - 2 * rank)
    ]


def case_uneven_eval(stage: int) -> list[int]:
    """Rank 0 evaluates 3 batches, rank 1 one (eval mode, with and without ``no_grad``): no
    collective, outputs equal the reference's; then both train a step together."""
    rank, _ = rank_world()
    model, opt, ref = _trained_pair(stage)
    model.eval()
    ref.eval()
    done = []
    for k, x in enumerate(_eval_batches(rank)):
        with torch.no_grad() if k % 2 == 0 else torch.enable_grad():
            out = model(x)
        torch.testing.assert_close(out, ref(x), msg=lambda m, k=k: f"rank {rank} batch {k}: {m}")
        done.append(k)
    model.train()
    F.mse_loss(model(torch.ones(2, 6)), torch.zeros(2, 3)).backward()
    opt.step()
    return done


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_uneven_eval_batches_do_not_hang(world, stage):
    assert world(2).run(case_uneven_eval, stage, timeout=TIMEOUT) == [[0, 1, 2], [0]]


def case_uneven_eval_stage3_recipe() -> list[int]:
    """Stage 3: uneven evaluation inside ``full_parameters`` (the full model held on every rank
    for the block) issues no collective and matches the reference."""
    rank, _ = rank_world()
    model, _, ref = _trained_pair(3)
    model.eval()
    done = []
    with zerodp.full_parameters(model, writeback=False), torch.no_grad():
        for k, x in enumerate(_eval_batches(rank)):
            torch.testing.assert_close(model(x), ref(x), msg=lambda m: f"rank {rank}: {m}")
            done.append(k)
    return done


def test_uneven_eval_stage3_inside_full_parameters(world):
    assert world(2).run(case_uneven_eval_stage3_recipe, timeout=TIMEOUT) == [[0, 1, 2], [0]]


def case_uneven_eval_stage3_error() -> str:
    """Stage 3 without the recipe: rank 1 evaluates fewer batches and goes on training while
    rank 0 still evaluates; both raise quickly."""
    rank, _ = rank_world()
    model, _, _ = _trained_pair(3)
    batches_ = _eval_batches(rank)
    with torch.no_grad():
        for x in batches_[:1]:
            model(x)

    def rest() -> None:
        if rank == 0:
            with torch.no_grad():
                model(batches_[1])
        else:
            model(torch.ones(2, 6)).sum().backward()

    return _raises_fast(rest)


def test_uneven_eval_stage3_raises_everywhere(world):
    for msg in world(2).run(case_uneven_eval_stage3_error, timeout=TIMEOUT):
        assert msg.startswith(
            "zerodp stage 3: ranks diverged at a parameter collective: rank 0 starts a "
            "forward without gradients (eval / no_grad); rank 1 starts a training forward."
        ), msg
        assert "zerodp.full_parameters" in msg, msg


def case_buffers(stage: int) -> list[float]:
    """A buffer that differs per rank stays different through eval and no_grad forwards (no
    collective there) and equals rank 0's after a training forward."""
    rank, _ = rank_world()
    model = build(Scaled)
    model, _ = zerodp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), _stage_config(stage)
    )
    model.scale.fill_(2.0 + rank)
    x = torch.ones(2, 6)
    with torch.no_grad():
        model(x)
    model.eval()
    model(x)
    model.train()
    seen = [model.scale.item()]
    model(x).sum().backward()
    return [*seen, model.scale.item()]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_buffers_broadcast_in_training_forward_only(world, stage):
    assert world(2).run(case_buffers, stage, timeout=TIMEOUT) == [[2.0, 2.0], [3.0, 2.0]]


def test_generate_on_a_single_rank_world(world):
    """World size 1: no synced_gpus, but T5's direct encoder call still needs the root held."""
    world(1).run(case_generate_everywhere, "t5", 3, timeout=TIMEOUT)


class Syncable(Scaled):
    """A ``generate`` with transformers' ``synced_gpus`` argument (without importing it in 4
    ranks)."""

    def generate(self, x: torch.Tensor, synced_gpus: bool | None = None) -> torch.Tensor:
        return self(x)


def case_generate_on_a_subgroup() -> str:
    """transformers synchronises ``synced_gpus`` over the default group: with zerodp on a
    subgroup the default cannot be used, and ``generate`` says so on every rank."""
    rank, _ = rank_world()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    model = build(Syncable)
    model, _ = zerodp.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        _stage_config(3),
        process_group=groups[rank // 2],
    )
    return _raises_fast(lambda: model.generate(torch.ones(2, 6)))


def test_generate_on_a_subgroup_raises(world):
    for msg in world(4).run(case_generate_on_a_subgroup, timeout=TIMEOUT):
        assert msg.startswith(
            "zerodp stage 3: model.generate needs synced_gpus=True to keep ranks in step, and "
            "transformers synchronises it over the default process group, which is larger than "
            "the ranks holding this model (zerodp's process_group, times its tensor-parallel "
            "group)."
        ), msg
