"""Run a function on several local ranks (CPU, gloo), or on the ranks torchrun already started.

Two entry points:

* :func:`spawn` runs ``fn(rank, world_size, *args)`` once on ``world_size`` fresh processes and
  returns the per-rank results. Under ``torchrun`` (the default process group already exists, or
  ``RANK``/``WORLD_SIZE`` are set) it runs ``fn`` in the current process instead, unchanged.
* :class:`World` keeps ``world_size`` processes with an initialised process group alive and runs many
  functions on them, so a test suite pays the start-up cost (a torch import per process) once.

Ranks start from a forkserver that has imported torch once (on Linux; ``spawn`` elsewhere), so
W ranks do not each pay that import; each rank takes the caller's
environment, and its standard output and error, as they are at start, as a spawned process would
(not the server's, which may have started long before under other ones: a test session's
capture, a notebook's cell).

Both bind every socket to loopback: the rendezvous store listens on ``127.0.0.1`` (a socket we bind
ourselves and hand to ``TCPStore``) and gloo is pinned to the ``lo`` interface.

If a rank raises, the caller gets :class:`RankError` naming the rank, with its traceback, promptly:
the remaining ranks are terminated rather than left blocked in a collective (a ``World`` whose
ranks all finished the task keeps them). Collectives time out after ``timeout`` seconds, so a rank
stuck in a collective fails instead of hanging forever.

Two guards keep ranks from outliving or silently stalling their launcher:

* every rank watches the launcher process (a pidfd on Linux, polling elsewhere) and kills itself
  the moment the launcher is gone, however it ended (SIGTERM, SIGKILL, the OOM killer): a rank's
  parent is the forkserver, not the launcher, so the kernel's parent-death signal cannot say so;
* every rank beats a heartbeat from a background thread into shared memory; a rank whose beat is
  older than ``max(timeout / 2, 10 s)`` (it was stopped, or is stuck in the kernel) ends the job with
  :class:`RankError` naming it, before its peers' collective time-outs blame themselves.

Ranks ignore SIGINT: a Ctrl-C reaches the whole terminal's process group, and the launcher alone
decides what to do with it (it terminates the ranks).

Example::

    >>> from meshfold.runtime.launch import spawn
    >>> def hello(rank, world_size):
    ...     import torch, torch.distributed as dist
    ...     t = torch.tensor([rank])
    ...     dist.all_reduce(t)
    ...     return int(t)
    >>> spawn(hello, 2)      # doctest: +SKIP  (fn must be importable by the child processes)
    [1, 1]
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import select
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable

__all__ = ["RankError", "World", "preload", "process_context", "spawn", "start_server", "under_torchrun"]

DEFAULT_TIMEOUT_S = 120.0
# imported once by the forkserver (a failed import is skipped): the slow third-party imports every
# rank needs, torch._dynamo included (building a model, even on the meta device, imports it). Not
# meshfold's own modules unless asked (preload): a rank forked from a server that preloaded them
# would run the code as it was when the server started, not as edited since (a notebook's later
# spawn after changing a model file).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint",
           "torch.distributed.fsdp", "torch._dynamo"]


HEARTBEAT_S = 1.0  # how often each rank beats; a rank is stalled after max(timeout / 2, 10 s) without
STALL_FLOOR_S = 10.0


class RankError(RuntimeError):
    """A rank failed: ``rank`` is its number, ``remote_traceback`` its formatted traceback,
    ``summary`` one line (the exception's type and message), and ``others`` the ``(rank,
    traceback)`` reports of peers that failed after it (usually symptoms of the first)."""

    def __init__(self, rank: int, remote_traceback: str, others: list[tuple[int, str]] = ()):
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.others = list(others)
        self.summary = _last_exception_line(remote_traceback)
        super().__init__(f"rank {rank} raised:\n{remote_traceback}")


def _last_exception_line(tb: str) -> str:
    """``"ValueError: bad"`` from a formatted traceback: its trailing unindented lines, joined."""
    lines = tb.rstrip().splitlines()
    i = len(lines)
    while i > 0 and lines[i - 1] and not lines[i - 1].startswith((" ", "Traceback")):
        i -= 1
    return " ".join(line.strip() for line in lines[i:]) or tb.strip()


def _loopback_listener() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    return sock


def _loopback_interface() -> str:
    """The loopback interface's name: ``lo`` on Linux, ``lo0`` on macOS."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), names[0] if names else "lo")


