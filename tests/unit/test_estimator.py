"""The memory estimator against the ZeRO paper's numbers and closed forms; meta-device counts."""

from __future__ import annotations

import sys
import textwrap
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from zerodp.apps.cli.estimate import format_gb
from zerodp.memory import (
    GB,
    BytesPerParam,
    GPTShape,
    Overheads,
    activation_bytes,
    bytes_per_param,
    comm_buffer_bytes,
    count_parameters,
    estimate_memory,
    fits,
    gpt_largest_unit_params,
    gpt_param_count,
    model_state_bytes,
    optimizer_multiplier,
    recommend_stage,
    resolve_factory,
)

MIXED_ADAM = BytesPerParam(2.0, 2.0, 12.0)
FP32_ADAM = BytesPerParam(4.0, 4.0, 8.0)

# The ZeRO paper's Table 1, as printed: model size -> DP degree -> (P_os, P_os+g, P_os+g+p) in GB.
TABLE_1: dict[float, dict[int, tuple[str, str, str]]] = {
    7.5e9: {
        1: ("120", "120", "120"),
        4: ("52.5", "41.3", "30"),
        16: ("35.6", "21.6", "7.5"),
        64: ("31.4", "16.6", "1.88"),
        256: ("30.4", "15.4", "0.47"),
        1024: ("30.1", "15.1", "0.12"),
    },
    128e9: {
        1: ("2048", "2048", "2048"),
        4: ("896", "704", "512"),
        16: ("608", "368", "128"),
        64: ("536", "284", "32"),
        256: ("518", "263", "8"),
        1024: ("513", "257", "2"),
    },
    1e12: {
        1: ("16000", "16000", "16000"),
        4: ("7000", "5500", "4000"),
        16: ("4750", "2875", "1000"),
        64: ("4187", "2218", "250"),
        256: ("4046", "2054", "62.5"),
        1024: ("4011", "2013", "15.6"),
    },
}
TABLE_1_CELLS = [(psi, n, row) for psi, rows in TABLE_1.items() for n, row in rows.items()]

GPT2_XL = GPTShape(layers=48, hidden=1600, vocab=50257, seq_len=1024, micro_batch=32)


def _states(psi: float, n: int, stage: int, per_param: BytesPerParam = MIXED_ADAM) -> float:
    return model_state_bytes(psi, n, stage, **per_param._asdict()).total


@pytest.mark.parametrize(("psi", "n", "printed"), TABLE_1_CELLS)
def test_table_1_every_cell(psi: float, n: int, printed: tuple[str, str, str]) -> None:
    assert tuple(format_gb(_states(psi, n, stage)) for stage in (1, 2, 3)) == printed
    # "Without ZeRO, the memory consumption is equal to the first row in the table" (Sec. 5.4).
    assert format_gb(_states(psi, n, 0)) == TABLE_1[psi][1][0]


def test_figure_1_example_at_its_printed_precision() -> None:
    def one_decimal(num_bytes: float) -> Decimal:
        return Decimal(num_bytes / GB).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP)

    got = [one_decimal(_states(7.5e9, 64, stage)) for stage in (0, 1, 2, 3)]
    assert got == [Decimal("120.0"), Decimal("31.4"), Decimal("16.6"), Decimal("1.9")]


def test_gb_is_decimal_not_binary() -> None:
    assert GB == 1e9
    assert _states(7.5e9, 1, 0) / 2**30 == pytest.approx(111.76, abs=0.01)  # not Table 1's 120


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000])
def test_mixed_precision_adam_closed_forms(n: int) -> None:
    psi = 1.3e9
    expected = [16 * psi, 4 * psi + 12 * psi / n, 2 * psi + 14 * psi / n, 16 * psi / n]
    assert [_states(psi, n, s) for s in range(4)] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000])
def test_fp32_adam_closed_forms(n: int) -> None:
    psi = 1.3e9
    parts = [model_state_bytes(psi, n, s, **FP32_ADAM._asdict()) for s in range(4)]
    expected = [
        (4 * psi, 4 * psi, 8 * psi),
        (4 * psi, 4 * psi, 8 * psi / n),
        (4 * psi, 4 * psi / n, 8 * psi / n),
        (4 * psi / n, 4 * psi / n, 8 * psi / n),
    ]
    for got, want in zip(parts, expected, strict=True):
        assert (got.parameters, got.gradients, got.optimizer_state) == pytest.approx(want)
    assert parts[3].total == pytest.approx(16 * psi / n)


@pytest.mark.parametrize(
    ("precision", "optimizer", "expected"),
    [
        ("fp32", "adam", (4, 4, 8)),
        ("fp32", "adamw", (4, 4, 8)),
        ("fp32", "sgd", (4, 4, 4)),
        ("fp32", "sgd-nomomentum", (4, 4, 0)),
        ("fp32", "adagrad", (4, 4, 4)),
        ("fp32", "rmsprop", (4, 4, 4)),
        ("bf16", "adam", (2, 2, 12)),
        ("fp16", "adam", (2, 2, 12)),
        ("bf16", "adamw", (2, 2, 12)),
        ("bf16", "sgd", (2, 2, 8)),
        ("fp16", "sgd-nomomentum", (2, 2, 4)),
        ("bf16", "adagrad", (2, 2, 8)),
        ("fp16", "rmsprop", (2, 2, 8)),
    ],
)
def test_bytes_per_param(precision: str, optimizer: str, expected: tuple[int, int, int]) -> None:
    assert bytes_per_param(precision, optimizer) == expected


