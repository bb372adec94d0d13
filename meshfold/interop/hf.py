"""Hugging Face checkpoints in and out: Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 (whose names
and config mapping live in :mod:`meshfold.interop.hf_deepseek`).

A checkpoint directory is ``config.json`` plus ``*.safetensors`` (one file, or shards listed in
``model.safetensors.index.json``) with the per-expert key names that transformers'
``save_pretrained`` writes (5.x fuses experts in memory but still writes these)::

    model.embed_tokens.weight [V, H]              lm_head.weight [V, H] (absent when tied)
    model.norm.weight [H]                         model.layers.N.{input,post_attention}_layernorm.weight [H]
    model.layers.N.self_attn.{q,k,v,o}_proj.weight [out, in]   (+ q/k/v .bias: Qwen2-MoE)
    model.layers.N.self_attn.{q,k}_norm.weight [d]             (Qwen3-MoE)
    Mixtral:  model.layers.N.block_sparse_moe.gate.weight [E, H]
              model.layers.N.block_sparse_moe.experts.E.{w1 (gate), w3 (up)}.weight [F, H], w2 (down) [H, F]
    Qwen:     model.layers.N.mlp.gate.weight [E, H]
              model.layers.N.mlp.experts.E.{gate_proj, up_proj}.weight [F, H], down_proj [H, F]
              model.layers.N.mlp.shared_expert.{gate,up,down}_proj.weight,
              model.layers.N.mlp.shared_expert_gate.weight [1, H]          (Qwen2-MoE)
              model.layers.N.mlp.{gate,up,down}_proj.weight                (dense layers)

Each meshfold parameter has a *recipe* (:mod:`meshfold.interop.recipes`: a ``Leaf`` = one
checkpoint tensor, maybe transposed; a ``Stack`` = parts stacked along a dim, e.g. experts along 0
and gate/up along the ``2`` axis of ``w_gate_up``), so :func:`load_state` can turn any slice of a
meshfold parameter into slices of checkpoint tensors and read only those
(``safe_open(...).get_slice``): a folded layout asks each rank's shard through ``select``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from meshfold.interop import hf_deepseek
from meshfold.interop.recipes import Leaf, Stack, gate_up, leaves, linear
from meshfold.models.config import MoEConfig
from meshfold.models.transformer import MoETransformer, TransformerConfig

__all__ = ["SUPPORTED", "config_from_hf", "checkpoint_config", "config_to_hf", "infer_architecture", "checkpoint_map", "load_state", "save_mapped",
           "from_pretrained", "save_pretrained", "Leaf", "Stack"]

SUPPORTED = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", hf_deepseek.ARCH)
_MODEL_TYPE = {"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
               "Qwen3MoeForCausalLM": "qwen3_moe", hf_deepseek.ARCH: "deepseek_v3"}
# transformers 5.24 config defaults for the fields read here (config.json may omit defaults)
_DEFAULTS = {
    "MixtralForCausalLM": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                               max_position_embeddings=4096 * 32, rms_norm_eps=1e-5, rope_theta=1e6,
                               num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.0),
    "Qwen2MoeForCausalLM": dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                                num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                                max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=10000.0,
                                decoder_sparse_step=1, moe_intermediate_size=1408,
                                shared_expert_intermediate_size=5632, num_experts_per_tok=4,
                                num_experts=60, norm_topk_prob=False, qkv_bias=True),
    "Qwen3MoeForCausalLM": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=4,
                                max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=10000.0,
                                decoder_sparse_step=1, moe_intermediate_size=768, num_experts_per_tok=8,
                                num_experts=128, norm_topk_prob=False, attention_bias=False),
}

Slices = tuple  # one slice per dim of a meshfold parameter
Select = Callable[[str], "Slices | None"]


# ---------------------------------------------------------------------------- configs


def _architecture(hf: dict) -> str:
    archs = hf.get("architectures") or [None]
    if archs[0] not in SUPPORTED:
        raise ValueError(f"unsupported architecture {archs[0]!r} (config.json 'architectures' = {archs}); "
                         f"supported: {list(SUPPORTED)}")
    return archs[0]


def _moe_pattern(moe_ids: list[int], layers: int) -> tuple[int, int]:
    """(first_k_dense, moe_every) that reproduce the MoE layer ids exactly."""
    if not moe_ids:
        raise ValueError("the checkpoint's config has no MoE layer (all layers in mlp_only_layers?)")
    first = moe_ids[0]
    every = moe_ids[1] - moe_ids[0] if len(moe_ids) > 1 else max(1, layers - first)
    if [i for i in range(first, layers) if (i - first) % every == 0] != moe_ids:
        raise ValueError(f"MoE layers {moe_ids} of {layers} are not 'every {every} from layer {first}'; "
                         f"meshfold expresses MoE placement as first_k_dense + moe_every")
    return first, every


def config_from_hf(hf: dict) -> TransformerConfig:
    """A Hugging Face ``config.json`` dict -> :class:`TransformerConfig`.

    Not carried over: HF's load-balancing loss (it is Switch-style over all layers' logits
    concatenated, not a per-layer loss: set ``MoEConfig.aux_loss_coeff`` yourself).
    """
    arch = _architecture(hf)
    if arch == hf_deepseek.ARCH:
        return hf_deepseek.config_from_hf(hf)
    c = {**_DEFAULTS[arch], **{k: v for k, v in hf.items() if v is not None}}
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act = {c['hidden_act']!r}; meshfold's experts are SwiGLU (valid: 'silu')")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_type = {rope_type!r} is not supported (valid: 'default')")
    theta = float(rope.get("rope_theta", c["rope_theta"]))
    if arch == "MixtralForCausalLM" and hf.get("sliding_window") is not None:
        raise ValueError(f"sliding_window = {hf['sliding_window']} is not supported (valid: null)")
    if arch != "MixtralForCausalLM" and c.get("use_sliding_window", False):
        raise ValueError("use_sliding_window = true is not supported (valid: false)")
    if arch == "Qwen3MoeForCausalLM" and c["attention_bias"]:
        raise ValueError("Qwen3-MoE attention_bias = true (bias on q/k/v/o) is not supported (valid: false)")

    L, H, heads = c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"]
    # an explicit null means "no GQA" (HF's __post_init__); an absent key means the class default
    kv_heads = heads if "num_key_value_heads" in hf and hf["num_key_value_heads"] is None \
        else c["num_key_value_heads"]
    if arch == "MixtralForCausalLM":
        moe_ids = list(range(L))
        moe = MoEConfig(hidden=H, ffn=c["intermediate_size"], num_experts=c["num_local_experts"],
                        topk=c["num_experts_per_tok"], renormalize=True,
                        input_jitter=float(c["router_jitter_noise"]))
    else:
        step, dense = c["decoder_sparse_step"], set(c.get("mlp_only_layers") or [])
        moe_ids = [i for i in range(L) if i not in dense and (i + 1) % step == 0]
        shared = c["shared_expert_intermediate_size"] if arch == "Qwen2MoeForCausalLM" else 0
        # transformers 5.x maps Qwen3-MoE's num_experts to num_local_experts and writes only that
        experts = hf.get("num_experts") or hf.get("num_local_experts") or c["num_experts"]
        moe = MoEConfig(hidden=H, ffn=c["moe_intermediate_size"], num_experts=experts,
                        topk=c["num_experts_per_tok"], renormalize=bool(c["norm_topk_prob"]),
                        shared_ffn=shared, shared_kind="qwen2" if shared else None)
    first_k_dense, moe_every = _moe_pattern(moe_ids, L)
    return TransformerConfig(
        vocab=c["vocab_size"], hidden=H, layers=L, heads=heads,
        kv_heads=kv_heads, head_dim=c.get("head_dim") or H // heads,
        ffn=c["intermediate_size"], moe=moe, moe_every=moe_every, first_k_dense=first_k_dense,
        qkv_bias=arch == "Qwen2MoeForCausalLM" and bool(c["qkv_bias"]),
        qk_norm=arch == "Qwen3MoeForCausalLM", tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        rope_theta=theta, norm_eps=float(c["rms_norm_eps"]), max_seq=c["max_position_embeddings"])


def checkpoint_config(path) -> TransformerConfig:
    """The :class:`TransformerConfig` of a checkpoint folder: its ``config.json``
    (:func:`config_from_hf`), with as many multi-token-prediction depths as the checkpoint holds
    weights for, at most ``num_nextn_predict_layers``. transformers' own
    ``DeepseekV3ForCausalLM`` builds no MTP layer, so its ``save_pretrained`` writes
    ``num_nextn_predict_layers`` without their weights: such a checkpoint loads with none."""
    path = Path(path)
    cfg = config_from_hf(json.loads((path / "config.json").read_text()))
    if not cfg.mtp_depth:
        return cfg
    with ExitStack() as stack:
        keys = _Checkpoint(path, stack).where
    held = 0
    while held < cfg.mtp_depth and f"model.layers.{cfg.layers + held}.eh_proj.weight" in keys:
        held += 1
    return dataclasses.replace(cfg, mtp_depth=held)


def infer_architecture(cfg: TransformerConfig) -> str:
    """The HF architecture a config most naturally saves as (q/k norm: Qwen3-MoE; qkv bias, a
    shared expert or dense layers: Qwen2-MoE; otherwise Mixtral; MLA: DeepSeek-V3)."""
    if cfg.mla is not None:
        return hf_deepseek.ARCH
    if cfg.qk_norm:
        return "Qwen3MoeForCausalLM"
    if cfg.qkv_bias or (cfg.moe is not None and cfg.moe.shared_ffn) or len(cfg.moe_layer_ids) != cfg.layers:
        return "Qwen2MoeForCausalLM"
    return "MixtralForCausalLM"


def config_to_hf(cfg: TransformerConfig, arch: str | None = None, dtype: torch.dtype | None = None) -> dict:
    """:class:`TransformerConfig` -> a ``config.json`` dict for ``arch`` (default: inferred).
    Raises ValueError naming every feature the architecture cannot express."""
    arch = arch or infer_architecture(cfg)
    if arch not in SUPPORTED:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {list(SUPPORTED)}")
    if arch == hf_deepseek.ARCH:
        return hf_deepseek.config_to_hf(cfg, None if dtype is None else str(dtype).removeprefix("torch."))
    if cfg.mla is not None:
        raise ValueError(f"{arch} cannot express this config: mla (multi-head latent attention; "
                         f"valid architecture: {hf_deepseek.ARCH})")
    m = cfg.moe
    if m is None:
        raise ValueError("a dense model (moe = None) has no Hugging Face MoE architecture")
    bad = [f"mtp_depth={cfg.mtp_depth} (multi-token prediction; valid architecture: {hf_deepseek.ARCH})"
           ] if cfg.mtp_depth else []
    if m.score_function != "softmax" or not m.pre_softmax:
        bad.append(f"routing score_function={m.score_function!r}, pre_softmax={m.pre_softmax} "
                   f"(HF: softmax over all experts, then top-k)")
    if m.num_groups is not None or m.topk_scaling_factor is not None or m.expert_bias:
        bad.append("group-limited routing / topk_scaling_factor / expert_bias")
    if m.expert_kind != "swiglu":
        bad.append(f"expert_kind={m.expert_kind!r}")
    if m.shared_ffn and m.shared_kind != "qwen2":
        bad.append(f"shared_kind={m.shared_kind!r} (HF Qwen2-MoE gates its shared expert)")
    need = {"MixtralForCausalLM": dict(qk_norm=False, qkv_bias=False, shared=False, all_moe=True, renorm=True),
            "Qwen2MoeForCausalLM": dict(qk_norm=False),
            "Qwen3MoeForCausalLM": dict(qk_norm=True, qkv_bias=False, shared=False)}[arch]
    have = dict(qk_norm=cfg.qk_norm, qkv_bias=cfg.qkv_bias, shared=bool(m.shared_ffn),
                all_moe=len(cfg.moe_layer_ids) == cfg.layers, renorm=m.renormalize)
    bad += [f"{k}={have[k]} (needs {v})" for k, v in need.items() if have[k] != v]
    if bad:
        raise ValueError(f"{arch} cannot express this config: " + "; ".join(bad))
    hf = dict(architectures=[arch], model_type=_MODEL_TYPE[arch], vocab_size=cfg.vocab,
              hidden_size=cfg.hidden, num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
              num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
              max_position_embeddings=cfg.max_seq, rms_norm_eps=cfg.norm_eps,
              rope_parameters=dict(rope_theta=cfg.rope_theta, rope_type="default"),
              tie_word_embeddings=cfg.tie_embeddings, num_experts_per_tok=m.topk)
    if dtype is not None:
        hf["dtype"] = str(dtype).removeprefix("torch.")
    if arch == "MixtralForCausalLM":
        hf.update(intermediate_size=m.ffn, num_local_experts=m.num_experts, sliding_window=None,
                  router_jitter_noise=m.input_jitter)
    else:
        hf.update(intermediate_size=cfg.ffn or m.ffn, num_experts=m.num_experts, num_local_experts=m.num_experts,
                  moe_intermediate_size=m.ffn,
                  norm_topk_prob=m.renormalize, decoder_sparse_step=1, use_sliding_window=False,
                  mlp_only_layers=[i for i in range(cfg.layers) if not cfg.is_moe_layer(i)])
        if arch == "Qwen2MoeForCausalLM":
            hf.update(shared_expert_intermediate_size=m.shared_ffn, qkv_bias=cfg.qkv_bias)
        else:
            hf.update(attention_bias=False)
    return hf


# ---------------------------------------------------------------------------- recipes


def checkpoint_map(cfg: TransformerConfig, arch: str) -> dict[str, Leaf | Stack]:
    """meshfold parameter name (and buffer name, for checkpointed buffers such as DeepSeek-V3's
    expert bias) -> recipe over checkpoint tensors of ``arch``."""
    if arch == hf_deepseek.ARCH:
        return hf_deepseek.checkpoint_map(cfg)
    mixtral = arch == "MixtralForCausalLM"
    r: dict[str, Leaf | Stack] = {"embed.weight": Leaf("model.embed_tokens.weight"),
                                  "norm.weight": Leaf("model.norm.weight")}
    if not cfg.tie_embeddings:
        r["head.weight"] = Leaf("lm_head.weight")
    for i in range(cfg.layers):
        hf, mf = f"model.layers.{i}", f"layers.{i}"
        r[f"{mf}.attn_norm.weight"] = Leaf(f"{hf}.input_layernorm.weight")
        r[f"{mf}.mlp_norm.weight"] = Leaf(f"{hf}.post_attention_layernorm.weight")
        for w, p in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "o")):
            r[f"{mf}.attn.w{w}"] = linear(f"{hf}.self_attn.{p}_proj.weight")
        if cfg.qkv_bias:
            for w in "qkv":
                r[f"{mf}.attn.b{w}"] = Leaf(f"{hf}.self_attn.{w}_proj.bias")
        if cfg.qk_norm:
            for w in "qk":
                r[f"{mf}.attn.{w}_norm.weight"] = Leaf(f"{hf}.self_attn.{w}_norm.weight")
        if not cfg.is_moe_layer(i):
            r[f"{mf}.mlp.w_gate_up"] = gate_up(f"{hf}.mlp", "gate_proj", "up_proj")
            r[f"{mf}.mlp.w_down"] = linear(f"{hf}.mlp.down_proj.weight")
            continue
        blk = f"{hf}.block_sparse_moe" if mixtral else f"{hf}.mlp"
        gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        E = range(cfg.moe.num_experts)
        r[f"{mf}.mlp.router.weight"] = Leaf(f"{blk}.gate.weight")
        r[f"{mf}.mlp.experts.w_gate_up"] = Stack(tuple(gate_up(f"{blk}.experts.{e}", gate, up) for e in E), 0)
        r[f"{mf}.mlp.experts.w_down"] = Stack(tuple(linear(f"{blk}.experts.{e}.{down}.weight") for e in E), 0)
        if cfg.moe.shared_ffn:
            r[f"{mf}.mlp.shared.w_gate_up"] = gate_up(f"{blk}.shared_expert", "gate_proj", "up_proj")
            r[f"{mf}.mlp.shared.w_down"] = linear(f"{blk}.shared_expert.down_proj.weight")
            r[f"{mf}.mlp.shared.gate"] = Leaf(f"{blk}.shared_expert_gate.weight")
    return r


# ---------------------------------------------------------------------------- loading


class _Checkpoint:
    """Lazy view of a checkpoint directory's tensors (``safe_open`` handles, nothing read)."""

    def __init__(self, path: Path, stack: ExitStack):
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {f: stack.enter_context(safe_open(path / f, "pt")) for f in sorted(set(weight_map.values()))}
            self.where = {k: files[f] for k, f in weight_map.items()}
        else:
            paths = sorted(path.glob("*.safetensors"))
            if not paths:
                raise ValueError(f"no *.safetensors in {path}")
            self.where = {}
            for p in paths:
                f = stack.enter_context(safe_open(p, "pt"))
                self.where.update({k: f for k in f.keys()})
        self.path = path

    def slice(self, key: str, param: str):
        if key not in self.where:
            raise ValueError(f"checkpoint {self.path} has no tensor {key!r} (needed for meshfold {param})")
        return self.where[key].get_slice(key)


