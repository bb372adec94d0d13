"""What a run may choose, defined once, in plain Python: meshfold's own modes and named models.

The layers above read these lists instead of keeping copies: ``meshfold.parallel`` validates
its arguments against them, ``meshfold.train.config`` offers them as settings, and the planner
(:mod:`meshfold.plan`, which imports no torch) enumerates them. The named model configs are plain
numbers here; :mod:`meshfold.models.configs` builds ``TransformerConfig`` objects of them and
:mod:`meshfold.plan.models` the planner's ``ModelShape``.

* :data:`RECOMPUTE`: activation recomputation of every block (``meshfold.parallel.recompute``).
* :data:`SCHEDULES`: pipeline schedules (``meshfold.parallel.pipeline``, torch's
  ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
  ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``).
* :data:`DATA_PARALLEL`: FSDP2 shards parameters, gradients and optimizer state; ``allreduce``
  keeps whole replicas and sums gradients once per step (``meshfold.parallel.data_parallel``).
* :data:`MODEL_CONFIGS`: ``{name: fields}``, the fields of ``TransformerConfig`` with ``moe``
  (``MoEConfig`` fields), ``mla`` (``MLAConfig`` fields) and ``mla["yarn"]`` (``YaRN`` fields) as
  nested dicts; a field left out takes the dataclass's default.

Sources of the named models: the shapes of the paper's models from arXiv 2504.14960 (its
Table 1); the other fields (rope_theta, norm eps, context, vocab, dense ffn) from the models'
public Hugging Face ``config.json`` files (mistralai/Mixtral-8x7B-v0.1,
mistralai/Mixtral-8x22B-v0.1, Qwen/Qwen2-57B-A14B, Qwen/Qwen3-30B-A3B, allenai/OLMoE-1B-7B,
deepseek-ai/DeepSeek-V3, deepseek-ai/DeepSeek-V2-Lite).
"""

from __future__ import annotations

__all__ = ["RECOMPUTE", "SCHEDULES", "V_SCHEDULES", "ZERO_BUBBLE", "rank_chunks", "remote_neighbours", "DATA_PARALLEL", "MODEL_CONFIGS", "check_choice"]

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")  # two chunks a rank in a V: rank r holds chunks r and 2 pp - 1 - r
ZERO_BUBBLE = ("interleaved-zb", "zbv", "dualpipev")  # split each backward: input gradients, then weights
DATA_PARALLEL = ("fsdp", "allreduce")


def rank_chunks(pp: int, virtual: int, rank: int, schedule: str) -> list[int]:
    """The model chunks (pipeline stages, of ``pp * virtual``) pipeline rank ``rank`` holds:
    ``rank, rank + pp, ...`` (a loop), or ``rank`` and ``2 pp - 1 - rank`` under the V
    schedules (:data:`V_SCHEDULES`), where the first and the last chunk share rank 0."""
    if schedule in V_SCHEDULES:
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(virtual)]


def remote_neighbours(pp: int, virtual: int, rank: int, schedule: str) -> int:
    """How many of its chunks' neighbouring chunks (the one before, the one after) pipeline rank
    ``rank`` hands over to another rank: each such pair sends and receives once per micro-batch
    each way (activations forward, their gradients back). In a V the turn is on one rank."""
    mine = rank_chunks(pp, virtual, rank, schedule)
    n = pp * virtual
    return sum(c + 1 < n and c + 1 not in mine for c in mine) + sum(c > 0 and c - 1 not in mine for c in mine)


def check_choice(what: str, value, valid: tuple) -> str:
    """``value`` if it is one of ``valid``, else ``ValueError`` naming ``what``, the value and the choices."""
    if value not in valid:
        raise ValueError(f"{what} = {value!r}; valid: {list(valid)}")
    return value


def _mixtral(vocab, hidden, layers, heads, kv_heads, ffn, experts, topk, max_seq) -> dict:
    # HF Mixtral: softmax over all experts, top-k, renormalised; rope_theta 1e6, rms eps 1e-5
    moe = dict(hidden=hidden, ffn=ffn, num_experts=experts, topk=topk, score_function="softmax",
               pre_softmax=True, renormalize=True)
    return dict(vocab=vocab, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, ffn=ffn, moe=moe,
                rope_theta=1e6, norm_eps=1e-5, max_seq=max_seq)


