"""Token dispatcher, local half: capacity and dropping, permute and unpermute.

Shapes: T = tokens, k = top-k, E = experts, N = routed (token, expert) pairs kept, H = hidden.

``permute`` orders the kept pairs expert-major, stable in token order (tokens of one expert are
contiguous, as the grouped GEMM wants); ``unpermute`` sums each token's expert outputs weighted by
its routing probabilities. The collective half (all-to-all-v over ``ep``, all-gather-v /
reduce-scatter-v over ``etp``) lives in :mod:`meshfold.models.moe_parallel`; on one device it is
the identity.

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
from torch.autograd.function import once_differentiable

from meshfold.kernels import cpu_grouped

__all__ = ["capacity", "drop_pairs", "gather_rows", "keep_mask", "permute", "scatter_rows", "scatter_rows_reference", "unpermute",
           "unpermute_reference", "Permuted"]


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


def drop_pairs(experts_TK: torch.Tensor, probs_TK: torch.Tensor, cfg, comm) -> tuple[torch.Tensor | None, int | None]:
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


def permute(x_TH, experts_TK, probs_TK, num_experts, keep_TK=None, pad_to=None) -> Permuted:
    """Group the kept (token, expert) pairs by expert, stable in token order.

    With ``pad_to`` (pad-to-capacity) every expert gets exactly ``pad_to`` rows, zero-filled, so
    split sizes are static and need no host sync.
    """
    T, k = experts_TK.shape
    e = experts_TK.reshape(-1)
    token = torch.arange(T, device=x_TH.device).repeat_interleave(k)
    p = probs_TK.reshape(-1)
    if keep_TK is not None:
        kept = keep_TK.reshape(-1)
        e, token, p = e[kept], token[kept], p[kept]
    order = torch.argsort(e, stable=True)
    e, token, p = e[order], token[order], p[order]
    counts_E = _counts(e, num_experts)
    x_NH = gather_rows(x_TH, token)
    if pad_to is None:
        if keep_TK is None:
            return Permuted(x_NH, counts_E, token, p, pair_N=order, probs_TK=probs_TK)
        return Permuted(x_NH, counts_E, token, p)
    # row r of expert e goes to slot e * pad_to + (r - start_e)
    start_E = torch.cumsum(counts_E, 0) - counts_E
    slot = e * pad_to + torch.arange(e.numel(), device=e.device) - start_E[e]
    n = num_experts * pad_to
    token_N = torch.full((n,), -1, dtype=token.dtype, device=token.device).index_copy(0, slot, token)
    probs_N = torch.zeros(n, dtype=p.dtype, device=p.device).index_copy(0, slot, p)
    x_NH = x_TH.new_zeros(n, x_TH.shape[1]).index_copy(0, slot, x_NH)
    return Permuted(x_NH, torch.full_like(counts_E, pad_to), token_N, probs_N)


def unpermute(y_NH: torch.Tensor, perm: Permuted, num_tokens: int) -> torch.Tensor:
    """``out[t] = sum over t's kept pairs of probs * y`` -> [T, H] in y's dtype.

    Dropless and unpadded (``perm.pair_N`` set), every token has exactly k rows: the fast path
    :class:`_CombineTopK` weights them in one batched ``[1, k] @ [k, H]`` per token in y's dtype
    (the weights rounded to it; bf16 GEMMs accumulate in fp32). Otherwise, and as the definition
    the fast path is tested against, :func:`unpermute_reference`.
    """
    if perm.pair_N is not None:
        return _CombineTopK.apply(y_NH, perm.probs_TK, perm.pair_N, perm.token_N)
    return unpermute_reference(y_NH, perm, num_tokens)


def unpermute_reference(y_NH: torch.Tensor, perm: Permuted, num_tokens: int) -> torch.Tensor:
    """The plain combine: weight every row, then add it into its token, in the wider of y's and
    the probabilities' dtypes (bf16 experts with an fp32 router: fp32; fp64 experts with an fp32
    router: fp64, never rounding y down to fp32), rounded to y's dtype at the end."""
    y = y_NH
    dtype = torch.promote_types(y.dtype, perm.probs_N.dtype)
    # Padding rows carry weight 0 and an all-zero expert output; sending them to token 0 avoids
    # a data-dependent filter (a host sync).
    token = perm.token_N.clamp(min=0)
    weighted = y.to(dtype) * perm.probs_N.to(dtype).unsqueeze(-1)
    out = weighted.new_zeros(num_tokens, y.shape[1])
    return out.index_add(0, token, weighted).to(y.dtype)


def gather_rows(x_TH: torch.Tensor, token_N: torch.Tensor) -> torch.Tensor:
    """``x_TH[token_N]`` [N, H] whose backward adds the rows back with ``index_add`` (fp32
    accumulation for bf16) instead of autograd's ``index_put(accumulate=True)``, 4-14x slower.
    On CPU the ``index_add`` runs on one thread (:func:`scatter_rows`)."""
    return _GatherRows.apply(x_TH, token_N)


