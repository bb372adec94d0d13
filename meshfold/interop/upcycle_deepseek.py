"""Upcycling into DeepSeek-V3: a *dense* ``DeepseekV3ForCausalLM`` -> the same model with routed
experts, equal to it at initialization (the statement and its condition: :mod:`.upcycle`).

Why the source must be a dense DeepSeek-V3 and not a Llama / Mistral / Qwen2: DeepSeek-V3's
attention is MLA, and a GQA attention has no exact MLA form. MLA RMS-normalises its key/value
latent per token (a nonlinearity a linear re-factoring cannot absorb) and gives all heads one
shared RoPE key of ``qk_rope_head_dim`` dims, where GQA rotates every dim of each kv head's key.
So the attention is copied, never converted: the source is a DeepSeek-V3 whose layers are all
dense (``first_k_dense_replace >= num_hidden_layers``, which transformers builds and saves), and
only its MLPs become experts.

The router is DeepSeek-V3's with settings that keep :mod:`.upcycle`'s coarse and granular
statements (legend as there: E copies, G slices, k copies per token, N = E*G experts):

* sigmoid scores, ``e_score_correction_bias = 0`` (it only selects, so it never moves the
  weights), ``norm_topk_prob = true``, ``routed_scaling_factor = 1``: the weights of a token are
  ``s_j / (sum_i s_i + 1e-20)`` over its k*G chosen experts, summing to 1 (the 1e-20 vanishes
  in fp32 unless the chosen scores sum below ~1.7e-13, every chosen logit below about -30).
  k*G >= 2 is required: meshfold's sigmoid router gives a lone expert its score, not 1.
* no shared expert by default (``n_shared_experts = 0``; transformers builds it with zero elements
  and lists them as missing on load, harmless as for Qwen2-MoE): a shared branch adds to every
  token, and the dense MLP is already all of the output. ``shared_slices = S`` (0 < S < G) makes
  one exactly: the first S slices of the dense ffn (rows ``0 .. S*F/G``, down unscaled) are the
  shared expert (``n_shared_experts = S`` of ``moe_intermediate_size = F/G``), the other R = G - S
  slices of each copy are routed (N = E*R experts, top-k*R, down scaled by R, router rows
  repeated R times), so the output is ``shared + MLP_rest = MLP`` under the same condition with
  R in place of G; with R = 1 a copy's routed part is one expert and it holds for any router.
* layers ``first_dense`` .. L-1 get experts (default 0: every layer, as the other targets); the
  layers before keep their dense MLP, as ``first_k_dense_replace`` describes.
* ``n_group`` routing groups (default 1), each a union of whole copies (n_group must divide E),
  ``topk_group`` of them kept (default all). A group scores the sum of its best 2 scores: with
  G >= 2 twice its best copy's score, with G = 1 (coarse) anything, as coarse holds for any
  routing. So the chosen slices are those of the best copies among the kept groups', and the
  granular condition becomes: **the k-th and (k+1)-th best copy scores among the kept groups'
  copies differ** (after the sigmoid, in fp32). With ``n_group = E, topk_group = k`` (one group
  per copy, G >= 2) exactly k*G experts survive the group mask, so whole virtual groups are
  routed *for every token, ties included*; the price is that this stays true in training (a
  token always takes all G slices of its copies) until n_group is lowered in the config.
"""

from __future__ import annotations

from meshfold.interop import hf_deepseek

__all__ = ["ARCH", "dense_config", "moe_config", "expert_keys", "router_keys", "shared_keys"]

ARCH = hf_deepseek.ARCH


def dense_config(src, hf: dict) -> dict:
    """``config.json`` of a dense DeepSeek-V3 checkpoint with the class defaults filled in; a
    ValueError when it has MoE layers already."""
    c = {**hf_deepseek.DEFAULTS, **{key: v for key, v in hf.items() if v is not None}}
    if "q_lora_rank" in hf and hf["q_lora_rank"] is None:  # null: a plain q projection
        c["q_lora_rank"] = None
    L, K = c["num_hidden_layers"], c["first_k_dense_replace"]
    if K < L:
        raise ValueError(f"SRC {src} is a {ARCH} with MoE layers from layer {K} (first_k_dense_replace = {K} < "
                         f"num_hidden_layers = {L}); upcycle needs a dense one (first_k_dense_replace >= {L})")
    return c


