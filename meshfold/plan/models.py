"""Model shapes the planner reasons about: sizes only, no weights and no code.

A :class:`ModelShape` is the handful of numbers that set parameter count, FLOPs, activation size
and communication volume of a MoE transformer: attention in every layer, then either an MoE layer
(routed experts, optionally a shared expert) or, for the layers ``TransformerConfig`` makes dense
(``first_k_dense``, ``moe_every``: DeepSeek-V3's first 3 layers, Qwen's ``decoder_sparse_step``),
a dense SwiGLU MLP of ``dense_ffn``. :meth:`ModelShape.from_config` reads them off any config
object (meshfold's model configs, a Hugging Face config, a Megatron args namespace).

Parameters are counted as meshfold builds them (``tests/plan/test_plan.py`` checks the count against
``sum(p.numel())`` of every named config built on meta) and split by how ``parallelize`` lays them
over ``tp`` (:meth:`ModelShape.layer_params`): replicated (norms, router, the shared expert's
gate, MLA's latent down projections and norms, embeddings and head) or split by head / ffn.

Legend: h = hidden size, L = layers, n = attention heads, g = KV groups, d = head dim (kv_channels),
E = experts, k = top-k, f_e = expert FFN size, f_sh = shared-expert FFN size, f_d = dense-layer FFN
size, V = vocabulary. MLA (multi-head latent attention, DeepSeek-V2/V3; ``kv_lora_rank`` > 0):
rq = q_lora_rank (0: a plain q projection), rkv = kv_lora_rank, dn / dr / dv = qk_nope / qk_rope /
v head dims.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

from meshfold.catalog import MODEL_CONFIGS

__all__ = ["ModelShape", "LayerParams", "MODELS", "model_shape", "shape_of_config", "shape_of_fields"]


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one layer by placement over attention ``tp`` and the MoE view:
    ``replicated`` (every tp rank holds them whole), ``tp_split`` (split over tp), ``experts``
    (the routed experts, split over ep x etp)."""

    replicated: int
    tp_split: int
    experts: int = 0

    @property
    def total(self) -> int:
        return self.replicated + self.tp_split + self.experts

    def per_rank(self, tp: int, ep_etp: int) -> float:
        """Parameters one rank holds before data-parallel sharding."""
        return self.replicated + self.tp_split / tp + self.experts / ep_etp


