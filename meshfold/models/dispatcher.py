"""Token dispatcher, local half: capacity and dropping, permute and unpermute.

Shapes: T = tokens, k = top-k, E = experts, N = routed (token, expert) pairs kept, H = hidden.

``permute`` orders the kept pairs expert-major, stable in token order (tokens of one expert are
contiguous, as the grouped GEMM wants); ``unpermute`` sums each token's expert outputs weighted by
its routing probabilities; how their rows move is :mod:`meshfold.kernels.combine`. The
collective half (all-to-all-v over ``ep``, all-gather-v / reduce-scatter-v over ``etp``) is
:func:`meshfold.placements.dispatch`; on one device it is the identity.

Dropping (``capacity_factor`` set): an expert keeps at most ``capacity = ceil(cf * T * k / E)``
pairs of the token set that decides (this rank's tokens for sub-sequence dropping, the DP rank's
whole micro-batch for full-sequence dropping). Policy ``probs`` keeps the highest routing weights
(ties to the earlier token), ``position`` the earliest tokens (deterministic). "Earlier" is the
order of the deciding token set: a rank's local order for sub-sequence dropping, and for
full-sequence dropping the (cp, tp) rank-major order of the gathered tokens, which with
load-balanced CP chunks is not the order within the sequence. Dropped pairs
contribute nothing; a token whose every pair is dropped outputs zero (plus shared experts).
"""

from __future__ import annotations

import math
from fractions import Fraction
from dataclasses import dataclass

import torch

from meshfold.kernels import combine_reference, combine_topk, gather_rows, serial_graph
from meshfold.kernels.combine import inverse_order

__all__ = ["capacity", "drop_pairs", "keep_mask", "permute", "unpermute", "unpermute_reference", "Permuted"]


