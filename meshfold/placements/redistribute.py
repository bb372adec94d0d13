"""``meshfold.redistribute``: change how a tensor is laid out, keeping the whole tensor the same.

Like DTensor's ``redistribute``, every transition here preserves the global tensor (what
``full_tensor()`` returns); only which rank holds which rows changes. Handled here, one mesh dim
at a time:

======================================  ===========================  ==============================
transition on one mesh dim              collective                   backward
======================================  ===========================  ==============================
Shard/RaggedShard(d) -> RaggedShard(d)  all-to-all-v (re-split)      the inverse re-split
RaggedShard(d) -> Shard(d)              all-to-all-v (re-split)      the inverse re-split
RaggedShard(d) -> Replicate             all-gather-v                 local slice (grad replicated)
Replicate -> RaggedShard(d)             local slice, no comm         all-gather-v
Partial -> RaggedShard(d)/Shard(d)      reduce-scatter-v             all-gather-v
Partial -> Replicate                    all-reduce                   identity
======================================  ===========================  ==============================

A target of only ``Shard``/``Replicate``/``Partial`` placements gives a DTensor back, a target with
a ``RaggedShard`` a :class:`~meshfold.placements.ragged.RaggedTensor`. DTensor inputs with
non-ragged targets on the same mesh go to DTensor's own ``redistribute``.

Moving between the folded views (the ``attn`` and ``moe`` meshes hold the same ranks) re-labels
the tensor without copying when every rank's local piece is the same rows of the global tensor
under both layouts (e.g. tokens ``Shard(0)`` over attn ``(dp, cp, tp)`` are ``Shard(0)`` over moe
``(edp, ep, etp)``); otherwise it raises. Every rank decides locally and one all-reduce of a flag
over the source mesh's dims makes them agree, so no rank re-labels while another raises.

The token dispatch itself (rank i sends ``splits[j]`` rows to rank j, a block transpose of the
rows) is not a re-layout of one global tensor, so it is an op of its own
(:mod:`meshfold.placements.token_dispatch`), not a redistribute.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from meshfold.placements.collectives import (all_agree, all_gather_replicated, all_gather_v, all_to_all_v,
                                             on_dim, reduce_scatter_v, sum_partial)
from meshfold.placements.ragged import RaggedShard, RaggedTensor, chunk_sizes, explicit_shards

__all__ = ["redistribute", "resplit_sizes"]


def resplit_sizes(src: Sequence[int], dst: Sequence[int], me: int) -> tuple[list[int], list[int]]:
    """Send/receive splits for moving the rows of one interval split (``src`` sizes per rank)
    to another (``dst``), as rank ``me``: rows keep their global order."""
    def bounds(sizes):
        out, s = [], 0
        for n in sizes:
            out.append((s, s + n))
            s += n
        return out

    src_b, dst_b = bounds(src), bounds(dst)
    overlap = lambda a, b: max(0, min(a[1], b[1]) - max(a[0], b[0]))  # noqa: E731
    send = [overlap(src_b[me], d) for d in dst_b]
    recv = [overlap(s, dst_b[me]) for s in src_b]
    return send, recv


class _SliceFullGrad(torch.autograd.Function):
    """Replicate -> RaggedShard: a local slice whose input gradient (replicated) is the gathered
    gradient of every rank's slice."""

    @staticmethod
    def forward(ctx, x, sizes, mesh, dim, me):
        ctx.meta = (sizes, mesh, dim)
        start = sum(sizes[:me])
        return x[start:start + sizes[me]].clone()

    @staticmethod
    def backward(ctx, grad):
        sizes, mesh, dim = ctx.meta
        return all_gather_v(grad.contiguous(), sizes, mesh, dim), None, None, None, None


def _source(x) -> tuple[torch.Tensor, object, list]:
    """(local tensor, mesh, placements with Shard made explicit as RaggedShard)."""
    if isinstance(x, RaggedTensor):
        return x.local, x.mesh, list(x.placements)
    if isinstance(x, DTensor):
        has_partial = any(isinstance(p, Partial) for p in x.placements)
        grad_pl = [Replicate() if isinstance(p, Partial) else p for p in x.placements]
        local = x.to_local(grad_placements=grad_pl) if has_partial else x.to_local()
        return local, x.device_mesh, explicit_shards(x.placements, x.shape, x.device_mesh)
    raise TypeError(f"redistribute takes a DTensor or RaggedTensor, got {type(x).__name__}")


