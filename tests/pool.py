"""Gloo ranks started once for the whole test run, reused by every multi-process test.

Starting a rank means a new Python process that imports torch and the package: 6-7 s on two
cores, several times over for a 4-rank test, and it was most of the suite's time. A
:class:`RankPool` keeps ``world`` such processes alive and runs each test's per-rank function in
them; :class:`RankPools` holds one pool per world size used, for the session (see
``conftest.py``). ``tests.distributed.run_ranks`` goes through it, so a test does not know
whether its ranks are new.

[Note: isolation between tests]
Each test gets a new default process group (destroyed afterwards with every sub-group made on it),
rendezvoused under a prefix of its own through one store the test process hosts for all its pools:
a new store per test, on rank 0, cost up to 0.7 s whenever a rank knocked before it was up, and
``MASTER_PORT`` still names a free port for a test that starts a group of its own. It also gets the
parent's environment and working directory as they are when the test calls, the random generators
as a new process has them, torch's thread count, default dtype and grad mode reset, warning filters
restored (and the "already shown" registries invalidated, so a warning shows as it would in a new
process), and any function of ``torch.distributed``, ``os``, ``shutil`` or a ``ds_strategy`` module
that the test replaced put back; Accelerate's singletons and torch's DTensor caches (which hold an
earlier test's device mesh) are cleared. What cannot be put back makes the pool start again for the
next test: a rank that raised while another did not finish, a rank that died (``os._exit``, a
signal), a timeout, or a thread the test left running. A test that needs what only a new process
has (an environment variable read at start-up, such as glibc's ``MALLOC_*``, or a peak RSS from a
clean heap) says so: ``run_ranks(..., fresh=True)`` runs it on a pool of its own, started for that
call, and the test is marked ``launcher``. At the end of a run pytest prints how often each pool's
ranks were started and after which tests.

[Note: starting ranks]
A new Python process that imports torch and the package takes 3 s of CPU on these cores. The
session's pools fork their ranks from a fork server (multiprocessing's ``forkserver``) that
imported torch and the package once (``PRELOAD``), so a start or restart costs a fork; the
fork server itself ran no torch operation, so no thread or device state is copied. Random
generators are those of a new process (torch's default seed; Python's ``random`` reseeds at
fork; numpy's is reseeded here). What a new process reads from the environment at start-up
comes from the fork server's: ``fresh=True`` pools spawn their ranks instead. A rank whose
heap has grown past ``HEAP_LIMIT`` objects since its start (more than the frameworks a test
imports: compiled graphs and their caches) or was unfrozen (``gc.unfreeze``, as
``StepMemoryProbe.close`` does) is replaced after its test, so its memory stays bounded and
collections cheap.

[Note: failures]
A rank's exception comes back with its traceback; the other ranks are given a few seconds to
report too (they usually fail the same way, through the engine's failure agreement), and if
one is still inside a collective the pool is killed rather than left waiting for the process
group's timeout. A test that runs past its timeout has every stuck rank's Python stacks
printed (faulthandler, SIGUSR1), the pool killed, and fails with a ``TimeoutError`` naming the
test and the ranks that did not finish. Either way only that test fails: the next one gets a
new pool.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import io
import itertools
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import torch

from benchmarks._ranks import free_port

GRACE_S = 5.0  # how long the other ranks may take to report after one has failed
# What the fork server imports once; a session pool's ranks are forked from it (see the note).
# (preloading transformers' Llama and Trainer as well made the suite slower here: 914 s
# against 830 s)
PRELOAD = ["torch", "torch.distributed", "ds_strategy", "tests.pool"]
# A rank whose heap has grown past this many objects since start-up (modules a test imported,
# caches) is replaced after its test. What outlives a test is frozen, so neither a collection
# nor live_tensor_bytes walks it: the bound is on memory. Importing transformers, Lightning,
# PEFT and TRL adds 290,000 objects (250 MiB); at 150,000 a rank was replaced after every
# such import and the next test imported them again (a subset of 76 tests: 69 s against 47 s)
HEAP_LIMIT = 600_000


class WorkerError(RuntimeError):
    """A rank raised or died. ``errors`` maps each rank that failed to its report."""

    def __init__(self, message: str, errors: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.errors = errors or {}


def fork_context() -> Any:
    """multiprocessing's ``forkserver`` context, its server importing ``PRELOAD`` once: a
    process started from it costs a fork, not an interpreter importing torch (see [Note:
    starting ranks]). Its processes exit with ``os._exit``: no ``atexit`` handler runs."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the fork server starts (once)
    return ctx


def current_test() -> str:
    """The running test's id (pytest sets it in the environment), or a placeholder."""
    return os.environ.get("PYTEST_CURRENT_TEST", "<no test>").rsplit(" (", 1)[0]


