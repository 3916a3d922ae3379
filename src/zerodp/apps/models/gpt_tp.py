"""The shipped GPT split over a tensor-parallel group (Megatron's layout).

Per block: the fused q/k/v projection is column-parallel in three blocks (rank r computes
heads ``[r * H / TP, (r + 1) * H / TP)``), the attention output projection row-parallel; the
MLP's first layer column-parallel, its second row-parallel. The token embedding is
vocabulary-parallel, and so is the tied head (its weight is that embedding's slice) with the
vocabulary-parallel loss; an untied head is split by vocabulary rows too. LayerNorms, the
position embedding and the row-parallel biases stay whole on every TP rank. Two all-reduces
per block in forward (after each row-parallel layer), two in backward (before each
column-parallel one), plus the embedding's and the head's.
"""

from __future__ import annotations

from zerodp.apps.models.gpt import GPT
from zerodp.tensor_parallel import (
    Colwise,
    Rowwise,
    Style,
    TensorParallel,
    VocabEmbedding,
    parallelize,
)

GPT_PLAN: dict[str, Style] = {
    "wte": VocabEmbedding(),
    "blocks.*.attn.c_attn": Colwise(chunks=3),
    "blocks.*.attn.c_proj": Rowwise(),
    "blocks.*.mlp.c_fc": Colwise(),
    "blocks.*.mlp.c_proj": Rowwise(),
}
"""Module-name patterns of :class:`GPT` and how each is split."""


def tensor_parallel_gpt(model: GPT, tp: TensorParallel) -> GPT:
    """Split ``model`` (unsharded, before ``zerodp.initialize``) over ``tp`` in place."""
    config = model.config
    if config.n_head % tp.size:
        raise ValueError(
            f"n_head={config.n_head} cannot be split over {tp.size} tensor-parallel ranks"
        )
    if config.dropout > 0:
        # The replicated regions would need the same dropout mask on every TP rank and the
        # split ones different masks (Megatron's RNG tracker); not built.
        raise ValueError(
            f"tensor parallelism of the shipped GPT runs without dropout (dropout="
            f"{config.dropout}); set GPTConfig.dropout=0"
        )
    plan: dict[str, Style] = dict(GPT_PLAN)
    if model.lm_head is not None:
        plan["lm_head"] = Colwise()
    parallelize(model, tp, plan)
    model.tensor_parallel = tp
    return model
