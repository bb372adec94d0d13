"""Two micro-batches on one rank taking turns, so that one's all-to-all travels while the other computes.

An MoE layer's dispatch and combine all-to-alls leave the rank idle unless something else is
ready to compute. :func:`run_in_turns` runs two pieces of work of one rank (two micro-batches'
forward and backward, or a pipeline schedule's forward of one micro-batch and backward of another)
as two threads that take turns: exactly one runs at a time, and a turn ends where the running one
would otherwise wait for an all-to-all it started (:func:`wait_for`, called by meshfold's
asynchronous all-to-all, forward and backward). The other then computes until it, too, waits; by
the time the turn comes back the first one's rows have usually arrived. This is the idea of
Megatron-Core's combined 1F1B and of DeepSeek-V3's two-micro-batch overlap, on plain threads: the
model code is unchanged, and only the collectives know about the turns.

Why threads and turns, not free-running threads: every rank must issue its collectives in the same
order. Turns make a rank's order a function of the code alone (the first piece runs until its first
wait, then the second until its first wait, and so on; a finished piece passes the turn for good),
the same on every rank of a group. Within a turn the usual rules hold (the collectives a piece
issues are ordered by its own code); between turns, the async all-to-alls in flight run on the
process group's own threads (gloo) or stream (NCCL) while the Python thread computes.

What each turn sees: grad mode, dispatch modes (a dry run's fake tensors) and (on CUDA) the
current device of the caller; everything else torch keeps per process (the RNG, parameters and
their ``.grad``, a module's own attributes) is shared, and the turns make the order of its use
deterministic. Work that must not interleave with the other piece's runs under
:func:`keeping_turn` (a recomputation replaying saved state). A piece that raises ends its turns
and makes the other raise at its next wait; :func:`run_in_turns` re-raises the first error.

Where the waits run: forward, on the piece's thread. Backward, where autograd runs the node: on
CPU the thread that called backward (the piece's), so the backward's all-to-alls take turns too;
on CUDA autograd runs a device's nodes on its own device thread, which holds no turn, so there
only the forwards' all-to-alls are overlapped (a forward beside the other piece's backward
included) and a backward runs in one turn.

:class:`TurnStats` counts what happened: how many all-to-alls a piece waited for, how many of them
were in flight while the other piece computed, and how many had already arrived when waited for
(hidden entirely). ``meshfold train`` reports them as the step's ``a2a_overlap`` metrics; on its
profiler trace (``train.profile_steps``) each thread shows a ``meshfold.a2a_in_flight`` range while
its all-to-all travels, with the other thread's ops inside it, and gloo's ``all_to_all`` on the
process group's threads.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import torch

from meshfold.runtime.pools import kept_pool

__all__ = ["run_in_turns", "wait_for", "in_turns", "TurnStats", "IN_FLIGHT"]

# the range a piece's thread shows on a profiler trace (train.profile_steps) while its all-to-all
# travels and the other piece computes
IN_FLIGHT = "meshfold.a2a_in_flight"
_here = threading.local()  # .turns (the _Turns this thread takes part in), .me (its index)


@dataclass
class TurnStats:
    """What one :func:`run_in_turns` saw. ``waited``: all-to-alls waited for inside the turns;
    ``crossed``: of them, the ones in flight while the other piece computed (a turn passed between
    their start and their wait); ``arrived``: of those, the ones already complete when waited for
    (their transfer hidden entirely); ``wait_s``: seconds spent waiting on all of them;
    ``hand_overs``: turns passed to the other piece."""

    waited: int = 0
    crossed: int = 0
    arrived: int = 0
    wait_s: float = 0.0
    hand_overs: int = 0

    def __add__(self, other: "TurnStats") -> "TurnStats":
        return TurnStats(self.waited + other.waited, self.crossed + other.crossed, self.arrived + other.arrived,
                         self.wait_s + other.wait_s, self.hand_overs + other.hand_overs)


class _Turns:
    def __init__(self, n: int):
        self.cv = threading.Condition()
        self.turn = 0
        self.running = [True] * n
        self.stats = TurnStats()
        self.failed: BaseException | None = None  # the first error a piece raised
        self.kept = 0  # > 0: the running piece keeps its turn through its waits (keeping_turn)

    def _next(self, me: int) -> int | None:
        n = len(self.running)
        return next((j % n for j in range(me + 1, me + n) if self.running[j % n]), None)

    def hand_over(self, me: int) -> bool:
        """Give the turn to the next piece still running and wait for it to come back; False (and
        nothing happens) when no other piece runs."""
        with self.cv:
            other = self._next(me)
            if other is None:
                return False
            self.turn = other
            self.stats.hand_overs += 1
            self.cv.notify_all()
            self.cv.wait_for(lambda: self.turn == me)
            return True

    def begin(self, me: int) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.turn == me)

    def finish(self, me: int) -> None:
        with self.cv:
            self.running[me] = False
            other = self._next(me)
            if other is not None:
                self.turn = other
            self.cv.notify_all()


def in_turns() -> bool:
    """Whether this thread runs a piece of :func:`run_in_turns`."""
    return getattr(_here, "turns", None) is not None


@contextlib.contextmanager
def keeping_turn():
    """Inside, the running piece's waits do not pass the turn (plain waits): for work that must
    not interleave with the other piece's, e.g. a recomputation running with state it restores
    afterwards. Outside :func:`run_in_turns`, nothing."""
    turns = getattr(_here, "turns", None)
    if turns is None:
        yield
        return
    turns.kept += 1
    try:
        yield
    finally:
        turns.kept -= 1


def _check_partner(turns: _Turns) -> None:
    if turns.failed is not None:  # its collectives stopped: ours would wait for peers that pair
        raise RuntimeError(f"a2a_overlap: the other micro-batch on this rank raised "  # with it
                           f"{type(turns.failed).__name__}: {turns.failed}") from turns.failed


def wait_for(work) -> None:
    """Wait for a collective this thread started (``work``: what ``async_op=True`` returned).
    Inside :func:`run_in_turns` the other piece computes first, for one turn; outside (or under
    :func:`keeping_turn`), a plain ``work.wait()``. Raises if the other piece has raised: this
    piece's next collectives would pair with the peers' pieces in another order."""
    turns = getattr(_here, "turns", None)
    if turns is None or turns.kept:
        work.wait()
        return
    _check_partner(turns)
    with torch.profiler.record_function(IN_FLIGHT):  # on a trace: the other piece computes meanwhile
        crossed = turns.hand_over(_here.me)
    _check_partner(turns)
    arrived = crossed and work.is_completed()
    t0 = time.perf_counter()
    work.wait()
    s = turns.stats
    s.waited += 1
    s.crossed += crossed
    s.arrived += arrived
    s.wait_s += time.perf_counter() - t0


def _dispatch_modes() -> list:
    """The caller's dispatch modes (torch keeps them per thread), outermost first: a dry run's fake
    tensors and recorders (:mod:`meshfold.dryrun`) must see the pieces' ops too."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return _get_current_dispatch_mode_stack()


