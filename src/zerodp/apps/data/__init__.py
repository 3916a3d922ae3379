"""Data: the embedded byte-level default corpus (the stdlib's source) and a batch sampler."""

from zerodp.apps.data.corpus import (
    DEFAULT_MAX_BYTES,
    VOCAB_SIZE,
    BatchSampler,
    corpus_files,
    decode,
    encode,
    load_corpus,
    train_val_split,
)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "VOCAB_SIZE",
    "BatchSampler",
    "corpus_files",
    "decode",
    "encode",
    "load_corpus",
    "train_val_split",
]