def capacity(num_tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """Pairs one expert may keep: ``ceil(capacity_factor * tokens * k / E)``, in exact arithmetic
    (``1.1 * 25 * 4 / 2`` is 55.000000000000007 in floats, which would round up to 56)."""
    cf = Fraction(str(capacity_factor)) if isinstance(capacity_factor, float) else Fraction(capacity_factor)
    return math.ceil(cf * num_tokens * topk / num_experts)


def keep_mask(experts_TK: torch.Tensor, probs_TK: torch.Tensor, num_experts: int, cap: int,
              policy: str) -> torch.Tensor:
    """Bool [T, k]: which pairs survive when each expert keeps at most ``cap`` of them."""
    T, k = experts_TK.shape
    e = experts_TK.reshape(-1)
    n = e.numel()
    position = torch.arange(n, device=e.device)  # token-major, so earlier tokens first
    if policy == "probs":
        # order by (expert, -prob, position) with stable sorts from the least significant key
        order = torch.argsort(-probs_TK.reshape(-1).detach(), stable=True)
    else:
        order = position
    order = order[torch.argsort(e[order], stable=True)]
    counts_E = _counts(e, num_experts)
    start_E = torch.cumsum(counts_E, 0) - counts_E
    rank_in_expert = torch.empty_like(position)
    rank_in_expert[order] = position - start_E[e[order]]
    return (rank_in_expert < cap).reshape(T, k)


def drop_pairs(experts_TK: torch.Tensor, probs_TK: torch.Tensor, cfg,
               comm) -> tuple[torch.Tensor | None, int | None]:
    """(keep_TK bool [T, k] or None when dropless, rows per expert to pad to or None) under the
    layer's config: sub-sequence dropping decides on this rank's tokens, full-sequence dropping on
    the DP rank's tokens, gathered over attn (cp, tp) with ``comm.gather_tokens``."""
    if cfg.capacity_factor is None:
        return None, None
    T, k = experts_TK.shape
    if cfg.drop_scope == "sub_sequence":
        cap = capacity(T, k, cfg.num_experts, cfg.capacity_factor)
        keep = keep_mask(experts_TK, probs_TK, cfg.num_experts, cap, cfg.drop_policy)
    else:
        both = torch.cat([experts_TK.to(probs_TK.dtype), probs_TK.detach()], dim=1)
        group, offset = comm.gather_tokens(both, ("cp", "tp"))
        g_experts, g_probs = group[:, :k].long(), group[:, k:]
        cap = capacity(group.shape[0], k, cfg.num_experts, cfg.capacity_factor)
        keep = keep_mask(g_experts, g_probs, cfg.num_experts, cap, cfg.drop_policy)[offset:offset + T]
    return keep, (cap if cfg.pad_to_capacity else None)


def _counts(e: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows per expert. A scatter-add, not ``bincount``, which reads its input's max on the
    host (a device sync on CUDA)."""
    return torch.zeros(num_experts, dtype=torch.int64, device=e.device).scatter_add_(0, e, torch.ones_like(e))


@dataclass
class Permuted:
    """Expert-major rows and what is needed to put them back.

    ``x_NH`` rows grouped by expert; ``counts_E`` rows per expert; ``token_N`` source token of each
    row (-1 for padding); ``probs_N`` routing weight of each row (0 for padding). Dropless and
    unpadded, every token owns exactly k rows: ``pair_N`` then holds each row's token-major pair
    index (``t * k + j``) and ``probs_TK`` the weights, so unpermute can put the rows back with a
    plain gather and one batched weighted sum instead of a serial scatter-add.
    """

    x_NH: torch.Tensor
    counts_E: torch.Tensor
    token_N: torch.Tensor
    probs_N: torch.Tensor
    pair_N: torch.Tensor | None = None
    probs_TK: torch.Tensor | None = None
    row_TK: torch.Tensor | None = None  # fused: the row of each token-major pair (kernels.combine)
    # the counts as read on the host to cut the kept rows (dropping, unpadded): what
    # ``read_counts`` returned, for the dispatch of the same counts to take instead of reading again
    counts_read: object | None = None

    @property
    def fused(self) -> bool:
        """Whether the dropless row passes run as compiled loops (:mod:`meshfold.kernels.combine`)."""
        return self.row_TK is not None


def _expert_order(experts_TK, probs_TK, keep_TK, num_experts):
    """(order [T*k], expert, token and weight of each sorted pair, sort key, counts_E [E]): the
    pairs sorted by expert, stably (so in token order within an expert), dropped pairs last."""
    k = experts_TK.shape[1]
    e = experts_TK.reshape(-1)
    key = e if keep_TK is None else torch.where(keep_TK.reshape(-1), e, num_experts)  # dropped: E
    order = torch.argsort(key, stable=True)
    counts_E = _counts(key, num_experts + 1)[:num_experts]
    return order, e[order], order.div(k, rounding_mode="floor"), probs_TK.reshape(-1)[order], key, counts_E


def permute(x_TH, experts_TK, probs_TK, num_experts, keep_TK=None, pad_to=None, read_counts=None,
            fused: bool = False) -> Permuted:
    """Group the kept (token, expert) pairs by expert, stable in token order.

    Dropped pairs are sorted behind the kept ones (sort key E) rather than filtered out with a
    boolean mask, whose data-dependent shape would cost a host sync. Without padding the kept
    rows are then the first ``sum(counts_E)``: ``read_counts(counts_E)`` reads the counts on the
    host and returns an object whose ``rows_sent`` is that number (the layer's comm, which reads
    the dispatch's counts with it: its one host read; the result is returned as
    ``Permuted.counts_read`` for the dispatch; None: ``int(counts_E.sum())``). With ``pad_to`` (pad-to-capacity) every expert gets exactly
    ``pad_to`` rows, zero-filled, so the number of rows is static and nothing is read.
    The sort keys and counts are small [T*k] ops, run on one thread (:func:`serial_graph`).
    ``fused`` (dropless, unpadded): the gather's backward and the combine run as compiled
    one-pass loops (:mod:`meshfold.kernels.combine`, ``train.compile``).
    """
    T, k = experts_TK.shape
    order, e, token, p, key, counts_E = serial_graph(
        lambda e_, p_, keep: _expert_order(e_, p_, keep, num_experts), experts_TK, probs_TK, keep_TK)
    if pad_to is None:
        if keep_TK is None:
            row_TK = inverse_order(order).view(T, k) if fused else None
            return Permuted(gather_rows(x_TH, token, row_TK), counts_E, token, p, pair_N=order,
                            probs_TK=probs_TK, row_TK=row_TK)
        read = None if read_counts is None else read_counts(counts_E)
        n = int(counts_E.sum()) if read is None else read.rows_sent
        token, p = token[:n], p[:n]
        return Permuted(gather_rows(x_TH, token), counts_E, token, p, counts_read=read)
    # kept row r of expert e goes to slot e * pad_to + (r - start_e); dropped pairs to slot n,
    # one past the end, which is cut off
    n = num_experts * pad_to
    start_E = torch.cumsum(counts_E, 0) - counts_E
    slot = e * pad_to + torch.arange(e.numel(), device=e.device) - start_E[e]
    slot = torch.where(key[order] < num_experts, slot, n)
    token_N = torch.full((n + 1,), -1, dtype=token.dtype, device=token.device).index_copy(0, slot, token)[:n]
    probs_N = torch.zeros(n + 1, dtype=p.dtype, device=p.device).index_copy(0, slot, p)[:n]
    if T == 0:  # nothing to gather from (and n = 0 for any capacity of zero tokens)
        return Permuted(x_TH.new_zeros(n, x_TH.shape[1]), torch.full_like(counts_E, pad_to), token_N, probs_N)
    x_NH = gather_rows(x_TH, token_N.clamp(min=0)).masked_fill((token_N < 0).unsqueeze(1), 0)  # padding: 0
    return Permuted(x_NH, torch.full_like(counts_E, pad_to), token_N, probs_N)


def unpermute(y_NH: torch.Tensor, perm: Permuted, num_tokens: int) -> torch.Tensor:
    """``out[t] = sum over t's kept pairs of probs * y`` -> [T, H] in y's dtype.

    Dropless and unpadded (``perm.pair_N`` set), every token has exactly k rows: the fast path
    :func:`~meshfold.kernels.combine_topk` weights them in one batched ``[1, k] @ [k, H]`` per
    token in y's dtype (the weights rounded to it; bf16 GEMMs accumulate in fp32). Otherwise, and
    as the definition the fast path is tested against, :func:`unpermute_reference`.
    """
    if perm.pair_N is not None:
        return combine_topk(y_NH, perm.probs_TK, perm.pair_N, perm.token_N, perm.row_TK)
    return unpermute_reference(y_NH, perm, num_tokens)


def unpermute_reference(y_NH: torch.Tensor, perm: Permuted, num_tokens: int) -> torch.Tensor:
    """The plain combine (:func:`~meshfold.kernels.combine_reference`) of a Permuted."""
    return combine_reference(y_NH, perm.token_N, perm.probs_N, num_tokens)
