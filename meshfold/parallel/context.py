"""Context parallelism for grouped-query attention: the ``context`` hook a folded model's
:class:`~meshfold.models.attention.Attention` calls (MLA's is :mod:`meshfold.parallel.mla`).

Each cp rank holds chunks ``c`` and ``2cp - 1 - c`` of ``2cp`` equal chunks of every sequence
(:func:`meshfold.parallel.batch.local_positions`: causal load balance). Queries in that layout take
ring attention (:mod:`meshfold.parallel.ring_attention`: K/V blocks travel around ``cp``, no
[S/cp, S] mask exists); queries at other positions take the generic path, K/V all-gathered over
``cp`` (all-gather-v, whose backward reduce-scatters their gradients) and masked by position.
"""

from __future__ import annotations

from meshfold.models.attention import CausalMaskCache, attend
from meshfold.parallel import ring_attention as ring
from meshfold.placements import all_gather_v

__all__ = ["RingContext", "gather_positions"]


def gather_positions(pos, sizes, mesh, dim):
    if pos.dim() == 1:
        return all_gather_v(pos, sizes, mesh, dim)
    return all_gather_v(pos.transpose(0, 1).contiguous(), sizes, mesh, dim).transpose(0, 1)


class _KVGather:
    """Context-parallel hook for Attention: all-gather K/V (and positions) over ``cp``."""

    def __init__(self, mesh, cp: int):
        self.mesh, self.cp = mesh, cp

    def __call__(self, k, v, k_pos):
        sizes = [k.shape[2]] * self.cp

        def gather(t):  # [B, g, S, d] -> gather the S dim
            return all_gather_v(t.permute(2, 0, 1, 3).contiguous(), sizes, self.mesh, "cp").permute(1, 2, 0, 3)

        return gather(k), gather(v), gather_positions(k_pos, sizes, self.mesh, "cp")


class RingContext:
    """Context-parallel attention core (an attention module's ``context`` hook, set by a plan's
    ``context`` rule ``"ring"``): ``hook(q [B, h, S, d], k [B, g, S, d], v, positions) -> o [B, h,
    S, d]``, this rank's causal attention over every cp rank's keys. Ring attention over
    ``cp`` (:func:`~meshfold.parallel.ring_attention.ring_attention`) when the queries are in the
    load-balanced layout of :func:`local_positions`, else the generic path (K/V all-gathered,
    masked by position, one mask per forward from the shared ``masks``).

    Which path is decided by the cp ranks together, from every rank's positions (each sequence:
    that rank's two chunks, up to one offset per sequence), so all take the same collectives; it
    costs one all-reduce over ``cp`` and one host read per positions tensor, and positions that
    overlap across the cp ranks (a forward given none) are an error on every rank
    (:func:`~meshfold.parallel.ring_attention.ring_applies`). ``method = "gather"`` forces the
    generic path."""

    def __init__(self, mesh, cp: int, masks: CausalMaskCache, method: str = "ring"):
        self.mesh, self.cp, self.masks, self.method = mesh, cp, masks, method
        self.gather = _KVGather(mesh, cp)

    def __call__(self, q, k, v, positions):
        if self.method == "ring" and ring.ring_applies(positions, self.mesh, "cp"):
            return ring.ring_attention(q, k, v, self.mesh, "cp")
        k_all, v_all, k_pos = self.gather(k, v, positions)
        return attend(q, k_all, v_all, positions, k_pos, self.masks)
