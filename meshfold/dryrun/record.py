"""What a step does, recorded the same way for a real run and a dry run: its collectives, its
host reads and its memory peak.

Each recorder is a :class:`~torch.utils._python_dispatch.TorchDispatchMode`, so it sees the ops a
step dispatches whatever their tensors are (real CPU tensors under gloo, fake ones under the fake
backend), and the same Python code gives the same records on both sides.

* :class:`CollectiveLog`: every c10d / functional collective as ``{"kind", "dim", "bytes"}``.
  ``kind`` is one of :data:`KINDS`; ``dim`` names the folded mesh dims the group spans
  (:func:`dim_names`); ``bytes`` is the size of this rank's *input*: the local shard of an
  all-gather, the whole input of a reduce-scatter, everything sent by an all-to-all, the tensor
  of an all-reduce, send, recv or broadcast.
* :class:`HostReads`: every read of device data on the host (``.item()``, ``.tolist()``, a
  tensor's truth value, ``torch.equal``) with the source line that made it. Under a fake tensor
  there is no value to read, so in a dry run it answers ``True`` (1), which keeps host checks
  (increasing positions, the ring's layout) on their normal path and makes a loss or norm read 1.
* :class:`LivePeak`: the peak bytes of the storages created while it is active and still alive
  (each storage once, views included), i.e. the step's activations, temporaries, gathered
  weights and the gradients as they form; a fake tensor's storage has the real one's size.

Each is a mode of its own, and :class:`StepRecorder` is all three as one mode, which is what a
step uses: every op of a fake step passes through each Python mode on the stack, and half of
them are the autograd engine's and FSDP2's ``prim.device`` queries, so three modes cost three
times the per-op overhead for the same records (``tests/dryrun/test_dryrun.py`` compares the two).
"""

from __future__ import annotations

import contextlib
import traceback
import weakref
from itertools import combinations

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import _DISPATCH_META_HANDLERS, FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from meshfold.mesh import VIEWS
from meshfold.runtime.live_bytes import holders

__all__ = ["KINDS", "CollectiveLog", "HostReads", "LivePeak", "StepRecorder", "dim_names", "summary"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send", "recv", "broadcast")

# op name (c10d and _c10d_functional) -> kind; ops not listed (barrier, wait_tensor) are not logged
_OPS = {
    "allgather_": "all_gather", "_allgather_base_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "alltoall_base_": "all_to_all", "alltoall_": "all_to_all", "all_to_all_single": "all_to_all",
    "send": "send", "recv_": "recv", "recv_any_source_": "recv",
    "broadcast_": "broadcast", "broadcast": "broadcast",
}
_INPUT_ARGS = ("input", "input_tensor", "input_tensors", "inputs", "tensors")

aten = torch.ops.aten
_READS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}
_DEVICE = torch.ops.prim.device.default  # a tensor's device: no data, no storage, no message
_FAKE_DEVICE = _DISPATCH_META_HANDLERS[_DEVICE]  # how FakeTensorMode answers it, first thing
_PASS = object()  # HostReads.intercept: not a host read, run the op


def dim_names(spec, rank: int, prefer: str = "attn") -> dict[frozenset, str]:
    """``{ranks of a group containing rank: name}`` for every group of folded mesh dims.

    A name is one dim (``tp``) or several joined by ``+`` slowest first (``dp+cp``); dims of size
    1 are left out of joined names. Where several names span the same ranks (``etp`` when it
    equals ``tp``; ``ep`` over the ranks of ``cp``), the first wins, in this order: the single
    dims of the ``prefer`` view, then the other view's (attention ``tp, cp, dp, pp``, MoE ``etp,
    ep, edp``), then joined dims in the same view order, fewest dims first.
    :class:`CollectiveLog` prefers the MoE view for all-to-alls (the token dispatch's) and the
    attention view for everything else."""
    singles = {"attn": ("tp", "cp", "dp", "pp"), "moe": ("etp", "ep", "edp")}
    views = (prefer, "moe" if prefer == "attn" else "attn")
    names: dict[frozenset, str] = {}
    for view in views:
        for d in singles[view]:
            names.setdefault(frozenset(spec.group_of(rank, view, d)), d)
    for view in views:
        big = [d for d in VIEWS[view] if getattr(spec, d) > 1]
        for n in range(2, len(big) + 1):
            for combo in combinations(big, n):  # layout order: slowest first
                names.setdefault(frozenset(spec.group_of(rank, view, combo)), "+".join(combo))
    return names


def _arg(func, args, kwargs, names):
    schema = func._schema.arguments
    for i, a in enumerate(schema):
        if a.name in names:
            return args[i] if i < len(args) else kwargs.get(a.name)
    raise KeyError(f"{func} has none of the arguments {names}")


def _group_of(func, args, kwargs):
    if func.namespace == "_c10d_functional":
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(_arg(func, args, kwargs, ("group_name", "tag")))
    return _arg(func, args, kwargs, ("process_group",))


def _nbytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(x) if isinstance(t, torch.Tensor))


