"""How tensors are laid out over a mesh and moved: ragged placements and variable-size collectives.

* :class:`RaggedShard` / :class:`RaggedTensor`: per-rank variable sizes (routed tokens).
* :func:`all_to_all_v`, :func:`all_gather_v`, :func:`reduce_scatter_v`: autograd collectives over
  one named mesh dim; :func:`exchange_splits` learns receive counts (the one host sync).
* :func:`redistribute`: layout changes that keep the global tensor, including moves between the
  folded ``attn`` and ``moe`` views.
* :func:`dispatch` / :func:`combine`: the MoE token dispatch, rows in, a RaggedTensor of
  expert-major rows on the ``(ep, etp)`` mesh out, and back.
* :func:`local_view`: a DTensor parameter's local shard with Partial gradients, for single-device
  code applied to each rank's own tokens.

Layer: imports torch, ``meshfold.mesh`` and ``meshfold.runtime`` only (``tests/test_layers.py``).
"""

from meshfold.placements.collectives import (all_gather_v, all_to_all_v, exchange_splits, gather_equal,
                                             reduce_scatter_v, set_debug_checks, sum_in_place, sum_statistic)
from meshfold.placements.params import local_view, partial_grads
from meshfold.placements.ragged import RaggedShard, RaggedTensor, chunk_sizes
from meshfold.placements.redistribute import redistribute, resplit_sizes
from meshfold.placements.token_dispatch import Routed, combine, dispatch

__all__ = ["RaggedShard", "RaggedTensor", "Routed", "all_gather_v", "all_to_all_v", "chunk_sizes", "combine",
           "dispatch", "exchange_splits", "gather_equal", "local_view", "partial_grads", "reduce_scatter_v",
           "redistribute", "resplit_sizes", "set_debug_checks", "sum_in_place", "sum_statistic"]
