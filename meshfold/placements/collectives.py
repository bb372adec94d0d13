"""Variable-size collectives over one named mesh dim, with autograd.

Each collective moves rows (dim 0) between the ranks of one mesh dim. Split sizes are host ints
that every rank already knows, so the collectives themselves never sync with the device. Learning
the receive sizes is the dispatch's one device-to-host sync: :func:`exchange_splits` does it for
one mesh dim (one ``.tolist()`` of a [group] int64 tensor); the MoE dispatcher gathers the counts
of its whole ep x etp block instead, also with one ``.tolist()``.

=========================  =============================================  ========================
forward                    meaning                                        backward
=========================  =============================================  ========================
``all_to_all_v``           rank i sends ``input_splits[j]`` rows to j     all-to-all, splits swapped
``all_gather_v``           every rank gets the concat of all ranks' rows  reduce-scatter-v
``reduce_scatter_v``       rank i gets rows ``sizes[i]`` of the sum       all-gather-v
``all_gather_replicated``  the concat, as one replicated tensor           this rank's slice
``sum_partial``            the sum of every rank's tensor                 identity (replicated)
=========================  =============================================  ========================

Non-differentiable helpers for metadata and statistics: :func:`sum_statistic` /
:func:`sum_in_place` (a sum over named mesh dims), :func:`gather_equal` (an equal-size
all-gather), :func:`all_agree` (is a flag set on every rank). The rest of meshfold.placements
and the models reach ``torch.distributed`` collectives only through this module, so every
collective they run names its mesh dims. :func:`all_to_all_v_start` is the asynchronous
all-to-all (an :class:`InFlight` to wait on), forward and backward; its waits go through
:func:`meshfold.runtime.overlap.wait_for`, so under ``run_in_turns`` another micro-batch computes
while it travels.

Which primitive runs is decided on the host from the split list (every rank holds the same list,
so every rank decides the same way, and the decision costs nothing):

=====================  ==========================================  ================================
collective             even sizes (every rank the same row count)  ragged sizes
=====================  ==========================================  ================================
all-gather             ``all_gather_single`` (NCCL and gloo)       ``all_to_all_single``, x sent
                                                                   ``group`` times (its G copies)
reduce-scatter, fp32+  NCCL: ``reduce_scatter_single``;            ``all_to_all_single``, then a
                       gloo: the all-to-all (see below)            local sum in rank order
                       (the backend that serves the tensor's
                       device: :func:`meshfold.mesh.collective_backend`)
reduce-scatter, half   the all-to-all, both backends (see below)   the same
=====================  ==========================================  ================================

Byte counts per rank equal the ring algorithms' on both paths: it receives ``(group - 1) * rows``
for the reduce-scatter and the other ranks' rows for the gather. The native all-gather also avoids
the G-fold send buffer, and NCCL's native reduce-scatter overlaps transfer and reduction and needs
no receive buffer of the input's size. Two exceptions keep the all-to-all on even sizes:

* gloo's ``reduce_scatter_single`` is an all-reduce of a clone of the whole input followed by a
  slice (torch 2.13): twice the bytes of a ring reduce-scatter, plus a copy of the input.
* half-precision reduce-scatters (bf16 / fp16) must sum in fp32 and round once (a native half
  reduce-scatter rounds at every hop). Upcasting to fp32 before a native reduce-scatter would keep
  that, but sends fp32: twice the bytes of the all-to-all, which moves the half-precision pieces
  and sums them in fp32 locally. ``benchmarks/bench_collectives.py`` measures both.

Determinism: the all-to-all path sums in rank order (bitwise reproducible); gathers do no
arithmetic. NCCL's native reduce-scatter sums in its own ring order: reproducible run to run for
the same group size and NCCL algorithm, but not bitwise the rank-order sum (fp32 and fp64 only;
half precision never takes it under ``"auto"``).
:func:`set_collective_path` forces one path for tests and A/B benchmarks: ``"native"`` takes the
native collective for every even split (half precision upcast to fp32 first), ``"a2a"`` never;
``"auto"`` (the default, or ``MESHFOLD_COLLECTIVES``) is the table above.

Set ``MESHFOLD_DEBUG_SPLITS=1`` (or call :func:`set_debug_checks`) to compare split metadata across
ranks before every collective: a rank whose view of the splits disagrees with its peers then gets a
``ValueError`` naming both views, instead of a hang or silently shuffled rows.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.distributed as dist

from meshfold.runtime import compat, overlap, spmd
from meshfold.mesh import backend_device_type, collective_backend

__all__ = ["all_to_all_v", "all_gather_v", "all_gather_replicated", "reduce_scatter_v", "sum_partial",
           "exchange_splits", "sum_statistic", "sum_in_place", "gather_equal", "all_agree", "on_dim",
           "set_debug_checks", "debug_checks_enabled", "set_collective_path", "collective_path",
           "all_to_all_v_start", "InFlight"]

_DEBUG = os.environ.get("MESHFOLD_DEBUG_SPLITS", "") not in ("", "0")
_PATHS = ("auto", "native", "a2a")
_PATH = os.environ.get("MESHFOLD_COLLECTIVES", "auto")
if _PATH not in _PATHS:
    raise ValueError(f"MESHFOLD_COLLECTIVES = {_PATH!r}; valid: {list(_PATHS)}")
_HALF = (torch.float16, torch.bfloat16)


def set_debug_checks(enabled: bool) -> None:
    """Turn the cross-rank split-metadata check on or off (costs one all-gather per collective)."""
    global _DEBUG
    _DEBUG = bool(enabled)


def debug_checks_enabled() -> bool:
    return _DEBUG


def set_collective_path(path: str) -> str:
    """Choose how even-split all-gathers / reduce-scatters run: ``"auto"`` (native where it moves
    no more bytes, see the module docstring), ``"native"`` (always, half precision summed in
    fp32) or ``"a2a"`` (never: the all-to-all path everywhere). Every rank must choose the same.
    Returns the previous choice."""
    global _PATH
    if path not in _PATHS:
        raise ValueError(f"collective path {path!r}; valid: {list(_PATHS)}")
    previous, _PATH = _PATH, path
    return previous


def collective_path() -> str:
    return _PATH


def _group(mesh, dim: str):
    """(process group, group size, my position) of a named mesh dim, cached on the mesh object
    itself (not in a global table, which would keep discarded meshes alive, nor keyed by mesh
    equality, which two folds of one spec share while owning different groups): DeviceMesh
    lookups cost microseconds that add up on a per-layer hot path."""
    # simulated ranks: keyed by the ranks too, as a mode over one pipeline stage's ranks sees
    # the same mesh object with other coordinates than a mode over all of them
    cache = mesh.__dict__.setdefault("_meshfold_groups", {})
    ranks = spmd.simulated_ranks()
    if ranks is not None:
        cache = cache.setdefault(ranks, {})
    if dim not in cache:
        names = mesh.mesh_dim_names or ()
        if dim not in names:
            raise ValueError(f"mesh has no dim {dim!r}; its dims are {list(names)}")
        cache[dim] = (mesh.get_group(dim), mesh.size(names.index(dim)), mesh.get_local_rank(dim))
    return cache[dim]


def _check_splits(name: str, splits: Sequence[int], group_size: int, total: int | None,
                  what: str) -> list[int]:
    splits = [s if isinstance(s, torch.SymInt) else int(s) for s in splits]  # SymInt: simulated ranks'
    if len(splits) != group_size:
        raise ValueError(f"{name}: {what} has {len(splits)} entries but the mesh dim has "
                         f"{group_size} ranks: {splits}")
    if any(s < 0 for s in splits):
        raise ValueError(f"{name}: {what} must be non-negative, got {splits}")
    if total is not None and sum(splits) != total:
        raise ValueError(f"{name}: {what} sum to {sum(splits)} but the local tensor has {total} "
                         f"rows (dim 0): {splits}")
    return splits


def _gather_meta(values: list[int], group, group_size: int) -> list[list[int]]:
    t = torch.tensor(values, dtype=torch.int64, device=backend_device_type(group))
    out = [torch.empty_like(t) for _ in range(group_size)]
    spmd.all_gather(out, t, group)
    return [o.tolist() for o in out]


def _a2a(x: torch.Tensor, input_splits: list[int], output_splits: list[int], group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    spmd.all_to_all_single(out, x, output_splits, input_splits, group)
    return out


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, input_splits, output_splits, group):
        ctx.splits = (input_splits, output_splits)
        ctx.group = group
        return _a2a(x, input_splits, output_splits, group)

    @staticmethod
    def backward(ctx, grad):
        input_splits, output_splits = ctx.splits
        return _a2a(grad, output_splits, input_splits, ctx.group), None, None, None


def _even(sizes: list[int]) -> bool:
    # sizes that differ by simulated rank (SymInt) take the all-to-all, which handles them
    return all(isinstance(s, int) and s == sizes[0] for s in sizes)


def _native_gather(sizes: list[int]) -> bool:
    return _PATH != "a2a" and _even(sizes)


def _native_scatter(sizes: list[int], dtype: torch.dtype, group, device_type: str) -> bool:
    if _PATH == "a2a" or not _even(sizes):
        return False
    return _PATH == "native" or (dtype not in _HALF and collective_backend(group, device_type) == "nccl")


def _gather_v(x, sizes, rank, group):
    G = len(sizes)
    x = x.contiguous()
    out = x.new_empty((sum(sizes), *x.shape[1:]))
    if out.numel() == 0:
        return out  # every rank sees the same sizes, so every rank skips together
    if _native_gather(sizes):
        compat.all_gather_single(out, x, group=group)
        return out
    # Send my rows to every rank: input_splits = [n_me] * G, output_splits = sizes.
    send = x.repeat(G, *[1] * (x.dim() - 1))  # one copy (an expand's reshape would be a view per rank
    # under LocalTensorMode, which fails on ranks whose row count makes the strides differ)
    return _a2a(send, [spmd.at(sizes, rank)] * G, sizes, group)


def _scatter_v(x, sizes, rank, group):
    G = len(sizes)
    half = x.dtype in _HALF
    if x.numel() == 0:
        return x.new_zeros((spmd.at(sizes, rank), *x.shape[1:]))
    if _native_scatter(sizes, x.dtype, group, x.device.type):
        src = x.float() if half else x.contiguous()  # half precision: sum in fp32, round once
        out = src.new_empty((sizes[rank], *x.shape[1:]))
        compat.reduce_scatter_single(out, src, group=group)
        return out.to(x.dtype) if half else out
    # Send rows sizes[j] to rank j, receive G copies of my slice, sum them in rank order.
    mine = spmd.at(sizes, rank)
    pieces = _a2a(x, sizes, [mine] * G, group)
    pieces = pieces.reshape(G, mine, *x.shape[1:])
    if half:
        return pieces.float().sum(0).to(x.dtype)
    return pieces.sum(0)


class _AllGatherV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, rank, group):
        ctx.meta = (sizes, rank, group)
        return _gather_v(x, sizes, rank, group)

    @staticmethod
    def backward(ctx, grad):
        sizes, rank, group = ctx.meta
        return _scatter_v(grad, sizes, rank, group), None, None, None


class _ReduceScatterV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, rank, group):
        ctx.meta = (sizes, rank, group)
        return _scatter_v(x, sizes, rank, group)

    @staticmethod
    def backward(ctx, grad):
        sizes, rank, group = ctx.meta
        return _gather_v(grad, sizes, rank, group), None, None, None


def all_to_all_v(x: torch.Tensor, input_splits: Sequence[int], output_splits: Sequence[int],
                 mesh, dim: str) -> torch.Tensor:
    """Variable-size all-to-all over mesh dim ``dim``: x [sum(input_splits), ...] ->
    [sum(output_splits), ...]; rows ``input_splits[j]`` go to the j-th rank of the dim, and the
    rows from rank j arrive in order at offset ``sum(output_splits[:j])``. Differentiable."""
    group, ins, outs = _a2a_splits("all_to_all_v", x, input_splits, output_splits, mesh, dim)
    if not (x.requires_grad and torch.is_grad_enabled()):
        return _a2a(x, ins, outs, group)  # no graph to record: skip the autograd wrapper
    return _AllToAllV.apply(x, ins, outs, group)


def _a2a_splits(name, x, input_splits, output_splits, mesh, dim):
    group, G, me = _group(mesh, dim)
    ins = _check_splits(name, input_splits, G, x.shape[0], "input_splits")
    outs = _check_splits(name, output_splits, G, None, "output_splits")
    if _DEBUG:
        # Every rank checks the whole send/receive matrix, so all ranks raise together (no rank
        # is left waiting in the all-to-all for a peer that raised).
        views = _gather_meta(ins + outs, group, G)
        for i in range(G):
            for j in range(G):
                if views[i][j] != views[j][G + i]:
                    raise ValueError(
                        f"{name} over {dim!r}: rank {i} sends {views[i][j]} rows to rank {j}, "
                        f"but rank {j} expects {views[j][G + i]} from rank {i} (this is rank {me})")
    return group, ins, outs


class InFlight:
    """An all-to-all-v started by :func:`all_to_all_v_start`: ``wait()`` returns its output
    (once; every rank must wait, in the same order as it started its collectives). Holds the
    work handles and the buffers they use, forward and backward."""

    def __init__(self, splits, group, graph: bool):
        self.splits, self.group, self.graph = splits, group, graph
        self.work = self.send = self.out = None
        self.grad = None  # backward all-to-all: (work, output gradient sent, input gradient)

    def wait(self) -> torch.Tensor:
        if self.out is None:
            raise RuntimeError("InFlight.wait: already waited")
        out, self.out = self.out, None
        if self.graph:
            return _A2AWait.apply(out, self)
        overlap.wait_for(self.work)
        self.work = self.send = None
        return out


def _a2a_async(x, ins, outs, group):
    x = x.contiguous()
    out = x.new_empty((sum(outs), *x.shape[1:]))
    work = spmd.all_to_all_single(out, x, outs, ins, group, async_op=True)
    return work, x, out


class _A2AStart(torch.autograd.Function):
    """Starts the all-to-all and returns its (not yet filled) output; :class:`_A2AWait` waits.
    Backward: waits for the reverse all-to-all that ``_A2AWait``'s backward started, so whatever
    autograd runs between the two (the nodes recorded between start and wait in the forward,
    e.g. the shared expert) overlaps it."""

    @staticmethod
    def forward(ctx, x, flight):
        ctx.flight = flight
        ins, outs = flight.splits
        flight.work, flight.send, out = _a2a_async(x, ins, outs, flight.group)
        return out

    @staticmethod
    def backward(ctx, grad):
        flight = ctx.flight
        work, _, grad_x = flight.grad
        overlap.wait_for(work)
        flight.grad = None
        return grad_x, None


class _A2AWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, flight):
        ctx.flight = flight
        overlap.wait_for(flight.work)
        flight.work = flight.send = None
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        flight = ctx.flight
        ins, outs = flight.splits
        flight.grad = _a2a_async(grad, outs, ins, flight.group)  # travels while autograd goes on
        return grad, None


def all_to_all_v_start(x: torch.Tensor, input_splits: Sequence[int], output_splits: Sequence[int],
                       mesh, dim: str) -> InFlight:
    """:func:`all_to_all_v`, asynchronous: starts it (``async_op=True``) and returns an
    :class:`InFlight` whose ``wait()`` gives the output, so the caller can compute in between.
    Differentiable: in backward the gradient's all-to-all is started where ``wait`` was and
    waited where the start was, so it overlaps the backward of what ran in between."""
    group, ins, outs = _a2a_splits("all_to_all_v_start", x, input_splits, output_splits, mesh, dim)
    flight = InFlight((ins, outs), group, x.requires_grad and torch.is_grad_enabled())
    if flight.graph:
        flight.out = _A2AStart.apply(x, flight)
    else:
        flight.work, flight.send, flight.out = _a2a_async(x, ins, outs, group)
    return flight


def all_gather_v(x: torch.Tensor, sizes: Sequence[int], mesh, dim: str) -> torch.Tensor:
    """Concatenate every rank's x [sizes[r], ...] along dim 0, over mesh dim ``dim``, on every
    rank: -> [sum(sizes), ...]. Backward is :func:`reduce_scatter_v`."""
    group, G, me = _group(mesh, dim)
    sizes = _check_splits("all_gather_v", sizes, G, None, "sizes")
    if x.shape[0] != spmd.at(sizes, me):
        raise ValueError(f"all_gather_v: sizes[{me}] = {spmd.at(sizes, me)} but this rank's tensor has "
                         f"{x.shape[0]} rows (dim 0); sizes = {sizes}")
    if _DEBUG:
        _check_agreement("all_gather_v", dim, sizes, group, G, me)
    return _AllGatherV.apply(x, sizes, me, group)


def reduce_scatter_v(x: torch.Tensor, sizes: Sequence[int], mesh, dim: str) -> torch.Tensor:
    """Sum x [sum(sizes), ...] over the ranks of mesh dim ``dim`` and give rank r rows
    ``sizes[r]`` of the sum: -> [sizes[r], ...]. Backward is :func:`all_gather_v`."""
    group, G, me = _group(mesh, dim)
    sizes = _check_splits("reduce_scatter_v", sizes, G, x.shape[0], "sizes")
    if _DEBUG:
        _check_agreement("reduce_scatter_v", dim, sizes, group, G, me)
    return _ReduceScatterV.apply(x, sizes, me, group)


def _check_agreement(name, dim, sizes, group, G, me):
    views = _gather_meta(sizes, group, G)
    for j, v in enumerate(views):
        if v != views[0]:
            raise ValueError(f"{name} over {dim!r}: ranks disagree on sizes: rank 0 has {views[0]}, "
                             f"rank {j} has {v} (this is rank {me})")


def exchange_splits(input_splits: Sequence[int] | torch.Tensor, mesh, dim: str) -> list[int]:
    """How many rows each rank of ``dim`` will send me, given how many I send each of them.

    Accepts host ints or a device tensor of counts; this is the one device-to-host sync of a
    dispatch (the ``.tolist()`` at the end), done on a [group]-sized int64 tensor.
    """
    group, G, _ = _group(mesh, dim)
    counts = torch.as_tensor(input_splits, dtype=torch.int64).reshape(-1)
    if counts.numel() != G:
        raise ValueError(f"exchange_splits: {counts.numel()} counts for a mesh dim of {G} ranks")
    counts = counts.to(backend_device_type(group))
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out.tolist()


def on_dim(fn, x: torch.Tensor, d: int) -> torch.Tensor:
    """Apply ``fn``, an op on rows (dim 0), to tensor dim ``d`` of x."""
    if d == 0:
        return fn(x)
    return fn(x.movedim(d, 0)).movedim(0, d)


class _GatherReplicated(torch.autograd.Function):
    """all-gather-v whose output is one replicated tensor: its gradient is the same on every rank,
    so each rank's input gradient is just its own slice (DTensor's Shard -> Replicate rule)."""

    @staticmethod
    def forward(ctx, x, sizes, mesh, dim, me):
        ctx.meta = (spmd.at([sum(sizes[:i]) for i in range(len(sizes))], me), spmd.at(sizes, me))
        return all_gather_v(x.detach(), sizes, mesh, dim)

    @staticmethod
    def backward(ctx, grad):
        start, n = ctx.meta
        return grad[start:start + n], None, None, None, None


def all_gather_replicated(x: torch.Tensor, sizes: Sequence[int], mesh, dim: str) -> torch.Tensor:
    """:func:`all_gather_v` whose result is treated as one replicated tensor (RaggedShard ->
    Replicate): the backward keeps this rank's slice of the (replicated) gradient instead of
    summing every rank's."""
    _, _, me = _group(mesh, dim)
    return _GatherReplicated.apply(x, list(sizes), mesh, dim, me)


