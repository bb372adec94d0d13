"""Many ranks in one process: what meshfold needs to run under torch's ``LocalTensorMode``.

``torch.distributed._local_tensor.LocalTensorMode`` (a debugging aid) runs one SPMD program for
every simulated rank at once: each tensor is a ``LocalTensor`` holding one shard per rank, and
each host int that differs between ranks (a mesh coordinate, a split size read with
``.tolist()``) is a ``SymInt`` over a ``LocalIntNode``, one int per rank. Arithmetic on those
works, but Python cannot index a list or slice a tensor with them, nor branch on them, and the
c10d all-to-all it simulates takes one list of split sizes for every rank. So, reached through
the seam :mod:`meshfold.runtime.spmd` while a mode is active:

* host logic that depends on the rank runs through :func:`per_rank` (a pure function run once
  per simulated rank, its results recombined) or :func:`pick` (``seq[i]``); :func:`per_rank_op`
  does the same for a differentiable local op (the expert kernels);
* the collectives torch simulates with one split list, or wrongly (its list ``all_gather`` with
  several groups), or not at all without threads (send / recv) are done here on the shards:
  :func:`all_to_all_single`, :func:`all_gather`, :func:`ring_shift`.

Outside the mode each is the plain call: real multi-process runs do not change. This leans on
torch 2.13's private LocalTensor internals (``_local_tensors``, how the fake process group's
partitions are laid out), as LocalTensorMode itself is private.
:func:`meshfold.testing.worlds.simulated_world` sets the mode up; ``tests/parallel/test_large_folds.py`` uses it.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch.distributed._local_tensor import (LocalIntNode, LocalTensor, _map_to_rank_local_val,
                                             enabled_local_tensor_mode)
from torch.distributed._local_tensor._c10d import _prepare_collective_groups
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = ["simulated_ranks", "per_rank", "per_rank_op", "pick", "all_to_all_single", "all_gather", "ring_shift"]

_R = TypeVar("_R")


def simulated_ranks() -> frozenset[int] | None:
    """The ranks an active ``LocalTensorMode`` simulates, else None (a real process per rank)."""
    mode = enabled_local_tensor_mode()
    return None if mode is None else mode.ranks


def per_rank(fn: Callable[..., _R]) -> Callable[..., _R]:
    """``fn`` (pure: no collectives, no mesh queries; the rank's values come in as arguments),
    run once per simulated rank under ``LocalTensorMode``, with every argument that differs by
    rank (a LocalTensor, a per-rank int, also inside lists, tuples and dicts) replaced by that
    rank's value. The results, which must have one structure on every rank, are recombined leaf
    by leaf: tensors into a LocalTensor, ints into a per-rank int (a plain int where all ranks
    agree); other values must agree. Outside the mode: ``fn`` itself."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        mode = enabled_local_tensor_mode()
        if mode is None:
            return fn(*args, **kwargs)
        with mode.disable():
            results = {r: fn(*_on_rank(args, r), **_on_rank(kwargs, r)) for r in sorted(mode.ranks)}
        return _combine(results)

    return run


def per_rank_op(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """:func:`per_rank` for a differentiable local computation (no collectives) returning one
    tensor, e.g. a kernel whose Python slices rows by per-rank counts: under ``LocalTensorMode``
    it runs once per simulated rank on that rank's plain tensors, recording each rank's graph,
    and its backward differentiates each rank's graph with that rank's output gradient.
    Outside the mode: ``fn`` itself."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if simulated_ranks() is None:
            return fn(*args, **kwargs)
        flat, spec = tree_flatten((args, kwargs))
        where = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
        return _PerRankOp.apply(fn, spec, flat, where, *(flat[i] for i in where))

    return run


def _shard_of(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t._local_tensors[rank] if hasattr(t, "_local_tensors") else t


class _PerRankOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, spec, flat, where, *tensors):
        mode = enabled_local_tensor_mode()
        wants = ctx.needs_input_grad[4:]
        ctx.runs = {}
        with mode.disable(), torch.enable_grad():
            for r in sorted(mode.ranks):
                ins = [_shard_of(t, r).detach().requires_grad_(w) for t, w in zip(tensors, wants)]
                leaves = _on_rank(list(flat), r)
                for i, t in zip(where, ins):
                    leaves[i] = t
                args, kwargs = tree_unflatten(leaves, spec)
                ctx.runs[r] = (ins, fn(*args, **kwargs))
            return LocalTensor({r: out.detach() for r, (_, out) in ctx.runs.items()})

    @staticmethod
    def backward(ctx, grad):
        mode = enabled_local_tensor_mode()
        wants = ctx.needs_input_grad[4:]
        grads = [dict() if w else None for w in wants]
        with mode.disable():
            for r, (ins, out) in ctx.runs.items():
                need = [x for x, w in zip(ins, wants) if w]
                got = iter(torch.autograd.grad(out, need, _shard_of(grad, r), allow_unused=True))
                for k, (x, w) in enumerate(zip(ins, wants)):
                    if w:
                        g = next(got)
                        grads[k][r] = torch.zeros_like(x) if g is None else g
        ctx.runs = None
        return (None, None, None, None, *(None if g is None else LocalTensor(g) for g in grads))


def _on_rank(tree, rank: int):
    return tree_map(lambda v: _map_to_rank_local_val(v, rank), tree)


def _combine(results: dict):
    flat = {r: tree_flatten(v) for r, v in results.items()}
    specs = {str(spec) for _, spec in flat.values()}
    if len(specs) > 1:
        raise ValueError(f"per_rank: the simulated ranks returned different structures: {sorted(specs)}")
    ranks = sorted(flat)
    leaves = []
    for i, first in enumerate(flat[ranks[0]][0]):
        column = {r: flat[r][0][i] for r in ranks}
        if isinstance(first, torch.Tensor):
            leaves.append(LocalTensor(column))
        elif isinstance(first, int) and not isinstance(first, bool):
            leaves.append(first if len(set(column.values())) == 1 else torch.SymInt(LocalIntNode(column)))
        elif all(v == first for v in column.values()):
            leaves.append(first)
        else:
            raise ValueError(f"per_rank: the simulated ranks returned different values {column}")
    return tree_unflatten(leaves, flat[ranks[0]][1])


@per_rank
def pick(seq: Sequence[_R], i: int) -> _R:
    """``seq[i]``, where ``i`` (a mesh coordinate) may differ by simulated rank."""
    return seq[i]


class _Done:
    """The work handle of a collective that has already run (``wait()`` returns at once)."""

    def wait(self) -> bool:
        return True


def all_to_all_single(out: torch.Tensor, x: torch.Tensor, output_split_sizes: Sequence[int],
                      input_split_sizes: Sequence[int], group, async_op: bool = False):
    """``dist.all_to_all_single`` with variable splits. Under ``LocalTensorMode`` every rank
    has its own split sizes (per-rank ints), which torch's simulated all-to-all does not take
    (it applies one list to every rank), so the rows are moved here: for every group of
    ``group``'s partition (the translates of this process's group, as LocalTensorMode lays
    them out), rank i's rows ``input_split_sizes[j]`` (i's own) go to the group's j-th rank, in
    order of i. A rank whose ``output_split_sizes`` disagree with what its peers send gets a
    ValueError naming both."""
    if simulated_ranks() is None:
        return dist.all_to_all_single(out, x, output_split_sizes=output_split_sizes,
                                      input_split_sizes=input_split_sizes, group=group, async_op=async_op)
    mode = enabled_local_tensor_mode()
    with mode.disable():
        for members in _partition(group, mode.ranks):
            pieces = {i: torch.split(x._local_tensors[i], _on_rank(list(input_split_sizes), i)) for i in members}
            for pos, j in enumerate(members):
                expected = _on_rank(list(output_split_sizes), j)
                got = [pieces[i][pos] for i in members]
                if [p.shape[0] for p in got] != expected:
                    raise ValueError(f"all_to_all_single: rank {j} expects {expected} rows from ranks "
                                     f"{members} but they send {[p.shape[0] for p in got]}")
                out._local_tensors[j].copy_(torch.cat(got))
    return _Done() if async_op else None


def all_gather(parts: list[torch.Tensor], x: torch.Tensor, group) -> None:
    """``dist.all_gather(parts, x, group)``. Under ``LocalTensorMode`` the gather is done here:
    torch 2.13's simulated ``all_gather`` copies each source rank's tensor into that part on
    every rank, so with several groups in the partition the last group's tensors overwrite the
    others' (its ``all_gather_into_tensor`` is right; the list form is not)."""
    if simulated_ranks() is None:
        dist.all_gather(parts, x, group=group)
        return
    mode = enabled_local_tensor_mode()
    with mode.disable():
        for members in _partition(group, mode.ranks):
            for part, i in zip(parts, members):
                for j in members:
                    part._local_tensors[j].copy_(x._local_tensors[i])


