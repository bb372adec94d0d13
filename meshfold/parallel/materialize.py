"""A laid-out model's tensors filled shard by shard, with the values the whole model would hold.

:mod:`meshfold.models.init` draws every tensor's values from ``(seed, single-device name, global
position)`` alone. Here each rank fills only what it holds of a DTensor (TP / EP / ETP slices,
FSDP2 shards, strided shards: :func:`shard_indices`), so the global parameters equal, bitwise,
those of the model built whole on one device, and no rank allocates a parameter it does not keep.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from meshfold.models.init import Init, materialize
from meshfold.runtime.compat import strided_shard_indices

__all__ = ["shard_indices", "materialize_shards"]


def shard_indices(t: torch.Tensor) -> list[torch.Tensor]:
    """Per dim of the global tensor, the global indices this rank's local shard holds along it
    (a local shard is their outer product). ``t``: a DTensor (Shard and strided-shard placements,
    applied in mesh-dim order as DTensor does) or a plain tensor (everything)."""
    idx = [torch.arange(n) for n in t.shape]
    if not isinstance(t, DTensor):
        return idx
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    for i, p in enumerate(t.placements):
        if isinstance(p, _StridedShard):
            local = torch.tensor(strided_shard_indices(p, len(idx[p.dim]), mesh.size(i), coord[i]), dtype=torch.long)
        elif isinstance(p, Shard):
            size, offset = p._local_shard_size_and_offset(len(idx[p.dim]), mesh.size(i), coord[i])
            local = torch.arange(offset, offset + size)
        else:
            continue
        idx[p.dim] = idx[p.dim][local]
    return idx


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def materialize_shards(module: nn.Module, inits: dict[str, Init], seed: int, device,
                       name_of=lambda name: name) -> None:
    """Give every tensor of ``module`` (all on the meta device, possibly laid out as DTensors,
    possibly FSDP2-sharded) storage on ``device`` and fill it: this rank's shard only, from
    ``inits`` (keyed by single-device name; ``name_of`` maps a laid-out name to it)."""
    materialize(module, inits, seed, device, name_of, local=_local, indices=shard_indices)
