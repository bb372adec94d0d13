"""Hugging Face ``DeepseekV3ForCausalLM`` checkpoints (transformers 5.x names) <-> meshfold.

Checkpoint tensors (``[out, in]`` for linears) and the meshfold parameters they become::

    model.layers.N.self_attn.q_proj.weight [h*(dn+dr), H]          -> attn.wq  (q_lora_rank null)
    model.layers.N.self_attn.q_a_proj.weight [rq, H]               -> attn.wq_a.weight
    model.layers.N.self_attn.q_a_layernorm.weight [rq]             -> attn.q_norm.weight
    model.layers.N.self_attn.q_b_proj.weight [h*(dn+dr), rq]       -> attn.wq_b
    model.layers.N.self_attn.kv_a_proj_with_mqa.weight [rkv+dr, H] -> attn.wkv_a.weight
    model.layers.N.self_attn.kv_a_layernorm.weight [rkv]           -> attn.kv_norm.weight
    model.layers.N.self_attn.kv_b_proj.weight [h*(dn+dv), rkv]     -> attn.wkv_b
    model.layers.N.self_attn.o_proj.weight [H, h*dv]               -> attn.wo
    model.layers.N.mlp.gate.weight [E, H]                          -> mlp.router.weight
    model.layers.N.mlp.gate.e_score_correction_bias [E]            -> mlp.router.expert_bias (a buffer)
    model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight        -> mlp.experts.w_gate_up / w_down
    model.layers.N.mlp.shared_experts.{gate,up,down}_proj.weight   -> mlp.shared.w_gate_up / w_down
    model.layers.N.mlp.{gate,up,down}_proj.weight (N < first_k_dense_replace) -> mlp.w_gate_up / w_down

plus embeddings, norms and head as for the other families (:mod:`meshfold.interop.hf`).

Multi-token prediction (``num_nextn_predict_layers`` = D; DeepSeek-V3's released format, and the
names transformers' ``MtpLayer`` reads): depth k (0-based) is the layer after the last decoder
layer, ``model.layers.{L + k}`` with L = ``num_hidden_layers``::

    model.layers.{L+k}.enorm.weight [H]                 -> mtp.{k}.emb_norm.weight
    model.layers.{L+k}.hnorm.weight [H]                 -> mtp.{k}.hidden_norm.weight
    model.layers.{L+k}.eh_proj.weight [H, 2H]           -> mtp.{k}.proj.weight ([embedding; hidden] inputs)
    model.layers.{L+k}.shared_head.norm.weight [H]      -> mtp.{k}.head_norm.weight
    model.layers.{L+k}.{input_layernorm,self_attn,...}  -> mtp.{k}.block.* (as decoder layer L + k)
    model.layers.{L+k}.embed_tokens.weight, .shared_head.head.weight: copies of the main embedding
        and head, written on export, not read on load (meshfold shares the main ones)

Routing maps exactly: sigmoid scores; ``e_score_correction_bias`` is meshfold's expert bias (it
picks the groups and experts, the weights are the unbiased scores); ``n_group`` /
``topk_group`` with a group scored by the sum of its best 2 biased scores (transformers'
``topk(2)``, whatever top-k is: ``MoEConfig.group_score_topk = 2``); ``norm_topk_prob`` ->
``renormalize`` (over the k, + 1e-20); ``routed_scaling_factor`` -> ``topk_scaling_factor``.
"""

from __future__ import annotations

from meshfold.interop.recipes import Leaf, Stack, gate_up, linear
from meshfold.models.config import MoEConfig
from meshfold.models.mla import MLAConfig, YaRN
from meshfold.models.transformer import TransformerConfig

ARCH = "DeepseekV3ForCausalLM"

# transformers 5.24 DeepseekV3Config defaults for the fields read here
DEFAULTS = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
                routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
                first_k_dense_replace=3, norm_topk_prob=True, hidden_act="silu",
                max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_interleave=True, attention_bias=False, rope_theta=10000.0)


def _yarn(rope: dict, max_seq: int) -> YaRN | None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "yarn":
        raise ValueError(f"rope_type = {rope_type!r} is not supported for {ARCH} (valid: 'default', 'yarn')")
    original = rope.get("original_max_position_embeddings", max_seq)
    factor = rope.get("factor")
    if factor is None:  # transformers: the ratio of the context lengths
        factor = max_seq / original
    return YaRN(factor=float(factor), original_max_seq=int(original),
                beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                mscale=rope.get("mscale"), mscale_all_dim=rope.get("mscale_all_dim"),
                attention_factor=rope.get("attention_factor"), truncate=bool(rope.get("truncate", True)))


