"""A minimal GPT-2-style decoder-only transformer.

This is the reference model for ``zerodp train``, the benchmarks and the tests. It is kept
deliberately plain (no fused kernels, no custom autograd) so that sharded training can be compared
against a single-process run of the very same module.

Design points that matter to ZeRO:

* Every transformer layer is a :class:`Block`, a self-contained ``nn.Module``: stage 3 uses it as
  the unit whose parameters are gathered just before, and freed just after, it runs.
* Weight initialisation lives in ``init_weights`` methods rather than in the constructors'
  side effects, so a model built on the ``meta`` device can be materialised with
  ``to_empty(device=...)`` and then given exactly the weights a normally built model would get
  under the same RNG state.
* With ``tie_embeddings`` the LM head *is* the token-embedding Parameter (applied with
  ``F.linear``), so it appears once in ``parameters()`` and is sharded, reduced and updated once.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zerodp.memory import GPTShape
from zerodp.tensor_parallel import (
    TensorParallel,
    copy_to,
    gather_from,
    vocab_parallel_cross_entropy,
)

INIT_STD = 0.02
"""Standard deviation of the GPT-2 normal initialisation of weights and embeddings."""


@dataclass(frozen=True)
class GPTConfig:
    """Shape and options of a :class:`GPT`."""

    vocab_size: int
    seq_len: int
    """Maximum context length (size of the learned positional embedding)."""
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True
    """Biases in the linear layers and LayerNorms (GPT-2 has them)."""
    tie_embeddings: bool = True
    """Use the token-embedding matrix as the LM head's weight."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def residual_std(self) -> float:
        """Init std of projections that write into the residual stream.

        GPT-2 scales them by 1/sqrt(2 * n_layer) because each layer adds two such outputs
        (attention and MLP); without it the residual variance grows with depth.
        """
        return INIT_STD / math.sqrt(2 * self.n_layer)


PRESETS: dict[str, GPTConfig] = {
    # ~0.12M parameters: unit and distributed tests.
    "tiny": GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=4, n_embd=64),
    # ~3.2M parameters, byte-level: the default of `zerodp train`; ~100 steps of 8x128 on a
    # 2-rank CPU run take about a minute.
    "small": GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, n_embd=256),
    # ~25.4M parameters, byte-level so it trains on the embedded corpus: throughput/memory
    # benchmark. Almost all parameters are in the 8 identical blocks.
    "bench25m": GPTConfig(vocab_size=256, seq_len=128, n_layer=8, n_head=8, n_embd=512),
    # ~119.8M parameters: GPT-2-small-shaped body; the untied 22528x768 embedding and LM head
    # (17.3M each) are the large single tensors that stress uneven sharding.
    "gpt120m": GPTConfig(
        vocab_size=22528, seq_len=128, n_layer=12, n_head=12, n_embd=768, tie_embeddings=False
    ),
    # ~355M parameters, GPT-2-medium-shaped, tied embeddings: the NVMe (ZeRO-Infinity)
    # benchmark at world size 1 on CPU (issue 15); its embedding is the largest tensor (51.5M).
    "gpt350m": GPTConfig(vocab_size=50304, seq_len=128, n_layer=24, n_head=16, n_embd=1024),
    # ~1.01B parameters, tied embeddings: the single-GPU overhead benchmark (issue 5: bf16,
    # world size 1, zerodp vs plain training vs FSDP2). Byte tokens use 256 of the 50304 rows.
    "gpt1b": GPTConfig(vocab_size=50304, seq_len=1024, n_layer=18, n_head=16, n_embd=2048),
}


def memory_shape(config: GPTConfig, micro_batch: int) -> GPTShape:
    """This GPT as zerodp's memory formulas describe it, at ``micro_batch`` sequences."""
    return GPTShape(
        layers=config.n_layer,
        hidden=config.n_embd,
        vocab=config.vocab_size,
        seq_len=config.seq_len,
        micro_batch=micro_batch,
        heads=config.n_head,
    )


