"""The per-rank side of ``zerodp bench``: one configuration, timed step by step.

``rank_main`` runs in every rank of one launch (see ``launch.py``: one launch per configuration,
so a rank's peak RSS is that configuration's alone). It joins the process group from the
launcher's environment, imports the system's modules, records the baseline RSS, builds the
model from the seed, wraps it, runs ``warmup + steps`` steps on the embedded corpus, measures,
writes its full final parameters for the parity check and returns a plain dict (the launcher
hands it to the parent).

A step is ``zero_grad + forward + backward + step``, each phase timed on its own after a barrier
(on CUDA each phase ends with a synchronize so that its time is its own). Within ``step``, the
torch optimizer's own update is timed too (``OptimizerClock``): the rest of ``step`` is the
system's work around it (waiting for gradient reductions, gathering parameters, copies). The RSS
after each phase and the peak within it come from ``PhaseProbe``. With ``profile_steps``, more
steps follow under ``torch.profiler`` (``operators``), after everything else was measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from zerodp import sharded_init
from zerodp.apps.bench import peers
from zerodp.apps.bench.operators import profile_steps
from zerodp.apps.bench.options import BenchOptions
from zerodp.apps.bench.probe import PhaseProbe, malloc_stats
from zerodp.apps.bench.systems import BY_NAME
from zerodp.apps.train.world import cores_per_rank, local_placement
from zerodp.comm import Communicator, destroy, init_from_env
from zerodp.comm.launch import record
from zerodp.memory import SavedForBackward, meter_for

PHASES = ("zero_grad", "forward", "backward", "step")
_PG_TIMEOUT_S = 600.0  # a hung collective becomes an error after this, not a silent hang


@record
def rank_main(options: BenchOptions, name: str, workdir: str, save_params: bool) -> dict[str, Any]:
    """Run configuration ``name`` as this rank; the per-rank result (see ``_run``).

    ``@record`` writes an exception's traceback where the elastic agent finds it, so the parent
    can show the rank's error instead of a bare exit code."""
    info, comm = _join_world(options)
    try:
        return _run(options, name, info, comm, Path(workdir), save_params)
    finally:
        destroy()


def params_file(workdir: Path, name: str, rank: int) -> Path:
    return workdir / f"{name}.rank{rank}.pt"


def _join_world(options: BenchOptions) -> tuple[peers.RankInfo, Communicator]:
    local_rank, local_world, device = local_placement()
    # Ranks sharing a node share its cores: by default each gets its part, not all of them
    # (oversubscribed ranks run several times slower and much more noisily).
    torch.set_num_threads(options.threads or cores_per_rank(local_world))
    init_from_env(options.process_backend(device.type == "cuda"), timeout_s=_PG_TIMEOUT_S)
    comm = Communicator(None)  # barriers and rank facts; its ledger stays out of the report
    return peers.RankInfo(comm.rank, comm.world_size, local_rank, device), comm


def _run(
    options: BenchOptions,
    name: str,
    info: peers.RankInfo,
    comm: Communicator,
    workdir: Path,
    save_params: bool,
) -> dict[str, Any]:
    from zerodp.apps.data.corpus import BatchSampler, load_corpus
    from zerodp.apps.models.gpt import get_config, num_parameters

    base = {"rank": info.rank, "config": name}
    try:
        peers.import_for(name)
    except peers.Unavailable as exc:
        return {**base, "status": exc.status, "reason": exc.reason}
    cfg = get_config(options.preset)
    sampler = BatchSampler(
        load_corpus(), options.batch, cfg.seq_len, options.seed, info.rank, info.world_size
    )
    meter = meter_for(info.device)  # [Note: memory meters]
    rss_baseline = meter.current()  # runtime: torch, the system's modules, the process group
    heap_baseline = malloc_stats()
    torch.manual_seed(options.seed)  # the same initial weights for every configuration
    module = _construct(name, cfg, info.device)
    num_params = num_parameters(module)
    try:
        peer = peers.build(name, module, info, options)
    except peers.Unavailable as exc:
        return {**base, "status": exc.status, "reason": exc.reason}
    with peers.closing(peer), OptimizerClock(peer.inner_optimizer(), info.device) as clock:
        comm.barrier()
        rss_setup = meter.current()
        probe = PhaseProbe(meter)
        # The last step also accounts for memory at the end of its forward pass, when every
        # activation is alive (the hooks cost a Python call per saved tensor: ~1 ms).
        counted = _total(options) - 1

        def timed(s: int) -> dict[str, Any]:
            return _step(peer, sampler, s, info.device, probe, comm.barrier, clock, s == counted)

        steps = [timed(s) for s in range(options.warmup)]
        io_before = peer.nvme_io()
        steps += [timed(s) for s in range(options.warmup, _total(options))]
        io_after = peer.nvme_io()
        result = {
            **base,
            "status": "ok",
            "world_size": info.world_size,
            "backend": comm.backend,
            "device": str(info.device),
            "threads": torch.get_num_threads(),
            "num_params": num_params,
            "rss_baseline": rss_baseline,
            "heap_baseline": heap_baseline,
            "rss_setup": rss_setup,
            "peak_rss_setup": probe.setup_peak,
            "peak_resettable": probe.resettable,
            "steps": steps,
            "memory": peer.memory(),
            "comm": peer.comm(),
            "rss_end": meter.current(),
            "memory_source": meter.source,
        }
        if io_before is not None and io_after is not None:
            result["nvme"] = nvme_traffic(io_before, io_after, options)
        if options.profile_steps:  # every configuration runs these steps: parity holds

            def step(s: int) -> None:
                _plain_step(peer, sampler, s, info.device, comm.barrier)

            result["profile"] = profile_steps(step, _total(options), options.profile_steps)
        if save_params:  # after measuring: gathering full parameters allocates
            path = params_file(workdir, name, info.rank)
            torch.save(peer.full_params(), path)
            result["params_file"] = str(path)
        comm.barrier()
    return result