class CollectiveLog(TorchDispatchMode):
    """Records every collective this rank issues while active (``records``, in issue order)."""

    def __init__(self, spec, rank: int):
        super().__init__()
        self.names = {"attn": dim_names(spec, rank, "attn"), "moe": dim_names(spec, rank, "moe")}
        self.records: list[dict] = []
        self._ranks: dict[tuple, str] = {}

    def _dim(self, pg, prefer: str) -> str:
        if not isinstance(pg, dist.ProcessGroup):  # a c10d op's argument: the TorchScript box
            pg = dist.ProcessGroup.unbox(pg)
        key = (id(pg), prefer)
        if key not in self._ranks:
            ranks, names = frozenset(dist.get_process_group_ranks(pg)), self.names[prefer]
            if ranks not in names:
                raise ValueError(f"a collective over ranks {sorted(ranks)} spans no folded mesh dims "
                                 f"of this rank (known groups: {sorted(names.values())})")
            self._ranks[key] = names[ranks]
        return self._ranks[key]

    def observe(self, func, args, kwargs) -> None:
        """Record ``func`` if it is a collective (before it runs)."""
        kind = _kind(func)
        if kind is not None:
            prefer = "moe" if kind == "all_to_all" else "attn"
            self.records.append({"kind": kind, "dim": self._dim(_group_of(func, args, kwargs), prefer),
                                 "bytes": _nbytes(_arg(func, args, kwargs, _INPUT_ARGS))})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.observe(func, args, kwargs)
        return func(*args, **kwargs)


_KINDS_OF: dict = {}


def _kind(func) -> str | None:
    """The :data:`KINDS` entry of op ``func``, None if it is no collective (memoized: asked of
    every op a step dispatches)."""
    if func not in _KINDS_OF:
        collective = func.namespace in ("c10d", "_c10d_functional")
        _KINDS_OF[func] = _OPS.get(func._schema.name.split("::")[-1]) if collective else None
    return _KINDS_OF[func]


def summary(records: list[dict]) -> dict[tuple[str, str], int]:
    """``{(kind, dim): total bytes}`` of a collective log."""
    out: dict[tuple[str, str], int] = {}
    for r in records:
        out[(r["kind"], r["dim"])] = out.get((r["kind"], r["dim"]), 0) + r["bytes"]
    return out


def _where() -> str:
    """The innermost source line on the stack in meshfold (outside this package) or torch's
    optimizers, where most host reads of a step come from, searched up to the dry-run code that
    runs the step: what called the step (``meshfold dryrun``'s own command line, when its rank
    runs in its process) is not where a read came from."""
    for frame in reversed(traceback.extract_stack()):
        name = frame.filename
        if frame.name == "step_report" and name.endswith("/meshfold/dryrun/engine.py"):
            return "?"  # the step itself made the read: no meshfold line in between
        if ("/meshfold/" in name and "/dryrun/" not in name) or "/torch/optim/" in name:
            return f"{name.rsplit('/meshfold/', 1)[-1] if '/meshfold/' in name else name.rsplit('/torch/', 1)[-1]}:{frame.lineno}"
    return "?"


class HostReads(TorchDispatchMode):
    """Records host reads of device data (``reads``: ``(what, source line)``). ``answer``: under
    fake tensors, reply ``True`` instead of reading (see the module docstring)."""

    def __init__(self, answer: bool = False):
        super().__init__()
        self.answer = answer
        self.reads: list[tuple[str, str]] = []

    def record(self, what: str) -> None:
        self.reads.append((what, _where()))

    def intercept(self, func):
        """Record ``func`` if it reads device data; the answer a dry run gives instead of
        running it, else ``_PASS`` (run it)."""
        if func in _READS:
            self.record(func._schema.name.split("::")[-1])
            if self.answer:
                return True
        return _PASS

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        answer = self.intercept(func)
        return func(*args, **(kwargs or {})) if answer is _PASS else answer


