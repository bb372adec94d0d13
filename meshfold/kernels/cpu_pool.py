"""The CPU worker pool every CPU kernel of meshfold runs its parts on.

Legend: W = workers.

Expert work on CPU is many short ATen ops (one small GEMM per expert block, elementwise passes
over row parts). Run on the caller's thread, each op forks and joins the OpenMP team: on a
shared machine a descheduled thread stalls every join (a scheduler tick, ~4 ms), and between
parallel regions libgomp's idle team threads spin-wait (300k spins by default) on the cores the
next op needs. So CPU kernels hand their parts to a few Python pool threads instead, each with
``intra-op threads / W`` threads (1 on a small machine), taking the next part from a shared
queue: a stalled worker delays only its own part, there is one join per call, and no OpenMP team
is left spinning between ops. ATen ops release the GIL, so the workers overlap.
(benchmarks/bench_moe_layer.py measures each choice.)

Tasks must write disjoint outputs, and every output element is written by exactly one task of a
fixed shape whichever worker runs it, so results do not depend on scheduling. The caller's
thread settings are never touched: the workers are pool threads and the caller waits; they run
in the caller's grad and inference modes.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from meshfold.runtime.pools import kept_pool

__all__ = ["MAX_WORKERS", "run_tasks", "single_threaded", "serial", "serial_graph", "in_parts", "blocks",
           "plain_cpu"]

MAX_WORKERS = 8  # beyond this the Python dispatch of the parts (under the GIL) would dominate


def _pool(workers: int):
    return kept_pool("cpu", workers)


def run_tasks(tasks: list) -> None:
    """Call every zero-argument task once, on up to W pool workers with ``intra-op threads / W``
    threads each, in the caller's grad and inference modes; the caller waits. Tasks must write
    disjoint outputs (their order is not fixed)."""
    threads = torch.get_num_threads()
    workers = min(threads, MAX_WORKERS, len(tasks))
    if workers <= 1:
        for task in tasks:
            task()
        return
    per_worker = max(1, threads // workers)
    lock = threading.Lock()
    queue = iter(tasks)

    modes = _callers_modes()

    def drain() -> None:
        if torch.get_num_threads() != per_worker:  # thread-local (OpenMP ICV, MKL local threads)
            torch.set_num_threads(per_worker)
        with modes():
            while True:
                with lock:
                    task = next(queue, None)
                if task is None:
                    return
                task()

    pool = _pool(workers)
    for f in [pool.submit(drain) for _ in range(workers)]:
        f.result()
    # set_num_threads also records its value process-wide, for threads created later; every
    # worker has set its own by now, so put the caller's value back there.
    torch.set_num_threads(threads)


def _callers_modes():
    """A context manager factory: the calling thread's grad and inference modes, for a pool
    thread (both are thread-local). Without them a worker would write with grad mode on (``out=``
    ops refuse inputs that require grad, as a backward with ``create_graph`` passes) and outside
    inference mode (tensors made under ``torch.inference_mode`` may only be written inside it)."""
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    return lambda: _modes(grad, inference)


@contextlib.contextmanager
def _modes(grad: bool, inference: bool):
    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
        yield


def single_threaded(fn, *args):
    """``fn(*args)`` on a pool thread with one intra-op thread; the caller waits.

    For short memory-bound ATen ops that fork and join the OpenMP team, some of them many times
    per call (``index_add_``): when another process holds one of the cores, each join can wait
    for a scheduler tick, so on a shared machine one thread is faster than a team. The ops used
    here compute the same values on any number of threads (the tests compare them). The
    caller's grad and inference modes carry over; its thread count is left as it was.
    """
    if torch.get_num_threads() <= 1:
        return fn(*args)
    threads, modes = torch.get_num_threads(), _callers_modes()

    def call():
        if torch.get_num_threads() != 1:  # thread-local; the pool thread keeps it
            torch.set_num_threads(1)
        with modes():
            return fn(*args)

    try:
        return _pool(1).submit(call).result()
    finally:
        torch.set_num_threads(threads)  # the process-wide value, as in _run


def in_parts(part, length: int, size: int, device) -> None:
    """``part(start, end)`` over [0, length) cut into pieces of about ``size`` rows: on the pool
    (:func:`run_tasks`) for CPU tensors, as one piece elsewhere; never with zero rows. Parts must
    write disjoint outputs.

    For memory-bound row-wise work between grouped GEMMs. As ATen ops on the caller's thread it
    would run in an OpenMP team, whose other threads then spin-wait for the next parallel region
    (libgomp's default), taking a core from the next grouped GEMM's workers."""
    if not length:
        return  # no rows: a part of zero rows may not even have a shape (an empty expert's view)
    if device.type != "cpu":
        part(0, length)
    else:
        run_tasks([functools.partial(part, a, b) for a, b in blocks(length, max(1, size))])


def blocks(length: int, size: int) -> list[tuple[int, int]]:
    """[0, length) cut into ceil(length / size) near-equal (start, end) pieces."""
    n = -(-length // size)
    return [(length * i // n, length * (i + 1) // n) for i in range(n)]


def serial(fn, *args):
    """``fn(*args)``: on one pool thread with one intra-op thread (:func:`single_threaded`) when
    the first argument is a CPU tensor, directly elsewhere."""
    if args[0].device.type == "cpu":
        return single_threaded(fn, *args)
    return fn(*args)


def _on_caller(tensors) -> bool:
    """Whether work on ``tensors`` must stay on the calling thread: a tensor that is not a plain
    CPU tensor (an accelerator's, a fake, simulated or distributed subclass), or a thread-local
    mode that a pool thread would not see (a dispatch mode such as LocalTensorMode, compiling)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return True
    return any(type(t) is not torch.Tensor or t.device.type != "cpu" for t in tensors)


def plain_cpu(*tensors) -> bool:
    """Whether every tensor is a plain CPU tensor that may leave the calling thread's dispatch
    state (no subclass, no dispatch mode, not inside a compiled region): the condition for the
    CPU kernels' own paths (the pool, the compiled row passes); otherwise the plain ops run."""
    return not _on_caller(tensors)


def serial_graph(fn, *inputs):
    """``fn(*inputs)`` -> tuple of tensors, forward and backward each on one pool thread with one
    intra-op thread (:func:`single_threaded`) for plain CPU tensors; directly elsewhere.

    For chains of small ops on [T, E] or [T*k] tensors (the router's softmax and top-k, the
    dispatcher's sort keys): as ATen ops on the caller's thread each would fork and join the
    OpenMP team, and on a shared machine every join may wait for a descheduled thread, so a
    chain of sub-millisecond ops costs tens of milliseconds; on one thread they stay
    sub-millisecond. Autograd sees one node: the forward records ``fn``'s graph on the pool
    thread from detached copies of the inputs, the backward differentiates that graph there
    (``torch.autograd.grad``) and hands the gradients of the inputs that require them back.
    Floating outputs carry gradients, others are marked non-differentiable. A backward with
    ``create_graph`` runs ``fn`` again on the caller's thread and differentiates that, so
    gradients of gradients stay exact. Row-wise ops give the same values on any number of
    threads; the tests compare with ``fn`` called directly.
    """
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    if _on_caller(tensors):
        return fn(*inputs)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return single_threaded(fn, *inputs)
    return _SerialGraph.apply(fn, *inputs)


class _SerialGraph(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, *inputs):
        leaves = [t.detach().requires_grad_() if isinstance(t, torch.Tensor) and t.requires_grad else t
                  for t in inputs]
        with torch.enable_grad():
            outs = single_threaded(fn, *leaves)
        if not isinstance(outs, tuple):
            raise TypeError(f"serial_graph: fn must return a tuple of tensors, got {type(outs).__name__}")
        ctx.fn, ctx.leaves, ctx.outs = fn, leaves, outs
        ctx.others = [None if isinstance(t, torch.Tensor) else t for t in inputs]
        ctx.save_for_backward(*[t if isinstance(t, torch.Tensor) else None for t in inputs])
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return tuple(o.detach() for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        wanted = [i for i, t in enumerate(ctx.leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if torch.is_grad_enabled():
            # create_graph (a gradient penalty): the gradient must itself be differentiable, so
            # run fn again on the caller's thread on the real inputs and differentiate that
            inputs = [t if t is not None else o for t, o in zip(ctx.saved_tensors, ctx.others)]
            outs = ctx.fn(*inputs)
            targets = [inputs[i] for i in wanted]
            create = True
        else:
            outs, targets, create = ctx.outs, [ctx.leaves[i] for i in wanted], False
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
        result = [None] * len(ctx.leaves)
        if pairs and wanted:
            def grad():
                return torch.autograd.grad([o for o, _ in pairs], targets, [g for _, g in pairs],
                                           allow_unused=True, create_graph=create, retain_graph=True)

            got = grad() if create else single_threaded(grad)
            for i, g in zip(wanted, got):
                result[i] = g
        return (None, *result)