def test_k_override_replaces_the_table() -> None:
    assert optimizer_multiplier("adam", "bf16", k=20) == 20.0
    assert bytes_per_param("fp32", "sgd", k=0) == (4, 4, 0)


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda: bytes_per_param("int8", "adam"), "precision"),
        (lambda: bytes_per_param("fp32", "lamb"), "optimizer"),
        (lambda: optimizer_multiplier("adam", "fp32", k=-1), "K"),
        (lambda: model_state_bytes(1e9, 4, 4, **MIXED_ADAM._asdict()), "stage"),
        (lambda: model_state_bytes(1e9, 0, 1, **MIXED_ADAM._asdict()), "world_size"),
        (lambda: model_state_bytes(1e9, True, 1, **MIXED_ADAM._asdict()), "world_size"),
        (lambda: model_state_bytes(-1.0, 4, 1, **MIXED_ADAM._asdict()), "num_params"),
        (lambda: comm_buffer_bytes(2, -1.0), "bucket_bytes"),
        (lambda: GPTShape(layers=0, hidden=8, vocab=8, seq_len=8), "layers"),
    ],
)
def test_bad_input_raises_value_error_naming_it(call: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        call()  # type: ignore[operator]


def test_gpt_param_count_matches_published_gpt2_sizes() -> None:
    assert gpt_param_count(GPT2_XL) == 1_557_611_200
    small = GPTShape(layers=12, hidden=768, vocab=50257, seq_len=1024)
    assert gpt_param_count(small) == 124_439_808
    bare = 12 * 48 * 1600**2 + 50257 * 1600 + 1024 * 1600
    assert gpt_param_count(GPT2_XL, biases_and_norms=False) == bare


def test_gpt_largest_unit_is_the_root_or_a_block() -> None:
    assert gpt_largest_unit_params(GPT2_XL) == (50257 + 1024) * 1600 + 2 * 1600
    wide = GPTShape(layers=2, hidden=8192, vocab=1000, seq_len=16)
    assert gpt_largest_unit_params(wide) == 12 * 8192**2 + 13 * 8192


def test_activations_match_the_papers_gpt2_example() -> None:
    # Sec. 3.2: GPT-2 1.5B, sequence 1K, batch 32 "requires about 60 GB" (12·h·b·s·L, fp16).
    full = activation_bytes(GPT2_XL, dtype_bytes=2)
    assert full == 12 * 1600 * 32 * 1024 * 48 * 2
    assert round(full / GB) == 60
    # Checkpointing keeps one h·b·s input per block plus one block's working set.
    ckpt = activation_bytes(GPT2_XL, dtype_bytes=2, checkpointing=True)
    assert ckpt == (48 + 12) * 1600 * 32 * 1024 * 2
    assert ckpt < full / 9


def test_checkpoint_count_matches_the_papers_100b_example() -> None:
    # Sec. 6.1: the 100B model (Table 4: 125 layers, hidden 8192) at batch 32, seq 1024 needs
    # "about 33 GB" of checkpoints: h·b·s·L = 33.5e9 checkpointed values.
    shape = GPTShape(layers=125, hidden=8192, vocab=50257, seq_len=1024, micro_batch=32)
    one_byte = activation_bytes(shape, dtype_bytes=1, checkpointing=True)
    checkpoints = one_byte - 12 * 8192 * 32 * 1024
    assert round(checkpoints / GB) == 34  # 33.55: "about 33"
    assert gpt_param_count(shape) == pytest.approx(100e9, rel=0.02)


def test_comm_buffer_bytes_per_stage() -> None:
    bucket, unit = 32 * 2**20, 1e8
    assert comm_buffer_bytes(0, bucket, largest_unit_bytes=unit) == 0
    assert comm_buffer_bytes(1, bucket, largest_unit_bytes=unit) == 0
    assert comm_buffer_bytes(2, bucket, largest_unit_bytes=unit) == 2 * bucket
    assert comm_buffer_bytes(3, bucket) == 2 * bucket + 2 * 0  # default prefetch_depth=1
    got = comm_buffer_bytes(3, bucket, largest_unit_bytes=unit, prefetch_depth=2)
    assert got == 2 * bucket + 3 * unit


def test_comm_buffer_bytes_with_receive_buffers() -> None:
    """Point-to-point reduce-scatters (gloo on CPU) receive into (N-1)/N of each staging bucket
    behind it; stage 0 all-reduces and receives nothing extra."""
    bucket, unit, f = 2**20, 1e6, 3 / 4
    bf16 = {"param_bytes": 2, "reduce_bytes": 4, "receive_fraction": f}
    assert comm_buffer_bytes(0, bucket, **bf16) == 2 * 2 * bucket
    assert comm_buffer_bytes(1, bucket, **bf16) == 2 * 2 * bucket * (1 + f)
    assert comm_buffer_bytes(1, bucket, receive_fraction=f) == 0  # fp32: reduced in place
    assert comm_buffer_bytes(2, bucket, receive_fraction=f) == 2 * bucket * (1 + f)
    got = comm_buffer_bytes(3, bucket, largest_unit_bytes=unit, receive_fraction=f)
    assert got == 2 * bucket * (1 + f) + 2 * unit
    with pytest.raises(ValueError, match=r"receive_fraction must be in \[0, 1\)"):
        comm_buffer_bytes(2, bucket, receive_fraction=1.0)


def test_estimate_memory_adds_everything() -> None:
    overheads = Overheads(activation_bytes=5e9, bucket_bytes=1e8, largest_unit_bytes=2e8)
    est = estimate_memory(7.5e9, 64, 3, MIXED_ADAM, overheads)
    assert est.total == pytest.approx(1.875e9 + 5e9 + 2e8 + 2 * 2e8)
    assert fits(est, est.total) and not fits(est, est.total - 1)


@pytest.mark.parametrize(
    ("psi", "n", "stage"),
    [
        # Sec. 5.4: on 32 GB V100s with N=64, up to 7.5B fits with P_os, 14B with P_os+g and
        # 128B with P_os+g+p; Table 1's 1T model fits only at N=1024 with all three.
        (7.5e9, 64, 1),
        (14e9, 64, 2),
        (128e9, 64, 3),
        (1e12, 1024, 3),
        (1e12, 64, None),
        # One device: all 16Ψ bytes must fit, 1.5B (24 GB) does and 2.5B (40 GB) does not.
        (1.5e9, 1, 0),
        (2.5e9, 1, None),
    ],
)
def test_recommend_stage_reproduces_the_papers_claims(
    psi: float, n: int, stage: int | None
) -> None:
    assert recommend_stage(32e9, psi, n, MIXED_ADAM) == stage


class TinyGPT(nn.Module):
    """A GPT-2 shaped model with a tied LM head, for checking the count and the formula."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        h = shape.hidden
        self.wte = nn.Embedding(shape.vocab, h)
        self.wpe = nn.Embedding(shape.seq_len, h)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln1": nn.LayerNorm(h),
                    "qkv": nn.Linear(h, 3 * h),
                    "proj": nn.Linear(h, h),
                    "ln2": nn.LayerNorm(h),
                    "fc": nn.Linear(h, 4 * h),
                    "out": nn.Linear(4 * h, h),
                }
            )
            for _ in range(shape.layers)
        )
        self.ln_f = nn.LayerNorm(h)
        self.head = nn.Linear(h, shape.vocab, bias=False)
        self.head.weight = self.wte.weight  # tied: one tensor, two modules


SMALL = GPTShape(layers=3, hidden=32, vocab=101, seq_len=16)


def test_meta_count_equals_real_count_and_formula() -> None:
    real = TinyGPT(SMALL)
    real_count = sum(p.numel() for p in real.parameters())
    assert count_parameters(lambda: TinyGPT(SMALL)) == real_count == gpt_param_count(SMALL)
    untied_total = sum(p.numel() for m in real.modules() for p in m.parameters(recurse=False))
    assert untied_total == real_count + SMALL.vocab * SMALL.hidden  # the tie is counted once


def test_formula_matches_the_librarys_gpt_on_the_meta_device() -> None:
    from zerodp.apps.models import gpt

    config = gpt.GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=4, n_embd=64)
    shape = GPTShape(layers=2, hidden=64, vocab=256, seq_len=64)
    assert count_parameters(lambda: gpt.GPT(config)) == gpt_param_count(shape)


def test_meta_count_allocates_no_storage() -> None:
    built: list[nn.Module] = []

    def factory() -> nn.Module:
        built.append(TinyGPT(SMALL))
        return built[-1]

    count_parameters(factory)
    assert all(p.is_meta for p in built[0].parameters())
    # 100B parameters (400 GB in fp32) would not fit in this machine's memory if allocated.
    huge = GPTShape(layers=2, hidden=8192, vocab=12_000_000, seq_len=8)
    assert count_parameters(lambda: TinyGPT(huge)) == gpt_param_count(huge) > 9e10


def test_count_from_import_string(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "zerodp_estimator_fixture.py").write_text(
        textwrap.dedent(
            """
            from torch import nn

            def build():
                return nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5))
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "zerodp_estimator_fixture", raising=False)
    assert count_parameters("zerodp_estimator_fixture:build") == 10 * 20 + 20 + 20 * 5 + 5
    assert resolve_factory("torch.nn:Identity") is torch.nn.Identity
    with pytest.raises(ValueError, match="module:function"):
        resolve_factory("zerodp_estimator_fixture.build")
    with pytest.raises(TypeError, match=r"not a torch\.nn\.Module"):
        not_a_module: Any = lambda: 3  # noqa: E731 - Any: the wrong type is the point
        count_parameters(not_a_module)
