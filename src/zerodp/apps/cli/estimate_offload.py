"""``zerodp estimate --offload``: bytes per tier (device, host, NVMe) and the predicted step
time of ZeRO-Offload / ZeRO-Infinity placements on one machine, the fastest placement that
fits each model, and the largest GPT that fits with exact fp32 Adam.

The machine is the ``H100_BOX`` preset (``zerodp.memory.machine``) unless flags override its
constants; the models are GPT-3's 1.3B, 6.7B and 13B shapes (vocabulary 32,000, 4 x 1024
tokens per step) unless ``--params``, ``--gpt-*`` or ``--model`` name one. ``--measure``
measures this machine's host constants (CPU AdamW, memory copies, disk) beside the preset's.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from zerodp.apps.cli import estimate_measure
from zerodp.apps.cli.argtypes import positive_float, positive_int
from zerodp.config import GRADIENT_TIERS, HOST_GRADIENTS, TIERS, OffloadConfig
from zerodp.memory import (
    CALIBRATION_SHAPE,
    CALIBRATION_STEP_S,
    H100_BOX,
    GiB,
    GPTShape,
    Machine,
    Placement,
    Prediction,
    Workload,
    cheapest_fit,
    gpt3_shape,
    largest_fit,
    optimizer_multiplier,
    predict,
)

DEFAULT_MODELS = ("1.3B", "6.7B", "13B")
DEFAULT_BATCH = CALIBRATION_SHAPE.micro_batch  # 4 sequences per step, as calibrated

# Flag -> (Machine field, factor from the flag's unit to the field's).
_MACHINE_FLAGS = {
    "device_memory_gb": ("device_bytes", 1e9),
    "device_reserve_gb": ("device_reserve_bytes", 1e9),
    "host_memory_gb": ("host_bytes", 1e9),
    "host_reserve_gb": ("host_reserve_bytes", 1e9),
    "nvme_gb": ("nvme_bytes", 1e9),
    "pcie_gbps": ("pcie_bytes_per_s", 1e9),
    "host_memcpy_gbps": ("host_memcpy_bytes_per_s", 1e9),
    "cpu_adam_params_per_s": ("cpu_adam_params_per_s", 1.0),
    "disk_read_gbps": ("disk_read_bytes_per_s", 1e9),
    "disk_write_gbps": ("disk_write_bytes_per_s", 1e9),
    "device_tflops": ("device_peak_flops", 1e12),
    "mfu": ("mfu", 1.0),
    "device_hbm_gbps": ("device_memory_bytes_per_s", 1e9),
}
_PLACEMENT_FLAGS = (
    "offload_optimizer",
    "offload_params",
    "offload_gradients",
    "offload_host_gradients",
    "optimizer_fraction",
)
_OTHER_FLAGS = (
    "stage",
    "ring_buckets",
    "tokens",
    "allow_nvme",
    "measure",
    "measure_dir",
    "measure_mib",
)
OFFLOAD_ONLY = (*_MACHINE_FLAGS, *_PLACEMENT_FLAGS, *_OTHER_FLAGS)
"""Flags that only ``--offload`` reads (``--device-memory-gb`` aside, which both read)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--offload`` options of ``zerodp estimate``."""
    g = p.add_argument_group(
        "offload cost model (--offload; sizes in GB = 1e9 B, rates in GB/s = 1e9 B/s)"
    )
    g.add_argument(
        "--offload",
        action="store_true",
        help="bytes per tier and predicted step time of offload placements on a machine",
    )
    g.add_argument("--offload-optimizer", choices=TIERS, help="this placement only (else search)")
    g.add_argument("--offload-params", choices=TIERS, help="stage 3; this placement only")
    g.add_argument(
        "--offload-gradients", choices=GRADIENT_TIERS, help="stage 3; this placement only"
    )
    g.add_argument(
        "--offload-host-gradients",
        choices=HOST_GRADIENTS,
        help="OffloadConfig.host_gradients; this placement only",
    )
    g.add_argument(
        "--optimizer-fraction",
        type=_fraction,
        metavar="F",
        help="of the optimizer state, the fraction offloaded (the rest stays on the device)",
    )
    g.add_argument(
        "--stage",
        type=int,
        choices=(0, 1, 2, 3),
        help="ZeRO stage with the parameters on the device (default 2; offloaded: 3)",
    )
    g.add_argument(
        "--ring-buckets", type=positive_int, metavar="R", help="OffloadConfig.ring_buckets"
    )
    g.add_argument("--tokens", type=positive_int, help="tokens per step (--params, --model)")
    g.add_argument("--allow-nvme", action="store_true", help="the search may use NVMe too")
    for flag, unit in (
        ("host-memory-gb", "host memory"),
        ("device-reserve-gb", "device memory not for tensors"),
        ("host-reserve-gb", "host memory kept for the OS and process"),
        ("nvme-gb", "room on the NVMe"),
        ("pcie-gbps", "pinned host-device copies, each way"),
        ("host-memcpy-gbps", "host memory copy rate"),
        ("cpu-adam-params-per-s", "CPU AdamW parameters per second"),
        ("disk-read-gbps", "NVMe read"),
        ("disk-write-gbps", "NVMe write"),
        ("device-tflops", "device dense peak in TFLOP/s"),
        ("mfu", "model-FLOPs utilisation, 0-1"),
        ("device-hbm-gbps", "device memory bandwidth"),
    ):
        g.add_argument(f"--{flag}", type=positive_float, metavar="X", help=unit)
    g.add_argument("--measure", action="store_true", help="measure this machine's host constants")
    g.add_argument("--measure-dir", metavar="DIR", help="directory for the disk measurement")
    g.add_argument(
        "--measure-mib", type=positive_int, metavar="MiB", help="disk file size (default 256 MiB)"
    )


def given_offload_flags(args: argparse.Namespace) -> list[str]:
    """The ``--offload``-only flags given (for the error when ``--offload`` is missing)."""
    shared = {"device_memory_gb"}
    return [
        "--" + name.replace("_", "-")
        for name in OFFLOAD_ONLY
        if name not in shared and getattr(args, name) not in (None, False)
    ]


def run(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    models: list[tuple[float, GPTShape | None]],
) -> int:
    """``models``: (parameters, shape or None) of the model estimate.py was given; empty for
    the default GPT-3 shapes."""
    if args.k is not None:
        parser.error("--k does not apply to --offload (the tiers need the optimizer's tensors)")
    if args.measure:
        return estimate_measure.run(args)
    machine = _machine(args, parser)
    settings = _settings(args)
    workloads = _workloads(args, models, settings, parser)
    fixed = _placement(args, parser)
    search: dict[str, Any] = {
        "stage": args.stage if args.stage is not None else 2,
        "checkpointing": True if args.activation_checkpointing else None,
    }
    rows: list[tuple[str, Prediction, bool]] = []
    for name, w in workloads:
        if fixed is not None:
            rows.append((name, predict(w, fixed, machine), False))
            continue
        stage = search["stage"]
        baselines = [Placement(stage=stage)]
        if stage:
            baselines.append(Placement(optimizer="cpu", stage=stage))
        shown = [predict(w, p, machine) for p in baselines]
        best = cheapest_fit(w, machine, allow_nvme=args.allow_nvme, **search)
        for pr in shown:
            rows.append((name, pr, best is not None and pr.placement == best.placement))
        if best is not None and best.placement not in baselines:
            rows.append((name, best, True))
    shape = next((w.shape for _, w in workloads if w.shape is not None), None) or gpt3_shape("13B")
    largest = {
        "without_nvme": largest_fit(machine, **_family(shape), settings=settings, **search),
    }
    if args.allow_nvme and machine.nvme_bytes is not None:
        largest["with_nvme"] = largest_fit(
            machine, **_family(shape), settings=settings, allow_nvme=True, **search
        )
    if args.json:
        print(json.dumps(_to_json(machine, rows, largest)))
    else:
        print(_to_text(machine, settings, rows, largest, args))
    return 0


def _fraction(text: str) -> float:
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


def _machine(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Machine:
    values = {
        field: None if getattr(args, flag) is None else getattr(args, flag) * factor
        for flag, (field, factor) in _MACHINE_FLAGS.items()
    }
    name = H100_BOX.name if all(v is None for v in values.values()) else "H100_BOX, overridden"
    try:
        return H100_BOX.with_overrides(name=name, **values)  # type: ignore[arg-type]
    except ValueError as exc:
        parser.error(str(exc))


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    world = args.world_sizes or [1]
    return {
        "precision": args.precision,
        "optimizer": args.optimizer,
        "world_size": world[0],
        "bucket_bytes": args.bucket_bytes,
        "ring_buckets": args.ring_buckets or OffloadConfig().ring_buckets,
        "prefetch_depth": args.prefetch_depth,
        "largest_unit_params": args.largest_unit_params,
    }


def _workloads(
    args: argparse.Namespace,
    models: list[tuple[float, GPTShape | None]],
    settings: dict[str, Any],
    parser: argparse.ArgumentParser,
) -> list[tuple[str, Workload]]:
    if args.world_sizes is not None and len(args.world_sizes) != 1:
        parser.error("--offload models one world size: give --world-sizes N")
    if not models:
        shapes = [(n, gpt3_shape(n, micro_batch=args.gpt_batch)) for n in DEFAULT_MODELS]
        return [(n, Workload.gpt(s, **settings)) for n, s in shapes]
    out = []
    for num_params, shape in models:
        if shape is not None:
            out.append((_name(num_params), Workload.gpt(shape, **settings)))
        else:
            tokens = float(args.tokens or CALIBRATION_SHAPE.micro_batch * CALIBRATION_SHAPE.seq_len)
            w = Workload(num_params=num_params, tokens=tokens, **settings)
            out.append((_name(num_params), w))
    return out


def _placement(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Placement | None:
    if all(getattr(args, flag) is None for flag in _PLACEMENT_FLAGS):
        return None
    params = args.offload_params or "none"
    stage3 = params != "none" or args.offload_gradients not in (None, "device")
    try:
        return Placement(
            optimizer=args.offload_optimizer or "none",
            params=params,
            gradients=args.offload_gradients or "device",
            host_gradients=args.offload_host_gradients or "auto",
            optimizer_fraction=args.optimizer_fraction or 1.0,
            stage=args.stage if args.stage is not None else (3 if stage3 else 2),
            checkpointing=args.activation_checkpointing,
        )
    except ValueError as exc:
        parser.error(str(exc))


def _family(shape: GPTShape) -> dict[str, int]:
    return {"vocab": shape.vocab, "seq_len": shape.seq_len, "micro_batch": shape.micro_batch}


def _name(num_params: float) -> str:
    if num_params >= 1e9:
        return f"{num_params / 1e9:.3g}B"
    return f"{num_params / 1e6:.3g}M"


def _sci(x: float) -> str:
    """3 significant figures, exponent without "+" or padding: 1.28e9, 5.5e9, 54e9."""
    mantissa, _, exponent = f"{x:.3g}".partition("e")
    return f"{mantissa}e{int(exponent)}" if exponent else mantissa


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def _to_text(
    m: Machine,
    settings: dict[str, Any],
    rows: list[tuple[str, Prediction, bool]],
    largest: dict[str, Prediction | None],
    args: argparse.Namespace,
) -> str:
    k = optimizer_multiplier(settings["optimizer"], settings["precision"], offload=True)
    nvme = "not limited" if m.nvme_bytes is None else f"{_gib(m.nvme_bytes)} GiB"
    first = rows[0][1].workload
    tokens = f"{first.tokens:,.0f}" if len({pr.workload.tokens for _, pr, _ in rows}) == 1 else ""
    lines = [
        f"Offload cost model: predictions for one rank on {m.name} (GiB = 2^30 B)",
        f"machine: device {_gib(m.device_bytes)} GiB ({_gib(m.device_reserve_bytes)} kept), "
        f"host {_gib(m.host_bytes)} GiB ({_gib(m.host_reserve_bytes)} kept), NVMe {nvme};",
        f"  PCIe {_sci(m.pcie_bytes_per_s)} B/s each way, host memcpy "
        f"{_sci(m.host_memcpy_bytes_per_s)} B/s, CPU AdamW {_sci(m.cpu_adam_params_per_s)} "
        "params/s,",
        f"  NVMe read {_sci(m.disk_read_bytes_per_s)} B/s, write "
        f"{_sci(m.disk_write_bytes_per_s)} B/s, device memory "
        f"{_sci(m.device_memory_bytes_per_s)} B/s,",
        f"  device {_sci(m.device_peak_flops)} FLOP/s peak x MFU {m.mfu:.3f} = "
        f"{_sci(m.device_flops)} FLOP/s (the MFU reproducing the 1.3B GPT's",
        f"  {CALIBRATION_STEP_S} s/step without offload)",
        f"workload: {tokens + ' ' if tokens else ''}tokens per step, {settings['precision']}, "
        f"{settings['optimizer']} with fp32 masters and moments (K = {k:g} B/param: exact),",
        f"  world size {settings['world_size']}, bucket {settings['bucket_bytes'] / 2**20:g} MiB, "
        f"{settings['ring_buckets']} ring buckets",
        "",
        f"{'model':<7}{'params':>9}  {'placement':<44}{'dev GiB':>8}{'host GiB':>9}{'NVMe GiB':>9}"
        f"{'host B/p':>10}{'fits':>6}{'s/step':>8}  bottleneck",
    ]
    for name, pr, fastest in rows:
        b = pr.bytes
        mark = "*" if fastest else " "
        lines.append(
            f"{name:<7}{_sci(pr.workload.num_params):>9} {mark}{pr.placement.label():<44}"
            f"{_gib(b.device.total):>8}{_gib(b.host.total):>9}{_gib(b.nvme.total):>9}"
            f"{pr.host_bytes_per_param:>10.2f}{'yes' if pr.fits else 'no':>6}"
            f"{pr.time.seconds:>8.3f}  {pr.time.bottleneck}"
        )
    if any(fastest for _, _, fastest in rows):
        lines += ["", "* the fastest placement that fits (searched)"]
    lines.append(
        "ckpt: activation checkpointing (the model's own, e.g. Hugging Face's "
        "gradient_checkpointing_enable()); sN: ZeRO stage N;"
    )
    lines.append(
        "optimizer=cpu:F: F of the optimizer state offloaded (OffloadConfig.optimizer_fraction); "
        "hostgrad=ring|full: OffloadConfig.host_gradients"
    )
    lines += ["", "Seconds per step, each resource's work (overlapped in the step) and the path:"]
    for name, pr, _ in rows:
        work = ", ".join(f"{r} {s:.3f}" for r, s in pr.time.components if s)
        path = " + ".join(f"{s.label} {s.seconds:.3f} ({s.resource})" for s in pr.time.path)
        lines += [f"{name} {pr.placement.label()}: {work}", f"    path: {path}"]
    lines.append("")
    for key, what in (("without_nvme", "without NVMe"), ("with_nvme", "with NVMe")):
        if key in largest:
            lines.append(_largest_line(what, largest[key]))
    lines.append(
        "Every placement above is an OffloadConfig zerodp runs (docs/offload.md); the times and "
        "bytes are predictions."
    )
    return "\n".join(lines)


def _largest_line(what: str, pr: Prediction | None) -> str:
    if pr is None:
        return f"Largest GPT that fits {what}: none"
    s = pr.workload.shape
    assert s is not None
    return (
        f"Largest GPT (hidden = 128 x layers) that fits {what}, exact fp32 Adam: "
        f"{pr.workload.num_params / 1e9:.2f}B ({s.layers} layers x {s.hidden}), "
        f"{pr.placement.label()}: device {_gib(pr.bytes.device.total)} GiB, host "
        f"{_gib(pr.bytes.host.total)} GiB, {pr.time.seconds:.3f} s/step"
    )


def _prediction_json(name: str, pr: Prediction) -> dict[str, Any]:
    p, w = pr.placement, pr.workload
    return {
        "model": name,
        "num_params": w.num_params,
        "tokens": w.tokens,
        "placement": {
            "optimizer": p.optimizer,
            "params": p.params,
            "gradients": p.gradients,
            "optimizer_fraction": p.optimizer_fraction,
            "stage": p.stage,
            "activation_checkpointing": p.checkpointing,
            "host_gradients": p.host_gradients,
        },
        "bytes": {
            tier: {"total": getattr(pr.bytes, tier).total, **getattr(pr.bytes, tier).as_dict()}
            for tier in ("device", "host", "nvme")
        },
        "fits": {"device": pr.fits_device, "host": pr.fits_host, "nvme": pr.fits_nvme},
        "step_s": pr.time.seconds,
        "bottleneck": pr.time.bottleneck,
        "components_s": dict(pr.time.components),
        "path": [
            {"label": s.label, "resource": s.resource, "seconds": s.seconds} for s in pr.time.path
        ],
    }


def _to_json(
    m: Machine,
    rows: list[tuple[str, Prediction, bool]],
    largest: dict[str, Prediction | None],
) -> dict[str, Any]:
    machine = {f: getattr(m, f) for f in Machine.__dataclass_fields__}
    machine["device_flops"] = m.device_flops
    return {
        "machine": machine,
        "rows": [{**_prediction_json(n, pr), "fastest": fastest} for n, pr, fastest in rows],
        "largest_fit": {
            key: None if pr is None else _prediction_json(_name(pr.workload.num_params), pr)
            for key, pr in largest.items()
        },
    }