# -- inside a rank --------------------------------------------------------------------------------

_PATCHABLE = ("torch.distributed", "os", "os.path", "shutil", "time")


def _module_functions() -> dict[tuple[str, str], Any]:
    """The functions and classes of the modules tests patch, by (module, name)."""
    names = [m for m in sys.modules if m in _PATCHABLE or m.startswith("ds_strategy")]
    out: dict[tuple[str, str], Any] = {}
    for name in names:
        module = sys.modules.get(name)
        for attr, value in list(getattr(module, "__dict__", {}).items()):
            if callable(value) and not isinstance(value, type(sys)):
                out[(name, attr)] = value
    return out


def _restore_functions(before: dict[tuple[str, str], Any]) -> None:
    """Put back every function a test replaced."""
    for (name, attr), value in before.items():
        module = sys.modules.get(name)
        if module is not None and module.__dict__.get(attr, value) is not value:
            setattr(module, attr, value)


class _Baseline:
    """What a new rank process looks like, taken once after start-up; reset to before each
    test."""

    def __init__(self) -> None:
        import random

        self.torch_rng = torch.get_rng_state()
        self.random = random.getstate()
        try:
            import numpy

            self.numpy: Any = numpy.random.get_state()
        except ImportError:
            self.numpy = None
        self.threads = set(threading.enumerate())

    def reset(self, env: dict[str, str], cwd: str) -> None:
        import random

        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.random)
        if self.numpy is not None:
            import numpy

            numpy.random.set_state(self.numpy)
        torch.set_num_threads(1)
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)

    def leftover_threads(self) -> list[str]:
        """Threads a test started and left running (given a moment to finish)."""
        extra = [t for t in threading.enumerate() if t not in self.threads and t.is_alive()]
        for t in extra:
            t.join(timeout=1.0)
        return [t.name for t in extra if t.is_alive()]


def _reset_libraries() -> None:
    """Process-wide state of libraries a worker may use: Accelerate's singletons, and torch's
    DTensor caches (sharding results and redistribution plans are cached per mesh *shape*:
    an entry from an earlier test holds that test's mesh, whose groups are gone, and the next
    test's DTensors would come out on it)."""
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(True)
        state.GradientState._reset_state()
    if "torch.distributed.tensor._api" in sys.modules:
        from torch.distributed.tensor import _collective_utils, _redistribute
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()
        _redistribute._gen_transform_infos.cache_clear()
        _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()


def _release_memory() -> None:
    gc.collect()
    with suppress(OSError):  # freed heap back, so RSS readings start from what is live
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _call(task: dict[str, Any], rank: int, world: int, store: Any) -> tuple[str, bytes]:
    """One test's function on this rank in a new process group, rendezvoused through the
    pool's ``store`` under the task's own prefix: ("ok", the result saved by ``torch.save``)
    or ("error", the exception and its traceback)."""
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"task{task['id']}/", store),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=task["pg_timeout"]),
        )
        fn, args = pickle.loads(task["call"])
        result = fn(rank, world, *args)
        # Plain bytes: a tensor put on a queue travels as a shared-memory handle that dies
        # with this process, which may exit before the parent has read it.
        buf = io.BytesIO()
        torch.save(result, buf)
        return "ok", buf.getvalue()
    except BaseException as e:  # noqa: BLE001 - report anything to the parent
        return "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}".encode()