def get_config(name: str, **overrides: Any) -> GPTConfig:
    """Return the preset ``name``, optionally with some fields replaced (e.g. ``dropout=0.1``)."""
    try:
        config = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown GPT preset {name!r}; choose one of {sorted(PRESETS)}") from None
    return dataclasses.replace(config, **overrides) if overrides else config


def _normal_(tensor: torch.Tensor, std: float, generator: torch.Generator | None) -> None:
    # Skip meta tensors explicitly: there is nothing to fill, and PyTorch's meta kernel for
    # normal_ is a Python decomposition whose first use imports torch._dynamo (~2 s per process).
    if not tensor.is_meta:
        tensor.normal_(0.0, std, generator=generator)


def _init_linear(layer: nn.Linear, std: float, generator: torch.Generator | None) -> None:
    _normal_(layer.weight, std, generator)
    if layer.bias is not None:
        layer.bias.zero_()


def _empty_embedding(num: int, dim: int) -> nn.Embedding:
    """An ``nn.Embedding`` whose weight is left uninitialised (``init_weights`` fills it)."""
    # Passing _weight skips Embedding.reset_parameters(), i.e. a normal_ we would overwrite
    # anyway (and which, on meta, costs the torch._dynamo import noted in _normal_).
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


def _init_layer_norm(norm: nn.LayerNorm) -> None:
    norm.reset_parameters()  # ones / zeros: consumes no randomness


