"""How multi-head latent attention (:mod:`meshfold.models.mla`) lies on the folded mesh.

Legend as in :mod:`meshfold.models.mla` (h heads, rq / rkv latent ranks, dn / dr / dv head dims).

Its parameters' placements are :data:`meshfold.parallel.layouts.MLA_LAYOUT`.

**TP** (with sequence parallelism, as for GQA: the tp group's tokens are all-gathered before
attention and the output reduce-scattered after it, by :func:`meshfold.parallel.transformer.sequence_parallel`):

* the down projections to the latents, ``wq_a`` [H, rq] and ``wkv_a`` [H, rkv + dr], and the
  latent norms ``q_norm`` / ``kv_norm`` are **replicated** over tp: every tp rank computes the
  whole latent of the gathered tokens (rq + rkv + dr numbers per token, small beside the heads),
  and the shared rope key with it. Their gradients are each rank's heads' share: Partial over tp;
* the up projections ``wq_b`` [rq, h*(dn+dr)] (or the plain ``wq`` [H, h*(dn+dr)]) and
  ``wkv_b`` [rkv, h*(dn+dv)] are **column-parallel by head** (head-major columns, so a tp shard
  is h/tp whole heads), ``wo`` [h*dv, H] **row-parallel** (its rows are the heads' values).

**CP**: a ring (:func:`~meshfold.parallel.ring_attention.ring_attention` with an ``expand``
step, :class:`LatentContext`): each rank keeps its queries and what travels around ``cp`` is the
*latent* ``c_kv`` [rkv] plus the roped shared key ``k_pe`` [dr] per token, not the expanded K/V:
rkv + dr numbers a token against h / tp * (dn + dr + dv) (576 vs 40960 / tp for DeepSeek-V3, 72
times less traffic at tp = 1). Each rank expands every block it receives with its own heads of
``wkv_b`` (:meth:`~meshfold.models.mla.MLA.expand`), one block at a time, and the backward
recomputes that expansion per block and sends the latent's gradient home around the ring beside
the latent (as dK / dV travel for GQA). Cost: the expansion of S tokens per layer in the
forward and again in the backward (``2 * S * rkv * h*(dn+dv) / tp`` FLOPs each, a few percent
of attention at DeepSeek-V3's shape); memory: no [S/cp, S] mask or score tensor, at most one
block's expanded K/V at a time. Positions outside the load-balanced layout take the generic
path: the latent all-gathered over cp (:class:`LatentGather`, whose backward reduce-scatters
its gradient), expanded, masked by position, as for GQA.

**PP, FSDP2, DP**: nothing MLA-specific: blocks are cut into stages by
:mod:`meshfold.parallel.pipeline`, every dense weight above is sharded over ``dp x cp`` by FSDP2
(``fully_shard`` per block) on top of its tp placement, and gradients summed as for GQA.
**EP / ETP / EDP**: the MoE layers follow :data:`~meshfold.parallel.layouts.MOE_LAYOUT`
(routed experts over ep, their ffn over etp, replicas over edp; the router and its expert bias
replicated; the ungated shared experts a tp-split dense MLP on the attention mesh).
"""

from __future__ import annotations

from meshfold.models.attention import CausalMaskCache, attend
from meshfold.parallel import ring_attention as ring
from meshfold.placements import all_gather_v

__all__ = ["LatentContext", "LatentGather", "check_mla_fold"]


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


class LatentContext:
    """Context-parallel attention core for :class:`~meshfold.models.mla.MLA` (its ``context``
    hook): ring attention over ``cp`` with the latent travelling and ``expand`` per block when
    every cp rank's queries are in the load-balanced layout, decided by the cp ranks together
    (:func:`~meshfold.parallel.ring_attention.ring_applies`), else the generic path (the latent
    all-gathered, expanded, masked by position from the shared ``masks``). ``method = "gather"``
    forces the generic path, as for GQA's hook."""

    def __init__(self, mesh, cp: int, masks: CausalMaskCache, method: str = "ring"):
        self.mesh, self.cp, self.masks, self.method = mesh, cp, masks, method
        self.gather = LatentGather(mesh, cp)

    def __call__(self, q, c_kv, k_pe, positions, expand, wkv_b):
        """q [B, h, S, dn+dr], c_kv [B, 1, S, rkv], k_pe [B, 1, S, dr] -> o [B, h, S, dv]."""
        if self.method == "ring" and ring.ring_applies(positions, self.mesh, "cp"):
            return ring.ring_attention(q, c_kv, k_pe, self.mesh, "cp", expand=expand, weights=(wkv_b,))
        c_all, pe_all, k_pos = self.gather(c_kv, k_pe, positions)
        return attend(q, *expand(c_all, pe_all, wkv_b), positions, k_pos, self.masks)


def check_mla_fold(heads: int, tp: int) -> None:
    """MLA splits heads over tp (the latents are replicated, so their ranks need not divide)."""
    if heads % tp:
        raise ValueError(f"heads = {heads} is not divisible by tp = {tp} (MLA's wq_b / wkv_b columns and "
                         f"wo rows are split by head; valid tp: "
                         f"{[t for t in range(1, heads + 1) if heads % t == 0]})")