@dataclass(frozen=True)
class ModelShape:
    """Shape of a MoE transformer (SwiGLU experts, GQA or MLA attention, RMSNorm, untied head
    unless ``tie_embeddings``). Layer ``i`` is MoE iff ``i >= first_k_dense`` and
    ``(i - first_k_dense) % moe_every == 0`` (``TransformerConfig.is_moe_layer``)."""

    name: str
    hidden: int             # h
    layers: int             # L
    heads: int              # n
    kv_groups: int          # g
    experts: int            # E
    topk: int               # k
    expert_ffn: int         # f_e
    vocab: int              # V
    shared_ffn: int = 0     # f_sh (0: no shared expert)
    head_dim: int | None = None  # d; hidden // heads when None
    kv_lora_rank: int = 0   # rkv; 0: GQA attention, > 0: MLA with the fields below
    q_lora_rank: int = 0    # rq (0: q projected directly)
    qk_nope_head_dim: int = 0   # dn
    qk_rope_head_dim: int = 0   # dr
    v_head_dim: int = 0     # dv
    first_k_dense: int = 0  # the first layers with a dense MLP (DeepSeek's first_k_dense_replace)
    moe_every: int = 1      # after them, every moe_every-th layer is MoE, the others dense
    dense_ffn: int = 0      # f_d, the dense layers' SwiGLU size
    shared_gate: bool = True    # the shared expert is sigmoid-gated by a [1, h] linear (Qwen2; not DeepSeek)
    qkv_bias: bool = False  # biases on q, k, v (Qwen2)
    qk_norm: bool = False   # per-head RMSNorm of q and k (Qwen3, OLMoE)
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for f in ("hidden", "layers", "heads", "kv_groups", "experts", "topk", "expert_ffn", "vocab",
                  "moe_every"):
            v = getattr(self, f)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"ModelShape.{f} must be a positive integer, got {v!r}")
        if self.heads % self.kv_groups:
            raise ValueError(f"heads = {self.heads} is not a multiple of kv_groups = {self.kv_groups}")
        if self.topk > self.experts:
            raise ValueError(f"topk = {self.topk} exceeds experts = {self.experts}")
        if not 0 <= self.first_k_dense < self.layers:
            raise ValueError(f"ModelShape.first_k_dense = {self.first_k_dense} must be in 0..{self.layers - 1} "
                             f"(layers = {self.layers}: at least one MoE layer)")
        if self.dense_layers and self.dense_ffn < 1:
            raise ValueError(f"ModelShape.dense_ffn = {self.dense_ffn} but {self.dense_layers} layers are "
                             f"dense (first_k_dense = {self.first_k_dense}, moe_every = {self.moe_every}); "
                             f"valid: a positive dense_ffn")
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    # ---- which layers are MoE ---------------------------------------------------------------------
    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense and (i - self.first_k_dense) % self.moe_every == 0

    @cached_property
    def moe_layers(self) -> int:   # cached: the search asks for it per layout
        return sum(self.is_moe_layer(i) for i in range(self.layers))

    @property
    def dense_layers(self) -> int:
        """Layers with a dense MLP instead of an MoE layer (DeepSeek-V3: 3 of 61)."""
        return self.layers - self.moe_layers

    # ---- parameters -----------------------------------------------------------------------------
    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_dim(self) -> int:
        """Per-head query/key width: d, or dn + dr with MLA."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def value_dim(self) -> int:
        """Per-head value width: d, or dv with MLA."""
        return self.v_head_dim if self.mla else self.head_dim

    @property
    def kv_per_token(self) -> int:
        """Numbers a token keeps for later queries (its KV-cache entry, what context parallelism
        gathers): 2 g d for GQA; the latent plus the shared rope key, rkv + dr, for MLA."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.mla else 2 * self.kv_groups * self.head_dim

    @property
    def attn_params(self) -> int:
        """Attention weights of one layer: Q and O are h x n*d, K and V are h x g*d each. MLA:
        q (h rq + rq n (dn+dr), or h n (dn+dr)), kv down h (rkv + dr), kv up rkv n (dn + dv),
        o n dv h (latent norms not counted)."""
        return sum(self._attn_split())

    def _attn_split(self) -> tuple[int, int]:
        """Attention weights (no norms, no biases) as (replicated over tp, split over tp):
        MLA's down projections to the latents are replicated (``meshfold.parallel.layouts.MLA_LAYOUT``)."""
        h, n, g, d = self.hidden, self.heads, self.kv_groups, self.head_dim
        if not self.mla:
            return 0, 2 * h * n * d + 2 * h * g * d
        rq, rkv, dn, dr, dv = (self.q_lora_rank, self.kv_lora_rank, self.qk_nope_head_dim,
                               self.qk_rope_head_dim, self.v_head_dim)
        down = h * rq + h * (rkv + dr)              # wq_a, wkv_a
        up = (rq if rq else h) * n * (dn + dr) + rkv * n * (dn + dv) + n * dv * h   # wq_b | wq, wkv_b, wo
        return down, up

    def layer_params(self, moe: bool) -> LayerParams:
        """One layer's parameters by placement (:class:`LayerParams`): an MoE layer (``moe``)
        or a dense one. Replicated over tp: the two layer norms, q/k norms, MLA's latent down
        projections and latent norms, the router, the shared expert's gate. Split over tp:
        attention heads (and their biases), the dense MLP, the shared expert."""
        h, n, g, d = self.hidden, self.heads, self.kv_groups, self.head_dim
        rep, split = self._attn_split()
        rep += 2 * h                                        # attn_norm, mlp_norm
        if self.mla:
            rep += self.q_lora_rank + self.kv_lora_rank     # q_norm, kv_norm
        if self.qk_norm:
            rep += 2 * d
        if self.qkv_bias:
            split += n * d + 2 * g * d
        if not moe:
            return LayerParams(rep, split + 3 * h * self.dense_ffn)
        rep += self.experts * h                             # router (its expert bias is a buffer)
        if self.shared_ffn:
            split += 3 * h * self.shared_ffn
            rep += h if self.shared_gate else 0
        return LayerParams(rep, split, self.experts * self.expert_params)

    @property
    def expert_params(self) -> int:
        """One expert (SwiGLU: gate, up, down): 3 * h * f_e."""
        return 3 * self.hidden * self.expert_ffn

    @property
    def dense_layer_params(self) -> int:
        """Weights of one MoE layer that are not routed experts: attention, shared expert,
        router, norms (the name predates dense layers; see :meth:`layer_params`)."""
        p = self.layer_params(True)
        return p.replicated + p.tp_split

    @property
    def embedding_params(self) -> int:
        """Input embedding (the output head has as many again unless tied): V * h."""
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        """All parameters, as ``sum(p.numel())`` of the built model: every layer (MoE or
        dense), embedding, head (unless tied) and final norm."""
        moe, dense = self.layer_params(True), self.layer_params(False)
        heads = 1 if self.tie_embeddings else 2
        return (self.moe_layers * moe.total + self.dense_layers * dense.total
                + heads * self.embedding_params + self.hidden)

    # ---- FLOPs ----------------------------------------------------------------------------------
    def step_flops(self, global_batch: int, seq: int) -> float:
        """Model FLOPs of one training step (fwd + bwd), as Megatron-Core counts them.

        ``12 B s L h^2 [ (1 + g/n + s/h)(d n / h) + 1.5 k f_e / h + 1.5 f_sh / h + V / (2 L h) ]``
        with the full (non-causal) ``s^2`` attention term, the count the paper's MFU uses (arXiv
        2504.14960, Table 1; Megatron-LM's ``num_floating_point_operations`` in
        megatron/training/training.py), over the MoE layers; a dense layer has ``1.5 f_d / h`` in place
        of the two MLP terms. Router and norms are not counted.
        """
        B, s, L, h = global_batch, seq, self.layers, self.hidden
        n, g, d, k = self.heads, self.kv_groups, self.head_dim, self.topk
        attn = (1 + g / n + s / h) * (d * n / h)
        if self.mla:  # the same count: projections 6 * params, scores and values 6 s n (d_qk + d_v)
            attn = (self.attn_params + s * n * (self.qk_dim + self.value_dim)) / (2 * h * h)
        moe_mlp = 1.5 * k * self.expert_ffn / h + 1.5 * self.shared_ffn / h
        dense_mlp = 1.5 * self.dense_ffn / h
        mlp = (self.moe_layers * moe_mlp + self.dense_layers * dense_mlp) / L
        return 12 * B * s * L * h * h * (attn + mlp + self.vocab / (2 * L * h))

    # ---- from any config --------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: object, name: str | None = None) -> "ModelShape":
        """Read a shape off any object with the usual config attributes.

        Accepted spellings (first present wins): hidden ``hidden_size``; layers ``num_layers`` |
        ``num_hidden_layers``; heads ``num_attention_heads`` | ``num_heads``; KV groups
        ``num_key_value_heads`` | ``num_query_groups`` | ``num_kv_heads`` (default: heads); experts
        ``num_experts`` | ``num_local_experts`` | ``num_moe_experts``; top-k ``top_k`` |
        ``num_experts_per_tok`` | ``moe_router_topk``; expert FFN ``expert_ffn`` |
        ``moe_intermediate_size`` | ``moe_ffn_hidden_size`` | ``intermediate_size`` |
        ``ffn_hidden_size``; shared FFN ``shared_ffn`` | ``shared_expert_intermediate_size`` |
        ``moe_shared_expert_intermediate_size`` (default 0; gated, as Qwen2's); vocab
        ``vocab_size``; head dim ``head_dim`` | ``kv_channels`` (optional); MLA ``kv_lora_rank``,
        ``q_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim`` (optional,
        Hugging Face names; DeepSeek's ``n_routed_experts`` and ``n_shared_experts``, ungated,
        too); dense layers ``first_k_dense`` | ``first_k_dense_replace`` and ``moe_every`` |
        ``moe_layer_freq`` | ``decoder_sparse_step`` (default 0 and 1), their FFN ``dense_ffn``,
        else ``intermediate_size`` where the experts' size has its own name; ``qkv_bias``,
        ``qk_norm``, ``tie_word_embeddings`` (default False).
        """
        def pick(*names: str, default: object = ...) -> object:
            for a in names:
                v = cfg.get(a) if isinstance(cfg, dict) else getattr(cfg, a, None)
                if v is not None:
                    return v
            if default is ...:
                raise ValueError(f"config {type(cfg).__name__} has none of the attributes {list(names)}")
            return default

        heads = pick("num_attention_heads", "num_heads")
        expert_ffn = pick("expert_ffn", "moe_intermediate_size", "moe_ffn_hidden_size",
                          "intermediate_size", "ffn_hidden_size")
        mla = {f: int(pick(f, default=0) or 0) for f in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                                                          "qk_rope_head_dim", "v_head_dim")}
        shared = pick("shared_ffn", "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
                      default=None)
        gate = bool(pick("shared_gate", default=True))
        if shared is None:
            shared, gate = int(pick("n_shared_experts", default=0) or 0) * expert_ffn, False
        own_name = pick("moe_intermediate_size", "moe_ffn_hidden_size", default=None) is not None
        dense_ffn = pick("dense_ffn", default=None)
        if dense_ffn is None:
            dense_ffn = pick("intermediate_size", "ffn_hidden_size", default=0) if own_name else 0
        moe_every = int(pick("moe_every", "moe_layer_freq", "decoder_sparse_step", default=1))
        # Qwen's decoder_sparse_step s makes layers s-1, 2s-1, ... MoE
        sparse_step = pick("moe_every", "moe_layer_freq", default=None) is None and \
            pick("decoder_sparse_step", default=None) is not None
        first_k_dense = int(pick("first_k_dense", "first_k_dense_replace",
                                 default=moe_every - 1 if sparse_step else 0))
        return cls(
            name=name or str(pick("name", "model_name", default=type(cfg).__name__)),
            hidden=pick("hidden_size", "hidden"),
            layers=pick("num_layers", "num_hidden_layers", "layers"),
            heads=heads,
            kv_groups=pick("num_key_value_heads", "num_query_groups", "num_kv_heads", "kv_groups", default=heads),
            experts=pick("num_experts", "num_local_experts", "num_moe_experts", "n_routed_experts", "experts"),
            topk=pick("top_k", "num_experts_per_tok", "moe_router_topk", "topk"),
            expert_ffn=expert_ffn,
            vocab=pick("vocab_size", "vocab"),
            shared_ffn=shared,
            head_dim=pick("head_dim", "kv_channels", default=None),
            first_k_dense=first_k_dense, moe_every=moe_every,
            dense_ffn=int(dense_ffn),
            shared_gate=gate,
            qkv_bias=bool(pick("qkv_bias", default=False)),
            qk_norm=bool(pick("qk_norm", default=False)),
            tie_embeddings=bool(pick("tie_embeddings", "tie_word_embeddings", default=False)),
            **mla,
        )


