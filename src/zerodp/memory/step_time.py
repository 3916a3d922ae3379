"""Predicted step time of one rank under an offload placement: what overlaps what.

[Note: step-time model]
Times come from the ``Machine``'s rates: the forward takes 2·Ψ·T / (peak·MFU) for T tokens,
the backward 4·Ψ·T (6·Ψ·T with activation checkpointing: the recomputed forward); the device
optimizer step moves ``device_step_bytes`` per device-stepped parameter at the device's memory
bandwidth; the CPU steps ``cpu_adam_params_per_s``; an upcast or downcast of n elements costs
n·(p + 4) / 2 bytes at the host copy rate; PCIe moves the compute dtype each way at once;
the disk serves reads and writes one after the other (one drive).

A step is two phases, one after the other, because the step is exact: the offloaded update
needs every gradient (the non-finite check and clipping run over all of them before any
bucket is stepped), and the next forward needs every update.

1. Backward: the compute; with offloaded parameters, pipelined per unit with the offloaded
   units' parameters coming in (h2d, from the disk for NVMe); with the gradients on NVMe, each
   unit's reduced gradient going out to the disk.
2. Step and next forward, two tracks at once, the phase lasting the longer. Both start with
   the device's share of the optimizer step (partial offload steps the kept part first):
   - the device: ``step()`` returns once every offloaded gradient is in host memory: with a
     whole host gradient (``host_gradients="full"``) that is the d2h copies and their upcast;
     with a ring, the offloaded step up to its last R chunks (the ring is reused only once a
     chunk is stepped). Then the forward (offloaded parameters: pipelined per unit with their
     h2d);
   - the host: the offloaded step, pipelined per bucket (one ring slot) through its stages:
     d2h of the gradient (or its read from NVMe), upcast into fp32, the disk (NVMe: read the
     masters and moments, write them back), CPU Adam, the cast of the masters into the compute
     dtype (a worker of its own), h2d of the updated parameters (parameters on the device);
     then the forward of the last bucket to land.

A pipeline of stages over n items (buckets or units) of stage totals S_i ends after
max S_i + (ΣS_i - max S_i)/n: the slowest stage throughout, the others for one item (the head
and the tail). Not modelled: contention for host memory bandwidth between the host stages,
collectives between ranks (world size 1 is what the preset describes), kernel launch and
Python overheads beyond those in the calibrated MFU.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerodp.memory.estimator import optimizer_multiplier
from zerodp.memory.machine import Machine, device_step_bytes, training_flops
from zerodp.memory.tiers import FP32, Placement, Workload, counts

RESOURCES = (
    "compute",
    "device step",
    "cpu adam",
    "host memcpy",
    "pcie d2h",
    "pcie h2d",
    "disk",
)


@dataclass(frozen=True, slots=True)
class Segment:
    """One stretch of the critical path and the resource that sets its length."""

    label: str
    resource: str
    seconds: float


@dataclass(frozen=True, slots=True)
class StepTime:
    """A predicted step: its length, the work of each resource (not overlapped), and the
    critical path (segments adding up to ``seconds``)."""

    seconds: float
    components: tuple[tuple[str, float], ...]
    path: tuple[Segment, ...]

    @property
    def bottleneck(self) -> str:
        """The resource that sets most of the critical path."""
        by_resource: dict[str, float] = {}
        for seg in self.path:
            by_resource[seg.resource] = by_resource.get(seg.resource, 0.0) + seg.seconds
        return max(by_resource, key=lambda r: by_resource[r])

    def component(self, name: str) -> float:
        return dict(self.components)[name]


def pipeline(stages: list[tuple[str, float]], items: float) -> tuple[float, str]:
    """(end, slowest resource) of ``items`` going through ``stages`` of total times S_i:
    max S_i + (ΣS_i - max S_i) / items. Stages of no time are skipped."""
    busy = [(resource, s) for resource, s in stages if s > 0]
    if not busy:
        return 0.0, "compute"
    resource, longest = max(busy, key=lambda rs: rs[1])
    n = max(1.0, items)
    return longest + (sum(s for _, s in busy) - longest) / n, resource


def predict_step(w: Workload, p: Placement, m: Machine) -> StepTime:
    """The step of one rank: see [Note: step-time model]."""
    c = counts(w, p)
    pb = w.param_bytes
    rate = m.device_flops
    forward = training_flops(w.num_params, w.tokens, checkpointing=False) / 3 / rate
    backward = training_flops(w.num_params, w.tokens, checkpointing=p.checkpointing) / rate
    backward -= forward
    on_device = c.owned - c.offloaded
    k_device = optimizer_multiplier(w.optimizer, w.precision)
    k_off = optimizer_multiplier(w.optimizer, w.precision, offload=True)
    device_step = on_device * device_step_bytes(k_device, pb, w.mixed)
    device_step /= m.device_memory_bytes_per_s

    h = c.offloaded
    params_off = p.params != "none"
    pcie, copy = m.pcie_bytes_per_s, m.host_memcpy_bytes_per_s
    read, write = m.disk_read_bytes_per_s, m.disk_write_bytes_per_s
    unpack = h * (pb + FP32) / (2 * copy)  # compute dtype -> fp32 gradient
    cast = h * (FP32 + pb) / (2 * copy)  # fp32 masters -> compute-dtype parameters
    adam = h / m.cpu_adam_params_per_s
    grads_nvme = p.gradients == "nvme"  # written in the backward, read by the step
    grads_out = pb * h / pcie  # the offloaded gradients to the host: in the backward or the step
    grads_d2h = 0.0 if grads_nvme else grads_out  # in the step
    updates_h2d = 0.0 if params_off else pb * h / pcie
    shard = pb * c.resting_params * p.offloaded  # the offloaded units' shards
    units_h2d = shard / pcie if params_off else 0.0  # one pass: the forward or the backward
    nvme_state = p.optimizer == "nvme"
    state_read = k_off * h / read if nvme_state else 0.0
    state_write = k_off * h / write if nvme_state else 0.0
    params_read = shard / read if p.params == "nvme" else 0.0  # one pass
    params_write = shard / write if p.params == "nvme" else 0.0
    grads_write = pb * h / write if grads_nvme else 0.0
    grads_read = pb * h / read if grads_nvme else 0.0

    # Phase 1: backward. The reduced gradients stay on the device until the step, or go to
    # NVMe as reduced.
    if params_off or grads_nvme:
        stages = [("disk", params_read + grads_write), ("pcie h2d", units_h2d)]
        out = grads_out - grads_d2h  # with the gradients on NVMe: on their way to the disk
        back, back_by = pipeline([*stages, ("compute", backward), ("pcie d2h", out)], w.units)
    else:
        back, back_by = backward, "compute"

    # Phase 2, the host's track: the offloaded step, then the forward of the last bucket.
    chunks = h / c.ring_chunk if h else 1.0
    disk = state_read + state_write + params_write + grads_read
    host_stages = [
        ("pcie d2h", grads_d2h),
        ("host memcpy", unpack),
        ("disk", disk),
        ("cpu adam", adam),
        ("host memcpy", cast),
        ("pcie h2d", updates_h2d),
    ]
    chain, host_by = pipeline(host_stages, chunks)
    host_track = 0.0
    if h:
        if params_off:
            tail = (forward + units_h2d + params_read) / w.units
        else:
            tail = forward * c.ring_chunk / c.owned
        host_track = device_step + chain + tail
        if disk + params_read > host_track:  # one drive serves the step and the forward
            host_track, host_by = device_step + disk + params_read, "disk"

    # Phase 2, the device's track.
    device_track: list[Segment] = []
    if device_step:
        device_track.append(Segment("device step", "device step", device_step))
    if h and p.host_gradient == "fp32":
        stages = [("pcie d2h", grads_d2h), ("host memcpy", unpack)]
        if grads_nvme:
            stages = [("disk", grads_read), ("host memcpy", unpack)]
        g, g_by = pipeline(stages, chunks)
        device_track.append(Segment("gradients to host", g_by, g))
    elif h:  # a ring: until the last R chunks are being stepped
        slowest = max(seconds for _, seconds in host_stages)
        left = min(chunks, float(w.ring_buckets)) * slowest / chunks
        device_track.append(Segment("offloaded step to its last chunks", host_by, chain - left))
    if params_off:
        stages = [("disk", params_read), ("pcie h2d", units_h2d), ("compute", forward)]
        fwd, fwd_by = pipeline(stages, w.units)
    else:
        fwd, fwd_by = forward, "compute"
    device_track.append(Segment("forward", fwd_by, fwd))

    path = [Segment("backward", back_by, back)]
    if host_track > sum(s.seconds for s in device_track):
        if device_step:
            path.append(Segment("device step", "device step", device_step))
        path.append(Segment("offloaded step", host_by, host_track - device_step))
    else:
        path += device_track
    components = (
        ("compute", forward + backward),
        ("device step", device_step),
        ("cpu adam", adam),
        ("host memcpy", unpack + cast),
        ("pcie d2h", grads_out),
        ("pcie h2d", updates_h2d + 2 * units_h2d),
        ("disk read", state_read + 2 * params_read + grads_read),
        ("disk write", state_write + params_write + grads_write),
    )
    return StepTime(sum(s.seconds for s in path), components, tuple(path))
