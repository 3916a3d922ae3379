"""What the offload tiers do not support yet is refused before anything is touched (rather than
silently run without it): adoption of new trainable parameters with the NVMe tier."""

from __future__ import annotations

from zerodp.plan import Plan


def refuse_adoption(plan: Plan) -> None:
    """Before anything changes: new trainable parameters would need the NVMe files relaid."""
    if "nvme" in (plan.offload_optimizer, plan.offload_gradients):
        raise NotImplementedError(
            "zerodp: adding trainable parameters after initialize (unfreezing them, "
            "add_param_group) is not supported with the NVMe tier "
            "(ZeroConfig.offload.optimizer='nvme' or gradients='nvme') yet: make them trainable "
            "before zerodp.initialize, or keep those on 'cpu' / 'device'"
        )