def _read(recipe, expected: tuple, idx: tuple, ckpt: _Checkpoint, param: str, full: tuple) -> torch.Tensor:
    """The part ``idx`` (one slice per dim) of a tensor of shape ``expected`` built by ``recipe``."""
    if isinstance(recipe, Stack):
        d = recipe.dim
        if len(recipe.parts) != expected[d]:  # an internal inconsistency, not a checkpoint error
            raise AssertionError(f"{param}: recipe has {len(recipe.parts)} parts, shape says {expected[d]}")
        sub_shape, sub_idx = expected[:d] + expected[d + 1:], idx[:d] + idx[d + 1:]
        chosen = range(len(recipe.parts))[idx[d]]
        return torch.stack([_read(recipe.parts[j], sub_shape, sub_idx, ckpt, param, full) for j in chosen], d)
    sl = ckpt.slice(recipe.key, param)
    want = tuple(reversed(expected)) if recipe.transpose else tuple(expected)
    got = tuple(sl.get_shape())
    if got != want:
        raise ValueError(f"checkpoint tensor {recipe.key!r} has shape {list(got)} but the config expects "
                         f"{list(want)} (for meshfold {param} {list(full)})")
    if recipe.transpose:
        return sl[tuple(reversed(idx))].T
    return sl[idx]


