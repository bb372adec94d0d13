"""meshfold's own transformer's layout plan: what :func:`~meshfold.parallel.transformer.parallelize`
does with a :class:`~meshfold.models.transformer.MoETransformer` (GQA or MLA, dense and MoE
layers), as a :class:`~meshfold.parallel.plan.Plan` built from the tables of
:mod:`meshfold.parallel.layouts`, and the checks of its sizes against a fold.

A model of a user's own gets the same treatment by declaring ``plan()`` (or by
:func:`~meshfold.parallel.plan.register_plan`, which is how this module makes
:func:`transformer_plan` the MoETransformer's default: the model, single-device code, cannot
import the parallel package).
"""

from __future__ import annotations

import functools

from torch.distributed.tensor import Replicate

from meshfold.models.transformer import MoETransformer
from meshfold.parallel.layouts import MLA_LAYOUT, MOE_LAYOUT, TRANSFORMER_LAYOUT
from meshfold.parallel.mla import check_mla_fold
from meshfold.parallel.moe import check_moe_fold
from meshfold.parallel.plan import Plan, SequenceParallel, register_plan

__all__ = ["transformer_plan", "check_fold"]

R = Replicate()


def transformer_plan(cfg, layers: list[int] | None = None, first: bool = True, last: bool = True) -> Plan:
    """The plan of a :class:`~meshfold.models.transformer.MoETransformer` of ``cfg`` (GQA or
    MLA), from the tables of :mod:`meshfold.parallel.layouts` (transformer, MLA, MoE); with
    ``layers`` (ids) and ``first`` / ``last``, the plan of a pipeline chunk holding those layers
    and the embeddings (first) or the final norm and head (last). Every entry names parameters or
    modules the model has, so the plan passes :func:`~meshfold.parallel.plan.check_plan`. The
    whole model's plan (``layers`` None) is ``whole``: with pp > 1 the model runs as a
    :class:`~meshfold.parallel.pipeline.Pipeline`."""
    ids = list(range(cfg.layers)) if layers is None else list(layers)
    # multi-token prediction (in the whole model's plan; a pipeline's last chunk holds the depths
    # and keeps their entries): depth k's block is laid out as layer cfg.layers + k - 1 would be,
    # its norms and 2H -> H projection replicated
    depths = list(range(cfg.mtp_depth)) if layers is None and last else []
    blocks = {f"layers.{i}": i for i in ids} | {f"mtp.{k}.block": cfg.layers + k for k in depths}
    prefixes = (["layers.*"] if ids else []) + (["mtp.*.block"] if depths else [])
    moe_paths = [p for p, i in blocks.items() if cfg.is_moe_layer(i)]
    dense_paths = [p for p, i in blocks.items() if not cfg.is_moe_layer(i)]
    mla = cfg.mla
    q_latent = mla is not None and mla.q_lora_rank is not None
    if mla is None:
        attn = ["wq", "wk", "wv", "wo"] + (["bq", "bk", "bv"] if cfg.qkv_bias else [])
    else:
        attn = ["wkv_a.weight", "kv_norm.weight", "wkv_b", "wo"] + (["wq_a.weight", "q_norm.weight", "wq_b"]
                                                                    if q_latent else ["wq"])
    tables = MLA_LAYOUT | TRANSFORMER_LAYOUT  # keyed by the name within a block
    params, tp_summed = {}, []
    for b in prefixes:
        params |= {f"{b}.attn.{n}": tables["attn." + n] for n in attn}
        params |= {f"{b}.{n}.weight": (R, R, R) for n in ("attn_norm", "mlp_norm")}
        if cfg.qk_norm:
            params |= {f"{b}.attn.{n}.weight": (R, R, R) for n in ("q_norm", "k_norm")}
        tp_summed += [f"{b}.attn_norm", f"{b}.mlp_norm"]
        if cfg.qk_norm:
            tp_summed += [f"{b}.attn.q_norm", f"{b}.attn.k_norm"]
        if mla:
            tp_summed += [f"{b}.attn.kv_norm", f"{b}.attn.wkv_a"] + ([f"{b}.attn.q_norm", f"{b}.attn.wq_a"]
                                                                  if q_latent else [])
    for p in dense_paths:
        params |= {f"{p}.{n}": TRANSFORMER_LAYOUT[n] for n in ("mlp.w_gate_up", "mlp.w_down")}
    mtp_parts = ("emb_norm", "hidden_norm", "proj", "head_norm") if depths else ()
    params |= {f"mtp.*.{n}.weight": (R, R, R) for n in mtp_parts}  # applied to each rank's own tokens
    tp_summed += [f"mtp.*.{n}" for n in mtp_parts]
    if first:
        params["embed.weight"] = (R, R, R)
    if last:
        params["norm.weight"] = (R, R, R)
        if not cfg.tie_embeddings:
            params["head.weight"] = (R, R, R)
    moe = cfg.moe
    if moe is not None and moe.shared_ffn and moe.shared_kind == "qwen2":  # its gate is tp-replicated
        tp_summed += [f"{p}.mlp.shared" for p in moe_paths]
    return Plan(
        params=params,
        tp={f"{b}.attn": SequenceParallel(positions=True) for b in prefixes}
        | {f"{p}.mlp": SequenceParallel() for p in dense_paths},
        context={f"{b}.attn": "latent" if mla else "ring" for b in prefixes},
        moe={f"{p}.mlp": MOE_LAYOUT for p in moe_paths},
        fsdp=tuple(f"{p}.mlp.experts" for p in moe_paths) + tuple(prefixes[:1] if ids else ())
        + (("mtp.*",) if depths else ()),
        tp_summed=tuple(tp_summed), recompute=tuple(prefixes),
        keep_dtype={f"{p}.mlp.router.weight": None for p in moe_paths},  # its router_dtype
        blocks="layers", before=("embed",) if first else (),
        after=(("norm",) if cfg.tie_embeddings else ("norm", "head")) if last else (),
        check=functools.partial(check_fold, cfg), whole=layers is None and first and last)


def check_fold(cfg, spec) -> None:
    """Raise ``ValueError`` naming the model size that does not divide over ``spec`` (a
    :class:`~meshfold.mesh.FoldSpec`): heads, kv_heads and the dense ffn over ``tp``, and the MoE
    sizes (:func:`~meshfold.parallel.moe.check_moe_fold`). Needs no mesh, so a config can
    be checked before any process starts; :func:`~meshfold.parallel.transformer.parallelize` runs
    the same checks (the plan's ``check``)."""
    if getattr(cfg, "mla", None) is not None:
        check_mla_fold(cfg.heads, spec.tp)
    for what, n in (("heads", cfg.heads), ("kv_heads", cfg.kv_heads)):
        if n % spec.tp:
            raise ValueError(f"{what} = {n} is not divisible by tp = {spec.tp}")
    if any(not cfg.is_moe_layer(i) for i in range(cfg.layers + getattr(cfg, "mtp_depth", 0))) and cfg.ffn % spec.tp:
        raise ValueError(f"ffn = {cfg.ffn} is not divisible by tp = {spec.tp}")
    if cfg.moe is not None:
        check_moe_fold(cfg.moe, spec.ep, spec.etp, spec.tp)


register_plan(MoETransformer, lambda model: transformer_plan(model.cfg))
