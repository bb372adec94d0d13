"""The one seam between meshfold's per-rank code and the way its ranks run.

meshfold is one SPMD program that every rank runs. In a real run each rank is a process, and each
function here is the plain operation it names: the ``torch.distributed`` call, ``seq[i]``, a call
of ``fn``. The code above (the collectives of :mod:`meshfold.placements`, the expert kernels,
ring attention) calls these where its host logic depends on the rank, and reads as if it ran on
one rank.

Under torch's ``LocalTensorMode`` one process runs every rank at once (for folds larger than the
processes a machine holds: :func:`meshfold.testing.worlds.simulated_world`). There a mesh
coordinate is one int per rank, which Python cannot index with, and torch's simulated
all-to-all takes one list of split sizes for every rank; so each function here hands over to
:mod:`meshfold.runtime.simulated`, which runs it rank by rank. Whether a mode is active is asked
only once torch's ``_local_tensor`` module has been imported (no mode can exist before), so in a
real run nothing of the simulation is loaded.

=====================================  =====================================  ===============================
here                                   one process per rank                   under LocalTensorMode
=====================================  =====================================  ===============================
:func:`all_to_all_single`              ``dist.all_to_all_single``             every rank's own split sizes
:func:`all_gather`                     ``dist.all_gather``                    per group of the partition
:func:`at` ``(seq, i)``                ``seq[i]``                             ``seq[i]`` rank by rank
:func:`per_rank` (a decorator)         ``fn``                                 ``fn`` once per rank, recombined
:func:`per_rank_op` (a decorator)      ``fn``                                 the same, differentiable
:func:`simulated_ranks`                ``None``                               the ranks simulated
:func:`simulated_ring_shift`           (not called)                           a ring shift of every rank
=====================================  =====================================  ===============================
"""

from __future__ import annotations

import functools
import sys
from typing import Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

__all__ = ["all_to_all_single", "all_gather", "at", "per_rank", "per_rank_op", "simulated_ranks",
           "simulated_ring_shift"]

_R = TypeVar("_R")


def _simulating() -> bool:
    local_tensor = sys.modules.get("torch.distributed._local_tensor")
    return local_tensor is not None and local_tensor.enabled_local_tensor_mode() is not None


def _simulation():
    from meshfold.runtime import simulated

    return simulated


def simulated_ranks() -> frozenset[int] | None:
    """The ranks an active ``LocalTensorMode`` simulates, else None (a real process per rank)."""
    return _simulation().simulated_ranks() if _simulating() else None


def all_to_all_single(out: torch.Tensor, x: torch.Tensor, output_split_sizes: Sequence[int],
                      input_split_sizes: Sequence[int], group, async_op: bool = False):
    """``dist.all_to_all_single`` with variable splits: rows ``input_split_sizes[j]`` of x to the
    group's j-th rank, ``output_split_sizes[j]`` rows from it into ``out``."""
    if _simulating():
        return _simulation().all_to_all_single(out, x, output_split_sizes, input_split_sizes, group, async_op)
    return dist.all_to_all_single(out, x, output_split_sizes=output_split_sizes,
                                  input_split_sizes=input_split_sizes, group=group, async_op=async_op)


def all_gather(parts: list[torch.Tensor], x: torch.Tensor, group) -> None:
    """``dist.all_gather(parts, x, group)``: every rank's x, in group order."""
    if _simulating():
        _simulation().all_gather(parts, x, group)
    else:
        dist.all_gather(parts, x, group=group)


def at(seq: Sequence[_R], i: int) -> _R:
    """``seq[i]`` for ``i`` a rank's coordinate (a mesh position)."""
    return _simulation().pick(seq, i) if _simulating() else seq[i]


def per_rank(fn: Callable[..., _R]) -> Callable[..., _R]:
    """``fn``, host logic (pure: no collectives) whose arguments may hold a rank's coordinates
    and per-rank sizes. Simulated: run once per rank on that rank's values, results recombined
    (:func:`meshfold.runtime.simulated.per_rank`)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if _simulating():
            return _simulation().per_rank(fn)(*args, **kwargs)
        return fn(*args, **kwargs)

    return run


def per_rank_op(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """:func:`per_rank` for a differentiable local op returning one tensor (an expert kernel
    whose Python slices rows by per-rank counts)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if _simulating():
            return _simulation().per_rank_op(fn)(*args, **kwargs)
        return fn(*args, **kwargs)

    return run


def simulated_ring_shift(tensors: Sequence[torch.Tensor], group) -> list[torch.Tensor]:
    """Under ``LocalTensorMode`` only: every rank's ``tensors`` as the previous rank of its group
    holds them (:func:`meshfold.placements.ring.ring_shift`'s point-to-point sends, whose peers
    differ by rank, which torch's simulated send / recv cannot take)."""
    return _simulation().ring_shift(tensors, group)
