"""Models shipped with zerodp: a small GPT used by ``zerodp train``, the benchmarks and tests."""

from zerodp.apps.models.gpt import (
    GPT,
    MLP,
    PRESETS,
    Block,
    CausalSelfAttention,
    GPTConfig,
    generate,
    get_config,
    num_parameters,
)

__all__ = [
    "GPT",
    "MLP",
    "PRESETS",
    "Block",
    "CausalSelfAttention",
    "GPTConfig",
    "generate",
    "get_config",
    "num_parameters",
]
