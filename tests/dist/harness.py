"""Multi-rank test harness: run one test function in N real ranks over gloo.

Import convention
-----------------
``tests/conftest.py`` puts ``tests/dist`` at the front of ``sys.path``, so tests import this
module as a top-level module::

    from harness import RankFailure, WorldPool, WorldTimeout, run_world

Do not import it as ``tests.dist.harness``: that would load a second copy with its own pool
registry and its own exception classes (``pytest.raises(RankFailure)`` would stop matching).

Usage
-----
Most tests use the session-scoped ``world`` fixture from ``tests/conftest.py``, which hands out
one persistent pool per world size::

    def _allreduce_rank():                       # module level, so workers can import it
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    def test_allreduce(world):
        assert world(2).run(_allreduce_rank) == [1.0, 1.0]

``fn(*args, **kwargs)`` runs in every rank with the default (gloo) process group initialised;
``run`` returns the per-rank return values, index = rank.  ``fn`` must be a module-level function
(workers import it by module name, falling back to the module's file) or a picklable callable;
arguments and return values travel with plain ``pickle``, so every rank gets its own copy.
``run`` consumes the keyword ``timeout`` itself, so ``fn`` cannot take a kwarg of that name.

Workers stay alive between runs, so state a test leaves behind (seeds, default dtype, extra
process groups) is visible to later tests on the same pool; reset what you change.  Workers do
not see later changes to the parent's environment variables or working directory: pass what a
rank needs (e.g. an absolute ``tmp_path``) as an argument.  Plain ``assert`` inside ``fn`` is not
rewritten by pytest in the ranks, so give such asserts a message (or use ``torch.testing``).

If any rank raises, dies or hangs, ``run`` raises ``RankFailure`` / ``WorldTimeout`` (both
``AssertionError`` subclasses) with every failing rank's traceback and the Python stacks of
ranks that were stuck, kills the workers, and the next ``run`` transparently starts a fresh world.
Output the ranks print is forwarded to ``sys.stdout`` after the run (so pytest captures it per
test) and is included in failure messages.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import importlib
import importlib.util
import itertools
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_START_METHOD",
    "RankFailure",
    "WorldPool",
    "WorldTimeout",
    "close_shared_pools",
    "run_world",
    "shared_pool",
]

# forkserver: the server imports torch once per session and then forks each worker from a
# process that has never run a torch op (so no OpenMP/gloo threads are forked).  A fresh rank
# then costs a fork instead of a ~2 s torch import, which matters when a failed pool restarts.
# Override with ZERODP_TEST_START_METHOD=spawn if forkserver misbehaves somewhere.
DEFAULT_START_METHOD = os.environ.get("ZERODP_TEST_START_METHOD", "forkserver")
# Test modules import pytest too (~0.2 s each); preloading it makes every pool restart cheaper.
_FORKSERVER_PRELOAD = ["torch", "torch.distributed"] + (
    ["pytest"] if "pytest" in sys.modules else []
)

_STACK_DUMP_SIGNAL = signal.SIGUSR1
_MAX_OUTPUT_CHARS = 8000  # per rank, in failure messages: keep the tail, where errors are


class RankFailure(AssertionError):
    """At least one rank raised or died; the message has every failing rank's traceback."""

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:  # default: unpickling
        super().__init__(message)
        self.ranks = tuple(ranks)


class WorldTimeout(AssertionError):
    """Some ranks did not answer in time; the message names them and shows their stacks."""

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:  # default: unpickling
        super().__init__(message)
        self.ranks = tuple(ranks)


# --------------------------------------------------------------------------------------------
# Messages between the parent and the workers (pickled by hand, see _send/_recv).


@dataclass(frozen=True)
class _FnRef:
    """A module-level function, sent by name plus file: the file is the fallback for modules
    that are not importable by name in a worker (pytest's importlib mode, scripts)."""

    module: str
    qualname: str
    file: str | None


@dataclass(frozen=True)
class _Job:
    job_id: int
    fn: _FnRef | bytes  # bytes: a pickled callable that is not a plain module-level function
    args: bytes  # pickled (args, kwargs), shared by all ranks
    sys_path: list[str]


@dataclass(frozen=True)
class _Reply:
    job_id: int
    ok: bool
    value: bytes | None  # pickled return value when ok
    error: str | None  # formatted traceback when not ok
    pg_alive: bool = True  # False if fn tore down the default group: the pool must restart


_STOP = "stop"
_STARTUP_JOB_ID = 0  # the "ready" reply after init_process_group


# --------------------------------------------------------------------------------------------
# Worker side.


