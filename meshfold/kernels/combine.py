"""Moving expert rows between token-major and expert-major order, on every device.

Legend: T = tokens, k = top-k, N = expert-major rows, H = hidden.

* :func:`gather_rows`: ``x_TH[token_N]``, the permute's gather, with a backward that adds rows
  back with ``index_add`` (on one thread on CPU: :func:`scatter_rows`); plain reference
  :func:`scatter_rows_reference`.
* :func:`combine_topk`: the dropless combine, each token's k expert rows weighted and summed in
  one batched ``[1, k] @ [k, H]``, in parts of ~``COMBINE_ROWS`` rows on the CPU pool
  (:mod:`.cpu_pool`), as one part elsewhere; plain reference :func:`combine_reference` (a
  weighted ``index_add``), which also serves dropping and padding.
* ``fused=True`` (both, dropless and unpadded, plain CPU tensors; ``train.compile`` asks for it):
  each row pass is one ``torch.compile``-generated loop instead of a chain of ATen ops: the
  combine's forward and the permute's backward sum each token's k rows in one pass
  (:func:`sum_topk_rows`), the combine's backward gathers dout once and writes dy and the weight
  gradients from it in one pass (:func:`combine_grads`). Same values as the eager path up to the
  order of a sum (fp64: ~1e-16 relative; the tests compare them).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from meshfold.kernels.compiled import compiled
from meshfold.kernels.cpu_pool import in_parts, plain_cpu, serial

__all__ = ["COMBINE_ROWS", "combine_grads", "combine_reference", "combine_topk", "gather_rows",
           "inverse_order", "scatter_rows", "scatter_rows_reference", "sum_topk_rows"]


def gather_rows(x_TH: torch.Tensor, token_N: torch.Tensor, row_TK: torch.Tensor | None = None) -> torch.Tensor:
    """``x_TH[token_N]`` [N, H] whose backward adds the rows back with ``index_add`` (fp32
    accumulation for bf16) instead of autograd's slower ``index_put(accumulate=True)``.
    On CPU the ``index_add`` runs on one thread (:func:`scatter_rows`).

    ``row_TK`` (dropless, every token sent to exactly k rows): the row of each of a token's k
    pairs (:func:`inverse_order` of the pairs' expert-major order); given for plain CPU tensors,
    the backward sums each token's k rows in one compiled pass (:func:`sum_topk_rows`) instead."""
    return _GatherRows.apply(x_TH, token_N, row_TK)


def inverse_order(order_N: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[order_N[n]] = n``: where each token-major pair went in expert-major order."""
    return torch.empty_like(order_N).index_copy_(0, order_N, torch.arange(order_N.numel(), device=order_N.device))


def _use_fused(row_TK, *tensors) -> bool:
    return row_TK is not None and plain_cpu(*tensors)


def sum_topk_rows(y_NH: torch.Tensor, row_TK: torch.Tensor, w_TK: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, H] = sum over j of ``w_TK[t, j] * y_NH[row_TK[t, j]]`` (no weights: a plain sum), in
    y's dtype, written as k gathered rows added up so that the compiler makes it one loop over
    the output (each output row read from its k source rows once, accumulated in registers, in
    fp32 for bf16). The combine's forward (weighted) and the permute's backward (unweighted)."""
    k = row_TK.shape[1]
    out = y_NH[row_TK[:, 0]] if w_TK is None else y_NH[row_TK[:, 0]] * w_TK[:, :1]
    for j in range(1, k):
        out = out + (y_NH[row_TK[:, j]] if w_TK is None else y_NH[row_TK[:, j]] * w_TK[:, j:j + 1])
    return out


def combine_grads(dout_TH: torch.Tensor, token_N: torch.Tensor, y_NH: torch.Tensor,
                  p_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy [N, H], dprobs [N]) of the combine ``out[token_n] += p_n y_n``: ``g = dout[token_n]``,
    ``dy_n = p_n g``, ``dprobs_n = y_n . g``, for the compiler to make one pass over the rows
    (g is never stored)."""
    g = dout_TH[token_N]
    return g * p_N.unsqueeze(1), (g * y_NH).sum(-1)


def scatter_rows(g_NH: torch.Tensor, token_N: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """dx [T, H] with ``dx[t] = sum of g_NH[n] over token_N[n] == t``: gather_rows' backward.

    On CPU it runs single-threaded (:func:`.cpu_pool.single_threaded`): the parallel
    ``index_add_`` kernel forks and joins its threads many times per call and stalls on every
    join when the cores are shared. Same values as :func:`scatter_rows_reference`.
    """
    return serial(scatter_rows_reference, g_NH, token_N, num_tokens)


def scatter_rows_reference(g_NH: torch.Tensor, token_N: torch.Tensor, num_tokens: int) -> torch.Tensor:
    return g_NH.new_zeros(num_tokens, g_NH.shape[1]).index_add_(0, token_N, g_NH)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, token_N, row_TK):
        ctx.save_for_backward(token_N, row_TK)
        ctx.num_tokens = x_TH.shape[0]
        return x_TH.index_select(0, token_N)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_NH):
        token_N, row_TK = ctx.saved_tensors
        if _use_fused(row_TK, g_NH, token_N) and ctx.num_tokens:
            return compiled(sum_topk_rows)(g_NH.contiguous(), row_TK), None, None
        return scatter_rows(g_NH, token_N, ctx.num_tokens), None, None


def combine_topk(y_NH: torch.Tensor, probs_TK: torch.Tensor, pair_N: torch.Tensor,
                 token_N: torch.Tensor, row_TK: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, H] = sum over each token's k rows of probs * y, in y's dtype: the dropless combine.

    ``y_NH`` expert-major rows, ``probs_TK`` the routing weights, ``pair_N`` each row's
    token-major pair index (``t * k + j``), ``token_N`` each row's token. Same values as
    :func:`combine_reference` (to y's rounding of the weights in bf16). ``row_TK`` (as for
    :func:`gather_rows`, the inverse of ``pair_N``): given for plain CPU tensors, both passes run
    as compiled loops (:func:`sum_topk_rows`, :func:`combine_grads`).
    """
    return _CombineTopK.apply(y_NH, probs_TK, pair_N, token_N, row_TK)


def combine_reference(y_NH: torch.Tensor, token_N: torch.Tensor, probs_N: torch.Tensor,
                      num_tokens: int) -> torch.Tensor:
    """The plain combine: weight every row, then add it into its token, in the wider of y's and
    the probabilities' dtypes (bf16 experts with an fp32 router: fp32; fp64 experts with an fp32
    router: fp64, never rounding y down to fp32), rounded to y's dtype at the end. Rows with
    token -1 (padding) must carry weight 0."""
    dtype = torch.promote_types(y_NH.dtype, probs_N.dtype)
    # Padding rows carry weight 0 and an all-zero expert output; sending them to token 0 avoids
    # a data-dependent filter (a host sync).
    token = token_N.clamp(min=0)
    weighted = y_NH.to(dtype) * probs_N.to(dtype).unsqueeze(-1)
    out = weighted.new_zeros(num_tokens, y_NH.shape[1])
    return out.index_add(0, token, weighted).to(y_NH.dtype)


class _CombineTopK(torch.autograd.Function):
    """out [T, H] = probs_TK [T, 1, k] @ y_TKH [T, k, H], in y's dtype, where y_TKH are the expert
    rows of each token (token-major, gathered from the expert-major y_NH).

    Never builds y_TKH whole: it works in parts of ~``COMBINE_ROWS`` rows (a few MB, kept in
    cache), each gathering its tokens' rows (``index_select`` by ``row_P``, the inverse of
    ``pair_N``) and reducing them with a batched ``[1, k] @ [k, H]``. Saves only y_NH (the
    experts' output, no copy). The backward goes the other way, in expert-major parts: it gathers
    dout for each row once and takes both the row's gradient (times its weight) and the weight's
    gradient (a dot product with the row, ``linalg.vecdot``: cheaper than a bmm, with a slightly
    larger rounding error in bf16, where each product is rounded before the fp32 sum) from it.
    In bf16 the weights are rounded to bf16 (bf16 GEMMs accumulate in fp32).

    On CPU the parts run on the CPU pool (:func:`.cpu_pool.run_tasks`: one intra-op thread per
    worker, one join per pass, so no OpenMP fork/join per op); elsewhere (CUDA: no Triton kernel
    of its own) a pass is one part. Every output element is written by one part, so results do
    not depend on the split.
    """

    @staticmethod
    def forward(ctx, y_NH, probs_TK, pair_N, token_N, row_TK):
        y, p_TK = y_NH.detach(), probs_TK.detach().to(y_NH.dtype)
        ctx.fused = p_TK.numel() > 0 and _use_fused(row_TK, y, p_TK)
        if ctx.fused:
            out_TH = compiled(sum_topk_rows)(y.contiguous(), row_TK, p_TK)
        else:
            row_P = inverse_order(pair_N) if row_TK is None else row_TK.reshape(-1)  # each pair's row
            out_TH = _combine_forward(y, p_TK, row_P)
        ctx.save_for_backward(y, p_TK, pair_N, token_N)
        ctx.probs_dtype = probs_TK.dtype
        return out_TH

    @staticmethod
    @once_differentiable
    def backward(ctx, dout_TH):
        y, p_TK, pair_N, token_N = ctx.saved_tensors
        need_dy, need_dprobs = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if ctx.fused and need_dy and need_dprobs:
            dy_NH, dprobs_N = compiled(combine_grads)(dout_TH.contiguous(), token_N, y.contiguous(),
                                                      p_TK.reshape(-1)[pair_N])
            dprobs_TK = torch.empty(pair_N.numel(), dtype=ctx.probs_dtype, device=y.device).index_copy_(
                0, pair_N, dprobs_N.to(ctx.probs_dtype)).view(p_TK.shape)
            return dy_NH, dprobs_TK, None, None, None
        return _combine_backward(dout_TH.contiguous(), y, p_TK, pair_N, token_N, ctx.probs_dtype,
                                 need_dy, need_dprobs) + (None, None, None)


COMBINE_ROWS = 1024  # expert rows per part of the combine: ~2-4 MB of y at H = 512-1024


def _combine_forward(y_NH, p_TK, row_P):
    T, k = p_TK.shape
    out_TH = y_NH.new_empty((T, y_NH.shape[1]))

    def part(t0, t1):
        y_bKH = y_NH.index_select(0, row_P[t0 * k:t1 * k]).view(t1 - t0, k, -1)
        torch.bmm(p_TK[t0:t1].unsqueeze(1), y_bKH, out=out_TH[t0:t1].unsqueeze(1))

    in_parts(part, T, COMBINE_ROWS // k, y_NH.device)
    return out_TH


def _combine_backward(dout_TH, y_NH, p_TK, pair_N, token_N, probs_dtype, need_dy, need_dprobs):
    """Row by row, expert-major: g = dout[token_n] (gathered once), dprobs of the row's pair =
    y_n . g (a dot product, cheaper on CPU than a [k, H] @ [H, 1] bmm per token), dy_n = g p_n."""
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

    in_parts(part, N, COMBINE_ROWS, y_NH.device)
    dprobs_TK = None
    if need_dprobs:
        dprobs_TK = torch.empty(T * k, dtype=probs_dtype, device=y_NH.device).index_copy_(
            0, pair_N, dprobs_N.to(probs_dtype)).view(T, k)
    return dy_NH, dprobs_TK
