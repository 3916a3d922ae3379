"""Tensor parallelism (Megatron's layout) over the TP group of a DP x TP mesh, with ZeRO over
the DP group ([Note: tensor parallelism] in group.py)."""

from zerodp.tensor_parallel.group import TensorParallel
from zerodp.tensor_parallel.loss import vocab_parallel_cross_entropy
from zerodp.tensor_parallel.parallelize import (
    Colwise,
    Layout,
    Rowwise,
    Split,
    Style,
    VocabEmbedding,
    check_split_root,
    join_slices,
    layout_of,
    local_slice,
    parallelize,
)
from zerodp.tensor_parallel.regions import copy_to, gather_from, reduce_from

__all__ = [
    "Colwise",
    "Layout",
    "Rowwise",
    "Split",
    "Style",
    "TensorParallel",
    "VocabEmbedding",
    "check_split_root",
    "copy_to",
    "gather_from",
    "join_slices",
    "layout_of",
    "local_slice",
    "parallelize",
    "reduce_from",
    "vocab_parallel_cross_entropy",
]