def shape_of_fields(name: str, fields: dict) -> ModelShape:
    """The shape of a model given as plain ``TransformerConfig`` fields (the form of
    :data:`meshfold.catalog.MODEL_CONFIGS`; a field left out has the dataclass's default)."""
    moe, a = fields["moe"], fields.get("mla")
    layers, heads = fields["layers"], fields["heads"]
    first, every = fields.get("first_k_dense", 0), fields.get("moe_every", 1)
    dense = any(not (i >= first and (i - first) % every == 0) for i in range(layers))
    shared = moe.get("shared_ffn", 0)
    mla = {} if a is None else dict(kv_lora_rank=a["kv_lora_rank"], q_lora_rank=a.get("q_lora_rank") or 0,
                                    qk_nope_head_dim=a["qk_nope_head_dim"], qk_rope_head_dim=a["qk_rope_head_dim"],
                                    v_head_dim=a["v_head_dim"])
    return ModelShape(name, hidden=fields["hidden"], layers=layers, heads=heads,
                      kv_groups=fields.get("kv_heads") or heads, experts=moe["num_experts"],
                      topk=moe.get("topk", 2), expert_ffn=moe["ffn"], vocab=fields["vocab"], shared_ffn=shared,
                      head_dim=fields.get("head_dim"), first_k_dense=first, moe_every=every,
                      dense_ffn=fields.get("ffn", 0) if dense else 0,
                      shared_gate=not shared or (moe.get("shared_kind") or "qwen2") == "qwen2",
                      qkv_bias=fields.get("qkv_bias", False), qk_norm=fields.get("qk_norm", False),
                      tie_embeddings=fields.get("tie_embeddings", False), **mla)


def shape_of_config(name: str, cfg) -> ModelShape:
    """The shape of a meshfold :class:`~meshfold.models.transformer.TransformerConfig` (MoE)."""
    return shape_of_fields(name, dataclasses.asdict(cfg))


# Every named model of meshfold (meshfold.catalog.MODEL_CONFIGS, the paper's among them): `plan
# --model` and `train model.name` take the same names (tests/plan/test_plan.py checks every
# parameter count against the built model).
MODELS: dict[str, ModelShape] = {name: shape_of_fields(name, f) for name, f in MODEL_CONFIGS.items()}


def model_shape(model: str | ModelShape | object) -> ModelShape:
    """A named shape (``MODELS``), a :class:`ModelShape`, or any config via ``from_config``."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, str):
        key = model.lower()
        if key not in MODELS:
            raise ValueError(f"unknown model {model!r}; valid choices: {sorted(MODELS)}")
        return MODELS[key]
    return ModelShape.from_config(model)
