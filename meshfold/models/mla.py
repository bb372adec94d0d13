"""Multi-head latent attention (MLA, DeepSeek-V2 / V3), with YaRN rope scaling.

Legend: B = sequences, S = this rank's tokens, Sk = key length, H = hidden, h = heads,
rq = q_lora_rank, rkv = kv_lora_rank, dn = qk_nope_head_dim, dr = qk_rope_head_dim,
dv = v_head_dim.

Every token is compressed to a *latent* ``c_kv`` [rkv] (after an RMSNorm) plus one RoPE key
``k_pe`` [dr] shared by all heads; the heads' keys and values are expanded from the latent by
``wkv_b``: ``k = [c_kv @ wkv_b (nope part) ; k_pe]`` [dn + dr], ``v`` [dv]. Queries come from a
latent too (``q_lora_rank``; DeepSeek-V2-Lite has none and uses a plain ``wq``), and split into
a non-RoPE part [dn] and a RoPE part [dr] per head. The score of head ``i`` is
``q_nope . k_nope + q_pe . k_pe``, scaled by ``softmax_scale``.

Math decisions, each matching transformers 5.24's ``modeling_deepseek_v3.py``:

* RoPE covers only the dr dims, frequencies ``theta^(-2i/dr)``. With ``rope_interleave``
  (DeepSeek's checkpoints) the dr dims are rotated as interleaved pairs ``(x0, x1), (x2, x3)``;
  here they are first de-interleaved (evens, then odds) and rotated in the rotate-half
  convention, which is the same rotation with the output dims permuted: q and k are permuted
  alike, so every score is unchanged (transformers writes its output in that order too).
* YaRN (:class:`YaRN`): the NTK-by-parts frequencies (extrapolated above ``beta_fast``
  rotations, interpolated by ``factor`` below ``beta_slow``, a linear ramp between, the ramp
  ends floored/ceiled when ``truncate``), the cos/sin tables multiplied by
  ``attention_factor`` (default ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``
  when both are set, else ``mscale(factor)``, with ``mscale(s, m) = 0.1 m ln s + 1``), and the
  softmax scale ``(dn + dr)^-0.5 * mscale(factor, mscale_all_dim)^2`` (when mscale_all_dim).
* The latent norms (``q_norm``, ``kv_norm``) use eps 1e-6 whatever ``rms_norm_eps`` is, as
  transformers builds them.

The attention itself is :func:`~meshfold.models.attention.attend` (or, under context
parallelism, ring attention, whose block kernels scale alike); it scales by ``1/sqrt(dn + dr)``,
so q is multiplied by ``softmax_scale * sqrt(dn + dr)`` first (one [B, h, S, dn+dr] product,
where a scale argument would save nothing worth a second convention).

``context`` (None on one device), set from outside, is the context-parallel hook: a function
``(q [B, h, S, dn+dr], c_kv [B, 1, S, rkv], k_pe [B, 1, S, dr], positions, expand, wkv_b) -> o
[B, h, S, dv]``, this rank's attention over every cp rank's keys. It receives the *latent* (rkv +
dr numbers per token, 576 for DeepSeek-V3, against h * (dn + dr + dv) = 40960 for the expanded
K/V) and :meth:`MLA.expand` with this rank's heads of ``wkv_b``, so each rank expands the other
ranks' latents itself. Layout: :mod:`meshfold.parallel.mla`.

Multi-token prediction (DeepSeek-V3's MTP, ``num_nextn_predict_layers``) is
``TransformerConfig.mtp_depth`` (:mod:`meshfold.models.mtp`); with MLA its blocks are MLA blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from meshfold.models import init
from meshfold.models.attention import _check_increasing, apply_rope, attend
from meshfold.models.layers import RMSNorm

__all__ = ["YaRN", "MLAConfig", "MLA", "LatentProjection", "mla_rope_cos_sin", "yarn_mscale"]

LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm: the RMSNorm default


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(scale) + 1`` (1 when scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YaRN:
    """YaRN rope scaling as a Hugging Face ``rope_parameters`` (``rope_type: yarn``) describes it."""

    factor: float
    original_max_seq: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def rope_factor(self) -> float:
        """The factor the cos/sin tables are multiplied by."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def inv_freq(self, dim: int, theta: float, dtype: torch.dtype) -> torch.Tensor:
        """[dim / 2] frequencies: extrapolated (unscaled) for the fast dims, interpolated
        (divided by factor) for the slow ones, a linear ramp between."""
        def correction_dim(rotations):  # the dim index that turns `rotations` times in the context
            return dim * math.log(self.original_max_seq / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # a one-point ramp would divide by zero
        pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=dtype) / dim)
        extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)
        ramp = ((torch.arange(dim // 2, dtype=dtype) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # 1: extrapolate (fast dims), 0: interpolate
        return interpolated * (1 - keep) + extrapolated * keep


@dataclass
class MLAConfig:
    """MLA shapes (Hugging Face DeepSeek-V3 names): ``q_lora_rank`` (None: a plain q projection),
    ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``;
    ``rope_interleave`` (RoPE on interleaved pairs), ``yarn`` (None: plain RoPE)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True
    yarn: YaRN | None = None

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"MLAConfig.{name} must be a positive integer, got {v!r}")
        if self.q_lora_rank is not None and not (isinstance(self.q_lora_rank, int) and self.q_lora_rank >= 1):
            raise ValueError(f"MLAConfig.q_lora_rank must be a positive integer or None, got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLAConfig.qk_rope_head_dim = {self.qk_rope_head_dim} must be even "
                             f"(RoPE rotates pairs)")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        if self.yarn is not None and self.yarn.mscale_all_dim:
            scale *= yarn_mscale(self.yarn.factor, self.yarn.mscale_all_dim) ** 2
        return scale


def mla_rope_cos_sin(positions: torch.Tensor, cfg: MLAConfig, theta: float, dtype: torch.dtype):
    """RoPE tables for the dr rope dims at ``positions`` [S] or [B, S] -> (cos, sin) [..., S, dr],
    YaRN-scaled when ``cfg.yarn``; computed in fp32 for fp32/bf16 models (as transformers), fp64
    for fp64 ones."""
    work, dr = torch.promote_types(dtype, torch.float32), cfg.qk_rope_head_dim
    if cfg.yarn is None:
        inv_freq, factor = 1.0 / (theta ** (torch.arange(0, dr, 2, dtype=work) / dr)), 1.0
    else:
        inv_freq, factor = cfg.yarn.inv_freq(dr, theta, work), cfg.yarn.rope_factor()
    angles = positions.to(work)[..., None] * inv_freq.to(positions.device)  # [..., S, dr/2]
    emb = torch.cat((angles, angles), dim=-1)  # [..., S, dr]
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., dr] pairs (x0, x1), (x2, x3), ... -> (x0, x2, ..., x1, x3, ...): the rotate-half layout."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class LatentProjection(nn.Module):
    """A down projection to a latent, ``x [..., H] @ weight [H, r] -> [..., r]``.

    A module rather than a parameter of :class:`MLA` because it is replicated over tp while the
    heads around it are split: under FSDP2 with mixed precision its tp gradient sum must run in
    the master dtype, which FSDP2 only does for a group all-gathered in that dtype, and a group
    is a module (:func:`~meshfold.parallel.data_parallel.fully_shard_folded`, as for the norms)."""

    def __init__(self, hidden: int, rank: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = init.normal_(nn.Parameter(torch.empty(hidden, rank, dtype=dtype)), std=hidden ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class MLA(nn.Module):
    """Multi-head latent attention: ``forward(x [B, S, H], positions, rope) -> [B, S, H]``.

    Parameters (stored [in, out]): ``wq`` [H, h*(dn+dr)] or ``wq_a.weight`` [H, rq] + ``q_norm``
    [rq] + ``wq_b`` [rq, h*(dn+dr)]; ``wkv_a.weight`` [H, rkv + dr] (latent, then the shared rope
    key; the down projections are :class:`LatentProjection` modules);
    ``kv_norm`` [rkv]; ``wkv_b`` [rkv, h*(dn+dv)] (per head: nope key, then value);
    ``wo`` [h*dv, H]. The per-head columns are head-major, so a tp shard of them is whole heads.
    """

    def __init__(self, hidden: int, heads: int, cfg: MLAConfig, rope_theta: float,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.cfg, self.rope_theta = cfg, rope_theta
        rq, rkv, dr, dv = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim
        qd = heads * cfg.qk_head_dim

        def weight(rows, cols):
            return init.normal_(nn.Parameter(torch.empty(rows, cols, dtype=dtype)), std=rows ** -0.5)

        if rq is None:
            self.wq, self.wq_a, self.q_norm, self.wq_b = weight(hidden, qd), None, None, None
        else:
            self.wq = None
            self.wq_a = LatentProjection(hidden, rq, dtype)  # [H, rq]
            self.q_norm = RMSNorm(rq, LATENT_NORM_EPS, dtype)
            self.wq_b = weight(rq, qd)  # [rq, h*(dn+dr)]
        self.wkv_a = LatentProjection(hidden, rkv + dr, dtype)  # [H, rkv + dr]
        self.kv_norm = RMSNorm(rkv, LATENT_NORM_EPS, dtype)
        self.wkv_b = weight(rkv, heads * (cfg.qk_nope_head_dim + dv))  # [rkv, h*(dn+dv)]
        self.wo = weight(heads * dv, hidden)  # [h*dv, H]
        self.context = None

    def expand(self, c_kv: torch.Tensor, k_pe: torch.Tensor, wkv_b: torch.Tensor):
        """Keys and values of latents ``c_kv`` [B, 1, Sk, rkv] and roped shared keys ``k_pe``
        [B, 1, Sk, dr] with the up projection ``wkv_b`` [rkv, h*(dn+dv)] (any whole heads of it)
        -> k [B, h, Sk, dn+dr], v [B, h, Sk, dv]."""
        dn, dv = self.cfg.qk_nope_head_dim, self.cfg.v_head_dim
        B, _, Sk, _ = c_kv.shape
        kv = (c_kv.squeeze(1) @ wkv_b).view(B, Sk, -1, dn + dv).transpose(1, 2)  # [B, h, Sk, dn+dv]
        k_nope, v = kv.split([dn, dv], dim=-1)
        return torch.cat((k_nope, k_pe.expand(-1, k_nope.shape[1], -1, -1)), dim=-1), v

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(_deinterleave(x) if self.cfg.rope_interleave else x, cos, sin)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, rope=None) -> torch.Tensor:
        """x [B, S, H] at ``positions`` ([S] or [B, S], default 0..S-1; increasing unless
        ``context`` is set) -> [B, S, H]. ``rope``: precomputed :func:`mla_rope_cos_sin`."""
        cfg = self.cfg
        B, S, _ = x.shape
        dn, dr, rkv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        if positions is None:
            positions = torch.arange(S, device=x.device)
        elif self.context is None and positions.device.type == "cpu" and not torch.compiler.is_compiling():
            _check_increasing(positions)
        cos, sin = rope if rope is not None else mla_rope_cos_sin(positions, cfg, self.rope_theta, x.dtype)

        q = x @ self.wq if self.wq is not None else self.q_norm(self.wq_a(x)) @ self.wq_b  # [B, S, h*(dn+dr)]
        q = q.view(B, S, -1, dn + dr).transpose(1, 2)  # [B, h, S, dn+dr]
        q_nope, q_pe = q.split([dn, dr], dim=-1)
        c_kv, k_pe = self.wkv_a(x).split([rkv, dr], dim=-1)  # [B, S, rkv], [B, S, dr]
        c_kv = self.kv_norm(c_kv).unsqueeze(1)  # [B, 1, S, rkv]
        q_pe, k_pe = self._rope(q_pe, cos, sin), self._rope(k_pe.unsqueeze(1), cos, sin)  # k_pe [B, 1, S, dr]
        q = torch.cat((q_nope, q_pe), dim=-1) * (cfg.softmax_scale * (dn + dr) ** 0.5)
        if self.context is not None:  # context parallelism: the latent meets every cp rank's queries
            o = self.context(q, c_kv, k_pe, positions, self.expand, self.wkv_b)
        else:  # in sequence order: causal by index
            o = attend(q, *self.expand(c_kv, k_pe, self.wkv_b))  # [B, h, S, dv]
        return o.transpose(1, 2).reshape(B, S, -1) @ self.wo
