"""Memory per GPU of one layout: what each pipeline rank holds, under meshfold's real shardings.

The planner's memory model (docs/plan.md, *Memory*), per pipeline rank ``r`` of a layout:

* **which layers** it holds: ``Pipeline`` cuts the L layers into ``n = pp * vpp`` contiguous
  chunks ``[i L // n, (i + 1) L // n)`` (uneven when n does not divide L) and rank r holds chunks
  ``r, r + pp, ...``; the first chunk has the embedding, the last the final norm and head.
  DeepSeek's dense first layers therefore sit on rank 0.
* **parameters** (:func:`stage_params`): by ``parallelize``'s layout, per layer kind
  (:meth:`~meshfold.plan.models.ModelShape.layer_params`): tp-replicated weights whole,
  tp-split ones / tp, routed experts / (ep etp); embedding and head replicated over tp (meshfold
  has no vocabulary-parallel embedding). Dense-side weights are data-parallel over ``dp x cp``,
  experts over ``edp`` (:func:`expert_shard`: by their hidden dim where edp does not divide
  the ``E / ep`` local experts, e.g. Mixtral's one at ep = 8).
* **states** by data-parallel sharding, for bf16 compute over fp32 master weights
  (``train.dtype = bfloat16``, ``train.master_dtype`` unset = float32; AdamW):

  ``fsdp`` (FSDP2, ``parallelize``'s default and ``meshfold train``'s): fp32 parameters, their
  fp32 gradients and AdamW's two fp32 moments all sharded, 4 + 4 + 8 bytes / n. With gradient
  accumulation (m > 1 without pp) or under a pipeline schedule, gradient sync is off until the
  last backward and FSDP2 keeps *unsharded* fp32 gradients (4 bytes per local parameter) instead;
  under a pipeline schedule it also keeps each group's bf16 parameters unsharded after its first
  backward (``reshard_after_backward=False``, torch.distributed.pipelining), 2 bytes per local
  parameter. The root group (embedding, final norm, head) stays gathered from forward to
  backward, in fp32 when tp > 1 (``fully_shard_folded`` gathers tp-replicated weights in the
  master dtype). Without pp the step's gradients, gathered weights and activations are those of
  its largest phase (:func:`fsdp_step_phases`: the root's gather, the loss backward, the layers'
  backward, the root's gradient reduction), each summing only what is alive then; with pp every
  group stays gathered after its first backward, and the peak is the largest of 1F1B's moments
  (:func:`_pipeline_activations`), under interleaving (vpp > 1) counted chunk by chunk along
  torch's order of ops (:mod:`meshfold.plan.interleaved`).

  ``allreduce`` (``parallelize(data_parallel="allreduce")``): whole fp32 replicas, 4 + 4 + 8
  bytes per local parameter, plus the bf16 copy of each weight the parametrization casts for
  compute, kept by autograd for backward in every micro-batch in flight (inside a recomputed
  block it is recomputed instead), and the 16 MiB fp32 gradient bucket of ``reduce_gradients``
  twice (the bucket and its concatenation).

  ``zero1`` (the paper's Megatron-Core distributed optimizer, for comparison only; meshfold does
  not have it): bf16 parameters and fp32 gradients replicated, fp32 master and Adam moments
  sharded, 2 + 4 + 12 / n bytes; vocabulary-parallel embedding and head.
* **activations**: micro-batches in flight (:func:`in_flight`) times what each layer keeps for
  backward (:func:`layer_activations`), plus one layer rematerialized under recomputation (one
  per micro-batch of an ``a2a_overlap`` pair, either may be inside a recomputed block when the
  turn passes) and the logits on the rank with the head (in the loss phase only, under FSDP2
  without pp). Under FSDP2 without pp, ``a2a_overlap`` also keeps every block gathered from its
  forward to the step's end (:func:`fsdp_step_phases`).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshfold.catalog import ZERO_BUBBLE, remote_neighbours
from meshfold.plan.interleaved import interleaved_activations
from meshfold.plan.models import ModelShape
from meshfold.plan.stages import (BF16, FP32, StageParams, expert_shard, regathered, stage_layers,  # noqa: F401
                                  stage_params, wide_shared)

__all__ = ["StageParams", "stage_layers", "stage_params", "in_flight", "layer_activations", "memory_terms", "copy_weights",
           "expert_shard", "gathered_blocks", "REDUCE_BUCKET_BYTES"]

REDUCE_BUCKET_BYTES = 16 * 2**20  # meshfold.parallel.data_parallel.REDUCE_BUCKET_BYTES (a test checks)


def in_flight(layout, microbatches: int, rank: int) -> float:
    """Micro-batches whose activations pipeline rank ``rank`` holds at its peak, in units of all
    of its layers: 1 without pp (accumulation runs them one after another), 2 with
    ``a2a_overlap`` (a pair in turns: both forwards run before either backward); GPipe all m; 1F1B
    ``min(pp - r, m)`` (combined 1F1B under ``a2a_overlap``: ``min(pp - r + 1, m)``); interleaved 1F1B ``((v - 1) pp + 2 (pp - 1 - r) + 1) / v`` chunks' worth
    (torch's warm-up, = Korthikanti et al. 2022's ``pp (1 + (pp - 1) / (pp v))`` on rank 0);
    interleaved-zb and zbv ``2 pp / v``, dualpipev ``(2 pp + 1) / v`` on every rank (torch's
    orders hold them from a forward to its weight pass; a test counts them). The zero-bubble
    schedules' peak is then costed with 1F1B's moments (:func:`_pipeline_activations`)."""
    pp, m, v = layout.spec.pp, microbatches, layout.vpp
    if pp == 1:
        return min(2.0, float(m)) if layout.a2a_overlap else 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule == "1f1b":  # combined 1F1B (a2a_overlap) warms up with one forward more
        return float(min(pp - rank + (1 if layout.a2a_overlap else 0), m))
    if layout.schedule in ("interleaved-zb", "zbv"):  # 2 pp chunk-micro-batches on every rank
        return min(2 * pp / v, float(m))
    if layout.schedule == "dualpipev":
        return min((2 * pp + 1) / v, float(m))
    return min(((v - 1) * pp + 2 * (pp - 1 - rank) + 1) / v, float(m))


def layer_activations(model: ModelShape, layout, seq: int, moe: bool, recv: float = 1.0,
                      copy_slots: int = 0) -> tuple[float, float]:
    """(bytes one layer keeps for backward under ``layout.recompute``, bytes of the whole layer's
    activations) for one micro-batch; docs/plan.md, *Memory*, derives each term. ``recv``: the
    rows the rank's experts receive over the balanced ones (a skewed routing's busiest ep rank):
    the expert-side activations scale with it. ``copy_slots``: ``R`` hot-expert copies over the
    ep ranks; each forward concatenates the rank's ``E / ep`` experts and its ``R / ep`` fetched
    copies into one weight per expert tensor, which the expert GEMMs keep for backward (FSDP2
    no longer frees and re-gathers the experts' own: they sit in the concatenation; under
    all-reduce the bf16 cast of the rank's experts, kept anyway, is the part no longer held)."""
    s, a = layout.spec, BF16
    tp, etp = s.tp, s.etp
    h, n, g, E, k = model.hidden, model.heads, model.kv_groups, model.experts, model.topk
    f_e, f_sh, f_d = model.expert_ffn, model.shared_ffn, model.dense_ffn
    dq, dv = model.qk_dim, model.value_dim
    T = layout.mbs * seq / s.cp
    Tr = T / tp
    # meshfold's RMSNorm keeps its fp32 upcast [Tr, h] and its bf16 output (layers.RMSNorm),
    # under tp its QKV projection the all-gathered input [T, h], its fp32 router a copy of the
    # input (``mine``: 0 on the Megatron rows, whose fused norm keeps its input and whose
    # sequence-parallel linears re-gather theirs in backward)
    mine = 0.0 if layout.megatron else 1.0
    norm = (mine * FP32 + a) * Tr * h
    gathered = a * T * h * mine if tp > 1 else 0.0
    attn = norm + a * Tr * h * (1 - mine) + gathered
    attn += a * (T * (n * dq + g * (dq + dv)) / tp + T * n * dv / tp)
    attn += 4 * T * n / tp
    attn_sel = a * (Tr * h + T * (n * dq + g * (dq + dv)) / tp + T * h)
    if moe:
        # the norm, the router's fp32 copy of its input, expert input, fc1 out, SwiGLU out, expert out
        mlp = norm + (mine * FP32 + a * (1 - mine)) * Tr * h
        mlp += a * recv * (Tr * k * etp * h + 3 * Tr * k * f_e + Tr * k * h) + 4 * Tr * E
        mlp += a * (Tr * h + 3 * T * f_sh / tp) if f_sh else 0.0
        # routing: fp32 top-k scores, int64 experts, the permute's int64 sort keys and order
        routing = 28 * Tr * k
        mlp_sel = (4 * Tr * E + a * recv * (2 * Tr * k * f_e + Tr * k * etp * h) + routing
                   + (a * (2 * T * f_sh / tp + T * h) if f_sh else 0.0))
        mlp += copy_weights(model, layout, copy_slots)
        mlp_sel += copy_weights(model, layout, copy_slots)
    else:  # the dense SwiGLU MLP under sequence parallelism: gathered input, fc1, SwiGLU out
        mlp = norm + (gathered if mine else a * T * h) + a * 3 * T * f_d / tp
        routing = 0.0
        mlp_sel = a * (2 * T * f_d / tp + T * h)
    full = attn + mlp
    kept = {"none": full, "selective": attn_sel + mlp_sel, "full": a * Tr * h + routing}[layout.recompute]
    return kept, full


def copy_weights(model: ModelShape, layout, copy_slots: int) -> float:
    """Bytes one MoE layer keeps for backward per micro-batch because of ``copy_slots`` copies
    (:func:`layer_activations`): the concatenated ``E / ep + R / ep`` experts' weights (bf16, the
    rank's etp shard) under FSDP2, the ``R / ep`` fetched copies' under all-reduce."""
    if not copy_slots:
        return 0.0
    s = layout.spec
    held = copy_slots / s.ep + (model.experts / s.ep if layout.sharding == "fsdp" else 0.0)
    return BF16 * held * model.expert_params / s.etp


def largest_group(model: ModelShape, layout, layers) -> float:
    """Parameters per rank of the largest FSDP2 group among ``layers`` (``fully_shard_folded``):
    a layer's routed experts (one group on the MoE mesh) or the rest of its block (attention,
    norms, a dense MLP or the shared expert; the router and tp-replicated pieces are groups of
    their own, small beside these)."""
    s = layout.spec
    out = 0.0
    for moe in {model.is_moe_layer(i) for i in layers}:
        p = model.layer_params(moe)
        out = max(out, p.experts / (s.ep * s.etp), p.replicated + p.tp_split / s.tp)
    return out


def gathered_blocks(model: ModelShape, layout, st: StageParams) -> float:
    """Bytes of every block of ``st`` gathered at once under FSDP2 (the root apart): bf16, and
    a gated shared expert in fp32 under tp > 1 (its group's master dtype)."""
    return BF16 * (st.total - st.ends) + (FP32 - BF16) * wide_shared(model, layout, st.layers)


def fsdp_step_phases(model: ModelShape, layout, st: StageParams, acts_of_stage: dict, m: int, logits: float,
                     head_copy: float, sharded: float) -> dict[str, dict[str, float]]:
    """What one rank holds in each phase of a step under FSDP2 without pp, as ``{phase: {"grads",
    "buffers", "activations"}}`` (bytes); the step's peak is the largest phase's sum, not the sum
    of each term's largest value, since what a phase holds is freed before the next one (the
    logits before the layers' backward, the activations before the root's gradients are reduced).

    With m > 1 micro-batches gradient sync is off until the last backward, so from the second
    micro-batch on every phase also holds the unsharded fp32 gradients of the earlier ones
    (``4 P``, the root's and the head's among them, accumulated in place). G is
    :func:`largest_group`, R the root (embedding, final norm, head: gathered from forward to
    backward, fp32 under tp > 1 as ``fully_shard_folded`` gathers tp-replicated weights in the
    master dtype), a = 2 (bf16).

    * ``gather``: the forward's first all-gather of the root, whose buffer and the weights copied
      out of it coexist (2 R), with the embedding's bf16 copy for compute; with m > 1 a later
      micro-batch's re-gather beside the earlier gradients (Llama3-8x70B's 7.8 GiB root at tp 8).
    * ``loss``: forward done, loss backward: the layers' kept activations, the loss backward's three
      fp32 [Tr, V] and the head's bf16 copy (``logits``, ``head_copy``), R, and the last group's
      gathered weights (a G), kept until the next all-gather.
    * ``backward``: the layers' backward: kept activations (freed layer by layer, all alive at the
      first), R, and the group in backward: with m > 1 its gathered weights, the all-gather buffer
      they were copied out of and their bf16 gradients (3 a G); with one micro-batch its bf16
      gradients and the fp32 copy the reduce-scatter sends (a G + 4 G; the sharded output, 4 G / n,
      takes the place of bf16 gradients freed meanwhile, no more than them for n >= 2), and the
      head's gradient (R's share, from the loss backward on). The layer's backward comes before
      any other group's sharded gradients exist (the first in backward keeps most activations).
    * ``root``: end of backward, activations gone: R, its gradients (with one micro-batch) and,
      under tp > 1, the all-reduce's output for one of them (fp32, the larger of embedding and
      head: FSDP2's post-backward sums the tp-partial gradients one at a time before its
      reduce-scatter), beside the last
      block group's fp32 reduce-scatter input (FSDP2 holds it until the next reduce-scatter) and
      the sharded gradients formed so far.

    With ``a2a_overlap`` (a pair of micro-batches in turns, ``acts_of_stage`` both of theirs) no
    block is resharded from its forward to the step's end (``Pipeline``'s ``_keep_gathered``,
    ``hold_fsdp_gradients``), so the phases from the forward on (``loss``, ``backward``, ``root``,
    and ``gather`` from the second pair on, m > 2) also hold every block's gathered weights
    (:func:`gathered_blocks`); each keeps its one-group buffers as well, for the partner's
    all-gather in flight and the gradients of the group in backward.
    """
    s, a = layout.spec, BF16
    wide = FP32 if s.tp > 1 else a          # the root's dtype, and its gradients'
    root = st.ends * wide
    G = largest_group(model, layout, st.layers)
    block = max(model.layer_params(k).replicated + model.layer_params(k).tp_split / s.tp
                for k in {model.is_moe_layer(i) for i in st.layers})
    kept = acts_of_stage["stored"] + acts_of_stage["working"]
    accumulated = FP32 * st.total if m > 1 else 0.0
    head = wide * st.head
    embedding = st.ends - st.head - (model.hidden if st.last else 0.0)   # parameters, on the first rank
    out = {"gather": {"grads": accumulated, "buffers": 2 * root + (a * embedding if s.tp > 1 else 0.0),
                      "activations": 0.0},
           "loss": {"grads": accumulated, "buffers": root + a * G,
                    "activations": kept + (logits + head_copy if st.last else 0.0)}}
    if m > 1:
        out["backward"] = {"grads": accumulated, "buffers": root + 3 * a * G, "activations": kept}
        out["root"] = {"grads": accumulated, "buffers": root + FP32 * block, "activations": 0.0}
        if layout.a2a_overlap:
            for phase in ("loss", "backward", "root") + (("gather",) if m > 2 else ()):
                out[phase]["buffers"] += gathered_blocks(model, layout, st)
    else:
        out["backward"] = {"grads": 0.0, "buffers": root + (a + FP32) * G + head, "activations": kept}
        out["root"] = {"grads": FP32 * (sharded - st.ends / (s.dp * s.cp)),
                       "buffers": root + wide * st.ends + (FP32 * max(st.head, embedding) if s.tp > 1 else 0.0)
                       + FP32 * block, "activations": 0.0}
    return out


def _pipeline_activations(model: ModelShape, layout, seq: int, m: int, st: StageParams, flight: float,
                          stored: float, logits: float, head_copy: float) -> float:
    """What pipeline rank ``st.rank`` holds at its forward/backward peak under FSDP2 besides
    its gathered weights and its gradients ``G`` (4 bytes per local parameter once its first
    backward has formed them): the largest of these moments of its step, less ``G``.

    * **a backward right after a forward** re-gathers each group, resharded after that forward:
      FSDP2's flat all-gather output coexists with the group's weights, and for a group sharded
      off dim 0 (experts where edp does not divide E / ep, :func:`expert_shard`) so does the copy
      it chunk-cats them from; with the ``flight`` micro-batches' activations. The first backward
      has no gradients yet; under 1F1B with m > flight a later one (steady state) has all of them.
    * **a backward right after a backward** (1F1B's cool-down, GPipe's backwards but the first):
      nothing re-gathered, one micro-batch fewer in flight, all gradients, and the largest
      weight's new bf16 gradient: FSDP2 adds it in place to the fp32 one the first backward formed
      (``FSDPParam.accumulate_unsharded_grad_if_needed``), no fp32 copy of it.
    * **the loss backward** (the last chunk): log-softmax's three fp32 [Tr, V], the bf16 logits,
      the head's bf16 copy (with tp > 1), the activations in flight; gradients from the second
      micro-batch on under 1F1B (GPipe runs every loss before any backward).
    * **the end of backward**: with tp > 1 FSDP2 sums the gradients of tp-replicated weights over
      tp out of place, one fp32 copy of the largest (embedding, head) beside its fp32 gradient; from
      the second micro-batch on, its backward also holds the new bf16 gradient of the weight's
      compute copy and that gradient cast to fp32 before autograd adds it to the accumulated one
      (the root is gathered in fp32 and cast for compute).

    ``torch.distributed.pipelining``'s buffers are there throughout: the output each stage but the
    last keeps per micro-batch in flight, and one receive buffer [b, s / (cp tp), h] per micro-batch
    and neighbouring stage, all allocated for the step."""
    s, a = layout.spec, BF16
    G = FP32 * st.total
    Tr_h = layout.mbs * seq / (s.cp * s.tp) * model.hidden
    neighbours = remote_neighbours(s.pp, layout.vpp, st.rank, layout.schedule)
    recv = m * neighbours * a * Tr_h
    kept_out = 0.0 if st.last and layout.vpp == 1 else flight * a * Tr_h
    group, largest = regathered(model, layout, st.layers)
    gpipe = layout.schedule == "gpipe"
    regather = flight * stored + kept_out + a * group
    phases = [regather]
    if not gpipe and m > flight:
        phases.append(G + regather)
    if flight >= 2:
        phases.append(G + (flight - 1) * stored + kept_out + a * largest)
    if st.last:
        loss = flight * stored + logits + a * layout.mbs * seq / (s.cp * s.tp) * model.vocab + head_copy
        phases.append(loss + (G if not gpipe and m > 1 else 0.0))
    first = model.embedding_params if st.rank == 0 else 0.0
    if s.tp > 1:
        phases.append(G + (FP32 + (a if m > 1 else 0.0)) * max(first, st.head))
    return recv + max(phases) - G


def memory_terms(model: ModelShape, layout, seq: int, global_batch: int,
                 recv: float = 1.0, copy_slots: int = 0) -> tuple[dict[str, float], dict]:
    """The memory terms (params, grads, optimizer, buffers, activations; bytes per GPU) of the
    pipeline rank that needs most, and details: ``params_per_rank`` (the :class:`StageParams`
    of every pipeline rank), ``memory_per_rank`` (every pipeline rank's terms; the dry-run
    comparison reads each stage's), ``worst_rank`` and ``grads_held`` (the gradient bytes the
    step ends with). Under FSDP2 without pp, grads + buffers + activations are those of the
    step's largest phase (:func:`fsdp_step_phases`, totals in ``step_phases``), whose gradients
    may be fewer than those held at the end. ``recv``, ``copy_slots``: as
    :func:`layer_activations`'."""
    s, a = layout.spec, BF16
    m = global_batch // (s.dp * layout.mbs)
    n_dense, exp_share = s.dp * s.cp, expert_shard(model, s)
    acts = {kind: layer_activations(model, layout, seq, kind, recv if kind else 1.0, copy_slots if kind else 0)
            for kind in (True, False)}
    # The loss's backward holds three fp32 [Tr, V]: log-softmax's output, its gradient and the
    # logits' gradient (the dry run's peak, docs/plan.md); with tp > 1 the head is gathered in
    # fp32 and its bf16 copy for compute lives beside it.
    logits = layout.mbs * seq / s.cp / s.tp * model.vocab * 3 * FP32
    head_copy = a * model.embedding_params if s.tp > 1 and layout.sharding == "fsdp" else 0.0
    unit = max(model.layer_params(kind).per_rank(s.tp, s.ep * s.etp) for kind in (True, False))
    worst, best, phases, held = -1.0, ({}, {}), {}, {}
    stages = stage_params(model, layout)
    per_rank = []
    for st in stages:
        kinds = [model.is_moe_layer(i) for i in st.layers]
        stored = sum(acts[kind][0] for kind in kinds)
        working = max(acts[kind][1] for kind in kinds) if layout.recompute != "none" else 0.0
        flight = in_flight(layout, m, st.rank)
        if s.pp == 1:   # a pair in turns (a2a_overlap): each may be inside a recomputed block
            working *= flight
        mem = {"activations": flight * stored + working + (logits + head_copy if st.last else 0.0)}
        sharded = st.dense / n_dense + st.experts * exp_share
        if layout.sharding == "zero1":
            mem.update(params=a * st.total, grads=FP32 * st.total, optimizer=12 * sharded, buffers=0.0)
        elif layout.sharding == "fsdp" and s.pp == 1:
            step = fsdp_step_phases(model, layout, st, acts_of_stage={"stored": flight * stored, "working": working},
                                    m=m, logits=logits, head_copy=head_copy, sharded=sharded)
            phase = max(step, key=lambda k: sum(step[k].values()))
            mem = {"params": FP32 * sharded, "optimizer": 8 * sharded, **step[phase]}
            phases[st.rank] = {k: sum(v.values()) for k, v in step.items()}
            held[st.rank] = FP32 * (st.total if m > 1 else sharded)
        elif layout.sharding == "fsdp":
            root = st.ends * (FP32 if s.tp > 1 else a)          # stays gathered forward to backward
            # every group stays unsharded after its first backward
            gathered = gathered_blocks(model, layout, st) + root
            if layout.vpp > 1 and layout.schedule not in ZERO_BUBBLE:
                mem["activations"] = interleaved_activations(model, layout, seq, m, st, acts, logits, head_copy,
                                                             gathered)
            else:
                mem["activations"] = _pipeline_activations(model, layout, seq, m, st, flight, stored, logits,
                                                           head_copy)
            mem.update(params=FP32 * sharded, grads=FP32 * st.total, optimizer=8 * sharded, buffers=gathered)
        else:  # allreduce
            layers = st.total - st.ends
            kept_copies = flight * a * (st.head + (layers if layout.recompute == "none" else 0.0))
            working_copy = a * unit if layout.recompute != "none" else 0.0
            mem.update(params=FP32 * st.total, grads=FP32 * st.total, optimizer=8 * st.total,
                       buffers=kept_copies + working_copy + 2 * REDUCE_BUCKET_BYTES)
        per_rank.append({t: mem[t] for t in ("params", "grads", "optimizer", "buffers", "activations")})
        total = sum(mem.values())
        if total > worst:
            worst, best = total, (mem, {"worst_rank": st.rank})
    mem, detail = best
    detail["params_per_rank"], detail["memory_per_rank"] = stages, per_rank
    if phases:  # FSDP2 without pp: the phases' totals, and the gradients the step ends with
        detail["step_phases"] = phases[detail["worst_rank"]]
    detail["grads_held"] = held.get(detail["worst_rank"], mem["grads"])
    # what the copies' weights add to that rank's activations: every MoE layer's in flight, or
    # the one layer rematerialized under full recomputation
    st = stages[detail["worst_rank"]]
    n_moe = sum(map(model.is_moe_layer, st.layers))
    detail["copies_bytes"] = copy_weights(model, layout, copy_slots) * (
        1 if layout.recompute == "full" else n_moe * in_flight(layout, m, st.rank))
    return {t: mem[t] for t in ("params", "grads", "optimizer", "buffers", "activations")}, detail