def config_from_hf(hf: dict) -> TransformerConfig:
    """A DeepseekV3 ``config.json`` dict -> :class:`~meshfold.models.transformer.TransformerConfig`."""
    c = {**DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    if "q_lora_rank" in hf and hf["q_lora_rank"] is None:  # null: a plain q projection
        c["q_lora_rank"] = None
    if c["hidden_act"] != "silu":
        raise ValueError(f"hidden_act = {c['hidden_act']!r}; meshfold's experts are SwiGLU (valid: 'silu')")
    if c["attention_bias"]:
        raise ValueError("attention_bias = true (biases on q_a/kv_a/o projections) is not supported (valid: false)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", c["rope_theta"]))
    max_seq = c["max_position_embeddings"]
    mla = MLAConfig(q_lora_rank=c["q_lora_rank"], kv_lora_rank=c["kv_lora_rank"],
                    qk_nope_head_dim=c["qk_nope_head_dim"], qk_rope_head_dim=c["qk_rope_head_dim"],
                    v_head_dim=c["v_head_dim"], rope_interleave=bool(c["rope_interleave"]),
                    yarn=_yarn(rope, max_seq))
    H, E = c["hidden_size"], c["n_routed_experts"]
    groups = c["n_group"] or 1
    moe = MoEConfig(hidden=H, ffn=c["moe_intermediate_size"], num_experts=E, topk=c["num_experts_per_tok"],
                    score_function="sigmoid", renormalize=bool(c["norm_topk_prob"]),
                    topk_scaling_factor=float(c["routed_scaling_factor"]),
                    num_groups=groups, group_topk=c["topk_group"] or 1, group_score_topk=min(2, E // groups),
                    expert_bias=True, shared_ffn=c["n_shared_experts"] * c["moe_intermediate_size"],
                    shared_kind="deepseek")
    if moe.topk == 1 and moe.renormalize:
        raise ValueError("num_experts_per_tok = 1 with norm_topk_prob = true (a weight of 1) is not "
                         "supported: meshfold renormalises sigmoid weights only for top-k > 1")
    return TransformerConfig(
        vocab=c["vocab_size"], hidden=H, layers=c["num_hidden_layers"], heads=c["num_attention_heads"],
        ffn=c["intermediate_size"], moe=moe, first_k_dense=c["first_k_dense_replace"],
        tie_embeddings=bool(c["tie_word_embeddings"]), rope_theta=theta, norm_eps=float(c["rms_norm_eps"]),
        max_seq=max_seq, mla=mla, mtp_depth=int(c.get("num_nextn_predict_layers") or 0))


def config_to_hf(cfg, dtype_name: str | None = None) -> dict:
    """:class:`TransformerConfig` (with ``mla``) -> a DeepseekV3 ``config.json`` dict; raises
    ValueError naming every feature DeepSeek-V3 cannot express."""
    m, a = cfg.moe, cfg.mla
    bad = []
    if a is None:
        bad.append("mla=None (DeepSeek-V3 attention is MLA)")
    if m is None:
        bad.append("moe=None")
    else:
        if m.score_function != "sigmoid" or not m.expert_bias:
            bad.append(f"score_function={m.score_function!r}, expert_bias={m.expert_bias} (needs sigmoid, True)")
        groups = m.num_groups or 1
        if m.num_groups is not None and (m.group_score_topk or m.topk // m.group_topk) != min(2, m.num_experts // groups):
            bad.append(f"group_score_topk={m.group_score_topk} (HF scores a group by its best 2 experts)")
        if m.shared_ffn and (m.shared_kind != "deepseek" or m.shared_ffn % m.ffn):
            bad.append(f"shared_ffn={m.shared_ffn}, shared_kind={m.shared_kind!r} (needs an ungated multiple "
                       f"of ffn = {m.ffn})")
        if m.expert_kind != "swiglu":
            bad.append(f"expert_kind={m.expert_kind!r}")
        if cfg.moe_every != 1:
            bad.append(f"moe_every={cfg.moe_every} (every layer from first_k_dense_replace is MoE)")
    if bad:
        raise ValueError(f"{ARCH} cannot express this config: " + "; ".join(bad))
    rope = dict(rope_theta=cfg.rope_theta, rope_type="default")
    if a.yarn is not None:
        y = a.yarn
        rope = dict(rope_theta=cfg.rope_theta, rope_type="yarn", factor=y.factor,
                    original_max_position_embeddings=y.original_max_seq, beta_fast=y.beta_fast,
                    beta_slow=y.beta_slow, truncate=y.truncate,
                    **{k: v for k, v in dict(mscale=y.mscale, mscale_all_dim=y.mscale_all_dim,
                                             attention_factor=y.attention_factor).items() if v is not None})
    hf = dict(architectures=[ARCH], model_type="deepseek_v3", vocab_size=cfg.vocab, hidden_size=cfg.hidden,
              num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads,
              intermediate_size=cfg.ffn or m.ffn, moe_intermediate_size=m.ffn, n_routed_experts=m.num_experts,
              n_shared_experts=m.shared_ffn // m.ffn, num_experts_per_tok=m.topk,
              n_group=m.num_groups or 1, topk_group=m.group_topk or 1, norm_topk_prob=m.renormalize,
              routed_scaling_factor=m.topk_scaling_factor or 1.0, first_k_dense_replace=cfg.first_k_dense,
              q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim,
              qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim, rope_interleave=a.rope_interleave,
              hidden_act="silu", max_position_embeddings=cfg.max_seq, rms_norm_eps=cfg.norm_eps,
              rope_parameters=rope, tie_word_embeddings=cfg.tie_embeddings, attention_bias=False,
              num_nextn_predict_layers=cfg.mtp_depth)
    if dtype_name is not None:
        hf["dtype"] = dtype_name
    return hf


def checkpoint_map(cfg) -> dict:
    """meshfold name -> recipe (:mod:`meshfold.interop.recipes`), for the parameters and the
    expert-bias buffers."""
    r = {"embed.weight": Leaf("model.embed_tokens.weight"), "norm.weight": Leaf("model.norm.weight")}
    if not cfg.tie_embeddings:
        r["head.weight"] = Leaf("lm_head.weight")
    for i in range(cfg.layers):
        _layer(r, cfg, i, f"model.layers.{i}", f"layers.{i}")
    for k in range(cfg.mtp_depth):
        hf, mf = f"model.layers.{cfg.layers + k}", f"mtp.{k}"
        for ours, theirs in (("emb_norm", "enorm"), ("hidden_norm", "hnorm"), ("proj", "eh_proj"),
                             ("head_norm", "shared_head.norm")):
            r[f"{mf}.{ours}.weight"] = Leaf(f"{hf}.{theirs}.weight")
        _layer(r, cfg, cfg.layers + k, hf, f"{mf}.block")
    return r


def mtp_copies(cfg) -> dict[str, str]:
    """Checkpoint key -> the meshfold parameter it copies: each MTP layer's ``embed_tokens`` and
    ``shared_head.head`` (DeepSeek-V3 stores the shared embedding and head again in each)."""
    out = {}
    for k in range(cfg.mtp_depth):
        hf = f"model.layers.{cfg.layers + k}"
        out[f"{hf}.embed_tokens.weight"] = "embed.weight"
        out[f"{hf}.shared_head.head.weight"] = "embed.weight" if cfg.tie_embeddings else "head.weight"
    return out


def _layer(r: dict, cfg, i: int, hf: str, mf: str) -> None:
    """The recipes of decoder layer ``i`` (checkpoint prefix ``hf``) into meshfold block ``mf``."""
    att = f"{hf}.self_attn"
    r[f"{mf}.attn_norm.weight"] = Leaf(f"{hf}.input_layernorm.weight")
    r[f"{mf}.mlp_norm.weight"] = Leaf(f"{hf}.post_attention_layernorm.weight")
    if cfg.mla.q_lora_rank is None:
        r[f"{mf}.attn.wq"] = linear(f"{att}.q_proj.weight")
    else:
        r[f"{mf}.attn.wq_a.weight"] = linear(f"{att}.q_a_proj.weight")
        r[f"{mf}.attn.q_norm.weight"] = Leaf(f"{att}.q_a_layernorm.weight")
        r[f"{mf}.attn.wq_b"] = linear(f"{att}.q_b_proj.weight")
    r[f"{mf}.attn.wkv_a.weight"] = linear(f"{att}.kv_a_proj_with_mqa.weight")
    r[f"{mf}.attn.kv_norm.weight"] = Leaf(f"{att}.kv_a_layernorm.weight")
    r[f"{mf}.attn.wkv_b"] = linear(f"{att}.kv_b_proj.weight")
    r[f"{mf}.attn.wo"] = linear(f"{att}.o_proj.weight")
    blk = f"{hf}.mlp"
    if not cfg.is_moe_layer(i):
        r[f"{mf}.mlp.w_gate_up"] = gate_up(blk, "gate_proj", "up_proj")
        r[f"{mf}.mlp.w_down"] = linear(f"{blk}.down_proj.weight")
        return
    E = range(cfg.moe.num_experts)
    r[f"{mf}.mlp.router.weight"] = Leaf(f"{blk}.gate.weight")
    r[f"{mf}.mlp.router.expert_bias"] = Leaf(f"{blk}.gate.e_score_correction_bias")
    r[f"{mf}.mlp.experts.w_gate_up"] = Stack(tuple(gate_up(f"{blk}.experts.{e}", "gate_proj", "up_proj")
                                                   for e in E), 0)
    r[f"{mf}.mlp.experts.w_down"] = Stack(tuple(linear(f"{blk}.experts.{e}.down_proj.weight") for e in E), 0)
    if cfg.moe.shared_ffn:
        r[f"{mf}.mlp.shared.w_gate_up"] = gate_up(f"{blk}.shared_experts", "gate_proj", "up_proj")
        r[f"{mf}.mlp.shared.w_down"] = linear(f"{blk}.shared_experts.down_proj.weight")
