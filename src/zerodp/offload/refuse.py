"""The offload tiers that are configurable but not built yet refuse to start, before
``initialize`` touches anything (rather than silently running without them)."""

from __future__ import annotations

from zerodp.plan import Plan


def refuse_unbuilt_tiers(plan: Plan) -> None:
    if plan.offload_optimizer == "nvme":
        raise NotImplementedError(
            "ZeroConfig.offload.optimizer='nvme' is not available in this version of zerodp: "
            "use 'cpu' (host memory)"
        )
    if plan.offload_params != "none":
        raise NotImplementedError(
            f"ZeroConfig.offload.params={plan.offload_params!r} is not available in this "
            "version of zerodp: use 'none' (parameter shards on the device)"
        )
