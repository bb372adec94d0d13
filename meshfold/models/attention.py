"""Grouped-query attention with RoPE, from explicit token positions.

Legend: B = sequences, S = this rank's tokens per sequence, Sq / Sk = query / key length,
H = hidden, h = query heads, g = key/value heads (GQA groups), d = head dim.

Why positions everywhere: under context parallelism a rank holds non-contiguous chunks of the
sequence (e.g. chunks 0 and 3 of 4, for causal load balance) and attends its queries against
keys gathered from other ranks. RoPE therefore takes each token's absolute position, and
:func:`attend` builds the causal mask from positions (key visible iff ``k_pos <= q_pos``)
instead of assuming queries and keys are one contiguous range. Without context parallelism a
rank's tokens are in sequence order (positions increasing), so :class:`Attention` then masks by
index with SDPA's ``is_causal`` and positions only set RoPE: a mask from positions would cost
an [Sq, Sk] fp32 tensor saved for backward in every layer (16 MiB per layer at S = 2048).
With context parallelism ``parallelize`` sets the ``context`` hook: ring attention
(:mod:`meshfold.parallel.ring_attention`), which classifies blocks from the load-balanced chunk
indices and needs no mask; only positions outside that layout take the generic path here, keys
all-gathered and masked by position, with a :class:`CausalMaskCache` shared by all layers so the
mask is built once per forward instead of once per layer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from meshfold.models import init
from meshfold.models.layers import RMSNorm

__all__ = ["Attention", "CausalMaskCache", "attend", "causal_mask", "rope_cos_sin", "apply_rope", "apply_rope_qk"]


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """RoPE tables for ``positions`` [S] or [B, S] -> (cos, sin), each [S, d] or [B, S, d].

    Hugging Face convention: frequencies ``theta^(-2i/d)`` for i < d/2, duplicated over both
    halves (pairs are (j, j + d/2), see :func:`apply_rope`). Angles are computed in fp32 for
    fp32/bf16 models, exactly as HF does (so logits match), and in fp64 for fp64 models."""
    work = torch.promote_types(dtype, torch.float32)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=work, device=positions.device) / head_dim))
    angles = positions.to(work)[..., None] * inv_freq  # [..., S, d/2]
    emb = torch.cat((angles, angles), dim=-1)  # [..., S, d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, n, S, d] by tables [S, d] or [B, S, d] (rotate_half convention)."""
    if cos.dim() == 3:  # per-sequence positions: broadcast over heads
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


def apply_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(q, k) rotated by the same RoPE tables: :func:`apply_rope` of each."""
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask of ``k_pos <= q_pos``: 0 where a key is visible, -inf elsewhere, [Sq, Sk]
    (or [B, 1, Sq, Sk] for per-sequence positions) in ``dtype``, exactly what SDPA makes of the
    boolean mask, so passing either gives the same values."""
    visible = k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)  # [Sq, Sk] or [B, Sq, Sk]
    if visible.dim() == 3:
        visible = visible.unsqueeze(1)  # [B, 1, Sq, Sk]
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


