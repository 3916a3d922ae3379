"""``zerodp estimate --offload --measure``: this machine's host constants of the offload cost
model (CPU AdamW, host memory copies, disk), measured, beside the ``H100_BOX`` preset's."""

from __future__ import annotations

import argparse
import json

from zerodp.memory import (
    H100_BOX,
    H100_CPU_CORES,
    H100_FOREACH_ADAM_PARAMS_PER_S,
    Measurement,
    measure_cpu_adam,
    measure_disk,
    measure_memcpy,
)

DEFAULT_DISK_MIB = 256


def run(args: argparse.Namespace) -> int:
    """Measure, then print each constant beside the preset's (text or ``--json``)."""
    mib = args.measure_mib or DEFAULT_DISK_MIB
    measured: list[Measurement] = [
        measure_cpu_adam(fused=True),
        measure_cpu_adam(fused=False),
        measure_memcpy(),
        *measure_disk(args.measure_dir, mib * 2**20),
    ]
    preset = {
        "cpu_adam_params_per_s": H100_BOX.cpu_adam_params_per_s,
        "cpu_adam_foreach_params_per_s": H100_FOREACH_ADAM_PARAMS_PER_S,
        "host_memcpy_bytes_per_s": H100_BOX.host_memcpy_bytes_per_s,
        "disk_write_bytes_per_s": H100_BOX.disk_write_bytes_per_s,
        "disk_read_bytes_per_s": H100_BOX.disk_read_bytes_per_s,
    }
    if args.json:
        out = [
            {
                "name": m.name,
                "value": m.value,
                "unit": m.unit,
                "how": m.how,
                "preset": preset[m.name],
            }
            for m in measured
        ]
        print(json.dumps({"measured": out, "preset": H100_BOX.name}))
        return 0
    lines = [
        f"Measured on this machine, beside the {H100_BOX.name} preset "
        f"({H100_CPU_CORES} CPU cores; PCIe, device FLOP/s",
        "and device memory bandwidth need a CUDA device: not measured)",
        f"{'constant':<31}{'measured':>10}{'preset':>10}  how",
    ]
    for m in measured:
        lines.append(f"{m.name:<31}{m.value:>10.3g}{preset[m.name]:>10.3g}  {m.how}")
    threads = _threads()
    adam = next(m for m in measured if m.name == "cpu_adam_params_per_s")
    lines.append(
        f"fused AdamW per core: {adam.value / threads:.3g} params/s here ({threads} threads), "
        f"{H100_BOX.cpu_adam_params_per_s / H100_CPU_CORES:.3g} in the preset"
    )
    print("\n".join(lines))
    return 0


def _threads() -> int:
    import torch

    return torch.get_num_threads()