@dataclass(frozen=True)
class _WorkerSpec:
    rank: int
    world_size: int
    store_path: str
    log_path: str
    stack_path: str
    pg_timeout_s: float
    sys_path: list[str]
    backend: str


def _worker_main(spec: _WorkerSpec, conn: Connection) -> None:
    """Entry point of a rank: set up, init the default group, serve jobs until told to stop."""
    _redirect_output(spec.log_path)
    _die_with_parent()
    try:
        _setup_worker(spec)
    except BaseException:
        _send(conn, _Reply(_STARTUP_JOB_ID, False, None, traceback.format_exc()))
        return
    _send(conn, _Reply(_STARTUP_JOB_ID, True, None, None))
    _serve(conn)


def _redirect_output(log_path: str) -> None:
    # Workers inherit whatever fd 1/2 were when the forkserver started, possibly a pytest capture
    # file of some earlier test.  Send everything (Python and C++) to a per-rank log instead; the
    # parent forwards it after each run.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives as long as we do
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def _die_with_parent() -> None:
    # If the test process is SIGKILLed, the forkserver exits; take the rank down with it even if
    # it is blocked in a collective (a blocked rank never notices its pipe closing).
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))


# For tests of CUDA tensors on one GPU (NCCL refuses two ranks on one GPU): gloo carries them
# too. Opt-in per pool (``shared_pool(n, CUDA_GLOO)``): under it, zerodp's default device for
# sharded construction becomes the GPU, which the CPU tests do not expect.
CUDA_GLOO = "cpu:gloo,cuda:gloo"


def _setup_worker(spec: _WorkerSpec) -> None:
    _sync_sys_path(spec.sys_path)
    # Append mode: the parent reads the file after signalling us; O_APPEND keeps dumps ordered.
    stack_file = open(spec.stack_path, "a")  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.register(_STACK_DUMP_SIGNAL, file=stack_file, all_threads=True)
    # A rank that crashes (segfault, abort) leaves its stack in its log, i.e. in the report.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # hermetic: never touch a real network interface
    torch.set_num_threads(1)  # N ranks share 2 cores; intra-op threads would only thrash
    with contextlib.suppress(RuntimeError):  # raises if inter-op threads already started
        torch.set_num_interop_threads(1)
    store = dist.FileStore(spec.store_path, spec.world_size)  # type: ignore[attr-defined, unused-ignore]
    dist.init_process_group(
        spec.backend,
        store=store,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=datetime.timedelta(seconds=spec.pg_timeout_s),
    )


def _serve(conn: Connection) -> None:
    while True:
        try:
            job = _recv(conn)
        except (EOFError, OSError):
            os._exit(0)  # parent went away: nothing left to report to
        if job == _STOP:
            break
        _send(conn, _run_job(job))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _run_job(job: _Job) -> _Reply:
    try:
        _sync_sys_path(job.sys_path)
        fn = _resolve_fn(job.fn)
        args, kwargs = pickle.loads(job.args)
        value = pickle.dumps(fn(*args, **kwargs))
    except BaseException:
        reply = _Reply(job.job_id, False, None, traceback.format_exc(), dist.is_initialized())
    else:
        reply = _Reply(job.job_id, True, value, None, dist.is_initialized())
    # The parent reads our log right after the reply: make sure it is all there.
    sys.stdout.flush()
    sys.stderr.flush()
    return reply


def _sync_sys_path(parent_path: list[str]) -> None:
    # pytest adds test directories to sys.path while collecting; mirror them so test modules
    # import the same way in the ranks as in the parent.
    missing = [p for p in parent_path if p not in sys.path]
    sys.path[:0] = missing


def _resolve_fn(ref: _FnRef | bytes) -> Callable[..., Any]:
    if isinstance(ref, bytes):
        fn: Callable[..., Any] = pickle.loads(ref)
        return fn
    obj: Any = _import_module(ref)
    for part in ref.qualname.split("."):
        obj = getattr(obj, part)
    resolved: Callable[..., Any] = obj
    return resolved


def _import_module(ref: _FnRef) -> types.ModuleType:
    # A script's __main__ is re-imported as __mp_main__ in workers (see multiprocessing.spawn).
    name = "__mp_main__" if ref.module == "__main__" else ref.module
    if name in sys.modules:
        return sys.modules[name]
    if name != "__mp_main__":
        try:
            return importlib.import_module(name)
        except ImportError:
            if ref.file is None:
                raise
    # Not importable by name (pytest's importlib import mode, or a script): load the file.
    assert ref.file is not None, f"cannot import {ref.module!r} in the worker"
    spec = importlib.util.spec_from_file_location(name, ref.file)
    assert spec is not None and spec.loader is not None, f"cannot load {ref.file}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------------