class LivePeak(TorchDispatchMode):
    """Peak bytes of the storages created by ops while active and still alive (``peak``;
    ``live`` now). Storages alive before (parameters, the tokens) are not counted, nor views of
    storages no op here made (gloo's reduce-scatter slices a clone made inside the backend).

    Two changes of live bytes that no op's output shows are followed by hand, so that the peak is
    what the step holds on a device:

    * FSDP2 frees a gathered weight by shrinking its storage to 0 bytes (``resize_``) and regrows
      the same storage at its next gather, so the storage object outlives its bytes: its bytes
      leave at ``FSDPParam.free_unsharded_param`` and return at ``alloc_all_gather_outputs``.
    * a functional collective's ``wait_tensor`` returns its input tensor in eager execution but
      a new fake tensor under FakeTensorMode: there the wait's output counts as the collective's
      output (its bytes stay while either is alive), not as a second buffer.

    A wrapper subclass counts as the tensors it wraps (:func:`~meshfold.runtime.live_bytes.holders`):
    in eager execution a functional collective returns its output wrapped in an
    ``AsyncCollectiveTensor`` (``_c10d_functional._wrap_tensor_autograd``; under FakeTensorMode
    it waits instead), and the wrapper's placeholder storage holds no bytes of its own.
    """

    def __init__(self, exclude=()):
        super().__init__()
        # storage id -> (weakref, bytes, what it keeps alive)
        self._seen: dict[int, tuple] = {id(h.untyped_storage()): (None, 0, None)
                                        for t in exclude for h in holders(t)}
        self._shrunk: set[int] = set()  # storages FSDP2 has resized to 0 bytes
        self.live = self.peak = 0

    def _forget(self, key: int) -> None:
        _, n, _ = self._seen.pop(key, (None, 0, None))
        if key in self._shrunk:
            self._shrunk.discard(key)
        else:
            self.live -= n

    def _resized(self, tensors, grown: bool) -> None:
        """FSDP2 shrank (``grown=False``) or regrew these tensors' storages in place."""
        for t in tensors:
            key = id(t.untyped_storage())
            n = self._seen.get(key, (None, 0, None))[1]
            if not n or (key in self._shrunk) != grown:
                continue
            if grown:
                self._shrunk.discard(key)
                self.live += n
                self.peak = max(self.peak, self.live)
            else:
                self._shrunk.add(key)
                self.live -= n

    @contextlib.contextmanager
    def following_fsdp(self):
        """Follow FSDP2's frees and regrowths (above) while active."""
        from unittest import mock

        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

        free, alloc = FSDPParam.free_unsharded_param, FSDPParam.alloc_all_gather_outputs
        tracker = self

        def freed(param):
            tracker._resized([*param.all_gather_outputs, *param._unsharded_inner_tensors], grown=False)
            return free(param)

        def grown(param):
            alloc(param)
            tracker._resized(param.all_gather_outputs, grown=True)

        with mock.patch.object(FSDPParam, "free_unsharded_param", freed), \
                mock.patch.object(FSDPParam, "alloc_all_gather_outputs", grown):
            yield

    def __enter__(self):
        self._following = self.following_fsdp()
        self._following.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self._following.__exit__(None, None, None)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(func, args, out)
        return out

    def track(self, func, args, out) -> None:
        """Count the storages ``func`` created for ``out`` from ``args`` (after it ran)."""
        if func.is_view:  # allocates nothing: its storage is its input's, counted or not
            return
        if func is torch.ops._c10d_functional.wait_tensor.default:
            waited, done = (holders(t)[0].untyped_storage() for t in (args[0], out))
            if done is not waited and id(done) not in self._seen:  # fake: keep the input's bytes alive
                self._seen[id(done)] = (weakref.ref(done, lambda _, key=id(done): self._forget(key)), 0, waited)
            return
        for t in (h for leaf in tree_leaves(out) if isinstance(leaf, torch.Tensor) for h in holders(leaf)):
            s = t.untyped_storage()
            key = id(s)
            if key in self._seen:
                continue
            n = s.nbytes()
            self._seen[key] = (weakref.ref(s, lambda _, key=key: self._forget(key)), n, None)
            self.live += n
            self.peak = max(self.peak, self.live)


# SDPA's fused attention kernels (forward and backward), named in a report's attention kernels.
# SDPA's math kernel and ring attention's plain blocks are torch ops, not one kernel: a step that
# took them shows none of these.
ATTENTION_KERNELS = {op: op.__name__.removesuffix(".default") for op in (
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_backward.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention_backward.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default)}


class StepRecorder(TorchDispatchMode):
    """:class:`CollectiveLog`, :class:`HostReads` and, inside :meth:`measuring`, a
    :class:`LivePeak`, as one mode: the same records as the three stacked (the peak outermost,
    then the host reads, then the log), for one mode's overhead per op. ``attention``: the
    :data:`ATTENTION_KERNELS` that ran inside :meth:`measuring` (the device's kernel choice)."""

    def __init__(self, log: CollectiveLog, reads: HostReads):
        super().__init__()
        self.log, self.reads = log, reads
        self.peak: LivePeak | None = None
        self.attention: set[str] = set()

    @contextlib.contextmanager
    def measuring(self, peak: LivePeak):
        """Track ``peak`` over the ops of this block (``with ... as peak``)."""
        self.peak = peak
        try:
            with peak.following_fsdp():  # as LivePeak's own __enter__ does
                yield peak
        finally:
            self.peak = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _DEVICE:  # no read, no collective, no storage: none of the three records it
            if type(args[0]) is FakeTensor:  # answered as the fake mode would, one mode sooner
                return _FAKE_DEVICE(args)
            return func(*args, **kwargs)
        out = self.reads.intercept(func)
        if out is _PASS:
            self.log.observe(func, args, kwargs)
            out = func(*args, **kwargs)
        if self.peak is not None:
            self.peak.track(func, args, out)
            if func in ATTENTION_KERNELS:
                self.attention.add(ATTENTION_KERNELS[func])
        return out
