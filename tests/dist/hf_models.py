"""Tiny Hugging Face transformers models built in code (no download), with their losses.

Each entry of ``MODELS`` builds a model from a config with a few thousand parameters and knows
the loss a user trains it with. Dropout is off so that a sharded run and the unsharded reference
compute the same function. The kinds cover what trips sharding up:

- ``gpt2``: tied input embedding and LM head (one Parameter, two modules);
- ``llama``: RoPE (a non-persistent buffer), RMSNorm, untied head;
- ``bert``: masked LM with labels -100 on unmasked tokens, plus a pooler whose output the loss
  never uses (its parameters get no gradient);
- ``t5``: encoder-decoder, the shared embedding used by the encoder, the decoder and the head;
- ``lora``: PEFT LoRA adapters on a frozen Llama (a few trainable parameters);
- ``albert``: one layer shared by every depth (a module applied three times per forward).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

VOCAB = 64
SEQ = 8


def _quiet() -> None:
    import transformers

    transformers.logging.set_verbosity_error()


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=1,
    )
    return GPT2LMHeadModel(cfg)


def switch_transformers(experts: int) -> nn.Module:
    """Top-1 routing over a ModuleDict of ``experts`` in every layer (an expert given no token
    is not run)."""
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    cfg = SwitchTransformersConfig(
        vocab_size=64,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        num_experts=experts,
        expert_capacity=64,
        encoder_sparse_step=1,
        decoder_sparse_step=1,
        dropout_rate=0.0,
        router_jitter_noise=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return SwitchTransformersForConditionalGeneration(cfg)


def llama_config(**overrides: int):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig

    fields = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, **overrides}
    return LlamaConfig(
        vocab_size=VOCAB,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        **fields,
    )


def llama() -> nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config())


def bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM
    from transformers.models.bert.modeling_bert import BertPooler

    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )
    model = BertForMaskedLM(cfg)
    # BertForMaskedLM builds no pooler; add one as BertModel would: it runs in every forward
    # and its output never reaches the masked-LM loss.
    model.bert.pooler = BertPooler(cfg)
    model.post_init()
    return model


def t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=VOCAB,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=True,
    )
    return T5ForConditionalGeneration(cfg)


def lora() -> nn.Module:
    from peft import LoraConfig, get_peft_model

    base = llama()
    return get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))


def albert() -> nn.Module:
    from transformers import AlbertConfig, AlbertForMaskedLM

    cfg = AlbertConfig(
        vocab_size=VOCAB,
        embedding_size=8,
        hidden_size=16,
        num_hidden_layers=3,
        num_hidden_groups=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
        pad_token_id=0,
    )
    return AlbertForMaskedLM(cfg)


def _tokens(g: torch.Generator, rows: int, low: int = 3) -> torch.Tensor:
    return torch.randint(low, VOCAB, (rows, SEQ), generator=g)


def causal_batch(g: torch.Generator, rows: int) -> dict[str, torch.Tensor]:
    x = _tokens(g, rows)
    return {"input_ids": x, "labels": x}


def masked_batch(g: torch.Generator, rows: int) -> dict[str, torch.Tensor]:
    x = _tokens(g, rows)
    masked = torch.rand(x.shape, generator=g) < 0.3
    masked[:, 0] = True  # at least one label per row
    labels = torch.where(masked, x, torch.full_like(x, -100))
    return {"input_ids": torch.where(masked, torch.full_like(x, 3), x), "labels": labels}


def seq2seq_batch(g: torch.Generator, rows: int) -> dict[str, torch.Tensor]:
    return {"input_ids": _tokens(g, rows), "labels": _tokens(g, rows)}


@dataclass(frozen=True)
class HFModel:
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator, int], dict[str, torch.Tensor]]
    block: str  # the repeated layer's class: a stage-3 unit per layer


MODELS: dict[str, HFModel] = {
    "gpt2": HFModel(gpt2, causal_batch, "GPT2Block"),
    "llama": HFModel(llama, causal_batch, "LlamaDecoderLayer"),
    "bert": HFModel(bert, masked_batch, "BertLayer"),
    "t5": HFModel(t5, seq2seq_batch, "T5Block"),
    "lora": HFModel(lora, causal_batch, "LlamaDecoderLayer"),
    "albert": HFModel(albert, masked_batch, "AlbertLayer"),
}


def build(name: str, seed: int = 0) -> nn.Module:
    _quiet()
    torch.manual_seed(seed)
    return MODELS[name].build()


def build_checkpointed(name: str, reentrant: bool, seed: int = 0) -> nn.Module:
    """``build`` with Hugging Face gradient checkpointing on every layer."""
    model = build(name, seed)
    kwargs = {"use_reentrant": reentrant}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def global_batches(name: str, step: int, world: int, per_rank: int = 2) -> list[dict]:
    """Rank r's batch of step ``step``: the r-th slice of one global batch."""
    g = torch.Generator().manual_seed(1000 + step)
    full = MODELS[name].batch(g, world * per_rank)
    return [
        {k: v[r * per_rank : (r + 1) * per_rank] for k, v in full.items()} for r in range(world)
    ]


def hf_loss(data: list[dict]) -> Callable[[nn.Module, int], torch.Tensor]:
    """Rank r's loss: the model's own (``labels=`` in the batch), in fp32."""

    def loss(m: nn.Module, r: int) -> torch.Tensor:
        return m(**data[r]).loss.float()

    return loss