def _ragged_targets(placements, local: torch.Tensor, src: list, mesh) -> list:
    """Target placements with each ``Shard(d)`` made explicit as ``RaggedShard(d, torch.chunk
    sizes)`` of the tensor's global length along d (the source's ragged total, else local)."""
    tgt = []
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            d = p.dim % local.ndim
            owner = [q for q in src if isinstance(q, RaggedShard) and q.dim == d]
            length = owner[0].total if owner else local.shape[d]
            p = RaggedShard(d, chunk_sizes(length, mesh.size(i)))
        tgt.append(p)
    return tgt


def redistribute(x, mesh, placements: Sequence):
    """Lay ``x`` (DTensor or RaggedTensor) out as ``placements`` on ``mesh``.

    ``placements`` has one entry per mesh dim: ``Replicate()``, ``Shard(d)``, ``RaggedShard(d,
    sizes)`` or ``Partial()`` (the last only where DTensor itself can produce it). Returns a
    RaggedTensor if any target placement is ragged, else a DTensor. Raises ``ValueError`` for a
    transition it does not support, never returning the input unchanged by accident.
    """
    placements = tuple(placements)
    src_mesh = x.mesh if isinstance(x, RaggedTensor) else getattr(x, "device_mesh", None)
    if len(placements) != mesh.ndim:
        raise ValueError(f"redistribute: {len(placements)} placements for a {mesh.ndim}-dim mesh "
                         f"{mesh.mesh_dim_names}")
    if src_mesh is not None and src_mesh is not mesh and src_mesh != mesh:
        return _relabel(x, mesh, placements)
    wants_ragged = any(isinstance(p, RaggedShard) for p in placements)
    if isinstance(x, DTensor) and not wants_ragged:
        return x.redistribute(mesh, placements)
    local, mesh, src = _source(x)
    tgt = _ragged_targets(placements, local, src, mesh)
    for i, p in enumerate(tgt):
        if isinstance(p, Partial):
            raise ValueError(f"redistribute: to {p!r} on mesh dim {mesh.mesh_dim_names[i]!r} is not "
                             f"supported from {src[i]!r}")
    _check_single_sharding(tgt, "target")
    for i in reversed(range(mesh.ndim)):  # innermost mesh dim first
        if src[i] != tgt[i]:
            local = _step(local, mesh, i, src, tgt[i])
            src[i] = tgt[i]
    if wants_ragged:
        return RaggedTensor(local, mesh, src)
    return RaggedTensor(local, mesh, src).to_dtensor()


def _check_single_sharding(placements, what):
    dims = [p.dim for p in placements if isinstance(p, RaggedShard)]
    if len(dims) != len(set(dims)):
        raise ValueError(f"redistribute: {what} placements {placements} shard one tensor dim over "
                         f"several mesh dims; meshfold supports one mesh dim per tensor dim")