# Plumbing shared by both sides.


def _send(conn: Connection, obj: object) -> None:
    # Plain pickle instead of Connection.send: torch registers shared-memory reductions with
    # multiprocessing's pickler, which would make every rank alias the same tensor storage.
    conn.send_bytes(pickle.dumps(obj))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


# --------------------------------------------------------------------------------------------
# Parent side.


@dataclass
class _Worker:
    rank: int
    process: mp.process.BaseProcess
    conn: Connection
    log_path: str
    stack_path: str
    log_offset: int = 0  # where the current run's output starts in log_path


@dataclass
class _Outcome:
    """What one rank did in one run."""

    reply: _Reply | None = None
    death: str | None = None  # set if the process exited instead of replying

    @property
    def failed(self) -> bool:
        return self.death is not None or (self.reply is not None and not self.reply.ok)


class WorldPool:
    """N persistent gloo ranks that run test functions one after another.

    Workers start lazily on the first ``run`` (or ``start``).  After any failure or timeout the
    workers are killed and the next ``run`` starts a fresh world.  Not thread-safe.
    """

    def __init__(
        self,
        world_size: int,
        *,
        grace: float = 2.0,
        start_timeout: float = 120.0,
        pg_timeout: float = 300.0,
        start_method: str = DEFAULT_START_METHOD,
        backend: str = "gloo",
    ) -> None:
        """
        Args:
            world_size: number of ranks.
            grace: after the first rank fails, how long to wait for the others to report
                before killing them (they are usually blocked in a collective forever).
            start_timeout: limit for starting the workers and initialising the group.
            pg_timeout: gloo's own collective timeout.  Longer than typical ``run`` timeouts
                so that a hang is reported by the harness, with stacks, not by gloo.
            start_method: multiprocessing start method ("forkserver" or "spawn").
            backend: the default group's (``CUDA_GLOO`` for CUDA tensors on one GPU).
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.grace = grace
        self.start_timeout = start_timeout
        self.pg_timeout = pg_timeout
        self.backend = backend
        self._ctx = _mp_context(start_method)
        self._workers: list[_Worker] = []
        self._tmpdir: str | None = None
        self._job_ids = itertools.count(_STARTUP_JOB_ID + 1)

    # -- public API ---------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return bool(self._workers) and all(w.process.is_alive() for w in self._workers)

    def start(self) -> None:
        """Start the workers now (``run`` does this on demand)."""
        if self.running:
            return
        self._kill()  # drop a half-dead world left behind by something external
        try:
            self._spawn_workers()
            outcomes = self._collect(_STARTUP_JOB_ID, self.start_timeout)
            self._raise_on_failure(outcomes, "starting the world", self.start_timeout)
        except BaseException:
            self._kill()
            raise

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` in every rank; return the results indexed by rank."""
        job = _Job(next(self._job_ids), _fn_payload(fn), _dumps_args(args, kwargs), list(sys.path))
        self.start()
        try:
            self._dispatch(job)
            outcomes = self._collect(job.job_id, timeout)
            self._forward_output(outcomes)
            self._raise_on_failure(outcomes, f"running {_fn_name(fn)}", timeout)
        except BaseException:
            # Failure, timeout, or pytest-timeout / Ctrl-C interrupting us: the ranks are in an
            # unknown state, so never reuse them.
            self._kill()
            raise
        if not all(o.reply is not None and o.reply.pg_alive for o in outcomes.values()):
            self.close()  # fn destroyed the default group; results are fine, the world is not
        return [_return_value(outcomes[r]) for r in range(self.world_size)]

    def close(self) -> None:
        """Stop idle workers gracefully (kill any that linger) and delete the temp dir."""
        self._shutdown(graceful=True)

    def _kill(self) -> None:
        # After a failure some ranks are blocked in a collective forever: don't wait for them.
        self._shutdown(graceful=False)

    def _shutdown(self, graceful: bool) -> None:
        workers, self._workers = self._workers, []
        _live_pools.discard(self)
        if graceful:
            for w in workers:
                with contextlib.suppress(OSError, ValueError):
                    _send(w.conn, _STOP)
            # Spawned workers tear down a whole interpreter with torch in it; allow for that.
            deadline = time.monotonic() + 5.0
            for w in workers:
                w.process.join(max(0.0, deadline - time.monotonic()))
        for w in workers:
            if w.process.is_alive():
                w.process.kill()
        for w in workers:
            w.process.join(5.0)
            w.conn.close()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def __enter__(self) -> WorldPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _spawn_workers(self) -> None:
        _live_pools.add(self)
        self._tmpdir = tempfile.mkdtemp(prefix=f"zerodp-world{self.world_size}-")
        store_path = os.path.join(self._tmpdir, "store")
        for rank in range(self.world_size):
            spec = _WorkerSpec(
                rank=rank,
                world_size=self.world_size,
                store_path=store_path,
                log_path=os.path.join(self._tmpdir, f"rank{rank}.log"),
                stack_path=os.path.join(self._tmpdir, f"rank{rank}.stack"),
                pg_timeout_s=self.pg_timeout,
                sys_path=list(sys.path),
                backend=self.backend,
            )
            parent_conn, child_conn = self._ctx.Pipe(duplex=True)
            process = self._ctx.Process(
                target=_worker_main, args=(spec, child_conn), name=f"zerodp-rank{rank}"
            )
            process.start()
            child_conn.close()  # so that a dead worker shows up as EOF on parent_conn
            self._workers.append(
                _Worker(rank, process, parent_conn, spec.log_path, spec.stack_path)
            )

    def _dispatch(self, job: _Job) -> None:
        for w in self._workers:
            w.log_offset = _file_size(w.log_path)
            _send(w.conn, job)

    def _collect(self, job_id: int, timeout: float) -> dict[int, _Outcome]:
        """Wait for every rank's reply; stop early once a rank failed and the grace ran out."""
        outcomes: dict[int, _Outcome] = {}
        deadline = time.monotonic() + timeout
        by_conn = {w.conn: w for w in self._workers}
        while len(outcomes) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            pending = [w.conn for w in self._workers if w.rank not in outcomes]
            for conn in wait(pending, remaining):
                worker = by_conn[conn]  # type: ignore[index]
                outcome = self._read_outcome(worker, job_id)
                if outcome is not None:
                    outcomes[worker.rank] = outcome
                    if outcome.failed:
                        deadline = min(deadline, time.monotonic() + self.grace)
        return outcomes

    def _read_outcome(self, worker: _Worker, job_id: int) -> _Outcome | None:
        try:
            reply = _recv(worker.conn)
        except (EOFError, OSError):
            worker.process.join(1.0)
            return _Outcome(death=_describe_exit(worker.process.exitcode))
        if not isinstance(reply, _Reply) or reply.job_id != job_id:
            return None  # stale reply from an earlier job; cannot happen, but do not crash
        return _Outcome(reply=reply)

    def _forward_output(self, outcomes: dict[int, _Outcome]) -> None:
        # Ranks' prints land in per-rank logs; echo them so pytest shows them with the test.
        if any(o.failed for o in outcomes.values()) or len(outcomes) < self.world_size:
            return  # the failure message includes the output instead
        for w in self._workers:
            text = _read_from(w.log_path, w.log_offset)
            if text:
                sys.stdout.write(_indent(text, f"[rank {w.rank}] "))

    def _raise_on_failure(self, outcomes: dict[int, _Outcome], what: str, timeout: float) -> None:
        failed = sorted(r for r, o in outcomes.items() if o.failed)
        missing = [w.rank for w in self._workers if w.rank not in outcomes]
        if not failed and not missing:
            return
        stacks = self._dump_stacks(missing)
        parts: list[str] = []
        for rank in failed:
            parts.append(self._describe_failure(rank, outcomes[rank]))
        for rank in missing:
            parts.append(self._describe_missing(rank, stacks.get(rank, ""), bool(failed)))
        n = self.world_size
        if failed:
            header = f"{len(failed)} of {n} ranks failed while {what}: ranks {failed}"
            if missing:
                header += f"; ranks {missing} did not report within {self.grace:g}s after that"
            raise RankFailure("\n".join([header, *parts]), failed)
        header = f"ranks {missing} of {n} did not answer within {timeout:g}s while {what}"
        raise WorldTimeout("\n".join([header, *parts]), missing)

    def _describe_failure(self, rank: int, outcome: _Outcome) -> str:
        if outcome.death is not None:
            body = f"process {outcome.death}"
        else:
            assert outcome.reply is not None and outcome.reply.error is not None
            body = outcome.reply.error.rstrip()
        return f"\n===== rank {rank} failed =====\n{body}{self._output_section(rank)}"

    def _describe_missing(self, rank: int, stack: str, after_failure: bool) -> str:
        why = "did not report (blocked?)" if after_failure else "timed out"
        stack_text = stack.rstrip() or "(no stack dump)"
        return (
            f"\n===== rank {rank} {why}; its Python stacks =====\n{stack_text}"
            f"{self._output_section(rank)}"
        )

    def _output_section(self, rank: int) -> str:
        w = self._workers[rank]
        text = _read_from(w.log_path, w.log_offset)
        if not text.strip():
            return ""
        if len(text) > _MAX_OUTPUT_CHARS:
            text = "...\n" + text[-_MAX_OUTPUT_CHARS:]
        return f"\n----- rank {rank} output -----\n{text.rstrip()}"

    def _dump_stacks(self, ranks: Sequence[int]) -> dict[int, str]:
        """Ask faulthandler in each hung rank for its stacks; cheap and works mid-collective."""
        signalled = []
        for rank in ranks:
            w = self._workers[rank]
            pid = w.process.pid
            if pid is not None and w.process.is_alive():
                with contextlib.suppress(OSError):
                    os.kill(pid, _STACK_DUMP_SIGNAL)
                    signalled.append(w)
        # faulthandler writes from the signal handler itself, so dumps appear almost at once;
        # poll briefly until every file has content and stopped growing.
        sizes: dict[int, int] = {}
        deadline = time.monotonic() + 2.0
        while signalled and time.monotonic() < deadline:
            time.sleep(0.05)
            now = {w.rank: _file_size(w.stack_path) for w in signalled}
            if all(now.values()) and now == sizes:
                break
            sizes = now
        return {w.rank: _read_from(w.stack_path, 0) for w in signalled}