def ring_shift(tensors: Sequence[torch.Tensor], group) -> list[torch.Tensor]:
    """Under ``LocalTensorMode``: every rank's ``tensors`` as the previous rank of its group
    (cyclically) holds them, i.e. each rank sends to the next. What the point-to-point
    ``batch_isend_irecv`` of :func:`meshfold.placements.ring.ring_shift` does, whose peers are
    per-rank ints that torch's simulated send / recv cannot take."""
    mode = enabled_local_tensor_mode()
    with mode.disable():
        received = []
        for t in tensors:
            shifted = {}
            for members in _partition(group, mode.ranks):
                for pos, j in enumerate(members):
                    shifted[j] = t._local_tensors[members[pos - 1]].clone()
            received.append(LocalTensor(shifted))
    return received


def _partition(group, simulated: frozenset[int]) -> list[list[int]]:
    """Every group of ranks of the partition ``group`` belongs to, under LocalTensorMode's fake
    process group (whose one real process holds only the group of rank 0), among the
    ``simulated`` ranks (a mode over one pipeline stage's ranks sees that stage's groups only)."""
    ranks, offsets, _ = _prepare_collective_groups(group)
    groups = [[o + r for r in ranks] for o in offsets]
    return [g for g in groups if all(r in simulated for r in g)]