def load_state(path, cfg: TransformerConfig, select: Select | None = None,
               arch: str | None = None) -> dict[str, torch.Tensor]:
    """Read a checkpoint into meshfold parameter names and layouts (checkpoint dtype).

    ``select(name)`` returns the part of parameter ``name`` to read as a tuple of slices (one per
    dim, missing trailing dims = whole), or None for the whole tensor; only those slices are read
    from disk. Without ``select`` every parameter is read in full and checkpoint tensors that no
    parameter uses are an error (a config that does not fit the checkpoint).
    """
    path = Path(path)
    arch = arch or _architecture(json.loads((path / "config.json").read_text()))
    recipes = checkpoint_map(cfg, arch)
    with torch.device("meta"):
        meta = MoETransformer(cfg)
        shapes = {n: tuple(p.shape) for n, p in meta.named_parameters()}
        shapes.update({n: tuple(b.shape) for n, b in meta.named_buffers() if n in recipes})
    if set(shapes) != set(recipes):  # the recipes must cover the model exactly
        raise AssertionError(f"no checkpoint recipe for {sorted(set(shapes) - set(recipes))}, "
                             f"recipe without parameter {sorted(set(recipes) - set(shapes))}")
    state = {}
    with ExitStack() as stack:
        ckpt = _Checkpoint(path, stack)
        for name, shape in shapes.items():
            idx = select(name) if select is not None else None
            idx = tuple(idx or ()) + (slice(None),) * (len(shape) - len(tuple(idx or ())))
            state[name] = _read(recipes[name], shape, idx, ckpt, name, shape).contiguous()
        if select is None:
            used = {leaf.key for r in recipes.values() for leaf in leaves(r)}
            ignorable = ("rotary_emb.inv_freq",) + (("lm_head.weight",) if cfg.tie_embeddings else ())
            if arch == hf_deepseek.ARCH:  # the MTP layers' copies of embedding and head, and layers not built
                used |= set(hf_deepseek.mtp_copies(cfg))
            extra = sorted(k for k in ckpt.where if k not in used and not k.endswith(ignorable)
                           and not (arch == hf_deepseek.ARCH and _layer_id(k) >= cfg.layers + cfg.mtp_depth))
            if extra:
                more = f" (+{len(extra) - 5} more)" if len(extra) > 5 else ""
                raise ValueError(f"checkpoint tensors not used by the config (does it fit the checkpoint?): "
                                 f"{extra[:5]}{more}")
    return state