def moe_config(c: dict, experts: int, topk: int, granularity: int, first_dense: int | None,
               n_group: int | None, topk_group: int | None, shared_slices: int | None = None):
    """(meshfold TransformerConfig, ``config.json`` dict) of the upcycled DeepSeek-V3: layers
    ``first_dense`` .. L-1 MoE (default 0: every layer, as the other targets), sigmoid routing with a
    zero correction bias, ``norm_topk_prob = true``, ``routed_scaling_factor = 1``, no shared expert,
    ``n_group`` routing groups of whole copies (default 1: no group limit) of which ``topk_group``
    are kept (default: all), ``shared_slices`` S of the G slices in one shared expert (default 0;
    each copy then has R = G - S routed slices, N = E*R). Each bad argument is a one-line
    ValueError naming what is valid."""
    E, k, G, L = experts, topk, granularity, c["num_hidden_layers"]
    S = 0 if shared_slices is None else shared_slices
    if not (isinstance(S, int) and 0 <= S < G):
        raise ValueError(f"--shared-slices {S!r} must leave each copy a routed slice (valid: 0..{G - 1} for "
                         f"--granularity {G})")
    R = G - S  # routed slices per copy
    K = 0 if first_dense is None else first_dense
    ng = 1 if n_group is None else n_group
    tg = ng if topk_group is None else topk_group
    if not (isinstance(K, int) and 0 <= K < L):
        raise ValueError(f"--first-dense {K!r}: layers before it stay dense, so it must leave an MoE layer "
                         f"(valid: 0..{L - 1} for num_hidden_layers = {L})")
    if k * R < 2:
        raise ValueError(f"--topk {k} --granularity {G} --shared-slices {S} routes each token to 1 expert, "
                         f"whose DeepSeek-V3 weight in meshfold is its sigmoid score, not 1 (valid: topk * (G - S) "
                         f">= 2)")
    if not (isinstance(ng, int) and ng >= 1 and E % ng == 0):
        raise ValueError(f"--n-group {ng!r} does not divide --experts {E}: a routing group must hold whole "
                         f"copies of the MLP (valid: {[d for d in range(1, E + 1) if E % d == 0]})")
    if E * R // ng < 2:
        raise ValueError(f"--n-group {ng} leaves 1 expert per group; DeepSeek-V3 scores a group by its best 2 "
                         f"(valid: {[d for d in range(1, E + 1) if E % d == 0 and E * R // d >= 2]})")
    if not (isinstance(tg, int) and 1 <= tg <= ng):
        raise ValueError(f"--topk-group {tg!r} must be in 1..--n-group {ng}")
    if k > tg * (E // ng):
        raise ValueError(f"--topk {k} exceeds the {tg * (E // ng)} copies in --topk-group {tg} groups of "
                         f"{E // ng} (valid --topk: 1..{tg * (E // ng)})")
    hf = {**c, "architectures": [ARCH], "n_routed_experts": E * R,
          "moe_intermediate_size": c["intermediate_size"] // G, "num_experts_per_tok": k * R,
          "n_shared_experts": S, "n_group": ng, "topk_group": tg, "norm_topk_prob": True,
          "routed_scaling_factor": 1.0, "first_k_dense_replace": K,
          "num_nextn_predict_layers": 0}  # upcycling writes no multi-token-prediction layer
    cfg = hf_deepseek.config_from_hf(hf)
    out = hf_deepseek.config_to_hf(cfg, c.get("dtype") or c.get("torch_dtype"))
    return cfg, out


def expert_keys(layer: int, expert: int) -> tuple[str, str, str]:
    """(gate, up, down) checkpoint keys of one routed expert (the names :mod:`.hf_deepseek` reads)."""
    p = f"model.layers.{layer}.mlp.experts.{expert}"
    return f"{p}.gate_proj.weight", f"{p}.up_proj.weight", f"{p}.down_proj.weight"


def shared_keys(layer: int) -> tuple[str, str, str]:
    """(gate, up, down) checkpoint keys of one layer's shared expert."""
    p = f"model.layers.{layer}.mlp.shared_experts"
    return f"{p}.gate_proj.weight", f"{p}.up_proj.weight", f"{p}.down_proj.weight"


def router_keys(layer: int) -> tuple[str, str]:
    """(gate weight [N, H], e_score_correction_bias [N]) keys of one MoE layer."""
    return f"model.layers.{layer}.mlp.gate.weight", f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
