"""The reference GPT: preset sizes, weight tying, shapes, init, meta-device build, sampling."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from zerodp.apps.data import BatchSampler, load_corpus
from zerodp.apps.models import GPT, PRESETS, Block, GPTConfig, generate, get_config, num_parameters

# Exact sizes of the presets; the benchmarks and docs quote them, so a change must be deliberate.
EXPECTED_PARAMS = {
    "tiny": 120_576,
    "small": 3_257_856,
    "bench25m": 25_416_704,
    "gpt120m": 119_757_312,
    "gpt1b": 1_011_572_736,
}


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    """Tiny matmuls gain nothing from intra-op threads, and on a busy 2-core box OpenMP threads
    contending with other processes make them up to 100x slower; restore afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _closed_form_params(c: GPTConfig) -> int:
    """Parameter count from the architecture (biases on, so 13*d per block beside 12*d^2)."""
    per_block = 12 * c.n_embd**2 + 13 * c.n_embd
    embeddings = (c.vocab_size + c.seq_len) * c.n_embd
    head = 0 if c.tie_embeddings else c.vocab_size * c.n_embd
    return c.n_layer * per_block + embeddings + 2 * c.n_embd + head


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_preset_parameter_counts(name: str) -> None:
    config = PRESETS[name]
    assert _closed_form_params(config) == EXPECTED_PARAMS[name]
    if name in ("tiny", "small"):  # cheap enough to build for real
        assert num_parameters(GPT(config)) == EXPECTED_PARAMS[name]
    else:  # meta: counts without allocating or initialising 100M+ floats
        with torch.device("meta"):
            assert num_parameters(GPT(config)) == EXPECTED_PARAMS[name]


def test_preset_ranges() -> None:
    assert 24_000_000 <= EXPECTED_PARAMS["bench25m"] <= 26_000_000
    assert 3_000_000 <= EXPECTED_PARAMS["small"] <= 6_000_000
    assert PRESETS["small"].vocab_size == PRESETS["tiny"].vocab_size == 256


def test_tied_head_is_the_embedding_parameter() -> None:
    model = GPT(PRESETS["tiny"])
    assert model.head_weight() is model.wte.weight
    assert sum(p is model.wte.weight for p in model.parameters()) == 1
    assert num_parameters(model) == sum(p.numel() for p in model.parameters())


def test_untied_head_is_a_separate_parameter() -> None:
    model = GPT(get_config("tiny", tie_embeddings=False))
    assert model.head_weight() is not model.wte.weight
    assert num_parameters(model) == EXPECTED_PARAMS["tiny"] + 256 * 64


def test_blocks_are_block_units() -> None:
    model = GPT(PRESETS["tiny"])
    assert len(model.blocks) == 2
    assert all(type(b) is Block for b in model.blocks)


def test_forward_shapes_and_untrained_loss() -> None:
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    idx = torch.randint(0, 256, (4, 64))
    targets = torch.randint(0, 256, (4, 64))
    logits, loss = model(idx, targets)
    assert logits.shape == (4, 64, 256)
    assert loss is not None and loss.dim() == 0
    # Small init => near-uniform predictions => loss ~ ln(vocab).
    assert abs(loss.item() - math.log(256)) < 0.1
    logits, loss = model(idx[:, :10])
    assert logits.shape == (4, 10, 256) and loss is None


def test_loss_ignores_minus_one_targets_and_backprops() -> None:
    model = GPT(PRESETS["tiny"])
    idx = torch.randint(0, 256, (2, 16))
    targets = torch.full((2, 16), -1)
    targets[:, 0] = 3
    _, loss = model(idx, targets)
    assert loss is not None and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_too_long_sequence_is_rejected() -> None:
    model = GPT(PRESETS["tiny"])
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_residual_projections_use_scaled_init() -> None:
    torch.manual_seed(0)
    model = GPT(PRESETS["small"])
    block = model.blocks[0]
    assert isinstance(block, Block)
    expected = 0.02 / math.sqrt(2 * 4)
    assert block.attn.c_proj.weight.std().item() == pytest.approx(expected, rel=0.05)
    assert block.mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.all(block.mlp.c_fc.bias == 0) and torch.all(block.ln_1.weight == 1)


def test_meta_build_then_init_matches_direct_build_bit_for_bit() -> None:
    config = PRESETS["tiny"]
    torch.manual_seed(1234)
    direct = GPT(config)
    torch.manual_seed(1234)
    with torch.device("meta"):
        lazy = GPT(config)
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    lazy.init_weights()
    direct_state, lazy_state = direct.state_dict(), lazy.state_dict()
    assert direct_state.keys() == lazy_state.keys()
    for key, value in direct_state.items():
        assert torch.equal(value, lazy_state[key]), key


def test_init_weights_is_a_function_of_the_rng_state() -> None:
    model = GPT(PRESETS["tiny"])
    model.init_weights(torch.Generator().manual_seed(7))
    first = [p.clone() for p in model.parameters()]
    model.init_weights(torch.Generator().manual_seed(7))
    assert all(torch.equal(a, b) for a, b in zip(first, model.parameters(), strict=True))


def test_generate_length_and_determinism() -> None:
    model = GPT(PRESETS["tiny"])
    model.train()
    prompt = torch.randint(0, 256, (2, 60))
    out = generate(model, prompt, 8, top_k=10, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 68)  # longer than seq_len=64: the context is cropped
    assert torch.equal(out[:, :60], prompt) and int(out.max()) < 256
    again = generate(model, prompt, 8, top_k=10, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    assert model.training  # mode restored
    greedy = generate(model, prompt[:, :5], 3, temperature=0.0)
    assert greedy.shape == (2, 8)
    assert torch.equal(generate(model, prompt, 0), prompt)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(vocab_size=256, seq_len=8, n_layer=1, n_head=3, n_embd=64)
    with pytest.raises(ValueError, match="n_layer"):
        GPTConfig(vocab_size=256, seq_len=8, n_layer=0, n_head=1, n_embd=64)
    with pytest.raises(ValueError, match="unknown GPT preset"):
        get_config("huge")


def test_tiny_model_learns_the_corpus() -> None:
    """End-to-end sanity of model + data: a few AdamW steps on real text lower the loss."""
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    sampler = BatchSampler(load_corpus(max_bytes=64 * 1024), batch_size=8, seq_len=64, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        x, y = sampler.next()
        _, loss = model(x, y)
        assert loss is not None
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