# --------------------------------------------------------------------------------------------
# Helpers.


def _mp_context(start_method: str) -> mp.context.ForkServerContext | mp.context.SpawnContext:
    # Never plain fork: the test process has run multithreaded torch ops by now, and forking it
    # can deadlock the child on a lock some other thread held.
    if start_method == "spawn":
        return mp.get_context("spawn")
    if start_method != "forkserver":
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
    ctx = mp.get_context("forkserver")
    # Only effective before the forkserver first starts; harmless afterwards.
    ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
    return ctx


def _fn_payload(fn: Callable[..., Any]) -> _FnRef | bytes:
    if isinstance(fn, types.FunctionType) and "<locals>" not in fn.__qualname__:
        module = sys.modules.get(fn.__module__)
        file = getattr(module, "__file__", None)
        return _FnRef(fn.__module__, fn.__qualname__, os.path.abspath(file) if file else None)
    try:
        return pickle.dumps(fn)
    except Exception as exc:
        raise TypeError(
            f"{fn!r} cannot be sent to the ranks: use a module-level function or a picklable "
            f"callable (lambdas and nested functions are not importable in the workers)"
        ) from exc


def _dumps_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    try:
        return pickle.dumps((args, kwargs))
    except Exception as exc:
        raise TypeError(f"arguments for the ranks are not picklable: {exc}") from exc