def _serve(rank: int, world: int, inbox: Any, outbox: Any, store: tuple[int, str]) -> None:
    """A rank's loop: run tasks until told to stop (``None``) or killed. Each task reports
    twice: its outcome as soon as the function is done (before this rank's teardown can
    disturb the others, so the first failure reported is the cause), then what teardown
    could not undo."""
    import faulthandler

    import torch.distributed as dist

    import ds_strategy  # noqa: F401 - imported once here rather than by the first test

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks on timeout
    torch.set_num_threads(1)
    with suppress(ImportError):  # tqdm's monitor thread would outlive a test's progress bar
        import tqdm

        tqdm.tqdm.monitor_interval = 0
    with suppress(ImportError):  # forked: numpy's generator is the fork server's; a new one's
        import numpy

        numpy.random.seed()
    # this start's part of the test process's store (see [Note: isolation between tests])
    port, prefix = store
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=_STORE_TIMEOUT)
    pool_store = dist.PrefixStore(prefix, client)
    outbox.put((0, rank, "ready", None))  # (and the queue's feeder thread is part of the baseline)
    baseline = _Baseline()
    # What a new rank holds (torch and the package, imported: most of its objects) is kept out
    # of every later collection's way: a full collection of that heap took 0.15 s, and each
    # call collects once. What tests create stays visible to gc.get_objects() (which skips
    # frozen objects; live_tensor_bytes walks it).
    _release_memory()
    gc.freeze()
    frozen = gc.get_freeze_count()
    while True:
        try:
            task = inbox.recv()
        except EOFError:  # the parent is gone
            return
        if task is None:
            return
        env = dict(task["env"])
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(task["port"]),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
        )
        env.setdefault("LOCAL_WORLD_SIZE", str(world))  # one machine, as torchrun says it
        baseline.reset(env, task["cwd"])
        functions = _module_functions()
        with warnings.catch_warnings():  # entering invalidates the "already shown" registries
            outbox.put((task["id"], rank, "report", _call(task, rank, world, pool_store)))
        if dist.is_initialized():  # with every sub-group made on it
            dist.destroy_process_group()
        else:  # an init that failed part-way (a peer left while this rank was joining) has
            # advanced the counter group names come from, which only destroying the default
            # group resets: the next call would join under another name than its peers and hang
            from torch.distributed import distributed_c10d

            distributed_c10d._world.group_count = 0
        _restore_functions(functions)
        _reset_libraries()
        # why this rank should not be reused: threads left running, a heap grown too large
        unfit = [f"thread(s) {names} left running" for names in [baseline.leftover_threads()]
                 if names]  # fmt: skip
        _release_memory()
        grown = len(gc.get_objects()) + gc.get_freeze_count() - frozen  # since the start
        if grown > HEAP_LIMIT:
            unfit.append(f"a heap of over {HEAP_LIMIT:,} objects")
        # StepMemoryProbe.close() unfreezes everything (frozen objects freed lower the count too)
        if gc.get_freeze_count() < frozen // 2:
            unfit.append("its start-up heap unfrozen")
        # What outlived the test (modules and classes it imported, their caches) is frozen
        # too: the next call's collection walks only what that test makes. A full collection
        # over a rank that had imported transformers took 70 ms, once a call.
        gc.freeze()
        outbox.put((task["id"], rank, "done", unfit))


# -- in the test process --------------------------------------------------------------------------


_STORE_TIMEOUT = datetime.timedelta(seconds=300)
_STORE: list[Any] = []
_STARTS = itertools.count()


def _parent_store() -> Any:
    """The store every pool of this test process rendezvouses through, hosted here (bound
    before any rank starts, so no rank knocks on a port nobody listens on yet)."""
    import torch.distributed as dist

    if not _STORE:
        _STORE.append(
            dist.TCPStore(
                "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=_STORE_TIMEOUT
            )
        )
    return _STORE[0]