def _layer_id(key: str) -> int:
    """The decoder layer id of a checkpoint key ``model.layers.<id>...`` (-1 for other keys)."""
    m = re.match(r"model\.layers\.(\d+)\.", key)
    return int(m.group(1)) if m else -1


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64}


def from_pretrained(path, mesh=None, dtype: torch.dtype | None = None, cfg: TransformerConfig | None = None,
                    compute_dtype: torch.dtype | None = None) -> MoETransformer:
    """Load a Hugging Face checkpoint directory into a :class:`MoETransformer`.

    ``mesh=None``: a single-device model. ``mesh=folded`` (a FoldedMesh, every rank calling):
    the model laid out as :func:`meshfold.parallel.transformer.parallelize` lays it out,
    each rank reading only the slices of its own shards (safetensors lazy slices), never a whole
    tensor it does not hold. ``dtype``: parameter dtype (None: the checkpoint's ``dtype`` /
    ``torch_dtype``, else fp32); routers stay in ``MoEConfig.router_dtype`` (fp32). ``cfg``: the
    config to build instead of the checkpoint's own, e.g. with routing or loss settings changed
    (its shapes must fit the checkpoint); ``compute_dtype``: as :func:`parallelize`'s (folded only).
    """
    path = Path(path)
    hf = json.loads((path / "config.json").read_text())
    cfg = cfg or checkpoint_config(path)
    if dtype is None:
        dtype = _DTYPES.get(hf.get("dtype") or hf.get("torch_dtype"), torch.float32)
    with torch.device("meta"):  # no random init of weights about to be overwritten
        model = MoETransformer(cfg, dtype=dtype)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    if mesh is not None:
        return _from_pretrained_folded(path, hf, cfg, model, mesh, compute_dtype)
    state = load_state(path, cfg, arch=_architecture(hf))
    model.load_state_dict({n: t.to(tensors[n].dtype) for n, t in state.items()}, strict=True, assign=True)
    return model