def scatter_rows(g_NH: torch.Tensor, token_N: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """dx [T, H] with ``dx[t] = sum of g_NH[n] over token_N[n] == t``: gather_rows' backward.

    On CPU it runs single-threaded (:func:`meshfold.kernels.cpu_grouped.single_threaded`): the
    parallel ``index_add_`` kernel forks and joins its threads ~20 times per call and stalls on
    every join when the cores are shared. Same values as :func:`scatter_rows_reference`.
    """
    return _serial(scatter_rows_reference, g_NH, token_N, num_tokens)


def scatter_rows_reference(g_NH: torch.Tensor, token_N: torch.Tensor, num_tokens: int) -> torch.Tensor:
    return g_NH.new_zeros(num_tokens, g_NH.shape[1]).index_add_(0, token_N, g_NH)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, token_N):
        ctx.save_for_backward(token_N)
        ctx.num_tokens = x_TH.shape[0]
        return x_TH.index_select(0, token_N)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_NH):
        (token_N,) = ctx.saved_tensors
        return scatter_rows(g_NH, token_N, ctx.num_tokens), None


class _CombineTopK(torch.autograd.Function):
    """out [T, H] = probs_TK [T, 1, k] @ y_TKH [T, k, H], in y's dtype, where y_TKH are the expert
    rows of each token (token-major, gathered from the expert-major y_NH).

    Never builds y_TKH whole: it works in parts of ~``COMBINE_ROWS`` rows (a few MB, kept in
    cache), each gathering its tokens' rows (``index_select`` by ``row_P``, the inverse of
    ``pair_N``) and reducing them with a batched ``[1, k] @ [k, H]``. Saves only y_NH (the
    experts' output, no copy). The backward goes the other way, in expert-major parts: it gathers
    dout for each row once and takes both the row's gradient (times its weight) and the weight's
    gradient (a dot product with the row, ``linalg.vecdot``; in bf16 each product is rounded
    before the fp32 sum: 2.4e-3 relative rms error against fp64 where a bmm has 1.7e-3, at half
    the time) from it. In bf16 the weights are rounded to bf16 (bf16 GEMMs accumulate in fp32).

    On CPU the parts run on the expert-GEMM pool (:func:`cpu_grouped.run_tasks`: one intra-op
    thread per worker, one join per pass, so no OpenMP fork/join per op); elsewhere a pass is one
    part. Every output element is written by one part, so results do not depend on the split.
    """

    @staticmethod
    def forward(ctx, y_NH, probs_TK, pair_N, token_N):
        y, p_TK = y_NH.detach(), probs_TK.detach().to(y_NH.dtype)
        # the row of each token-major pair: the inverse permutation of pair_N
        row_P = torch.empty_like(pair_N).index_copy_(0, pair_N, torch.arange(pair_N.numel(), device=pair_N.device))
        out_TH = _combine_forward(y, p_TK, row_P)
        ctx.save_for_backward(y, p_TK, pair_N, token_N)
        ctx.probs_dtype = probs_TK.dtype
        return out_TH

    @staticmethod
    @once_differentiable
    def backward(ctx, dout_TH):
        y, p_TK, pair_N, token_N = ctx.saved_tensors
        return _combine_backward(dout_TH.contiguous(), y, p_TK, pair_N, token_N, ctx.probs_dtype,
                                 ctx.needs_input_grad[0], ctx.needs_input_grad[1]) + (None, None)


COMBINE_ROWS = 1024  # expert rows per part of the combine: ~2-4 MB of y at H = 512-1024


def _serial(fn, *args):
    """fn(*args), on one thread when the tensors are on the CPU (see cpu_grouped.single_threaded)."""
    if args[0].device.type == "cpu":
        return cpu_grouped.single_threaded(fn, *args)
    return fn(*args)


def _combine_forward(y_NH, p_TK, row_P):
    T, k = p_TK.shape
    out_TH = y_NH.new_empty((T, y_NH.shape[1]))

    def part(t0, t1):
        y_bKH = y_NH.index_select(0, row_P[t0 * k:t1 * k]).view(t1 - t0, k, -1)
        torch.bmm(p_TK[t0:t1].unsqueeze(1), y_bKH, out=out_TH[t0:t1].unsqueeze(1))

    cpu_grouped.in_parts(part, T, COMBINE_ROWS // k, y_NH.device)
    return out_TH


def _combine_backward(dout_TH, y_NH, p_TK, pair_N, token_N, probs_dtype, need_dy, need_dprobs):
    """Row by row, expert-major: g = dout[token_n] (gathered once), dprobs of the row's pair =
    y_n . g (a dot product; a [k, H] @ [H, 1] bmm per token is 2x slower on CPU), dy_n = g p_n."""
    T, k = p_TK.shape
    N = pair_N.numel()
    dy_NH = y_NH.new_empty(y_NH.shape) if need_dy else None
    dprobs_N = y_NH.new_empty(N) if need_dprobs else None
    p_N = p_TK.reshape(-1)[pair_N] if need_dy else None

    def part(n0, n1):
        g = torch.index_select(dout_TH, 0, token_N[n0:n1], out=dy_NH[n0:n1] if need_dy else None)
        if need_dprobs:
            torch.linalg.vecdot(y_NH[n0:n1], g, out=dprobs_N[n0:n1])
        if need_dy:
            g.mul_(p_N[n0:n1].unsqueeze(1))

    cpu_grouped.in_parts(part, N, COMBINE_ROWS, y_NH.device)
    dprobs_TK = None
    if need_dprobs:
        dprobs_TK = torch.empty(T * k, dtype=probs_dtype, device=y_NH.device).index_copy_(
            0, pair_N, dprobs_N.to(probs_dtype)).view(T, k)
    return dy_NH, dprobs_TK