class CausalMaskCache:
    """One :func:`causal_mask` for every layer of a forward.

    SDPA keeps the mask it is given for backward, so masks built per layer cost one [Sq, Sk]
    tensor per layer until backward: at S = 32k over cp = 8 that is 512 MiB a layer in fp32.
    Every layer of a forward sees the same query and key positions, so layers sharing one cache
    share one mask. The mask is reused while the positions are the same tensors, unchanged, or
    equal ones on the CPU. Comparing values elsewhere would cost a device sync, and the context-
    parallel hook gathers the key positions anew in every layer, so on CUDA each layer still
    builds its own mask (sharing there needs the positions gathered once per forward). The mask
    is held weakly: once no saved graph needs it, it is freed, and a forward without autograd
    (which keeps nothing) builds it per layer, as without the cache.
    """

    def __init__(self):
        self._seen = None  # what built the last mask: per positions (tensor, its version, a copy)
        self._mask = lambda: None  # weak reference to the last mask

    def __call__(self, q_pos: torch.Tensor, k_pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        mask = self._mask()
        if mask is None or mask.dtype != dtype or not all(map(_same, self._seen, (q_pos, k_pos))):
            mask = causal_mask(q_pos, k_pos, dtype)
            self._seen = [(p, p._version, p.clone()) for p in (q_pos, k_pos)]
            self._mask = weakref.ref(mask)
        return mask


def _same(seen: tuple, pos: torch.Tensor) -> bool:
    """Whether ``pos`` holds the positions ``seen`` recorded: the same tensor, not changed in
    place since, or (on the CPU) equal values."""
    tensor, version, values = seen
    if pos is tensor and pos._version == version:
        return True
    return (pos.device == values.device and pos.device.type == "cpu" and pos.shape == values.shape
            and not torch.compiler.is_compiling() and torch.equal(pos, values))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None,
           masks: CausalMaskCache | None = None) -> torch.Tensor:
    """Causal softmax attention ``q`` [B, h, Sq, d] x ``k``/``v`` [B, g, Sk, d] -> [B, h, Sq, d].

    ``q_pos`` [Sq] (or [B, Sq]) and ``k_pos`` [Sk] (or [B, Sk]) are absolute token positions; a
    key is visible to a query iff ``k_pos <= q_pos``, so q and k may be any subsets of the
    sequence in any order. Every query must see at least one key (true whenever k holds all
    positions up to the query's own). Both None: q and k are the same contiguous range
    (``is_causal`` fast path). ``g`` divides ``h``; each KV head serves ``h / g`` query heads.
    ``masks`` (with positions): take the mask from this cache, shared with other layers.
    """
    h, g = q.shape[1], k.shape[1]
    if h % g:
        raise ValueError(f"attend: query heads {h} not a multiple of key/value heads {g}")
    if q_pos is None and k_pos is None:
        return _sdpa(q, k, v, is_causal=True)
    if q_pos is None or k_pos is None:
        raise ValueError("attend: give both q_pos and k_pos, or neither")
    if q_pos.shape[-1] != q.shape[2] or k_pos.shape[-1] != k.shape[2]:
        raise ValueError(f"attend: q_pos {tuple(q_pos.shape)} / k_pos {tuple(k_pos.shape)} do not "
                         f"match Sq = {q.shape[2]} / Sk = {k.shape[2]}")
    mask = causal_mask(q_pos, k_pos, q.dtype) if masks is None else masks(q_pos, k_pos, q.dtype)
    return _sdpa(q, k, v, attn_mask=mask)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask=None, is_causal=False) -> torch.Tensor:
    """SDPA with ``g`` key/value heads serving ``h`` query heads.

    Which fused kernel can take GQA itself (``enable_gqa``, no copy of K/V) depends on the device:
    on the CPU its flash kernel does in every dtype, with or without a mask; on CUDA only the
    flash kernel does, and it needs fp16 / bf16 and no mask. Anything else asked for
    ``enable_gqa`` on CUDA (fp32, or a mask) falls back to the math kernel, which materialises the
    [Sq, Sk] scores in fp32; there K/V are repeated to ``h`` heads instead (``h / g`` times their
    size, far below the scores) so the memory-efficient kernel runs.
    """
    h, g = q.shape[1], k.shape[1]
    if h == g or gqa_in_kernel(q, attn_mask is not None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=h != g)
    r = h // g
    return F.scaled_dot_product_attention(q, k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1),
                                          attn_mask=attn_mask, is_causal=is_causal)


def gqa_in_kernel(q: torch.Tensor, masked: bool) -> bool:
    """Whether SDPA's fused kernel for queries ``q`` takes grouped K/V itself (see :func:`_sdpa`)."""
    return q.device.type == "cpu" or (q.dtype in (torch.float16, torch.bfloat16) and not masked)


def _check_increasing(positions: torch.Tensor) -> None:
    if positions.shape[-1] > 1 and not bool((positions[..., 1:] > positions[..., :-1]).all()):
        flat = positions.flatten().tolist()
        bad = flat if len(flat) <= 16 else f"{flat[:16]}..."
        raise ValueError(f"positions {bad} do not increase along the sequence; without context "
                         f"parallelism (kv_gather) tokens must be in sequence order, e.g. 0..S-1 "
                         f"or an offset range")