def _materialize(module: nn.Module, device: torch.device) -> None:
    """Replace every meta parameter by an uninitialised one on ``device`` (like ``to_empty``).

    Not ``to_empty`` itself: its ``empty_like`` on meta tensors goes through a Python reference
    implementation whose first use costs ~1 s of imports per process, on every model build.
    """
    for submodule in module.modules():
        for name, param in list(submodule.named_parameters(recurse=False)):
            fresh = torch.empty(param.shape, dtype=param.dtype, device=device)
            setattr(submodule, name, nn.Parameter(fresh, requires_grad=param.requires_grad))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on top of ``F.scaled_dot_product_attention``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.dropout = config.dropout
        # One fused projection for q, k and v: one matmul instead of three, one parameter tensor.
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    @torch.no_grad()
    def init_weights(self, config: GPTConfig, generator: torch.Generator | None = None) -> None:
        """Re-initialise in GPT-2 style (c_proj writes to the residual stream: scaled std)."""
        _init_linear(self.c_attn, INIT_STD, generator)
        _init_linear(self.c_proj, config.residual_std, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        # [B, T, C] -> [B, H, T, C/H]. Heads counted from the width (-1): split over a
        # tensor-parallel group, this rank computes only its n_head / TP heads.
        q = q.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(batch, seq, -1)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network: width -> 4*width -> GELU -> width."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    @torch.no_grad()
    def init_weights(self, config: GPTConfig, generator: torch.Generator | None = None) -> None:
        """Re-initialise in GPT-2 style (c_proj writes to the residual stream: scaled std)."""
        _init_linear(self.c_fc, INIT_STD, generator)
        _init_linear(self.c_proj, config.residual_std, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer layer: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``.

    A separate class so that ZeRO stage 3 can treat each layer as one gather/free unit.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Re-initialise this layer's parameters (attention first, then MLP)."""
        _init_layer_norm(self.ln_1)
        self.attn.init_weights(self.config, generator)
        _init_layer_norm(self.ln_2)
        self.mlp.init_weights(self.config, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2-style language model: embeddings, ``n_layer`` :class:`Block` s, LayerNorm, LM head."""

    def __init__(self, config: GPTConfig) -> None:
        """Build the model on the current default device (honours ``with torch.device(...)``,
        including ``meta``) and initialise it with :meth:`init_weights`."""
        super().__init__()
        self.config = config
        # Set by tensor_parallel_gpt (gpt_tp.py): the head then computes this rank's vocabulary
        # columns and the loss is vocabulary-parallel.
        self.tensor_parallel: TensorParallel | None = None
        device = torch.empty(0).device
        # Build the layers on meta first so that PyTorch's per-layer default init (which would
        # consume RNG and then be overwritten) never runs: the only randomness the constructor
        # draws is init_weights()'s, which is what makes meta + to_empty + init_weights()
        # reproduce a directly built model exactly. It also makes construction cheaper.
        with torch.device("meta"):
            self.wte = _empty_embedding(config.vocab_size, config.n_embd)
            self.wpe = _empty_embedding(config.seq_len, config.n_embd)
            self.drop = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
            # Tied: no module at all, the head reuses self.wte.weight in forward(). This keeps a
            # single owner of the Parameter (no aliasing for to_empty()/sharding to preserve).
            self.lm_head: nn.Linear | None = None
            if not config.tie_embeddings:
                self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if device.type != "meta":
            _materialize(self, device)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Re-initialise every parameter, GPT-2 style, in a fixed order.

        Draws from ``generator`` (default: the global torch RNG), so the result is a pure function
        of the RNG state: a model built on ``meta``, moved with ``to_empty`` and re-initialised
        under the same seed is bit-identical to one built directly. On ``meta`` tensors this is a
        no-op that consumes no randomness. A ``generator`` must be on the parameters' device.
        """
        _normal_(self.wte.weight, INIT_STD, generator)
        _normal_(self.wpe.weight, INIT_STD, generator)
        for block in self.blocks:
            assert isinstance(block, Block)
            block.init_weights(generator)
        _init_layer_norm(self.ln_f)
        if self.lm_head is not None:
            _init_linear(self.lm_head, INIT_STD, generator)

    def head_weight(self) -> torch.Tensor:
        """The ``[vocab_size, n_embd]`` output projection (the token embedding when tied)."""
        return self.wte.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``[B, T, vocab]`` for token ids ``idx [B, T]``, and the mean next-token
        cross-entropy against ``targets [B, T]`` when given (entries of -1 are ignored).

        Split over a tensor-parallel group (``tensor_parallel_gpt``), the logits returned with
        a loss are this rank's vocabulary columns ``[B, T, vocab / TP]`` (the full logits never
        exist); without targets they are gathered whole (generation)."""
        seq = idx.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(f"sequence of length {seq} exceeds seq_len={self.config.seq_len}")
        pos = torch.arange(seq, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        if self.tensor_parallel is not None:
            return _split_head(self.ln_f(x), self.head_weight(), targets, self.tensor_parallel)
        logits = F.linear(self.ln_f(x), self.head_weight())
        if targets is None:
            return logits, None
        # Loss in fp32 even when the model runs in bf16/fp16: log-softmax over the vocabulary is
        # where low precision hurts most.
        loss = F.cross_entropy(
            logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1
        )
        return logits, loss


def _split_head(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor | None, tp: TensorParallel
) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = F.linear(copy_to(h, tp), weight)  # this rank's vocabulary columns
    if targets is None:
        return gather_from(logits, tp), None
    loss = vocab_parallel_cross_entropy(
        logits.float().view(-1, logits.size(-1)), targets.reshape(-1), tp, ignore_index=-1
    )
    return logits, loss


def num_parameters(model: nn.Module) -> int:
    """Number of elements in the model's unique parameters (a tied weight counts once)."""
    # parameters() already de-duplicates by identity; the explicit id set documents the intent
    # and also holds for callers that pass in modules sharing parameters via other paths.
    seen: set[int] = set()
    total = 0
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel()
    return total


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample ``max_new_tokens`` tokens after the prompt ``idx [B, T]``; returns ``[B, T + new]``.

    ``temperature == 0`` means greedy decoding; ``top_k`` keeps only the k most likely tokens.
    The context is cropped to the model's ``seq_len``. The model is put in eval mode for the
    duration (dropout off) and its previous mode restored.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k <= 0:
        raise ValueError(f"top_k must be positive, got {top_k}")
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            context = idx[:, -model.config.seq_len :]
            logits, _ = model(context)
            next_token = _sample(logits[:, -1, :].float(), temperature, top_k, generator)
            idx = torch.cat((idx, next_token), dim=1)
    finally:
        model.train(was_training)
    return idx


def _sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """One token id per row of ``logits [B, vocab]``, as ``[B, 1]``."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)