@contextlib.contextmanager
def _entered(modes: list):
    """``modes`` active on this thread as they are on the caller's: put on its mode stack as they
    stand (not entered again: the caller entered them, and leaves them)."""
    from torch._C import _pop_torch_dispatch_stack, _push_on_torch_dispatch_stack

    for mode in modes:
        _push_on_torch_dispatch_stack(mode)
    try:
        yield
    finally:
        for mode in reversed(modes):
            _pop_torch_dispatch_stack(getattr(mode, "_mode_key", None))


def run_in_turns(*pieces) -> tuple[list, TurnStats]:
    """Run the callables ``pieces`` (two, typically) in turns, the first first: ``(their results
    in order, the TurnStats of the run)``. Each piece runs on a thread of its own (kept for the
    next call, :mod:`meshfold.runtime.pools`; n pieces never share one of its n threads, as each
    waits for its turn) with the caller's grad mode, dispatch modes and CUDA device; the caller
    waits until all have finished. The first exception a piece raised is re-raised here; the
    others raise at their next wait (their collectives would no longer pair with their peers').
    Calls from several threads run one at a time."""
    if len(pieces) < 2:
        raise ValueError(f"run_in_turns takes two or more pieces of work, got {len(pieces)}")
    if in_turns():
        raise RuntimeError("run_in_turns inside run_in_turns: a piece's turns cannot be split again")
    with _one_run_at_a_time:  # the kept threads serve one run: two would hold them all and wait
        return _run(pieces)


_one_run_at_a_time = threading.Lock()


def _run(pieces) -> tuple[list, TurnStats]:
    turns = _Turns(len(pieces))
    modes = _dispatch_modes()
    grad = torch.is_grad_enabled()
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    results: list = [None] * len(pieces)
    errors: list = [None] * len(pieces)

    def body(i: int) -> None:
        _here.turns, _here.me = turns, i
        try:
            if device is not None:
                torch.cuda.set_device(device)
            turns.begin(i)
            with torch.set_grad_enabled(grad), _entered(modes):
                results[i] = pieces[i]()
        except BaseException as e:  # re-raised by the caller
            errors[i] = e
            with turns.cv:
                turns.failed = turns.failed or e
        finally:
            _here.turns = None
            turns.finish(i)

    for f in [kept_pool("turn", len(pieces)).submit(body, i) for i in range(len(pieces))]:
        f.result()
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results, turns.stats