class _SumPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_partial(x: torch.Tensor, mesh, dim: str) -> torch.Tensor:
    """Partial -> Replicate over mesh dim ``dim``: the sum of every rank's x; the replicated
    gradient passes through unchanged (each rank's input gets it once)."""
    return _SumPartial.apply(x, _group(mesh, dim)[0])


def sum_statistic(t: torch.Tensor, mesh, dims: Sequence[str]) -> torch.Tensor:
    """A (non-differentiable) statistic summed over the named mesh dims, e.g. token counts over
    ``("cp", "tp")``: one all-reduce per dim of size > 1; returns a new tensor."""
    return sum_in_place(t.detach().clone(), mesh, dims)


def sum_in_place(t: torch.Tensor, mesh, dims: Sequence[str] | None = None) -> torch.Tensor:
    """Sum ``t`` over the named mesh dims (None: every dim, i.e. all the mesh's ranks) in place,
    one all-reduce per dim of size > 1; returns t. Not differentiable: for statistics and
    gradient buffers."""
    for d in mesh.mesh_dim_names if dims is None else dims:
        group, G, _ = _group(mesh, d)
        if G > 1:
            dist.all_reduce(t, group=group)
    return t


def gather_equal(t: torch.Tensor, mesh, dim: str) -> torch.Tensor:
    """[G, *t.shape]: every rank's t (all of one shape) over mesh dim ``dim``, in rank order
    (not differentiable; for metadata such as per-expert counts)."""
    group, G, _ = _group(mesh, dim)
    if G == 1:
        return t.unsqueeze(0)
    parts = [torch.empty_like(t) for _ in range(G)]
    spmd.all_gather(parts, t.contiguous(), group)
    return torch.stack(parts)


def all_agree(flag: bool, mesh, device) -> bool:
    """True iff ``flag`` is set on every rank of ``mesh`` (a MIN over each of its dims in turn,
    so only the mesh's own ranks take part): lets ranks decide together, all raising or none."""
    ok = torch.tensor([int(flag)], device=device)
    for name in mesh.mesh_dim_names:
        group, G, _ = _group(mesh, name)
        if G > 1:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return bool(ok.item())
