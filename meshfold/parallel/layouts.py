"""Where every parameter of meshfold's models lies on the folded mesh: declarations only, as data.

Placements are per dim of a pipeline stage's view: ``(dp, cp, tp)`` of the attention mesh
(``attn``), ``(edp, ep, etp)`` of the MoE mesh (``moe``). Each rank applies its shard to its
own tokens, which differ along every dim, so a parameter replicated along a dim gets a partial
gradient there (:func:`meshfold.placements.partial_grads`). :func:`~meshfold.parallel.transformer.
parallelize` and :func:`~meshfold.parallel.moe.parallelize_moe` apply these tables; a layer of a
user's own passes a table that extends them (``{**MOE_LAYOUT, name: (view, placements)}``).

Names are single-device names (``model.named_parameters()`` before any layout), matched as
suffixes for the transformer's tables and exactly, relative to the layer, for an MoE layer.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard

__all__ = ["TRANSFORMER_LAYOUT", "MLA_LAYOUT", "MOE_LAYOUT", "MASK_LAYOUT", "OWN_GROUP_OVER_TP", "single_device_name"]

R = Replicate()

# parameter name suffix -> placements over attn (dp, cp, tp); every other dense parameter
# (embeddings, norms, q/k norms, head) is replicated
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

# multi-head latent attention (meshfold.models.mla), suffix -> placements over attn (dp, cp, tp)
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

# Modules of a block (single-device names within it) replicated over tp whose FSDP2 group is
# their own, all-gathered in the master dtype under mixed precision with tp > 1: their gradients
# are sums of tp shares, which FSDP2 adds in its param_dtype
# (meshfold.parallel.data_parallel.fully_shard_folded). Modules a block does not have are skipped.
OWN_GROUP_OVER_TP = ("attn_norm", "mlp_norm", "attn.q_norm", "attn.k_norm",
                     "attn.kv_norm", "attn.wq_a", "attn.wkv_a")  # the last three: MLA's latents


def single_device_name(name: str) -> str:
    """The single-device name of a parameter or module of a laid-out model (``parallelize`` adds
    ``parametrizations.<attr>.original`` and wraps TP modules in ``.inner``): the names these
    tables use."""
    return name.replace("parametrizations.", "").replace(".original", "").replace(".inner", "")
