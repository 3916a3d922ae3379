"""What zerodp 0.1's flat ``ZeroConfig.to_dict()`` held (as its checkpoint manifests store it),
for the tests that read such configs back. Importable from every test (``tests/conftest.py``
puts ``tests/dist`` on ``sys.path``)."""

from __future__ import annotations

from typing import Any

DEFAULTS_0_1: dict[str, Any] = {
    "stage": 2,
    "bucket_bytes": 32 * 2**20,
    "broadcast_buffers": True,
    "overlap_param_gather": True,
    "precision": "fp32",
    "reduce_dtype": "fp32",
    "loss_scale": None,
    "initial_scale": 65536.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1.0,
    "unit_classes": [],
    "unit_min_numel": 16384,
    "leaf_unit_min_numel": 1048576,
    "prefetch_depth": 1,
    "persist_numel": 0,
    "check_unit_order": True,
    "watchdog_s": 300.0,
    "nonfinite": "raise",
    "step_without_backward": "warn",
}


def saved_by_0_1(**fields: Any) -> dict[str, Any]:
    """0.1's flat config dict with ``fields`` changed (every key of 0.1, none of today's)."""
    unknown = set(fields) - set(DEFAULTS_0_1)
    assert not unknown, f"not a field of 0.1: {sorted(unknown)}"
    return {**DEFAULTS_0_1, **fields}