def _deepseek_v3(vocab, hidden, layers, heads, ffn, moe_ffn, experts, topk, groups, topk_groups, shared,
                 first_k_dense, mla, max_seq, scaling=2.5) -> dict:
    # HF DeepseekV3ForCausalLM: sigmoid scores, e_score_correction_bias (selection only), a group
    # scores its best 2 experts, top-k weights renormalised (norm_topk_prob) and scaled
    # (routed_scaling_factor); ungated shared experts of n_shared_experts * moe_intermediate_size
    moe = dict(hidden=hidden, ffn=moe_ffn, num_experts=experts, topk=topk, score_function="sigmoid",
               renormalize=True, topk_scaling_factor=scaling, num_groups=groups, group_topk=topk_groups,
               group_score_topk=2, expert_bias=True, shared_ffn=shared * moe_ffn, shared_kind="deepseek")
    return dict(vocab=vocab, hidden=hidden, layers=layers, heads=heads, ffn=ffn, moe=moe,
                first_k_dense=first_k_dense, rope_theta=1e4, norm_eps=1e-6, max_seq=max_seq, mla=mla)


def _replace(cfg: dict, **moe) -> dict:
    return {**cfg, "moe": {**cfg["moe"], **moe}}


_MIXTRAL_8X22B = _mixtral(32000, 6144, 56, 48, 8, 16384, 8, 2, 65536)

