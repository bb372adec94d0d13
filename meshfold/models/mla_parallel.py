"""How multi-head latent attention (:mod:`meshfold.models.mla`) lies on the folded mesh.

Legend as in :mod:`meshfold.models.mla` (h heads, rq / rkv latent ranks, dn / dr / dv head dims).

**TP** (with sequence parallelism, as for GQA: the tp group's tokens are all-gathered before
attention and the output reduce-scattered after it, by ``transformer_parallel._TensorParallel``):

* the down projections to the latents, ``wq_a`` [H, rq] and ``wkv_a`` [H, rkv + dr], and the
  latent norms ``q_norm`` / ``kv_norm`` are **replicated** over tp: every tp rank computes the
  whole latent of the gathered tokens (rq + rkv + dr numbers per token, small beside the heads),
  and the shared rope key with it. Their gradients are each rank's heads' share: Partial over tp;
* the up projections ``wq_b`` [rq, h*(dn+dr)] (or the plain ``wq`` [H, h*(dn+dr)]) and
  ``wkv_b`` [rkv, h*(dn+dv)] are **column-parallel by head** (head-major columns, so a tp shard
  is h/tp whole heads), ``wo`` [h*dv, H] **row-parallel** (its rows are the heads' values).

**CP**: the keys a rank's queries need are gathered over cp as the *latent* ``c_kv`` [rkv] plus
the roped shared key ``k_pe`` [dr] per token (:class:`LatentGather`), not as expanded K/V: that
is rkv + dr numbers a token against h * (dn + dr + dv) (576 vs 40960 for DeepSeek-V3; 72 times
less traffic and gathered memory), at the cost of each rank expanding the gathered latent with
its heads of ``wkv_b`` (S tokens instead of S / cp: an extra ``2 * S * rkv * h*(dn+dv) / tp``
FLOPs per layer, a few percent of attention at DeepSeek-V3's shape). The backward of the
all-gather reduce-scatters the latent's gradient. Positions are gathered with it; the mask is
by position, as for GQA.

**PP, FSDP2, DP**: nothing MLA-specific: blocks are cut into stages by
:mod:`meshfold.models.pipeline`, every dense weight above is sharded over ``dp x cp`` by FSDP2
(``fully_shard`` per block) on top of its tp placement, and gradients summed as for GQA.
**EP / ETP / EDP**: the MoE layers follow :data:`~meshfold.models.moe_parallel.MOE_LAYOUT`
(routed experts over ep, their ffn over etp, replicas over edp; the router and its expert bias
replicated; the ungated shared experts a tp-split dense MLP on the attention mesh).
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard

from meshfold.placements import all_gather_v

__all__ = ["MLA_LAYOUT", "LatentGather", "check_mla_fold"]

R = Replicate()

# parameter name suffix -> placements over attn (dp, cp, tp)
MLA_LAYOUT = {
    "attn.wq_a": (R, R, R),  # down to the q latent: replicated over tp
    "attn.q_norm.weight": (R, R, R),
    "attn.wq_b": (R, R, Shard(1)),  # up from the q latent: columns = heads
    "attn.wkv_a": (R, R, R),  # down to the kv latent + shared rope key: replicated over tp
    "attn.kv_norm.weight": (R, R, R),
    "attn.wkv_b": (R, R, Shard(1)),  # up from the kv latent: columns = heads (nope key, value)
    # attn.wq (no q latent): columns = heads, attn.wo: rows = heads, as TRANSFORMER_LAYOUT says
}


class LatentGather:
    """Context-parallel hook for :class:`~meshfold.models.mla.MLA`: all-gather the kv latent
    ``c_kv`` [B, 1, S, rkv], the roped key ``k_pe`` [B, 1, S, dr] and the positions over ``cp``."""

    def __init__(self, mesh, cp: int):
        self.mesh, self.cp = mesh, cp

    def __call__(self, c_kv, k_pe, k_pos):
        sizes = [c_kv.shape[2]] * self.cp

        def gather(t):  # [B, 1, S, d] -> [B, 1, cp*S, d]
            return all_gather_v(t.permute(2, 0, 1, 3).contiguous(), sizes, self.mesh, "cp").permute(1, 2, 0, 3)

        if k_pos.dim() == 1:
            pos = all_gather_v(k_pos, sizes, self.mesh, "cp")
        else:
            pos = all_gather_v(k_pos.transpose(0, 1).contiguous(), sizes, self.mesh, "cp").transpose(0, 1)
        return gather(c_kv), gather(k_pe), pos


def check_mla_fold(heads: int, tp: int) -> None:
    """MLA splits heads over tp (the latents are replicated, so their ranks need not divide)."""
    if heads % tp:
        raise ValueError(f"heads = {heads} is not divisible by tp = {tp} (MLA's wq_b / wkv_b columns and "
                         f"wo rows are split by head; valid tp: "
                         f"{[t for t in range(1, heads + 1) if heads % t == 0]})")
