"""The collectives one training step of a layout issues on each rank, and their bytes.

:func:`collective_bytes` lists, per pipeline rank, ``{(kind, dim): bytes per step per rank}`` for
what meshfold's code issues in one step of the model (forward and backward of every micro-batch,
the recomputation, the data-parallel reduction; not the training loop's own logging, gradient
norm or optimizer), in the format ``meshfold dryrun`` records:

* ``kind``: ``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all``, ``send``, ``recv``,
  ``broadcast``, the c10d collective that runs (not the logical one: a half-precision
  reduce-scatter-v is an all-to-all, see :mod:`meshfold.placements.collectives`);
* ``dim``: the folded mesh dim the group spans (``tp``, ``cp``, ``dp``, ``pp``, ``ep``, ``etp``,
  ``edp``), ``+``-joined for a flattened group (FSDP2's ``dp+cp``; only dims of size > 1 are named,
  all of them when every one is 1), slowest first as in the views;
* bytes: the size of the rank's *input* (all_gather: its local shard; reduce_scatter: the full
  input; all_to_all: everything it sends, its own share included; all_reduce, send, recv: the
  tensor).

What each piece issues (docs/plan.md, *Collectives*, has the table): sequence-parallel TP around
attention, the dense MLP and the shared expert (an all-gather of the tokens and their positions in,
a reduce-scatter out, and the transposes in backward); ring attention's point-to-point shifts of
K/V (MLA: the latent) over cp, ``cp - 1`` per pass and ``cp`` of fp32 gradients in backward; per
MoE layer the token statistics (all-reduces over cp, tp, dp), the dispatch's counts (all-gathers
over ep and etp), the token all-to-alls over ep and the ragged all-gather-v / reduce-scatter-v over
etp (all-to-alls: routed counts are ragged in practice); the loss's all-reduces; the pipeline's
activations and gradients; FSDP2's all-gathers per group and micro-batch (bf16, fp32 for the
groups it gathers in the master dtype) and one fp32 reduce-scatter per step, or ``reduce_gradients``'
fp32 all-reduces per partial dim. Recomputation reissues a block's forward collectives.

Routing is taken as balanced (every rank sends ``Tr k`` rows and its experts receive as many)
unless ``recv`` says the rank's experts receive more (a skewed routing's busiest ep rank).
With hot-expert copies (``copy_slots`` R, ``fetched``) the dispatch counts cover ``E + R`` slots
and each forward fetches the copies' weights with one all-to-all over ep per expert weight
(``FoldedComm.local``): the rank sends its experts that are copied elsewhere and, in backward,
the gradients of the copies it received.
"""

from __future__ import annotations

import math
from collections import defaultdict

from meshfold.catalog import remote_neighbours
from meshfold.plan.memory import REDUCE_BUCKET_BYTES
from meshfold.plan.stages import expert_shard, stage_params
from meshfold.plan.models import ModelShape

