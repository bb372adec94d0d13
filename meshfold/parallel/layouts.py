"""Where every parameter of meshfold's models lies on the folded mesh: declarations only, as data.

Placements are per dim of a pipeline stage's view: ``(dp, cp, tp)`` of the attention mesh
(``attn``), ``(edp, ep, etp)`` of the MoE mesh (``moe``). Each rank applies its shard to its
own tokens, which differ along every dim, so a parameter replicated along a dim gets a partial
gradient there (:func:`meshfold.placements.partial_grads`). :func:`~meshfold.parallel.transformer.
parallelize` and :func:`~meshfold.parallel.moe.parallelize_moe` apply these tables; a layer of a
user's own passes a table that extends them (``{**MOE_LAYOUT, name: (view, placements)}``).

Names are single-device names (``model.named_parameters()`` before any layout), relative to a
block for the transformer's tables (:func:`meshfold.parallel.transformer_plan.transformer_plan` turns
them into a :class:`~meshfold.parallel.plan.Plan`) and to the layer for an MoE layer's.
"""

from __future__ import annotations

import re

from torch.distributed.tensor import Replicate, Shard

__all__ = ["TRANSFORMER_LAYOUT", "MLA_LAYOUT", "MOE_LAYOUT", "MASK_LAYOUT", "single_device_name"]

R = Replicate()

# parameter name within a block -> placements over attn (dp, cp, tp); every other dense parameter
# (embeddings, norms, q/k norms, head) is replicated (transformer_plan)
TRANSFORMER_LAYOUT = {
    "attn.wq": (R, R, Shard(1)),  # columns = query heads
    "attn.wk": (R, R, Shard(1)),
    "attn.wv": (R, R, Shard(1)),
    "attn.bq": (R, R, Shard(0)),
    "attn.bk": (R, R, Shard(0)),
    "attn.bv": (R, R, Shard(0)),
    "attn.wo": (R, R, Shard(0)),  # rows = query heads
    "mlp.w_gate_up": (R, R, Shard(2)),  # dense MLP ffn over tp
    "mlp.w_down": (R, R, Shard(0)),
}

# multi-head latent attention (meshfold.models.mla), name within a block -> placements over attn (dp, cp, tp)
MLA_LAYOUT = {
    "attn.wq_a.weight": (R, R, R),  # down to the q latent: replicated over tp
    "attn.q_norm.weight": (R, R, R),
    "attn.wq_b": (R, R, Shard(1)),  # up from the q latent: columns = heads
    "attn.wkv_a.weight": (R, R, R),  # down to the kv latent + shared rope key: replicated over tp
    "attn.kv_norm.weight": (R, R, R),
    "attn.wkv_b": (R, R, Shard(1)),  # up from the kv latent: columns = heads (nope key, value)
    # attn.wq (no q latent): columns = heads, attn.wo: rows = heads, as TRANSFORMER_LAYOUT says
}

# MoE layer parameter (name within the layer) -> (view, placements over that view's three dims)
MOE_LAYOUT = {
    "router.weight": ("attn", (R, R, R)),  # every rank routes its own tokens
    "experts.w_gate_up": ("moe", (R, Shard(0), Shard(3))),  # experts over ep, ffn over etp
    "experts.w_down": ("moe", (R, Shard(0), Shard(1))),
    "shared.w_gate_up": ("attn", (R, R, Shard(2))),  # column-parallel over tp
    "shared.w_down": ("attn", (R, R, Shard(0))),  # row-parallel over tp
    "shared.gate": ("attn", (R, R, R)),  # applied to each rank's tokens
}

# tile masks are buffers, sliced like their weights: experts over ep, this dim over etp
MASK_LAYOUT = {"experts.mask_gate_up": 3, "experts.mask_down": 1}


def single_device_name(name: str) -> str:
    """The single-device name of a parameter or module of a laid-out model: ``parallelize``
    registers each parameter as a parametrization, which moves ``<module>.<attr>`` to
    ``<module>.parametrizations.<attr>.original``; every other name stays as it was."""
    return _PARAMETRIZED.sub(r"\1", name)


_PARAMETRIZED = re.compile(r"(?:^|(?<=\.))parametrizations\.([^.]+)\.original(?=$|\.)")