def under_torchrun() -> bool:
    """Whether this process is a rank torchrun started (or the default group already exists)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return True
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def _run_under_torchrun(fn: Callable, world_size: int, args: tuple, timeout: float) -> list[Any]:
    import torch
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    try:
        if dist.get_world_size() != world_size:
            raise ValueError(f"spawn(world_size={world_size}) but torchrun started "
                             f"{dist.get_world_size()} ranks; pass world_size={dist.get_world_size()}")
        result = fn(dist.get_rank(), world_size, *args)
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, result)
        if created:
            dist.barrier()  # nobody tears the group down while a peer still uses it
        return gathered
    finally:
        if created:  # we made the group, so we tear it down (gloo aborts at exit otherwise)
            dist.destroy_process_group()


def process_context():
    """The multiprocessing context ranks start from (see :func:`_context`), for other fresh
    processes that should start as cheaply: forked from a server that imported torch once."""
    return _context()


def _context():
    """The start method for rank processes: ``forkserver`` on Linux, else ``spawn``. Both start
    ranks without the parent's threads and state; a forkserver imports torch once
    (:data:`PRELOAD`) and forks every rank from that, so W ranks cost one ~2 s import instead of
    W of them competing for the cores. Not on macOS, where forking a process that has loaded
    Apple's frameworks (as torch does) is unsafe; that is why Python spawns there by default."""
    if not sys.platform.startswith("linux"):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (first use), ignored after
    return ctx


def preload(*modules: str) -> None:
    """Have the forkserver import ``modules`` too, once, instead of every rank importing them.

    For a process whose code does not change while it runs (``meshfold train``, a test session):
    a rank forked from the server runs a preloaded module as it was when the server started. It
    takes effect when the server starts (this process's first ``spawn``, ``World`` or
    :func:`start_server`); after that, ranks import the modules themselves, as without it.
    The server skips a module it cannot import, so a name that does not resolve is refused here.
    """
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"preload: no module named {missing}; give importable module names such as "
                         f"'meshfold.train.loop'")
    PRELOAD.extend(m for m in modules if m not in PRELOAD)


def start_server() -> None:
    """Start the forkserver now, so that its imports (:data:`PRELOAD`, seconds of CPU) run while
    this process does its own work before its first ``spawn``; otherwise they start at the first
    spawn. Does nothing where ranks are spawned (not Linux) or the server already runs."""
    if _context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _guard(launcher_pid: int, beats, rank: int) -> None:
    """Background thread of every rank: beat the heartbeat, and kill this rank as soon as the
    launcher process is gone (a pidfd becomes readable when its process exits)."""
    pidfd = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(launcher_pid)
        except ProcessLookupError:
            os.kill(os.getpid(), signal.SIGKILL)
        except OSError:  # no pidfd support in this kernel: poll instead
            pidfd = None
    while True:
        beats[rank] = time.monotonic()
        if pidfd is not None:
            gone = select.select([pidfd], [], [], HEARTBEAT_S)[0]
        else:
            time.sleep(HEARTBEAT_S)
            gone = not _pid_alive(launcher_pid)
        if gone:
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup: nothing of ours may run on


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


