"""Worlds of ranks for tests: folds cached per process, and many ranks simulated in one process.

* :func:`cached_fold`: one ``meshfold.fold(spec)`` per process and spec, so property tests that
  run many examples on one long-lived :class:`meshfold.runtime.launch.World` reuse its process
  groups.
* :func:`simulated_world`: ``world_size`` ranks in this process under torch's ``LocalTensorMode``
  (:mod:`meshfold.runtime.simulated`), for folds larger than the spawned worlds a small machine
  holds; :func:`rank_values` reads one rank's value of a tensor made there.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from meshfold.mesh import FoldSpec

__all__ = ["cached_fold", "simulated_process_group", "simulated_world", "rank_values"]


_FOLDS: dict = {}


def cached_fold(spec: FoldSpec, device_type: str = "cpu"):
    """``meshfold.fold(spec)``, built once per process and spec: property tests that run many
    examples on one long-lived world (``meshfold.runtime.launch.World``) would otherwise create new
    process groups for every example. Every rank must call it for the same specs in the same
    order, as with ``fold``."""
    from meshfold.mesh import fold

    key = (spec, device_type)
    if key not in _FOLDS:
        _FOLDS[key] = fold(spec, device_type)
    return _FOLDS[key]


@contextmanager
def simulated_process_group(world_size: int):
    """A fake default process group of ``world_size`` ranks (this process is rank 0 of it), for
    torch's ``LocalTensorMode`` to simulate them (:func:`simulated_world`, or one mode per
    pipeline stage over that stage's ranks: modes over different rank sets do not nest). Torch
    runs single-threaded inside: meshfold's CPU kernel pool would otherwise run LocalTensor ops
    on threads outside the mode. The process must have no process group of its own."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("simulated_process_group: this process already has a default process group")
    threads = torch.get_num_threads()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        dist.destroy_process_group()


@contextmanager
def simulated_world(world_size: int):
    """``world_size`` ranks simulated in this one process (:mod:`meshfold.runtime.simulated`): a
    :func:`simulated_process_group` and torch's ``LocalTensorMode`` over every rank, which it
    yields; inside, :func:`meshfold.mesh.fold` and everything built on it runs all ranks at once
    (``mode.rank_map(lambda r: ...)`` makes per-rank inputs, tensors made inside are
    LocalTensors). Reaches folds that spawned processes cannot on a small machine; FSDP2 and
    meshfold's Pipeline excepted (tests/parallel/test_large_folds.py says why)."""
    from torch.distributed._local_tensor import LocalTensorMode

    with simulated_process_group(world_size), LocalTensorMode(world_size) as mode:
        yield mode


def rank_values(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """``{rank: that simulated rank's value}`` of a LocalTensor made in :func:`simulated_world`."""
    local = getattr(t, "_local_tensors", None)
    if local is None:
        raise TypeError(f"rank_values: a {type(t).__name__} holds no per-rank values (valid: a LocalTensor)")
    return dict(sorted(local.items()))
