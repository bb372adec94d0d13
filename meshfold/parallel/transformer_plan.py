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
    moe_ids = [i for i in ids if cfg.is_moe_layer(i)]
    dense_ids = [i for i in ids if not cfg.is_moe_layer(i)]
    mla = cfg.mla
    q_latent = mla is not None and mla.q_lora_rank is not None
    if mla is None:
        attn = ["wq", "wk", "wv", "wo"] + (["bq", "bk", "bv"] if cfg.qkv_bias else [])
    else:
        attn = ["wkv_a.weight", "kv_norm.weight", "wkv_b", "wo"] + (["wq_a.weight", "q_norm.weight", "wq_b"]
                                                                    if q_latent else ["wq"])
    tables = MLA_LAYOUT | TRANSFORMER_LAYOUT  # keyed by the name within a block
    params = {f"layers.*.attn.{n}": tables["attn." + n] for n in attn}
    params |= {f"layers.*.{n}.weight": (R, R, R) for n in ("attn_norm", "mlp_norm")}
    if cfg.qk_norm:
        params |= {f"layers.*.attn.{n}.weight": (R, R, R) for n in ("q_norm", "k_norm")}
    if dense_ids:
        params |= {f"layers.*.{n}": TRANSFORMER_LAYOUT[n] for n in ("mlp.w_gate_up", "mlp.w_down")}
    if first:
        params["embed.weight"] = (R, R, R)
    if last:
        params["norm.weight"] = (R, R, R)
        if not cfg.tie_embeddings:
            params["head.weight"] = (R, R, R)
    blocks = ("layers.*",) if ids else ()
    tp_summed = ["layers.*.attn_norm", "layers.*.mlp_norm"] if ids else []
    if cfg.qk_norm:
        tp_summed += ["layers.*.attn.q_norm", "layers.*.attn.k_norm"]
    if mla:
        tp_summed += ["layers.*.attn.kv_norm", "layers.*.attn.wkv_a"] + (["layers.*.attn.q_norm", "layers.*.attn.wq_a"]
                                                                      if q_latent else [])
    moe = cfg.moe
    if moe is not None and moe.shared_ffn and moe.shared_kind == "qwen2":  # its gate is tp-replicated
        tp_summed += [f"layers.{i}.mlp.shared" for i in moe_ids]
    return Plan(
        params=params,
        tp=({"layers.*.attn": SequenceParallel(positions=True)} | {f"layers.{i}.mlp": SequenceParallel()
                                                                   for i in dense_ids}) if ids else {},
        context={"layers.*.attn": "latent" if mla else "ring"} if ids else {},
        moe={f"layers.{i}.mlp": MOE_LAYOUT for i in moe_ids},
        fsdp=tuple(f"layers.{i}.mlp.experts" for i in moe_ids) + blocks,
        tp_summed=tuple(tp_summed), recompute=blocks,
        keep_dtype={f"layers.{i}.mlp.router.weight": None for i in moe_ids},  # its router_dtype
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
    if any(not cfg.is_moe_layer(i) for i in range(cfg.layers)) and cfg.ffn % spec.tp:
        raise ValueError(f"ffn = {cfg.ffn} is not divisible by tp = {spec.tp}")
    if cfg.moe is not None:
        check_moe_fold(cfg.moe, spec.ep, spec.etp, spec.tp)


register_plan(MoETransformer, lambda model: transformer_plan(model.cfg))
