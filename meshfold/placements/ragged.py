"""``RaggedShard``: a tensor dim split over a mesh dim with a different size on every rank.

Routed tokens are ragged: after the dispatch all-to-all, EP rank 0 may hold 5 rows, rank 1 none and
rank 2 nine. DTensor (torch 2.13) cannot say that: its ``Shard`` means ``torch.chunk`` sizes, custom
``Shard`` subclasses fail inside ``DTensorSpec`` and there is no hook for custom redistribute steps
(pytorch/pytorch#169320). So meshfold keeps ragged data in a small type of its own:

* :class:`RaggedShard` ``(dim, sizes)``: tensor dim ``dim`` is split over one mesh dim, the rank at
  position ``j`` of that mesh dim holding ``sizes[j]`` rows. The sizes travel with the placement.
* :class:`RaggedTensor`: a local tensor + the mesh + one placement per mesh dim (``Replicate``,
  ``Partial`` or ``RaggedShard``). It converts to a DTensor with :meth:`RaggedTensor.to_dtensor`
  whenever the sizes happen to be ``torch.chunk``-shaped, and from one with
  :meth:`RaggedTensor.from_dtensor`.

Why a wrapper and not a DTensor with a custom placement: every DTensor op would need a ragged rule,
and ops on DTensors that silently lose the custom placement (Partial subclasses do) give wrong
answers without an error. A wrapper makes every computation on ragged data explicit: take
``.local``, compute, re-wrap. Limits: no operator dispatch on RaggedTensor; sizes of a
``RaggedShard`` describe the group of ranks along its mesh dim that this rank belongs to (other
groups may hold other sizes); a tensor dim may be ragged over at most one mesh dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from meshfold.placements.collectives import (all_agree, all_gather_replicated, debug_checks_enabled, gather_equal,
                                             on_dim, sum_partial)
from meshfold.runtime import spmd

__all__ = ["RaggedShard", "RaggedTensor", "chunk_sizes", "explicit_shards"]


def chunk_sizes(length: int, parts: int) -> list[int]:
    """Rows per rank when ``length`` rows are split ``torch.chunk``-style (DTensor ``Shard``)."""
    per = -(-length // parts) if length else 0
    return [max(0, min(per, length - per * j)) for j in range(parts)]


@dataclass(frozen=True)
class RaggedShard:
    """Split tensor dim ``dim`` over one mesh dim; the j-th rank of that mesh dim holds
    ``sizes[j]`` rows (zeros allowed)."""

    dim: int
    sizes: tuple[int, ...]

    def __init__(self, dim: int, sizes: Sequence[int]):
        sizes = tuple(s if isinstance(s, torch.SymInt) else int(s) for s in sizes)  # SymInt: simulated ranks'
        if any(s < 0 for s in sizes):
            raise ValueError(f"RaggedShard sizes must be non-negative, got {sizes}")
        if not sizes:
            raise ValueError("RaggedShard needs one size per rank of its mesh dim, got none")
        object.__setattr__(self, "dim", int(dim))
        object.__setattr__(self, "sizes", sizes)

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def offset(self, j: int) -> int:
        """First row held by the j-th rank of the mesh dim."""
        return sum(self.sizes[:j])

    def __repr__(self) -> str:
        return f"RaggedShard(dim={self.dim}, sizes={self.sizes})"


def explicit_shards(placements: Sequence, shape: Sequence[int], mesh) -> list:
    """``placements`` with every ``Shard(d)`` of a tensor of global ``shape`` made explicit as
    ``RaggedShard(d, torch.chunk sizes)``; other placements unchanged. Each tensor dim may be
    sharded over one mesh dim only (``ValueError`` otherwise)."""
    out = []
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            if sum(isinstance(q, Shard) and q.dim == p.dim for q in placements) > 1:
                raise ValueError(f"tensor dim {p.dim} is sharded over several mesh dims "
                                 f"{tuple(placements)}; meshfold handles one mesh dim per tensor dim "
                                 f"(use DTensor's redistribute for nested shards)")
            p = RaggedShard(p.dim, chunk_sizes(shape[p.dim], mesh.size(i)))
        out.append(p)
    return out


def _replica_mismatch(local: torch.Tensor, mesh, dim: str) -> str | None:
    """How the ranks along mesh dim ``dim`` disagree on ``local`` (None: they all hold the same).
    Every rank of the group sees every rank's data, so the whole group reaches the same answer."""
    ndims = gather_equal(torch.tensor([local.dim()], device=local.device), mesh, dim).flatten().tolist()
    if len(set(ndims)) > 1:
        return f"local tensors of {ndims} dims by position"
    shape = torch.tensor([*local.shape, 0], dtype=torch.int64, device=local.device)  # never empty
    shapes = [tuple(s[:-1]) for s in gather_equal(shape, mesh, dim).tolist()]
    if len(set(shapes)) > 1:
        return f"local shapes {shapes} by position"
    if local.numel() == 0:  # the same empty shape everywhere: nothing to compare
        return None
    parts = gather_equal(local.detach(), mesh, dim)
    for j in range(1, parts.shape[0]):
        a, b = parts[0], parts[j]
        same = (a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else a == b
        if not bool(same.all()):
            worst = (a.double() - b.double()).abs().nan_to_num(float("inf")).max().item()
            return f"position {j} holds other values than position 0 (max |difference| {worst:.3g})"
    return None


def _check_replicated(local: torch.Tensor, mesh, placements) -> None:
    """Raise on every rank of ``mesh`` if the ranks along some ``Replicate()`` mesh dim hold
    different local tensors (the debug check of :class:`RaggedTensor`)."""
    names = mesh.mesh_dim_names
    for i, p in enumerate(placements):
        if not isinstance(p, Replicate) or mesh.size(i) == 1:
            continue
        problem = _replica_mismatch(local, mesh, names[i])
        if not all_agree(problem is None, mesh, local.device):
            raise ValueError(f"RaggedTensor placements {placements}: mesh dim {names[i]!r} is Replicate() but "
                             f"its ranks hold different data ({problem or 'seen by other ranks of the mesh'}); "
                             f"declare Partial() if they hold summands of the whole, RaggedShard(d, sizes) if "
                             f"they hold different rows")


class RaggedTensor:
    """A local tensor plus the mesh and placements that say which piece of the whole it is.

    ``placements[i]`` is ``Replicate()``, ``Partial()`` (this rank holds a summand) or
    ``RaggedShard(d, sizes)`` for mesh dim ``i``. A ``RaggedShard`` on mesh dim ``i`` must give
    this rank's local size: ``local.shape[d] == sizes[mesh.get_local_rank(i)]`` (checked).

    ``Replicate()`` on mesh dim ``i`` promises that every rank along it holds the same local
    tensor; :meth:`full_tensor` takes one rank's word for it. With debug checks on
    (``MESHFOLD_DEBUG_SPLITS=1`` or :func:`~meshfold.placements.set_debug_checks`) the
    constructor verifies the promise, so construction is then a collective of the mesh's ranks
    (an all-gather of the data over each replicated dim of size > 1, and one flag all-reduce):
    ranks that differ (in shape or in any value; NaNs equal NaNs) make every rank of the mesh
    raise ``ValueError`` naming the dim. Skipped for meta tensors and simulated ranks.
    """

    def __init__(self, local: torch.Tensor, mesh, placements: Sequence):
        placements = tuple(placements)
        if len(placements) != mesh.ndim:
            raise ValueError(f"RaggedTensor needs one placement per mesh dim ({mesh.ndim}: "
                             f"{mesh.mesh_dim_names}), got {len(placements)}: {placements}")
        ragged_dims = {}
        for i, p in enumerate(placements):
            if not isinstance(p, (Replicate, Partial, RaggedShard)):
                raise ValueError(f"RaggedTensor placement {p!r} on mesh dim {i} is not supported; "
                                 f"valid: Replicate(), Partial(), RaggedShard(d, sizes) (a Shard's sizes are "
                                 f"unknown without the global shape: use RaggedTensor.from_dtensor)")
            if isinstance(p, RaggedShard) and not 0 <= p.dim < local.ndim:
                raise ValueError(f"placement {p!r} names tensor dim {p.dim} of a "
                                 f"{local.ndim}-d tensor")
            if isinstance(p, RaggedShard):
                if p.dim in ragged_dims:
                    raise ValueError(f"tensor dim {p.dim} is ragged over mesh dims "
                                     f"{ragged_dims[p.dim]} and {i}; at most one is supported")
                ragged_dims[p.dim] = i
                if len(p.sizes) != mesh.size(i):
                    raise ValueError(f"{p!r} has {len(p.sizes)} sizes but mesh dim "
                                     f"{mesh.mesh_dim_names[i]!r} has {mesh.size(i)} ranks")
                me = mesh.get_local_rank(i)
                if local.shape[p.dim] != spmd.at(p.sizes, me):
                    raise ValueError(f"{p!r}: this rank (position {me} of mesh dim "
                                     f"{mesh.mesh_dim_names[i]!r}) should hold {spmd.at(p.sizes, me)} rows "
                                     f"but its local tensor has {local.shape[p.dim]} "
                                     f"(shape {tuple(local.shape)})")
        self.local = local
        self.mesh = mesh
        self.placements = placements
        if debug_checks_enabled() and not local.is_meta and spmd.simulated_ranks() is None:
            _check_replicated(local, mesh, placements)

    def __repr__(self) -> str:
        return (f"RaggedTensor(local_shape={tuple(self.local.shape)}, dtype={self.local.dtype}, "
                f"mesh_dims={self.mesh.mesh_dim_names}, placements={self.placements})")

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    def to_local(self) -> torch.Tensor:
        return self.local

    def full_tensor(self) -> torch.Tensor:
        """The whole tensor on every rank (collective; differentiable, DTensor gradient rules):
        innermost mesh dim first, ragged dims all-gathered, partial ones summed."""
        local, names = self.local, self.mesh.mesh_dim_names
        for i in reversed(range(self.mesh.ndim)):
            p = self.placements[i]
            if isinstance(p, RaggedShard):
                local = on_dim(lambda t: all_gather_replicated(t, p.sizes, self.mesh, names[i]), local, p.dim)
            elif isinstance(p, Partial):
                local = sum_partial(local, self.mesh, names[i])
        return local

    def with_local(self, local: torch.Tensor, placements: Sequence | None = None) -> "RaggedTensor":
        """A RaggedTensor on the same mesh holding ``local`` (with these placements, or the same)."""
        return RaggedTensor(local, self.mesh, self.placements if placements is None else placements)

    @classmethod
    def from_dtensor(cls, x: DTensor) -> "RaggedTensor":
        """Wrap a DTensor's local shard; each ``Shard(d)`` becomes ``RaggedShard(d, sizes)`` with
        the ``torch.chunk`` sizes DTensor uses. Each tensor dim may be sharded over one mesh dim."""
        placements = explicit_shards(x.placements, x.shape, x.device_mesh)
        for i, p in enumerate(placements):
            if isinstance(p, Partial):
                raise ValueError(f"from_dtensor: placement {p!r} on mesh dim {i} is not supported; "
                                 f"redistribute Partial first (e.g. to RaggedShard, a reduce-scatter-v)")
        return cls(x.to_local(), x.device_mesh, placements)

    def to_dtensor(self) -> DTensor:
        """A DTensor of the same data, when every ragged split is ``torch.chunk``-shaped (the only
        uneven sharding DTensor understands); otherwise ``ValueError`` naming the sizes."""
        placements, shape = [], list(self.local.shape)
        for i, p in enumerate(self.placements):
            if isinstance(p, RaggedShard):
                expected = chunk_sizes(p.total, len(p.sizes))
                if list(p.sizes) != expected:
                    raise ValueError(f"{p!r} on mesh dim {self.mesh.mesh_dim_names[i]!r} is not "
                                     f"torch.chunk-shaped ({expected} for {p.total} rows), so no "
                                     f"DTensor can hold it; redistribute to Shard({p.dim}) first")
                shape[p.dim] = p.total
                placements.append(Shard(p.dim))
            else:
                placements.append(p)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(self.local, self.mesh, placements, run_check=False,
                                  shape=torch.Size(shape), stride=stride)