def _from_pretrained_folded(path, hf, cfg, model, mesh, compute_dtype=None) -> MoETransformer:
    from meshfold.models.init import fill_
    from meshfold.parallel.materialize import shard_indices
    from meshfold.parallel.moe import local_slices
    from meshfold.parallel.transformer import param_layouts, parallelize, single_device_name

    params = dict(model.named_parameters())
    layouts = param_layouts(model, mesh)

    def select(name):
        if name not in layouts:  # a checkpointed buffer (the expert bias): every rank holds it whole
            return None
        m, placements = layouts[name]
        return local_slices(params[name].shape, m, placements)

    device = mesh.device
    state = load_state(path, cfg, select=select, arch=_architecture(hf))
    buffers = dict(model.named_buffers())
    state = {n: t.to(device=device, dtype=(params[n] if n in params else buffers[n]).dtype).contiguous()
             for n, t in state.items()}
    parallelize(model, mesh, local_state={n: t for n, t in state.items() if n in params},
                compute_dtype=compute_dtype)
    for name, buf in list(model.named_buffers()):  # checkpointed ones (DeepSeek-V3's expert bias)
        if buf.is_meta:                              # from the checkpoint; others start as declared
            key = single_device_name(name)
            module_name, _, bname = name.rpartition(".")
            fresh = state.get(key)
            if fresh is None:
                fresh = torch.empty(buf.shape, dtype=buf.dtype, device=device)
                fill_(fresh, model.inits[key], model.init_seed, key, tuple(buf.shape), shard_indices(fresh))
            model.get_submodule(module_name).register_buffer(bname, fresh)
    return model