def _return_value(outcome: _Outcome) -> Any:
    assert outcome.reply is not None and outcome.reply.value is not None
    return pickle.loads(outcome.reply.value)


def _fn_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "closed its pipe without replying"
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode} without replying"


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read_from(path: str, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _indent(text: str, prefix: str) -> str:
    return "".join(prefix + line for line in text.splitlines(keepends=True)).rstrip("\n") + "\n"


# --------------------------------------------------------------------------------------------
# Shared pools and one-shot worlds.

_live_pools: set[WorldPool] = set()  # pools with workers, so atexit can reap them
_shared_pools: dict[tuple[int, str], WorldPool] = {}


def shared_pool(world_size: int, backend: str = "gloo") -> WorldPool:
    """The process-wide pool for ``world_size`` ranks over ``backend`` (what the ``world``
    fixture hands out)."""
    key = (world_size, backend)
    pool = _shared_pools.get(key)
    if pool is None:
        pool = _shared_pools[key] = WorldPool(world_size, backend=backend)
    return pool


def close_shared_pools() -> None:
    for pool in list(_shared_pools.values()):
        pool.close()
    _shared_pools.clear()


def run_world(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0, **kwargs: Any
) -> list[Any]:
    """Start a fresh world of ``world_size`` ranks, run ``fn`` once, tear the world down."""
    with WorldPool(world_size) as pool:
        return pool.run(fn, *args, timeout=timeout, **kwargs)


@atexit.register
def _close_all_pools() -> None:
    # Registered after multiprocessing's own atexit hook, so it runs first: that hook joins
    # non-daemonic children and would wait forever on ranks still blocked in a collective.
    for pool in list(_live_pools):
        pool.close()