MODEL_CONFIGS: dict[str, dict] = {
    # mistralai/Mixtral-8x7B-v0.1
    "mixtral-8x7b": _mixtral(32000, 4096, 32, 32, 8, 14336, 8, 2, 32768),
    # mistralai/Mixtral-8x22B-v0.1; paper Table 1
    "mixtral-8x22b": _MIXTRAL_8X22B,
    # paper's G8T8: Mixtral-8x22B with 64 experts of ffn 2048, top-8 (fine-grained experts)
    "mixtral-8x22b-g8t8": _replace(_MIXTRAL_8X22B, ffn=2048, num_experts=64, topk=8),
    # Qwen/Qwen2-57B-A14B: 64 experts top-8 without renormalisation, sigmoid-gated shared expert,
    # qkv bias; dense intermediate_size 18944 (unused: every layer is MoE)
    "qwen2-57b-a14b": dict(
        vocab=151936, hidden=3584, layers=28, heads=28, kv_heads=4, ffn=18944, qkv_bias=True,
        rope_theta=1e6, norm_eps=1e-6, max_seq=131072,
        moe=dict(hidden=3584, ffn=2560, num_experts=64, topk=8, renormalize=False, shared_ffn=20480,
                 shared_kind="qwen2")),
    # Qwen/Qwen3-30B-A3B: head_dim 128 (not hidden/heads = 64), q/k RMSNorm, 128 experts top-8
    # renormalised (norm_topk_prob), no shared expert; dense intermediate_size 6144 (unused)
    "qwen3-30b-a3b": dict(
        vocab=151936, hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, ffn=6144, qk_norm=True,
        rope_theta=1e6, norm_eps=1e-6, max_seq=40960,
        moe=dict(hidden=2048, ffn=768, num_experts=128, topk=8, renormalize=True)),
    # Llama-3-70B upcycled to 8 experts, top-2 (the paper's Llama3-8x70B): hidden 8192, 80 layers,
    # 64 heads, 8 KV groups, FFN 28672, vocab 128256, rope_theta 5e5
    "llama3-8x70b": _mixtral(128256, 8192, 80, 64, 8, 28672, 8, 2, 8192),
    # allenai/OLMoE-1B-7B: 64 experts top-8 without renormalisation, q/k norms
    "olmoe-1b-7b": dict(
        vocab=50304, hidden=2048, layers=16, heads=16, kv_heads=16, ffn=1024, qk_norm=True,
        rope_theta=1e4, norm_eps=1e-5, max_seq=4096,
        moe=dict(hidden=2048, ffn=1024, num_experts=64, topk=8, renormalize=False)),
    # deepseek-ai/DeepSeek-V3 config.json: 61 layers (the first 3 dense, ffn 18432), 128 heads,
    # q_lora_rank 1536, kv_lora_rank 512, qk_nope/rope/v head dims 128/64/128, 256 routed experts
    # of 2048 + 1 shared, top-8 in 4 of 8 groups, routed_scaling_factor 2.5, vocab 129280, YaRN
    # factor 40 over 4096 positions (beta 32/1, mscale = mscale_all_dim = 1), 163840 positions.
    # Its multi-token-prediction layer (num_nextn_predict_layers = 1) is model.mtp_depth = 1, off here
    # (a planner shape; from_pretrained of the checkpoint builds it).
    "deepseek-v3-671b": _deepseek_v3(
        129280, 7168, 61, 128, 18432, 2048, 256, 8, 8, 4, 1, 3, max_seq=163840,
        mla=dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                 v_head_dim=128, yarn=dict(factor=40.0, original_max_seq=4096, mscale=1.0, mscale_all_dim=1.0))),
    # deepseek-ai/DeepSeek-V2-Lite (15.7B, a planner shape): 27 layers (the first dense, ffn 10944),
    # 16 heads, no q latent (q_lora_rank null), kv_lora_rank 512, 64 routed experts of 1408 + 2
    # shared, softmax top-6 without renormalisation (V2's greedy routing), YaRN factor 40 with
    # mscale = mscale_all_dim = 0.707, vocab 102400
    "deepseek-v2-lite": dict(
        vocab=102400, hidden=2048, layers=27, heads=16, ffn=10944, first_k_dense=1, rope_theta=1e4,
        norm_eps=1e-6, max_seq=163840,
        moe=dict(hidden=2048, ffn=1408, num_experts=64, topk=6, renormalize=False, shared_ffn=2 * 1408,
                 shared_kind="deepseek"),
        mla=dict(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                 v_head_dim=128, yarn=dict(factor=40.0, original_max_seq=4096, mscale=0.707,
                                           mscale_all_dim=0.707))),
    # a small planner shape (also trainable on a CPU, slowly)
    "tiny-moe": _mixtral(1024, 512, 4, 8, 2, 1024, 8, 2, 4096),
    # ---- tiny CPU variants: same families, small enough for unit tests -----------------------
    "tiny-mixtral": _mixtral(256, 64, 2, 4, 2, 128, 4, 2, 512),
    # Qwen2-MoE with dense layers between MoE layers (decoder_sparse_step = 2: layers 1, 3 are MoE)
    "tiny-qwen2-moe": dict(
        vocab=256, hidden=64, layers=4, heads=4, kv_heads=2, ffn=96, qkv_bias=True, moe_every=2,
        first_k_dense=1, rope_theta=1e6, norm_eps=1e-6, max_seq=512,
        moe=dict(hidden=64, ffn=32, num_experts=8, topk=4, renormalize=False, shared_ffn=48,
                 shared_kind="qwen2")),
    # Qwen3-MoE with head_dim != hidden / heads and a dense first layer (mlp_only_layers = [0])
    "tiny-qwen3-moe": dict(
        vocab=256, hidden=64, layers=3, heads=4, kv_heads=2, head_dim=32, ffn=96, qk_norm=True,
        first_k_dense=1, rope_theta=1e6, norm_eps=1e-6, max_seq=512,
        moe=dict(hidden=64, ffn=32, num_experts=8, topk=2, renormalize=True)),
    # DeepSeek-V3 in miniature: MLA with both latents and YaRN, a dense first layer, 8 experts in
    # 4 groups (top-4 of 2 groups), a shared expert, sigmoid routing with the correction bias
    "tiny-deepseek-v3": _deepseek_v3(
        256, 64, 3, 4, 96, 32, 8, 4, 4, 2, 1, 1, max_seq=512,
        mla=dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                 yarn=dict(factor=4.0, original_max_seq=128, mscale=1.0, mscale_all_dim=1.0))),
}
