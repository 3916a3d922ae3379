"""Activation bytes of a GPT: the paper's 12·h·b·s·L estimate, and what the shipped GPT's
forward saves for its backward to the byte ([Note: GPT activations])."""

from __future__ import annotations

from zerodp.memory.estimator import GPTShape


def activation_bytes(shape: GPTShape, *, dtype_bytes: int, checkpointing: bool = False) -> float:
    """Per-rank activation bytes of a GPT forward kept for backward (no model parallelism).

    Without checkpointing: the paper's estimate (Sec. 3.2, footnote 3) of 12·h·b·s·L values;
    for GPT-2 1.5B at s=1K, b=32 in fp16 that is 60.4e9 bytes, the paper's "about 60 GB".
    With checkpointing: one h·b·s checkpoint per block, the input activation the paper
    checkpoints in Sec. 6.1 (P_a) and Sec. 8 ("we checkpoint the input activation for each
    transformer block"), plus the 12·h·b·s working set of the one block being recomputed during
    backward. The paper's Sec. 6.1 "about 33 GB" for its 100B model (L=125, h=8192, b=32, s=1024)
    is the h·b·s·L = 33.5e9 checkpoint *elements*; in fp16 that is 67e9 bytes.
    The b·s·V logits (and the loss's fp32 copy) are not counted, as in the paper.
    """
    per_block = shape.hidden * shape.micro_batch * shape.seq_len  # one h·b·s activation
    if checkpointing:
        values = per_block * shape.layers + 12 * per_block
    else:
        values = 12 * per_block * shape.layers
    return float(values * dtype_bytes)