class _CallerStdio:
    """The launcher's file descriptors 1 and 2, handed to a rank with the process's arguments
    (the forkserver passes them over its socket), which the rank makes its own 1 and 2."""

    def __init__(self, fds=None):
        self.fds = fds  # in the rank: what multiprocessing rebuilt of reduction.DupFd

    def __reduce__(self):  # runs in the launcher while multiprocessing starts the rank
        from multiprocessing import reduction

        return (_CallerStdio, (tuple(reduction.DupFd(fd) if _is_open(fd) else None for fd in (1, 2)),))

    def adopt(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for target, wrapper in zip((1, 2), self.fds or ()):
            if wrapper is None:  # the launcher has none: the rank keeps what the server gave it
                continue
            fd = wrapper.detach()
            os.dup2(fd, target)
            os.close(fd)


def _init_worker(rank: int, world_size: int, port: int, timeout: float, environ: dict[str, str],
                 launcher_pid: int, beats, stdio: _CallerStdio) -> None:
    stdio.adopt()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher handles Ctrl-C for the job
    threading.Thread(target=_guard, args=(launcher_pid, beats, rank), daemon=True,
                     name="meshfold-guard").start()
    # A forkserver's children inherit its environment, fixed when it started; use the caller's.
    os.environ.clear()
    os.environ.update(environ)
    # Gloo's own sockets follow GLOO_SOCKET_IFNAME; pin them to loopback like the store.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # W processes on a few cores: avoid oversubscription
    td = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=td)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=td)
    # Gloo's full mesh is connected pair by pair: a rank may return from init while a peer is
    # still finishing its side, and a rank whose function makes no collective could then exit
    # and tear that peer's connection ("Connection closed by peer"). One barrier: all connected.
    dist.barrier()


def _report(results, rank: int, ok: bool, value) -> None:
    """Send the launcher this rank's result (``ok``) or traceback, stamped with the time it was
    sent: the launcher reads several ranks' pipes at once and orders their reports by it."""
    results.send((time.monotonic(), rank, ok, value))


def _spawn_entry(rank, world_size, port, timeout, environ, launcher_pid, beats, stdio, fn, args, results) -> None:
    try:
        _init_worker(rank, world_size, port, timeout, environ, launcher_pid, beats, stdio)
        out = fn(rank, world_size, *args)
        # by value: the pipe's default pickler would share tensors through memory that this
        # process frees when it exits, before the parent has read it
        _report(results, rank, True, pickle.dumps(out))
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit
        _report(results, rank, False, traceback.format_exc())
        sys.exit(1)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _world_entry(rank, world_size, port, timeout, environ, launcher_pid, beats, stdio, tasks, results) -> None:
    try:
        _init_worker(rank, world_size, port, timeout, environ, launcher_pid, beats, stdio)
    except BaseException:  # noqa: BLE001
        _report(results, rank, False, traceback.format_exc())
        return
    _report(results, rank, True, "ready")
    while True:
        task = tasks.recv()
        if task is None:
            break
        fn, args = task
        try:
            _report(results, rank, True, pickle.dumps(fn(rank, world_size, *args)))
        except BaseException:  # noqa: BLE001
            _report(results, rank, False, traceback.format_exc())
    import torch.distributed as dist

    dist.destroy_process_group()


