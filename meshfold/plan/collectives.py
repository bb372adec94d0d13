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

Routing is taken as balanced (every rank sends ``Tr k`` rows and its experts receive as many).
"""

from __future__ import annotations

from collections import defaultdict

from meshfold.plan.memory import expert_shard, stage_params
from meshfold.plan.models import ModelShape

__all__ = ["KINDS", "collective_bytes", "loop_collectives", "group_name"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send", "recv", "broadcast")
I64, F32, F64 = 8, 4, 8  # bytes


def group_name(dims: tuple[str, ...], sizes: dict[str, int]) -> str:
    """The name of a (possibly flattened) group over ``dims`` (slowest first): the dims of size
    > 1 joined by ``+``, or all of them when every one has size 1."""
    named = [d for d in dims if sizes[d] > 1]
    return "+".join(named or dims)


def collective_bytes(model: ModelShape, layout, seq: int, global_batch: int, compute_bytes: int = 2,
                     backend: str = "nccl", ragged: bool = True) -> list[dict[tuple[str, str], float]]:
    """Per pipeline rank, ``{(kind, dim): bytes per step}`` of one of its ranks (see the module
    docstring). ``ragged``: the etp blocks' row counts differ (real routing; the gather-v is an
    all-to-all sending its rows to every etp rank); False: exactly equal counts, as ``meshfold
    dryrun``'s balanced routing gives when E divides each rank's ``Tr k`` pairs, where the
    gather-v is a native all-gather of the rank's rows (``placements.collectives._gather_v``).
    ``compute_bytes``: the compute dtype's size (2: bf16 over fp32 masters, the
    planner's setting; 4: fp32 compute; 8: fp64), which picks the reduce-scatter path: native on
    NCCL for fp32 and wider, an all-to-all otherwise (half precision, or gloo). Megatron rows
    (``zero1``) are not meshfold runs: empty dicts."""
    s = layout.spec
    if layout.megatron:
        return [{} for _ in range(s.pp)]
    sizes = {"pp": s.pp, "dp": s.dp, "cp": s.cp, "tp": s.tp, "ep": s.ep, "etp": s.etp, "edp": s.edp}
    a, master = compute_bytes, max(compute_bytes, F32)
    mixed = compute_bytes < master
    scatter = "reduce_scatter" if backend == "nccl" and compute_bytes >= F32 else "all_to_all"
    m = global_batch // (s.dp * layout.mbs)
    passes = 2 if layout.recompute != "none" else 1      # forward collectives: once more in backward
    h, k, E = model.hidden, model.topk, model.experts
    T = layout.mbs * seq / s.cp            # tokens of a cp rank (gathered over tp)
    Tr = T / s.tp                          # tokens a rank holds between blocks
    s_local = seq / (s.cp * s.tp)          # positions (int64) a rank holds
    out = []
    for st in stage_params(model, layout):
        c: dict = defaultdict(float)   # per micro-batch first, then times m

        def tp_pair(positions: bool) -> None:  # _TensorParallel / shared_in + shared_out, per micro-batch
            if s.tp == 1:
                return
            c["all_gather", "tp"] += passes * (Tr * h * a + (I64 * s_local if positions else 0)) + Tr * h * a
            c[scatter, "tp"] += passes * T * h * a + T * h * a   # forward reduce-scatter, backward of the gather

        for i in st.layers:
            moe = model.is_moe_layer(i)
            tp_pair(positions=True)                                   # attention
            if s.cp > 1:                                              # ring attention
                travel = T * (model.kv_per_token if model.mla else model.kv_per_token / s.tp)
                for kind in ("send", "recv"):
                    c[kind, "cp"] += (passes + 1) * (s.cp - 1) * travel * a + s.cp * travel * master
            if not moe:
                tp_pair(positions=False)                              # dense MLP
                continue
            if model.shared_ffn:
                tp_pair(positions=False)                              # shared expert
            stats = I64 * (2 * E + 2)
            for d in ("cp", "tp", "dp"):
                if sizes[d] > 1:
                    c["all_reduce", d] += passes * stats
            if s.ep > 1:
                c["all_gather", "ep"] += passes * I64 * E
            if s.etp > 1:
                c["all_gather", "etp"] += passes * I64 * s.ep * E
            rows = Tr * k * h * a
            c["all_to_all", "ep"] += (passes + 1) * 2 * rows          # dispatch + combine, and their transposes
            if s.etp > 1 and ragged:                                  # ragged gather-v / reduce-scatter-v
                c["all_to_all", "etp"] += (passes + 1) * 2 * s.etp * rows
            elif s.etp > 1:   # equal counts: native gather-v (forward, and the combine's backward)
                c["all_gather", "etp"] += (passes + 1) * rows
                c["all_to_all", "etp"] += (passes + 1) * s.etp * rows
        for key in c:
            c[key] *= m
        for d in ("dp", "cp", "tp"):                                  # the loss: (sum, count) in fp64
            if sizes[d] > 1 and s.pp == 1:
                c["all_reduce", d] += 2 * F64 * m
        if s.pp > 1:
            for d in ("pp", "dp", "cp", "tp"):                        # Pipeline.step: token count and loss share
                if sizes[d] > 1:
                    c["all_reduce", d] += 2 * F64
            n = s.pp * layout.vpp
            chunks = range(st.rank, n, s.pp)
            act = Tr * h * a
            not_last, not_first = sum(ch != n - 1 for ch in chunks), sum(ch != 0 for ch in chunks)
            c["send", "pp"] += m * act * (not_last + not_first)       # activations forward, gradients back
            c["recv", "pp"] += m * act * (not_first + not_last)
        _data_parallel(c, model, layout, st, sizes, a, master, mixed, m)
        out.append({key: v for key, v in c.items() if v})
    return out


def _data_parallel(c, model, layout, st, sizes, a, master, mixed, m) -> None:
    """FSDP2's or ``reduce_gradients``' collectives for one pipeline rank's parameters."""
    s = layout.spec
    dense_dim, exp_dim = group_name(("dp", "cp"), sizes), "edp"
    n_d, n_e = s.dp * s.cp, s.edp
    moe_p, dense_p = model.layer_params(True), model.layer_params(False)
    kinds = [model.is_moe_layer(i) for i in st.layers]
    router = sum(kinds) * model.experts * model.hidden
    replicated = sum((moe_p if k else dense_p).replicated for k in kinds) + st.ends   # tp-summed grads
    experts = st.experts
    if layout.sharding == "allreduce":
        for d in ("dp", "cp", "tp"):
            if sizes[d] > 1:
                c["all_reduce", d] += master * (replicated if d == "tp" else st.dense)
        if s.edp > 1:
            c["all_reduce", "edp"] += master * experts
        return
    # FSDP2: groups gathered in the master dtype (the root, and with tp > 1 under mixed precision
    # the tp-replicated weights; the router always, as its dtype is fp32), the rest in compute dtype
    wide_tp = s.tp > 1 and mixed
    # a gated shared expert is one group of its own under tp > 1, whole in the master dtype
    # (fully_shard_folded: its gate is tp-replicated)
    shared = sum(kinds) * 3 * model.hidden * model.shared_ffn / s.tp if wide_tp and model.shared_gate else 0.0
    wide = router + (replicated - router + shared if wide_tp else st.ends)
    root_dtype = master if wide_tp else a
    narrow = st.dense - wide
    # Without pp every group is gathered for forward and again for backward of each micro-batch
    # (a recompute runs inside the backward's gather, measured: it adds none), the root once per
    # micro-batch (it stays gathered from forward to backward). Under a pipeline schedule a group
    # stays gathered after a backward until the next forward ends (reshard_after_backward=False),
    # so a forward right after a backward and a backward right after a backward gather nothing:
    # m + 1 gathers per step for GPipe and 1F1B (measured), taken for interleaved 1F1B too; the
    # root once per step. One fp32 reduce-scatter per step (sync is on only for the last
    # backward). FSDP2 issues nothing on a group of one rank.
    groups, roots = (m + 1, 1) if s.pp > 1 else (2 * m, m)
    if n_d > 1:
        c["all_gather", dense_dim] += (groups * (narrow * a + (wide - st.ends) * master)
                                       + roots * st.ends * root_dtype) / n_d
        c["reduce_scatter", dense_dim] += master * st.dense
    if n_e > 1:   # FSDP2's padded dim-0 pieces of the local experts (memory.expert_shard)
        piece = experts * expert_shard(model, s)
        c["all_gather", exp_dim] += groups * piece * a
        c["reduce_scatter", exp_dim] += master * piece * n_e
    if s.tp > 1:
        c["all_reduce", "tp"] += master * replicated


def loop_collectives(layout, global_batch: int) -> dict[tuple[str, str], float]:
    """What ``meshfold train``'s step adds on every rank around :func:`collective_bytes`'s (the
    dry run records it): without pp and with m > 1 micro-batches, one fp64 all-reduce of the m
    micro-batches' token counts over all ranks (``train.loop.microbatch_counts``), and the
    gradient norm's fp64 scalar summed over each attention dim of size > 1 (``grad_norm``)."""
    s = layout.spec
    sizes = {"pp": s.pp, "dp": s.dp, "cp": s.cp, "tp": s.tp}
    m = global_batch // (s.dp * layout.mbs)
    c: dict = defaultdict(float)
    if s.pp == 1 and m > 1:
        c["all_reduce", group_name(("pp", "dp", "cp", "tp"), sizes)] += F64 * m
    for d in ("pp", "dp", "cp", "tp"):
        if sizes[d] > 1:
            c["all_reduce", d] += F64
    return dict(c)