def gpt_saved_bytes(
    shape: GPTShape,
    *,
    dtype_bytes: int,
    checkpointing: bool = False,
    on_device: int | None = None,
    tensor_parallel: int = 1,
    partitioned: bool = False,
) -> int:
    """Bytes one training forward of the shipped GPT (``zerodp.apps.models.gpt``: pre-LN
    blocks, ``scaled_dot_product_attention``, GELU MLP, tied head, fp32 loss, no dropout)
    leaves for its backward, per rank, counted by storage as ``SavedForBackward`` does
    ([Note: GPT activations]); exact, as measured on the CPU (``tests/unit/test_gpt_saved.py``).

    [Note: GPT activations]
    With b sequences of s tokens, hidden h, a heads, vocabulary V, p bytes per compute element:
    each block keeps 16·bsh·p (its input and its LayerNorm's output, the q/k/v projection 3,
    the attention output 1, which the output projection reads without a copy because the
    kernel lays it out as [b, s, a, d]; the second LayerNorm's input and output, the MLP's
    up-projection 4 and GELU output 4), its two LayerNorms' mean and rstd 4·bs·p, and the
    attention's log-sum-exp b·a·s in fp32. Exact as measured on the CPU with the fused causal
    kernel and no dropout; on CUDA the LayerNorm statistics are fp32 (8·bs more per block in
    bf16), and the math attention kernel (dropout > 0 on the CPU, or no fused kernel) keeps the
    b·a·s² attention probabilities instead of the log-sum-exp: not modelled. Checkpointed, a
    block keeps its input only, bsh·p (``on_device``: with the checkpoint offload, only that
    many stay on the device). Outside
    the blocks: the final LayerNorm's input and output 2·bsh·p and statistics 2·bs·p, the fp32
    log-softmax of the logits 4·bsV, the token ids and targets (int64, 16·bs), the positions
    (8·s) and the loss's fp32 weight (4). The paper's 12·h·b·s·L (``activation_bytes``) counts
    neither the logits nor the statistics. A dropout > 0 adds its masks (not modelled here).

    Split over ``tensor_parallel`` = t ranks (``tensor_parallel_gpt``, [Note: tensor
    parallelism]): a block's 12·bsh·p of projections, attention and MLP become 12·bsh·p / t
    and its log-sum-exp b·(a/t)·s·4; the 4·bsh·p around the LayerNorms and the statistics stay
    whole (Megatron's layout without sequence parallelism). Outside: the vocabulary-parallel
    loss keeps its softmax 4·bsV / t, its local targets (int64), two masks (bool) and the
    count (int64: 8), and the embedding its local ids (int64) and mask (bool): 19·bs + 8 in
    place of 16·bs + 4. Exact as measured on 2 TP ranks (tests/dist/test_tensor_parallel.py).
    ``partitioned`` (P_a, [Note: partitioned checkpoints]): each checkpoint kept as this rank's
    slice, ceil(bsh / t)·p.
    """
    b, s, h, layers = shape.micro_batch, shape.seq_len, shape.hidden, shape.layers
    bs, bsh, p, t = b * s, b * s * h, dtype_bytes, tensor_parallel
    if checkpointing:
        kept = layers if on_device is None else min(layers, on_device)
        blocks = kept * (-(-bsh // t) if partitioned else bsh) * p
    else:
        blocks = layers * _block_saved_bytes(shape, p, t)
    ids_and_loss = 16 * bs + 4 if t == 1 else 19 * bs + 8
    outside = 2 * bsh * p + 2 * bs * p + 4 * bs * shape.vocab // t + ids_and_loss + 8 * s
    return blocks + outside


def _block_saved_bytes(shape: GPTShape, p: int, tensor_parallel: int = 1) -> int:
    b, s, h, t = shape.micro_batch, shape.seq_len, shape.hidden, tensor_parallel
    return (4 * t + 12) * b * s * h * p // t + 4 * b * s * p + b * (shape.heads // t) * s * 4


def gpt_activation_bytes(
    shape: GPTShape,
    *,
    dtype_bytes: int,
    checkpointing: bool = False,
    tensor_parallel: int = 1,
    partitioned: bool = False,
) -> float:
    """The estimator's activations per rank for the shipped GPT layout: what the forward
    leaves for the backward (``gpt_saved_bytes``, the fp32 log-softmax of the logits included)
    and, checkpointed, what the one block the backward recomputes at a time adds. The logits in the
    compute dtype, which the caller holds, are not included."""
    t = tensor_parallel
    saved = gpt_saved_bytes(
        shape,
        dtype_bytes=dtype_bytes,
        checkpointing=checkpointing,
        tensor_parallel=t,
        partitioned=partitioned,
    )
    # The recomputed block reads its input from the checkpoint's storage: not a second time.
    # Partitioned, that storage is whole again for the recompute and the slice is gone.
    bsh = shape.micro_batch * shape.seq_len * shape.hidden
    kept = (-(-bsh // t) if partitioned else bsh) * dtype_bytes
    recomputed = _block_saved_bytes(shape, dtype_bytes, t) - kept if checkpointing else 0
    return float(saved + recomputed)


def gpt_working_bytes(shape: GPTShape, *, dtype_bytes: int, tensor_parallel: int = 1) -> int:
    """The backward's working set of the shipped GPT per rank: what it allocates on top of the
    activations the forward left ([Note: backward working set]).

    [Note: backward working set]
    The peak of a step comes in backward, where the activations the forward saved are still
    there and the backward allocates gradients on top of them. Two moments bound it, measured
    with ``AllocationTrace`` on the CPU (tests/dist/test_estimate_vs_measured.py):

    - the head, right after the loss: the logits the caller holds (b·s·V·p), the loss's two
      fp32 gradients of them (2·4·bsV) and, with a compute dtype narrower than fp32, their cast
      back (b·s·V·p); the gradient of the final LayerNorm's output (bsh·p) and the head's fresh
      weight gradient (V·h·p) before it is added into zerodp's gradient buffer;
    - a block: the MLP's 4h-wide activation gradient (4·bsh·p) and the fresh gradient of its
      largest weight (4h²·p).

    The larger is the margin ``zerodp estimate`` adds before it says "fits". Measured extra
    over the saved activations, against this: 4.4 vs 4.5 MB (small preset, fp32), 7.9 vs 8.4
    (h=512), 25.2 vs 27.5 (V=4096); never below, at most 26% above the working set (5% of
    the step's peak).
    """
    b, s, h, v, p = shape.micro_batch, shape.seq_len, shape.hidden, shape.vocab, dtype_bytes
    t = tensor_parallel  # the logits, the 4h-wide layers and their weights split t ways
    logits = b * s * v // t
    head = logits * p + 2 * 4 * logits + (logits * p if p != 4 else 0) + b * s * h * p
    block = (4 * b * s * h * p + 4 * h * h * p) // t
    return max(head + v * h * p // t, block)