class _Procs:
    """Processes plus one result pipe per rank, with prompt failure detection and teardown.

    Pipes, not ``multiprocessing`` queues: a queue holds named semaphores, which a launcher that
    is killed (SIGKILL) cannot unlink, so Python's resource tracker reports them as leaked; a
    pipe is two file descriptors the kernel closes however the process ends."""

    def __init__(self, target, world_size: int, timeout: float, extra_args) -> None:
        self.ctx = _context()
        self.world_size = world_size
        listener = _loopback_listener()
        port = listener.getsockname()[1]
        import torch.distributed as dist

        # The parent hosts the rendezvous store on the loopback socket it bound itself.
        self.store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True,
                                   wait_for_workers=False, master_listen_fd=listener.fileno(),
                                   timeout=datetime.timedelta(seconds=timeout))
        listener.detach()  # the store's server owns the socket from here on
        # each rank's last heartbeat (time.monotonic, one clock for all processes); 0: not yet
        self.beats = self.ctx.Array("d", world_size, lock=False)
        self.stall_after = max(timeout / 2, STALL_FLOOR_S)
        self._polled = time.monotonic()  # the launcher's own last look, to see it was paused
        self._grace_until = 0.0
        self.keep_if_all_answer = False  # World: a task every rank finished leaves the ranks usable
        self.terminated = False
        self.procs, self.results = [], []
        for rank in range(world_size):
            reader, writer = self.ctx.Pipe(duplex=False)
            p = self.ctx.Process(target=target, daemon=True,
                                 args=(rank, world_size, port, timeout, dict(os.environ), os.getpid(),
                                       self.beats, _CallerStdio(), *extra_args(rank), writer))
            p.start()
            writer.close()  # the rank holds the writing end: its end of file means it is gone
            self.procs.append(p)
            self.results.append(reader)

    def _receive(self, timeout: float) -> list[tuple[int, bool, Any]]:
        """The ``(rank, ok, value)`` reports that arrive within ``timeout`` seconds, in the order
        they were sent."""
        open_ = [r for r in self.results if not r.closed]
        if not open_:
            time.sleep(timeout)
            return []
        got = []
        for reader in multiprocessing.connection.wait(open_, timeout):
            try:
                got.append(reader.recv())
            except (EOFError, OSError):  # the rank ended; its exit code tells how
                reader.close()
        return [(rank, ok, value) for _, rank, ok, value in sorted(got, key=lambda report: report[0])]

    def collect(self, deadline: float, what: str) -> list[Any]:
        """One result per rank; raises RankError for the root failure, TimeoutError at deadline."""
        out: dict[int, Any] = {}
        while len(out) < self.world_size:
            reports = self._receive(0.05)
            failed = [(rank, value) for rank, ok, value in reports if not ok]
            out.update((rank, pickle.loads(value) if isinstance(value, bytes) else value)
                       for rank, ok, value in reports if ok)
            if failed:  # every report read so far: those of one wait can be several ranks'
                self._fail(out, failed)
            if reports:
                continue
            if any(r not in out and p.exitcode not in (None, 0) for r, p in enumerate(self.procs)):
                self._fail(out, [])
            if self._stalled(out):
                self._fail(out, [])
            if time.monotonic() > deadline:
                self.terminate()
                missing = sorted(set(range(self.world_size)) - set(out))
                raise TimeoutError(f"{what}: ranks {missing} did not finish in time (all ranks terminated)")
        return [out[r] for r in range(self.world_size)]

    def _stalled(self, out: dict) -> list[tuple[int, float]]:
        """``(rank, seconds since its last heartbeat)`` for each unfinished rank past the limit."""
        now = time.monotonic()
        if now - self._polled > 2 * HEARTBEAT_S:  # the launcher itself was paused (Ctrl-Z, a
            self._grace_until = now + 3 * HEARTBEAT_S  # frozen cgroup): let every rank beat again
        self._polled = now
        if now < self._grace_until:
            return []
        return [(r, now - self.beats[r]) for r in range(self.world_size)
                if r not in out and self.beats[r] > 0 and now - self.beats[r] > self.stall_after
                and self.procs[r].exitcode is None]

    def _fail(self, out: dict, errors: list[tuple[int, str]]) -> None:
        """Find the root failure, tear everything down (unless ``keep_if_all_answer`` and every
        rank answered) and raise it.

        When one rank crashes (killed, os._exit, segfault) or stalls (stopped), its peers soon
        raise errors of their own from the broken collective; those are symptoms. So wait a
        moment for reports, and prefer a stalled rank, then a rank that died without a
        traceback, over ranks that raised after it.
        """
        stalled = self._stalled(out)
        for r, _ in stalled:  # a stopped process takes no SIGTERM until continued
            self.procs[r].kill()
        errors = list(errors)  # (rank, traceback) reports already read, first first
        answered = set(out) | {r for r, _ in errors}
        settle = time.monotonic() + 1.0
        while time.monotonic() < settle and not (self.keep_if_all_answer and len(answered) == self.world_size):
            for rank, ok, value in self._receive(0.05):
                answered.add(rank)
                if not ok:
                    errors.append((rank, value))
        if (self.keep_if_all_answer and errors and not stalled and len(answered) == self.world_size
                and all(p.exitcode is None for p in self.procs)):
            # every rank returned or raised: no collective is left half done, the group is in step
            raise RankError(*errors[0], errors[1:]) from None
        reported = {r for r, _ in errors}
        crashed = [r for r, p in enumerate(self.procs)
                   if r not in out and r not in reported and p.exitcode not in (None, 0)]
        self.terminate()
        if stalled:
            r, quiet = stalled[0]
            raise RankError(r, f"stopped responding: no heartbeat for {quiet:.0f} s (limit "
                               f"{self.stall_after:.0f} s: max(timeout / 2, {STALL_FLOOR_S:.0f} s)); it was "
                               f"stopped (SIGSTOP, a debugger) or is stuck in the kernel", errors) from None
        crashed = [r for r in crashed if r not in {q for q, _ in stalled}]
        if crashed:
            r = crashed[0]
            raise RankError(r, f"process exited with code {self.procs[r].exitcode} without a Python "
                               f"traceback (killed or crashed)", errors) from None
        raise RankError(*errors[0], errors[1:]) from None

    def terminate(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        for reader in self.results:
            reader.close()
        self.store = None  # closes the rendezvous server
        self.terminated = True


def spawn(fn: Callable, world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks and return each rank's result.

    Locally this starts ``world_size`` CPU processes with the gloo backend, rendezvous on a free
    loopback port. Under torchrun it runs ``fn`` in the current process on the existing group.
    ``fn`` and ``args`` must be picklable (a module-level function). ``timeout`` bounds each
    collective (and start-up); the run as a whole has no limit. A rank that raises makes this
    raise :class:`RankError` with that rank's number and traceback, after the other ranks are
    terminated.
    """
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if under_torchrun():
        return _run_under_torchrun(fn, world_size, args, timeout)
    procs = _Procs(_spawn_entry, world_size, timeout, lambda rank: (fn, args))
    try:
        results = procs.collect(float("inf"), f"spawn({fn.__name__})")
    finally:
        procs.terminate()
    return results


class World:
    """A pool of ``world_size`` ranks with a live gloo process group, reused across many runs.

    ``world.run(fn, *args)`` runs ``fn(rank, world_size, *args)`` on every rank and returns the
    list of results. When some ranks raise and every rank finishes the task (returns or raises:
    no collective is left half done), the error is raised and the ranks stay up, so a property
    test that shrinks a failing example does not restart the world for each try. After any other
    failure (a rank crashed, stalled, timed out, or raised while its peers stayed inside a
    collective) the processes are torn down, the error is raised, and the next ``run`` starts a
    fresh world: a half-finished collective would leave the old process group out of step.
    """

    def __init__(self, world_size: int, timeout: float = DEFAULT_TIMEOUT_S):
        if not (isinstance(world_size, int) and world_size >= 1):
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        self.world_size = world_size
        self.timeout = timeout
        self._procs: _Procs | None = None
        self._tasks: list = []

    def _start(self) -> _Procs:
        if self._procs is None:
            ctx = _context()
            for task in self._tasks:  # a failed world's
                task.close()
            pipes = [ctx.Pipe(duplex=False) for _ in range(self.world_size)]  # (rank reads, we write)
            self._tasks = [writer for _, writer in pipes]
            procs = _Procs(_world_entry, self.world_size, self.timeout, lambda rank: (pipes[rank][0],))
            for reader, _ in pipes:
                reader.close()  # each rank holds its own reading end
            procs.collect(time.monotonic() + self.timeout + 60.0, "World start-up")
            procs.keep_if_all_answer = True
            self._procs = procs
        return self._procs

    def run(self, fn: Callable, *args: Any, timeout: float | None = None) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on every rank; raise RankError if any rank raises."""
        procs = self._start()
        for task in self._tasks:
            try:
                task.send((fn, args))
            except OSError:  # that rank is gone: collect() names it
                pass
        try:
            return procs.collect(time.monotonic() + (timeout or self.timeout) + 5.0,
                                 f"World.run({getattr(fn, '__name__', fn)})")
        except RankError:
            if procs.terminated:
                self._procs = None  # restart lazily
            raise
        except BaseException:  # a time-out (already torn down), or Ctrl-C while the ranks work
            procs.terminate()
            self._procs = None
            raise

    @property
    def running(self) -> bool:
        """Whether the ranks are up: started, and not torn down since by a failure or ``close``."""
        return self._procs is not None

    def close(self) -> None:
        if self._procs is not None:
            for task in self._tasks:
                try:
                    task.send(None)
                except OSError:  # that rank is gone already
                    pass
            deadline = time.monotonic() + 10
            for p in self._procs.procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
            self._procs.terminate()
            self._procs = None

    def __enter__(self) -> "World":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
