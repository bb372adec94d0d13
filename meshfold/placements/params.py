"""How single-device code sees a DTensor parameter: its local shard, with Partial gradients.

Every rank of a folded layer applies its shard of a parameter to *its own* tokens, which differ
along every non-pp mesh dim (batch over dp, sequence over cp and tp). Along a dim where the
parameter is replicated, each rank's gradient is therefore one summand of the true gradient:
the local view is taken with ``to_local(grad_placements=...)`` marking those dims ``Partial()``,
so the gradients come back as Partial DTensors and a data-parallel reduction (or
``full_tensor()``) sums them.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

__all__ = ["partial_grads", "local_view"]


def partial_grads(placements: Sequence) -> tuple:
    """The gradient placements of a parameter laid out as ``placements`` and applied to
    different tokens on every rank: ``Partial()`` where it is replicated, its own elsewhere."""
    return tuple(Partial() if isinstance(p, Replicate) else p for p in placements)


def local_view(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of DTensor ``p`` (a plain tensor passes through), whose gradient
    flows back with :func:`partial_grads` placements."""
    if not isinstance(p, DTensor):
        return p
    return p.to_local(grad_placements=partial_grads(p.placements))