__all__ = ["KINDS", "MICROBATCH", "STEP", "collective_bytes", "collective_traffic", "loop_collectives",
           "loop_traffic", "group_name"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send", "recv", "broadcast")
MICROBATCH, STEP = "microbatch", "step"   # issued with every micro-batch / once per step
I64, F32, F64 = 8, 4, 8  # bytes
EXPERT_WEIGHTS = 2  # tensors of a SwiGLU expert (meshfold's gate_up and down): one fetch each


def group_name(dims: tuple[str, ...], sizes: dict[str, int]) -> str:
    """The name of a (possibly flattened) group over ``dims`` (slowest first): the dims of size
    > 1 joined by ``+``, or all of them when every one has size 1."""
    named = [d for d in dims if sizes[d] > 1]
    return "+".join(named or dims)


def collective_bytes(model: ModelShape, layout, seq: int, global_batch: int, compute_bytes: int = 2,
                     backend: str = "nccl", ragged: bool = True, recv: float = 1.0, copy_slots: int = 0,
                     fetched: tuple[float, float] = (0.0, 0.0)) -> list[dict[tuple[str, str], float]]:
    """Per pipeline rank, ``{(kind, dim): bytes per step}`` of one of its ranks (see the module
    docstring). ``ragged``: the etp blocks' row counts differ (real routing; the gather-v is an
    all-to-all sending its rows to every etp rank); False: exactly equal counts, as ``meshfold
    dryrun``'s balanced routing gives when E divides each rank's ``Tr k`` pairs, where the
    gather-v is a native all-gather of the rank's rows (``placements.collectives._gather_v``).
    ``compute_bytes``: the compute dtype's size (2: bf16 over fp32 masters, the
    planner's setting; 4: fp32 compute; 8: fp64), which picks the reduce-scatter path: native on
    NCCL for fp32 and wider, an all-to-all otherwise (half precision, or gloo). Megatron rows
    (``zero1``, not meshfold runs) get Megatron-Core's traffic as :func:`collective_traffic`
    models it. ``copy_slots``, ``fetched``: as :func:`collective_traffic`."""
    return [_bytes_only(t) for t in collective_traffic(model, layout, seq, global_batch, compute_bytes, backend,
                                                        ragged, recv=recv, copy_slots=copy_slots, fetched=fetched)]


def _bytes_only(traffic: dict[tuple[str, str, str], list[float]]) -> dict[tuple[str, str], float]:
    out: dict = defaultdict(float)
    for (kind, dim, _), (nbytes, _) in traffic.items():
        out[kind, dim] += nbytes
    return {key: v for key, v in out.items() if v}


class _Tally:
    """``{(kind, dim, when): [bytes, calls]}`` of one rank's step, filled one collective at a time."""

    def __init__(self) -> None:
        self.c: dict = defaultdict(lambda: [0.0, 0.0])

    def add(self, kind: str, dim: str, nbytes: float, calls: float, when: str = MICROBATCH) -> None:
        entry = self.c[kind, dim, when]
        entry[0] += nbytes
        entry[1] += calls


def collective_traffic(model: ModelShape, layout, seq: int, global_batch: int, compute_bytes: int = 2,
                       backend: str = "nccl", ragged: bool = True,
                       stages=None, recv: float = 1.0, copy_slots: int = 0,
                       fetched: tuple[float, float] = (0.0, 0.0)) -> list[dict[tuple[str, str, str], list[float]]]:
    """Per pipeline rank, ``{(kind, dim, when): [bytes, calls] per step}``: what
    :func:`collective_bytes` counts (the same walk; its bytes are these summed over ``when``),
    with the number of calls (each pays a link latency in the time model) and ``when`` each is
    issued: :data:`MICROBATCH` (with every micro-batch: a layer's collectives, the pipeline's,
    FSDP2's gathers; on the critical path of each micro-batch, so in the pipeline bubble too) or
    :data:`STEP` (once per step: the gradient reductions). Calls are those the code issues for
    the layer and pipeline collectives (a ring shift is one batched send/recv); for the
    data-parallel ones, one per layer group and the root (FSDP2 splits tp-replicated weights
    into more, smaller groups under tp > 1, not counted) or, for ``allreduce``, one per 16 MiB
    bucket of ``reduce_gradients``.

    Megatron rows (``zero1``; Megatron-Core's runs, for comparison, which the dry run cannot
    check): the same layer and pipeline collectives, with NCCL's native reduce-scatter for tp and
    the etp reduce-scatter-v and a native all-gather-v over etp, no position ids gathered, and
    the distributed optimizer's per-step fp32 gradient reduce-scatter and bf16 parameter
    all-gather over dp x cp (dense) and edp (experts), evenly sharded. ``stages``: the layout's
    :func:`~meshfold.plan.stages.stage_params`, when the caller has them already. ``recv``: the
    rows the rank's experts receive over the balanced ``Tr k`` per etp rank (the busiest ep rank's
    under a skewed routing, :func:`meshfold.plan.cost.estimate`): the dispatch's backward and the
    combine send back what was received, the etp gather-v and reduce-scatter-v carry it.
    ``copy_slots``: the ``R`` copy slots of hot experts (``train.redundant_experts``), which the
    dispatch's counts cover too; ``fetched``: (experts whose weights the rank sends for other
    ranks' copies, copies it receives) per MoE layer forward, each an all-to-all over ep per
    expert weight in the compute dtype, its gradients sent back in backward."""
    s = layout.spec
    megatron = layout.megatron
    sizes = {"pp": s.pp, "dp": s.dp, "cp": s.cp, "tp": s.tp, "ep": s.ep, "etp": s.etp, "edp": s.edp}
    a, master = compute_bytes, max(compute_bytes, F32)
    mixed = compute_bytes < master
    native = megatron or (backend == "nccl" and compute_bytes >= F32)
    scatter = "reduce_scatter" if native else "all_to_all"
    m = global_batch // (s.dp * layout.mbs)
    passes = 2 if layout.recompute != "none" else 1      # forward collectives: once more in backward
    h, k, E = model.hidden, model.topk, model.experts
    T = layout.mbs * seq / s.cp            # tokens of a cp rank (gathered over tp)
    Tr = T / s.tp                          # tokens a rank holds between blocks
    s_local = seq / (s.cp * s.tp)          # positions (int64) a rank holds

    def layer(moe: bool) -> _Tally:
        """One layer's collectives in one micro-batch (forward, recomputation, backward)."""
        c = _Tally()

        def tp_pair() -> None:  # sequence_parallel / shared_in + shared_out
            if s.tp == 1:
                return
            c.add("all_gather", "tp", passes * Tr * h * a + Tr * h * a, passes + 1)
            c.add(scatter, "tp", passes * T * h * a + T * h * a, passes + 1)  # forward reduce-scatter, backward of the gather

        tp_pair()                                                     # attention
        if s.cp > 1:                                                  # ring attention
            travel = T * (model.kv_per_token if model.mla else model.kv_per_token / s.tp)
            for kind in ("send", "recv"):
                c.add(kind, "cp", (passes + 1) * (s.cp - 1) * travel * a + s.cp * travel * master,
                      (passes + 1) * (s.cp - 1) + s.cp)
        if not moe:
            tp_pair()                                                 # dense MLP
            return c
        if model.shared_ffn:
            tp_pair()                                                 # shared expert
        stats = I64 * (2 * E + 2)
        for d in ("cp", "tp", "dp"):
            if sizes[d] > 1:
                c.add("all_reduce", d, passes * stats, passes)
        slots = E + copy_slots             # the dispatch's counts: one per slot
        if s.ep > 1:
            c.add("all_gather", "ep", passes * I64 * slots, passes)
        if s.etp > 1:
            c.add("all_gather", "etp", passes * I64 * s.ep * slots, passes)
        if copy_slots:                     # the copies' weights (each forward), their gradients back
            w = model.expert_params / s.etp * a
            c.add("all_to_all", "ep", passes * fetched[0] * w + fetched[1] * w,
                  (passes + 1) * EXPERT_WEIGHTS)
        rows = Tr * k * h * a              # the rank's own routed rows
        got = recv * rows                  # the rows its experts receive (from its etp column)
        # dispatch and the combine's backward send the rank's own rows; the combine and the
        # dispatch's backward send back what it received
        c.add("all_to_all", "ep", (passes + 1) * (rows + got), (passes + 1) * 2)
        if s.etp > 1 and megatron:                                    # native all-gather-v / reduce-scatter-v
            c.add("all_gather", "etp", (passes + 1) * got, passes + 1)
            c.add("reduce_scatter", "etp", (passes + 1) * s.etp * got, passes + 1)
        elif s.etp > 1 and ragged:                                    # ragged gather-v / reduce-scatter-v
            c.add("all_to_all", "etp", (passes + 1) * 2 * s.etp * got, (passes + 1) * 2)
        elif s.etp > 1:   # equal counts: native gather-v (forward, and the combine's backward)
            c.add("all_gather", "etp", (passes + 1) * got, passes + 1)
            c.add("all_to_all", "etp", (passes + 1) * s.etp * got, passes + 1)
        return c

    per_layer = {moe: layer(moe).c for moe in (True, False)}  # every layer of a kind issues the same
    params = {moe: model.layer_params(moe) for moe in (True, False)}
    out, seen = [], {}
    for st in stages if stages is not None else stage_params(model, layout):
        n_moe = sum(map(model.is_moe_layer, st.layers))
        # pipeline ranks holding the same (the middle ones, mostly) issue the same: one dict for them
        same = (n_moe, len(st.layers), st.dense, st.experts, st.ends, st.rank == 0, st.last)
        if same in seen:
            out.append(seen[same])
            continue
        c = _Tally()
        for moe, count in ((True, n_moe), (False, len(st.layers) - n_moe)):
            for (kind, dim, when), (nbytes, calls) in per_layer[moe].items():
                c.add(kind, dim, count * m * nbytes, count * m * calls, when)
        if s.tp > 1 and not megatron:   # the step's positions [S], shared by its micro-batches: one tp gather
            c.add("all_gather", "tp", I64 * s_local, 1, STEP)
        if s.cp > 1 and not megatron:  # ring or all-gather, decided by the cp ranks together once per
            c.add("all_reduce", "cp", 3 * I64, 1, STEP)  # positions tensor: [off the layout, first, -first]
        for d in ("dp", "cp", "tp"):                                  # the loss: (sum, count) in fp64
            if sizes[d] > 1 and s.pp == 1:
                c.add("all_reduce", d, 2 * F64 * m, m)
        if s.pp > 1:
            for d in ("pp", "dp", "cp", "tp"):                        # Pipeline.step: token count and loss share
                if sizes[d] > 1:
                    c.add("all_reduce", d, 2 * F64, 1, STEP)
            act = Tr * h * a
            hops = remote_neighbours(s.pp, layout.vpp, st.rank, layout.schedule)  # activations forward, gradients back
            c.add("send", "pp", m * act * hops, m * hops)
            c.add("recv", "pp", m * act * hops, m * hops)
        if megatron:
            _distributed_optimizer(c, model, layout, st, sizes, a, master)
        else:
            _data_parallel(c, model, layout, st, n_moe, params, sizes, a, master, mixed, m)
        seen[same] = {key: v for key, v in c.c.items() if v[0]}
        out.append(seen[same])
    return out


def _distributed_optimizer(c: _Tally, model, layout, st, sizes, a, master) -> None:
    """Megatron-Core's distributed optimizer (``zero1``, comparison rows only): once per step, the
    fp32 gradients reduce-scattered and the updated bf16 parameters all-gathered, over dp x cp
    for the dense weights and edp for the experts; one call per layer and one for the ends."""
    s = layout.spec
    calls = len(st.layers) + 1
    for dim, n, params in ((group_name(("dp", "cp"), sizes), s.dp * s.cp, st.dense), ("edp", s.edp, st.experts)):
        if n > 1 and params:
            c.add("reduce_scatter", dim, master * params, calls, STEP)
            c.add("all_gather", dim, a * params / n, calls, STEP)


def _data_parallel(c: _Tally, model, layout, st, n_moe, params, sizes, a, master, mixed, m) -> None:
    """FSDP2's or ``reduce_gradients``' collectives for one pipeline rank's parameters
    (``n_moe`` of its layers MoE; ``params``: :meth:`ModelShape.layer_params` by kind)."""
    s = layout.spec
    dense_dim, exp_dim = group_name(("dp", "cp"), sizes), "edp"
    n_d, n_e = s.dp * s.cp, s.edp
    router = n_moe * model.experts * model.hidden
    replicated = (n_moe * params[True].replicated + (len(st.layers) - n_moe) * params[False].replicated
                  + st.ends)   # tp-summed grads
    experts = st.experts
    blocks = len(st.layers) + 1                                       # FSDP2 groups: one per layer and the root
    if layout.sharding == "allreduce":
        def bucketed(dim: str, nbytes: float) -> None:                 # reduce_gradients' 16 MiB buckets
            c.add("all_reduce", dim, nbytes, max(1, math.ceil(nbytes / REDUCE_BUCKET_BYTES)), STEP)
        for d in ("dp", "cp", "tp"):
            if sizes[d] > 1:
                bucketed(d, master * (replicated if d == "tp" else st.dense))
        if s.edp > 1:
            bucketed("edp", master * experts)
        return
    # FSDP2: groups gathered in the master dtype (the root, and with tp > 1 under mixed precision
    # the tp-replicated weights, and a gated shared expert whole, as fully_shard_folded makes it
    # one group for its tp-replicated gate; the router always, as its dtype is fp32), the rest in
    # compute dtype
    wide_tp = s.tp > 1 and mixed
    gated = 3 * model.hidden * model.shared_ffn / s.tp * n_moe if model.shared_gate else 0.0
    wide = router + (replicated - router + gated if wide_tp else st.ends)
    root_dtype = master if wide_tp else a
    narrow = st.dense - wide
    # Without pp every group is gathered for forward and again for backward of each micro-batch
    # (a recompute runs inside the backward's gather, measured: it adds none), the root once per
    # micro-batch (it stays gathered from forward to backward). Under a pipeline schedule a group
    # stays gathered after a backward until the next forward ends (reshard_after_backward=False),
    # so a forward right after a backward and a backward right after a backward gather nothing:
    # m + 1 gathers per step for GPipe and 1F1B (measured), taken for interleaved 1F1B too; the
    # root once per step. One fp32 reduce-scatter per step (sync is on only for the last
    # backward). FSDP2 issues nothing on a group of one rank. With a2a_overlap and no pp every
    # group stays gathered from its first forward to the step's end: gathered once per step.
    if s.pp > 1:
        groups, roots = m + 1, 1
    else:
        groups, roots = (1, 1) if getattr(layout, "a2a_overlap", False) else (2 * m, m)
    if n_d > 1:
        c.add("all_gather", dense_dim, (groups * (narrow * a + (wide - st.ends) * master)
                                        + roots * st.ends * root_dtype) / n_d,
              groups * (blocks - 1) + roots)
        c.add("reduce_scatter", dense_dim, master * st.dense, blocks, STEP)
    if n_e > 1 and experts:   # FSDP2's padded dim-0 pieces of the local experts (stages.expert_shard)
        piece = experts * expert_shard(model, s)
        c.add("all_gather", exp_dim, groups * piece * a, groups * n_moe)
        c.add("reduce_scatter", exp_dim, master * piece * n_e, n_moe, STEP)
    if s.tp > 1:
        c.add("all_reduce", "tp", master * replicated, blocks, STEP)


def loop_collectives(layout, global_batch: int) -> dict[tuple[str, str], float]:
    """What ``meshfold train``'s step adds on every rank around :func:`collective_bytes`'s (the
    dry run records it): without pp and with m > 1 micro-batches, one fp64 all-reduce of the m
    micro-batches' token counts over all ranks (``parallel.pipeline.microbatch_counts``; m x (1 + D)
    with multi-token prediction's D depths, which the plan does not model), and the gradient
    norm's fp64 scalar summed over each attention dim of size > 1 (``grad_norm``). Megatron rows:
    none (not meshfold's loop)."""
    return _bytes_only(loop_traffic(layout, global_batch))


def loop_traffic(layout, global_batch: int) -> dict[tuple[str, str, str], list[float]]:
    """:func:`loop_collectives` as ``{(kind, dim, STEP): [bytes, calls]}`` (one call each)."""
    s = layout.spec
    if layout.megatron:
        return {}
    sizes = {"pp": s.pp, "dp": s.dp, "cp": s.cp, "tp": s.tp}
    m = global_batch // (s.dp * layout.mbs)
    c = _Tally()
    if s.pp == 1 and m > 1:
        c.add("all_reduce", group_name(("pp", "dp", "cp", "tp"), sizes), F64 * m, 1, STEP)
    for d in ("pp", "dp", "cp", "tp"):
        if sizes[d] > 1:
            c.add("all_reduce", d, F64, 1, STEP)
    return dict(c.c)
