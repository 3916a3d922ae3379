"""ZeroConfig validation: every bad value names the field and what is allowed."""

from __future__ import annotations

import json

import pytest

from zerodp import ZeroConfig


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": 4}, "ZeroConfig.stage must be one of 0, 1, 2, 3; got 4"),
        ({"stage": True}, "ZeroConfig.stage must be one of 0, 1, 2, 3; got True"),
        ({"bucket_bytes": 0}, "ZeroConfig.bucket_bytes must be a positive integer; got 0"),
        ({"bucket_bytes": -5}, "ZeroConfig.bucket_bytes must be a positive integer; got -5"),
        ({"precision": "fp8"}, "ZeroConfig.precision must be one of 'fp32', 'bf16', 'fp16'"),
        ({"broadcast_buffers": 1}, "ZeroConfig.broadcast_buffers must be True or False; got 1"),
        ({"loss_scale": 8.0}, "ZeroConfig.loss_scale is only used with precision='fp16'"),
        ({"backoff_factor": 1.5}, "ZeroConfig.backoff_factor must be in (0, 1); got 1.5"),
        (
            {"nonfinite": "warn"},
            "ZeroConfig.nonfinite must be one of 'raise', 'skip', 'ignore'; got 'warn'",
        ),
        (
            {"step_without_backward": "skip"},
            "ZeroConfig.step_without_backward must be one of 'warn', 'raise', 'ignore'; got 'skip'",
        ),
    ],
)
def test_invalid_values(kwargs, message):
    with pytest.raises(ValueError) as err:
        ZeroConfig(**kwargs)
    assert message in str(err.value)


def test_frozen_and_round_trip(tmp_path):
    cfg = ZeroConfig(stage=1, bucket_bytes=1024)
    with pytest.raises(AttributeError):
        cfg.stage = 2  # type: ignore[misc]
    path = tmp_path / "zero.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert ZeroConfig.from_json(path) == cfg


def test_unknown_keys_are_rejected():
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['stag'\]"):
        ZeroConfig.from_dict({"stag": 2})