# ---------------------------------------------------------------------------- saving


def _split(recipe, t: torch.Tensor, out: dict) -> None:
    if isinstance(recipe, Stack):
        for j, part in enumerate(recipe.parts):
            _split(part, t.select(recipe.dim, j), out)
    else:
        out[recipe.key] = (t.T if recipe.transpose else t).contiguous()


def save_mapped(state: dict[str, torch.Tensor], recipes: dict[str, Leaf | Stack], path, config: dict,
                dtype: torch.dtype | None = None, keep_dtype: Callable[[str], bool] = lambda name: False,
                skip: tuple[str, ...] = ()) -> None:
    """Write ``config.json`` (``config``) + ``model.safetensors`` from ``state`` (``{single-device
    name: full tensor}``: a plain model's ``state_dict()``, or a laid-out model's
    :func:`meshfold.parallel.full_state_dict`) under the names ``recipes`` gives each tensor
    (:mod:`meshfold.interop.recipes`: a ``Leaf`` renames, maybe transposed; a ``Stack`` splits,
    e.g. experts along 0). This is the Hugging Face export of a model of one's own: its recipes
    are the mapping to the target architecture's names. Tensors are written in ``dtype`` (None:
    their own), except names ``keep_dtype`` accepts (e.g. routers kept in fp32).

    Nothing is dropped silently: a tensor of ``state`` without a recipe is an error naming it
    unless listed in ``skip`` (e.g. recomputed buffers), and so is a recipe for a name ``state``
    does not hold."""
    missing = [n for n in state if n not in recipes and n not in skip]
    if missing:
        raise ValueError(f"save_mapped: no recipe for {missing}; give each a Leaf / Stack, or list it in skip")
    unknown = [n for n in recipes if n not in state]
    if unknown:
        raise ValueError(f"save_mapped: recipes name {unknown}, which the state does not hold ({sorted(state)[:8]} ...)")
    tensors: dict[str, torch.Tensor] = {}
    for name, recipe in recipes.items():
        t = state[name].detach().cpu()
        _split(recipe, t if dtype is None or keep_dtype(name) else t.to(dtype), tensors)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def save_pretrained(model: MoETransformer, path, arch: str | None = None, dtype: torch.dtype | None = None) -> None:
    """Write ``config.json`` + ``model.safetensors`` in the Hugging Face format of ``arch``
    (default: inferred from the config), loadable by transformers and :func:`from_pretrained`.
    Tensors are written in ``dtype`` (None: the dtypes they have); routers keep theirs (fp32),
    as :func:`from_pretrained` reads them. Single-device (plain tensor) models only."""
    cfg = model.cfg
    arch = arch or infer_architecture(cfg)
    recipes = checkpoint_map(cfg, arch)
    state = dict(model.named_parameters()) | {n: b for n, b in model.named_buffers() if n in recipes}
    if arch == hf_deepseek.ARCH:  # each MTP layer's copies of the embedding and head, as DeepSeek-V3 stores them
        for key, name in hf_deepseek.mtp_copies(cfg).items():
            state[key], recipes[key] = state[name].detach().clone(), Leaf(key)  # its own storage on disk
    save_mapped(state, recipes, path, config_to_hf(cfg, arch, dtype or model.embed.weight.dtype), dtype,
                keep_dtype=lambda name: name.endswith(("router.weight", "router.expert_bias")))  # fp32, as HF keeps them