def _step(local: torch.Tensor, mesh, i: int, src: list, p) -> torch.Tensor:
    """Change mesh dim i from src[i] to p, every other mesh dim unchanged."""
    name = mesh.mesh_dim_names[i]
    s = src[i]
    me = mesh.get_local_rank(name)
    others = [q for j, q in enumerate(src) if j != i]
    if isinstance(p, RaggedShard) and any(isinstance(q, RaggedShard) and q.dim == p.dim for q in others):
        raise ValueError(f"redistribute: tensor dim {p.dim} is already sharded over another mesh dim "
                         f"({src}); meshfold supports one mesh dim per tensor dim")
    if isinstance(s, RaggedShard) and isinstance(p, RaggedShard):
        if s.dim != p.dim:
            raise ValueError(f"redistribute: {s!r} -> {p!r} on mesh dim {name!r} changes the sharded "
                             f"tensor dim; go through Replicate() or use DTensor for even shards")
        if s.total != p.total:
            raise ValueError(f"redistribute: target sizes {p.sizes} sum to {p.total} but the tensor "
                             f"has {s.total} rows along dim {p.dim} ({s.sizes})")
        send, recv = resplit_sizes(s.sizes, p.sizes, me)
        return on_dim(lambda t: all_to_all_v(t, send, recv, mesh, name), local, p.dim)
    if isinstance(s, RaggedShard) and isinstance(p, Replicate):
        return on_dim(lambda t: all_gather_replicated(t, s.sizes, mesh, name), local, s.dim)
    if isinstance(s, Replicate) and isinstance(p, RaggedShard):
        _check_total(p, local, name)
        return on_dim(lambda t: _SliceFullGrad.apply(t, list(p.sizes), mesh, name, me), local, p.dim)
    if isinstance(s, Partial) and isinstance(p, RaggedShard):
        _check_total(p, local, name)
        return on_dim(lambda t: reduce_scatter_v(t, list(p.sizes), mesh, name), local, p.dim)
    if isinstance(s, Partial) and isinstance(p, Replicate):
        return sum_partial(local, mesh, name)
    raise ValueError(f"redistribute: {s!r} -> {p!r} on mesh dim {name!r} is not supported; "
                     f"supported: Shard/RaggedShard -> RaggedShard/Shard/Replicate, Replicate -> "
                     f"RaggedShard/Shard, Partial -> RaggedShard/Shard/Replicate")


def _check_total(p: RaggedShard, local: torch.Tensor, name: str) -> None:
    if p.total != local.shape[p.dim]:
        raise ValueError(f"redistribute: target {p!r} on mesh dim {name!r} sums to {p.total} but the "
                         f"tensor has {local.shape[p.dim]} rows along dim {p.dim}")


# ---- moving between the folded views -----------------------------------------------------------
def _box(placements, local_shape, coord) -> list[tuple[int, int]] | None:
    """(offset, length) per tensor dim of this rank's piece; None if it cannot be known locally."""
    box = [(0, n) for n in local_shape]
    for i, p in enumerate(placements):
        if isinstance(p, RaggedShard):
            box[p.dim] = (p.offset(coord[i]), p.sizes[coord[i]])
        elif isinstance(p, Shard):
            return None
        elif not isinstance(p, Replicate):
            return None
    return box


def _dtensor_box(shape, mesh, placements):
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return list(zip(offset, local_shape))


def _relabel_error(src_mesh, mesh, src, src_box, tgt, tgt_box):
    return ValueError(
        f"redistribute between meshes {src_mesh.mesh_dim_names} -> {mesh.mesh_dim_names}: the "
        f"local data would change on some rank (source {src} holds rows {src_box} here, target "
        f"{tgt} would hold {tgt_box}); only re-labelling moves are supported across meshes: "
        f"redistribute on the source mesh first so both layouts hold the same rows")


def _relabel(x, mesh, placements):
    even = (Shard, Replicate)
    if isinstance(x, DTensor) and all(isinstance(p, even) for p in (*x.placements, *placements)):
        # DTensor-only layouts, nested shards allowed: compare boxes with DTensor's own rule.
        src_box = _dtensor_box(x.shape, x.device_mesh, x.placements)
        tgt_box = _dtensor_box(x.shape, mesh, placements)
        if not all_agree(src_box == tgt_box, x.device_mesh, x.device):
            raise _relabel_error(x.device_mesh, mesh, x.placements, src_box, placements, tgt_box)
        return DTensor.from_local(x.to_local(), mesh, placements, run_check=False,
                                  shape=x.shape, stride=x.stride())
    local, src_mesh, src = _source(x)
    tgt = _ragged_targets(placements, local, src, mesh)
    src_box = _box(src, local.shape, src_mesh.get_coordinate())
    tgt_box = _box(tgt, local.shape, mesh.get_coordinate())
    if not all_agree(src_box is not None and src_box == tgt_box, src_mesh, local.device):
        raise _relabel_error(src_mesh, mesh, src, src_box, tgt, tgt_box)
    if any(isinstance(p, RaggedShard) for p in placements):
        return RaggedTensor(local, mesh, tgt)
    return RaggedTensor(local, mesh, tgt).to_dtensor()