def nvme_traffic(
    before: dict[str, int], after: dict[str, int], options: BenchOptions
) -> dict[str, Any]:
    """Bytes per timed step to and from the NVMe files, and the disk's bandwidth measured now,
    in the same directory, through the same file code (``zerodp.memory.measure.measure_disk``)."""
    from zerodp.memory import measure_disk

    per_step = {k: (after[k] - before[k]) / options.steps for k in after}
    disk = {m.name: m.value for m in measure_disk(options.offload_dir)}
    read_s = per_step["read_bytes"] / disk["disk_read_bytes_per_s"]
    write_s = per_step["written_bytes"] / disk["disk_write_bytes_per_s"]
    return {
        "per_step": per_step,
        "disk": disk,
        "directory": options.offload_dir,
        "disk_seconds_per_step": {"read": read_s, "write": write_s},
    }


def _construct(name: str, cfg: Any, device: torch.device) -> torch.nn.Module:
    """The GPT, on the device, or on the meta device for a system built with
    ``zerodp.sharded_init()`` (``initialize`` materialises it unit by unit, with the values a
    whole build draws from the same seed)."""
    from zerodp.apps.models.gpt import GPT

    if not BY_NAME[name].sharded_init:
        return GPT(cfg).to(device)
    with sharded_init():
        return GPT(cfg)


def _total(options: BenchOptions) -> int:
    return options.warmup + options.steps


class OptimizerClock:
    """Seconds inside the torch optimizer's own ``step`` calls, from torch's step hooks; they
    add up (zerodp's mixed precision steps it once per bucket). CPU only: on CUDA the hooks
    would time kernel launches, not the update, so nothing is recorded there."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self._seconds = 0.0
        self._calls = 0
        self._start = 0.0
        self._hooks: list[Any] = []  # torch's RemovableHandle
        if device.type == "cpu":
            pre = optimizer.register_step_pre_hook(self._pre)
            self._hooks = [pre, optimizer.register_step_post_hook(self._post)]

    def _pre(self, *_: Any) -> None:
        self._start = time.perf_counter()

    def _post(self, *_: Any) -> None:
        self._seconds += time.perf_counter() - self._start
        self._calls += 1

    def take(self) -> float | None:
        """Seconds since the last ``take``; ``None`` if the optimizer's step did not run."""
        seconds = self._seconds if self._calls else None
        self._seconds, self._calls = 0.0, 0
        return seconds

    def __enter__(self) -> OptimizerClock:
        return self

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()


def _plain_step(
    peer: peers.Peer, sampler: Any, step: int, device: torch.device, barrier: Callable[[], None]
) -> None:
    """One untimed step, left settled (what the profiler watches)."""
    x, y = (t.to(device) for t in sampler.batch_at(step))
    barrier()
    peer.zero_grad()
    peer.backward(peer.forward(x, y))
    peer.step()
    peer.settle()


def _step(
    peer: peers.Peer,
    sampler: Any,
    step: int,
    device: torch.device,
    probe: PhaseProbe,
    barrier: Callable[[], None],
    clock: OptimizerClock,
    count_saved: bool = False,
) -> dict[str, Any]:
    """One step: seconds and memory per phase (and the optimizer's seconds within ``step``), the
    loss, and with ``count_saved`` the bytes autograd saved for backward and the tensors held by
    category at the end of the forward pass (measured between the phases, outside their times)."""
    x, y = (t.to(device) for t in sampler.batch_at(step))
    barrier()  # every rank starts the step together: a step's time is the slowest rank's
    times: dict[str, float] = {}
    memory: dict[str, dict[str, int | None]] = {}
    loss: Any = None

    saved = SavedForBackward(peer.module.parameters()) if count_saved else None
    forward_end: dict[str, int] = {}

    def forward() -> None:
        nonlocal loss
        if saved is None:
            loss = peer.forward(x, y)
            return
        with saved:
            loss = peer.forward(x, y)

    actions: dict[str, Callable[[], None]] = {
        "zero_grad": peer.zero_grad,
        "forward": forward,
        "backward": lambda: peer.backward(loss),
        "step": peer.step,
    }
    for phase in PHASES:
        probe.begin()
        clock.take()  # only the step phase's calls count
        t0 = time.perf_counter()
        actions[phase]()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times[phase] = time.perf_counter() - t0
        memory[phase] = probe.end()
        if saved is not None and phase == "forward":
            forward_end = {"saved": saved.nbytes, "saved_alive": saved.alive_bytes()}
            forward_end["saved_parameters"] = saved.param_bytes
            held = peer.memory()
            forward_end.update({k: v for k, v in held.items() if isinstance(v, int)})
            saved.release()
    times["total"] = sum(times.values())
    optimizer = clock.take()  # within "step", so not part of the total
    if optimizer is not None:
        times["optimizer"] = optimizer
    out = {
        "step": step,
        "times": times,
        "memory": memory,
        "loss": float(loss.detach().float().item()),
    }
    if saved is not None:
        out["forward_end"] = forward_end
    offload = peer.offload_timing()  # the step before this one, now complete
    if offload is not None:
        out["offload"] = offload
    return out