class RankPool:
    """``world`` rank processes, started on first use and again after a failure; forked from
    the fork server, or spawned with ``fresh`` (see [Note: starting ranks])."""

    def __init__(self, world: int, fresh: bool = False) -> None:
        self.world = world
        self.fresh = fresh
        self.starts = 0  # how many times the ranks were started (for the pool's own tests)
        self.retired: list[str] = []  # why ranks were replaced: "<test>: <reason>"
        self._procs: list[Any] = []
        self._inboxes: list[Any] = []
        self._outbox: Any = None
        self._next_id = 0
        self._clean = False
        self._reason = ""

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def _start(self) -> None:
        ctx = mp.get_context("spawn") if self.fresh else fork_context()
        self._outbox = ctx.Queue()
        self._procs, self._inboxes = [], []
        store = (_parent_store().port, f"start{next(_STARTS)}/")  # never reused
        for r in range(self.world):
            reader, writer = ctx.Pipe(duplex=False)
            args = (r, self.world, reader, self._outbox, store)
            proc = ctx.Process(target=_serve, args=args)
            proc.daemon = True
            proc.start()
            reader.close()
            self._procs.append(proc)
            self._inboxes.append(writer)
        self.starts += 1

    def kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        for w in self._inboxes:
            w.close()
        self._procs, self._inboxes = [], []

    def close(self) -> None:
        """Stop the ranks cleanly (each finishes its loop), killing any that do not."""
        for w in self._inboxes:
            with suppress(OSError):
                w.send(None)
        for p in self._procs:
            p.join(timeout=10)
        self.kill()

    def run(
        self, fn: Callable[..., Any], args: tuple, timeout: float, pg_timeout: float
    ) -> list[Any]:
        """``fn(rank, world, *args)`` on every rank; results by rank, or ``WorkerError`` /
        ``TimeoutError`` (see the module's note)."""
        if not self._alive():
            self.kill()
            self._start()
        self._next_id += 1
        task = {
            "id": self._next_id,
            "port": free_port(),
            "pg_timeout": pg_timeout,
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "call": pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL),
        }
        for w in self._inboxes:
            w.send(task)
        self._clean = False  # set once every rank has reported and none left anything behind
        self._reason = "a rank failed and the others did not all finish"
        try:
            return self._collect(task["id"], timeout)
        finally:
            if not self._clean:
                self.retired.append(f"{current_test()}: {self._reason}")
                self.kill()

    def _collect(self, task_id: int, timeout: float) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        done: dict[int, list[str]] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < self.world:  # every rank's outcome
            left = deadline - time.monotonic()
            if left <= 0:
                if errors:
                    raise self._error(errors)
                self._timed_out(timeout, sorted(results))
            message = self._next(task_id, left)
            if message is None:
                self._check_deaths(results, errors)
                continue
            rank, kind, payload = message
            if kind == "done":
                done[rank] = payload
            elif payload[0] == "ok":
                results[rank] = torch.load(io.BytesIO(payload[1]), weights_only=False)
            else:
                if not errors:  # the others get a grace period to report, then the pool goes
                    deadline = min(deadline, time.monotonic() + GRACE_S)
                errors[rank] = payload[1].decode()
        teardown = time.monotonic() + GRACE_S  # then every rank's teardown
        while len(done) < self.world and time.monotonic() < teardown:
            message = self._next(task_id, teardown - time.monotonic())
            if message is not None and message[1] == "done":
                done[message[0]] = message[2]
        # a rank not done, or one unfit for reuse (a thread left running, a heap grown too
        # large), is not reused (the results stand): the next test gets new ranks
        self._clean = len(done) == self.world and not any(done.values())
        unfit = sorted({why for whys in done.values() for why in whys})
        if unfit:
            self._reason = "; ".join(unfit)
        elif len(done) < self.world:
            self._reason = f"rank(s) {sorted(set(range(self.world)) - set(done))} did not tear down"
        if errors:
            raise self._error(errors)
        return [results[r] for r in range(self.world)]

    def _next(self, task_id: int, left: float) -> tuple[int, str, Any] | None:
        """This task's next message within ``min(left, 1)`` seconds, or ``None``."""
        end = time.monotonic() + min(max(left, 0.0), 1.0)
        while True:
            try:
                tid, rank, kind, payload = self._outbox.get(
                    timeout=max(end - time.monotonic(), 0.001)
                )
            except queue_mod.Empty:
                return None
            if tid == task_id:  # else a late message of an earlier task
                return rank, kind, payload

    def _check_deaths(self, results: dict[int, Any], errors: dict[int, str]) -> None:
        dead = {
            r: p.exitcode
            for r, p in enumerate(self._procs)
            if not p.is_alive() and r not in results and r not in errors
        }
        if dead and self._outbox.empty():
            self._reason = f"rank(s) {sorted(dead)} died"
            codes = ", ".join(f"rank {r} (exit code {c})" for r, c in sorted(dead.items()))
            raise WorkerError(
                f"{current_test()}: {codes} died without a report"
                + (f"; before that, {self._error(errors)}" if errors else ""),
                {**errors, **{r: f"died with exit code {c}" for r, c in dead.items()}},
            )

    def _error(self, errors: dict[int, str]) -> WorkerError:
        first = next(iter(errors))
        others = sorted(set(errors) - {first})
        also = f"\n(rank(s) {others} failed too)" if others else ""
        return WorkerError(f"rank {first}: {errors[first]}{also}", errors)

    def _timed_out(self, timeout: float, done: list[int]) -> None:
        stuck = [r for r in range(self.world) if r not in done]
        self._reason = f"rank(s) {stuck} timed out"
        for r in stuck:  # print every stuck rank's Python stacks before killing it
            p = self._procs[r]
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGUSR1)
        time.sleep(1)
        codes = {r: p.exitcode for r, p in enumerate(self._procs)}
        raise TimeoutError(
            f"{current_test()}: rank(s) {stuck} did not finish within {timeout}s "
            f"(done: {done}, exit codes: {codes}; their stacks are in the captured stderr)"
        )


class RankPools:
    """One :class:`RankPool` per world size, created on first use."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def pool(self, world: int) -> RankPool:
        if world not in self._pools:
            self._pools[world] = RankPool(world)
        return self._pools[world]

    def close(self) -> None:
        for p in self._pools.values():
            p.close()
        self._pools.clear()

    def summary(self) -> list[str]:
        """A line per pool: how often its ranks were started, and why they were replaced."""
        lines = []
        for world, p in sorted(self._pools.items()):
            lines.append(f"world {world}: ranks started {p.starts} time(s)")
            lines.extend(f"  new ranks after {why}" for why in p.retired)
        return lines


_active: RankPools | None = None


def active() -> RankPools | None:
    """The session's pools while the test run is on (``conftest.py``), else ``None``."""
    return _active


@contextmanager
def session_pools() -> Iterator[RankPools]:
    global _active
    pools = RankPools()
    _active = pools
    try:
        yield pools
    finally:
        _active = None
        pools.close()