KVGather = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple]
ContextAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Attention(nn.Module):
    """GQA self-attention: ``forward(x [B, S, H], positions [S] | [B, S]) -> [B, S, H]``.

    Parameters are plain tensors used as ``x @ w`` so a layout can shard them column-wise
    (``wq`` [H, h*d], ``wk``/``wv`` [H, g*d], biases ``bq``/``bk``/``bv`` with ``qkv_bias``) and
    row-wise (``wo`` [h*d, H]); head counts are read from the local shapes. With ``qk_norm``
    (Qwen3) ``q_norm``/``k_norm`` (weights [d]) normalise each head before RoPE.

    ``kv_gather`` (None on one device) is the context-parallel hook, set from outside: a function
    ``(k [B, g, S, d], v, k_pos) -> (k_all, v_all, k_pos_all)`` returning the keys and values of
    every token this rank's queries may need (RoPE already applied), with their positions.
    ``masks`` (None: a mask per call) is the :class:`CausalMaskCache` the layers of one model
    share for those keys, also set from outside. ``context`` (None on one device) replaces both:
    a function ``(q [B, h, S, d], k [B, g, S, d], v, positions) -> o [B, h, S, d]`` computing this
    rank's causal attention over every context-parallel rank's keys (``parallelize`` sets a ring,
    :mod:`meshfold.parallel.ring_attention`). ``rotate`` applies RoPE to q and k together
    (:func:`apply_rope_qk`); a runtime wrapper may set a compiled one from outside
    (:mod:`meshfold.parallel.compile`): the elementwise work between the projections and SDPA.
    """

    rotate = staticmethod(apply_rope_qk)

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, rope_theta: float,
                 qkv_bias: bool = False, qk_norm: bool = False, norm_eps: float = 1e-6,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.head_dim, self.rope_theta = head_dim, rope_theta
        qd, kvd = heads * head_dim, kv_heads * head_dim
        self.wq = nn.Parameter(torch.empty(hidden, qd, dtype=dtype))  # [H, h*d]
        self.wk = nn.Parameter(torch.empty(hidden, kvd, dtype=dtype))  # [H, g*d]
        self.wv = nn.Parameter(torch.empty(hidden, kvd, dtype=dtype))  # [H, g*d]
        self.wo = nn.Parameter(torch.empty(qd, hidden, dtype=dtype))  # [h*d, H]
        for w in (self.wq, self.wk, self.wv, self.wo):
            init.normal_(w, std=w.shape[0] ** -0.5)
        if qkv_bias:
            self.bq = init.zeros_(nn.Parameter(torch.empty(qd, dtype=dtype)))
            self.bk = init.zeros_(nn.Parameter(torch.empty(kvd, dtype=dtype)))
            self.bv = init.zeros_(nn.Parameter(torch.empty(kvd, dtype=dtype)))
        else:
            self.bq = self.bk = self.bv = None
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, norm_eps, dtype)
            self.k_norm = RMSNorm(head_dim, norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.kv_gather: KVGather | None = None
        self.masks: CausalMaskCache | None = None
        self.context: ContextAttention | None = None

    def project(self, x: torch.Tensor, positions: torch.Tensor, rope=None):
        """q [B, h, S, d], k/v [B, g, S, d] of tokens ``x`` [B, S, H] at ``positions``, with
        q/k norm and RoPE applied (``rope`` = precomputed :func:`rope_cos_sin` tables)."""
        B, S, _ = x.shape
        d = self.head_dim

        def proj(w, b):
            y = x @ w if b is None else x @ w + b
            return y.view(B, S, -1, d)  # [B, S, heads, d]

        q, k, v = proj(self.wq, self.bq), proj(self.wk, self.bk), proj(self.wv, self.bv)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, S, d]
        cos, sin = rope if rope is not None else rope_cos_sin(positions, d, self.rope_theta, x.dtype)
        q, k = self.rotate(q, k, cos, sin)
        return q, k, v

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, rope=None) -> torch.Tensor:
        """x [B, S, H] at ``positions`` ([S] or [B, S], default 0..S-1) -> [B, S, H]. Without
        ``kv_gather`` or ``context`` the positions must increase along S (the tokens are in sequence order),
        checked on the CPU (on an accelerator the check would cost a host sync)."""
        B, S, _ = x.shape
        if positions is None:
            positions = torch.arange(S, device=x.device)
        elif (self.kv_gather is None and self.context is None and positions.device.type == "cpu"
              and not torch.compiler.is_compiling()):
            _check_increasing(positions)
        q, k, v = self.project(x, positions, rope)
        if self.context is not None:  # context parallelism: attention over every cp rank's keys
            o = self.context(q, k, v, positions)
            return o.transpose(1, 2).reshape(B, S, -1) @ self.wo
        q_pos = k_pos = None  # in sequence order: causal by index
        if self.kv_gather is not None:
            q_pos = positions
            k, v, k_pos = self.kv_gather(k, v, positions)
        o = attend(q, k, v, q_pos, k_pos, self.masks)  # [B, h, S, d]
        return o.transpose(1, 2).reshape(B, S, -1) @ self.wo
