"""``gpt_saved_bytes`` ([Note: GPT activations] in memory/activations.py) is what a training forward
of the shipped GPT leaves for its backward, to the byte: fp32 and bf16, with and without every
block checkpointed, with the checkpoint offload, over shapes that vary every dimension."""

from __future__ import annotations

import pytest
import torch

import zerodp
from zerodp.activations import CheckpointOffload
from zerodp.apps.models.gpt import GPT, GPTConfig
from zerodp.memory import GPTShape, gpt_saved_bytes
from zerodp.memory.saved import SavedForBackward
from zerodp.streams import make_streams

SHAPES = [  # layers, batch, seq, hidden, heads, vocab
    (1, 2, 16, 32, 2, 64),
    (3, 2, 16, 32, 4, 64),
    (2, 3, 8, 48, 3, 96),
    (2, 4, 32, 64, 8, 50),
]


def _measure(shape, dtype: torch.dtype, checkpoint: str) -> tuple[int, int]:
    """(bytes saved, bytes still on the device after the forward)."""
    layers, b, s, h, a, v = shape
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=v, seq_len=s, n_layer=layers, n_head=a, n_embd=h))
    model = model.to(dtype)
    offload = CheckpointOffload(make_streams("cpu"), on_device=1)
    for block in model.blocks if checkpoint != "none" else []:
        zerodp.checkpoint_wrapper(block, offload if checkpoint == "offload" else None)
    meter = SavedForBackward(model.parameters())
    ids, targets = torch.randint(0, v, (b, s)), torch.randint(0, v, (b, s))
    with meter:
        loss = model(ids, targets)[1]
    resident = meter.alive_bytes()
    loss.backward()
    return meter.nbytes, resident


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checkpoint", ["none", "full", "offload"])
def test_saved_bytes_are_exact(shape, dtype, checkpoint):
    layers, b, s, h, a, v = shape
    gpt = GPTShape(layers=layers, hidden=h, vocab=v, seq_len=s, micro_batch=b, heads=a)
    size = torch.finfo(dtype).bits // 8
    kept = checkpoint != "none"
    saved, resident = _measure(shape, dtype, checkpoint)
    assert saved == gpt_saved_bytes(gpt, dtype_bytes=size, checkpointing=kept)
    on_device = 1 if checkpoint == "offload" else None
    expected = gpt_saved_bytes(gpt, dtype_bytes=size, checkpointing=kept, on_device=on_device)
    assert resident == expected
