"""How much memory and time one training step of one layout costs: the planner's model.

Every term is a closed formula over the model shape, the layout and the hardware; docs/plan.md
states each with its source. Legend (per rank, per micro-batch unless said otherwise):

    B = global batch, b = micro-batch, s = sequence, m = B / (dp b) micro-batches per step
    T  = b s / cp       tokens of one attention rank (its context-parallel chunk)
    Tr = T / tp         tokens one rank holds between blocks (sequence parallel)
    M_e = Tr k etp ep / E   rows of each local expert's GEMM (balanced routing; under a skewed
                            routing the busiest ep rank's, recv x as many: ``estimate``'s routing)
    a = 2               bytes per bf16 element

Layer compute, by kind (``ModelShape.is_moe_layer``): attention + the MoE layer (experts, shared
expert, token dispatcher), or attention + a dense SwiGLU MLP of ``dense_ffn`` split over tp;
forward, backward (2x forward, the attention core at its own measured rate, 2.5x its FLOPs) and
the recomputation. Communication: every collective the step issues, as :mod:`meshfold.plan.
collectives` counts it (``Estimate.collectives``: bytes per (kind, mesh dim), with calls and
whether per micro-batch or per step), in seconds by :mod:`meshfold.plan.traffic`.
Seconds come from Hardware: dense and grouped GEMMs, flash attention and collectives each run at a
measured rate for their shape (sequence length, rows per expert, message size, node span).

    t_mb(r) = compute of pipeline rank r's layers (+ the head on the last) + its per-micro-batch
              collectives / m, less the all-to-all seconds a2a_overlap hides (meshfold.plan.overlap)
    step    = m * max_r t_mb(r) + bubble + max_r (its once-per-step collectives)
    bubble  = (pp - 1) / vpp * t_mb for 1F1B and its interleaving; less for the zero-bubble
              schedules (:mod:`meshfold.plan.schedules`, from t_mb's forward and backward halves)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property

from meshfold.catalog import DATA_PARALLEL, RECOMPUTE, SCHEDULES, V_SCHEDULES, ZERO_BUBBLE
from meshfold.mesh import FoldSpec
from meshfold.plan.collectives import MICROBATCH, STEP, collective_traffic, loop_traffic
from meshfold.plan.hardware import GIB, Hardware
from meshfold.plan.memory import memory_terms
from meshfold.plan.overlap import a2a_hidden
from meshfold.plan.schedules import bubble
from meshfold.plan.models import ModelShape
from meshfold.plan.placement import check_replicas
from meshfold.plan.routing import Routing, busiest_rank_fetches, busiest_rank_shares, copy_slots, parse_placement
from meshfold.plan.traffic import collective_seconds, traffic_seconds

__all__ = ["Layout", "Estimate", "estimate", "check_layout", "RECOMPUTE", "SHARDINGS", "MEGATRON_SHARDINGS",
           "SCHEDULES", "TIME_TERMS", "MEMORY_TERMS"]

BF16 = 2  # bytes
# What meshfold runs (meshfold.catalog: RECOMPUTE, SCHEDULES and, as SHARDINGS, its data
# parallelism: FSDP2 fully sharded | whole replicas, gradients all-reduced)
SHARDINGS = DATA_PARALLEL
# The paper's Megatron-Core distributed optimizer: comparison rows only, meshfold does not have it.
MEGATRON_SHARDINGS = ("zero1",)
TIME_TERMS = ("compute", "tp", "cp", "ep", "etp", "dp", "pp", "bubble")
MEMORY_TERMS = ("params", "grads", "optimizer", "buffers", "activations")


@dataclass(frozen=True)
class Layout:
    """One point of the search: a fold plus the knobs that do not change where ranks are.

    Args:
        spec: the rank layout (attention ``tp, cp, dp, pp``; MoE ``etp, ep, edp, pp``).
        mbs: micro-batch size (sequences per micro-batch per data-parallel rank).
        vpp: model chunks per pipeline rank (``train.virtual``); > 1 = interleaved 1F1B.
        recompute: activation recomputation as ``meshfold train`` runs it (``train.recompute``):
            ``"none"``; ``"selective"`` (keep each layer's input, weight-GEMM outputs and routing;
            recompute norms, RoPE, the attention core, SwiGLU, the combine, and reissue the
            layer's collectives); ``"full"`` (keep each layer's input and routing).
        sharding: data parallelism as meshfold runs it (``parallelize(data_parallel=...)``):
            ``"fsdp"`` = FSDP2 (params, grads and AdamW state sharded over dp x cp / edp, each
            block gathered when used; ``meshfold train``'s); ``"allreduce"`` = whole replicas,
            gradients all-reduced. ``"zero1"`` = the paper's Megatron-Core distributed optimizer
            (bf16 params and fp32 grads replicated, optimizer state sharded), which meshfold does
            not have: only for the comparison rows (:mod:`meshfold.plan.baselines`).
        schedule: the pipeline schedule (``train.schedule``) with pp > 1: ``"1f1b"``, ``"gpipe"``
            (meshfold's choice where micro-batches < pp, which 1F1B cannot run) or
            ``"interleaved-1f1b"`` (set automatically when vpp > 1).
        a2a_overlap: two micro-batches of a rank take turns so that one's MoE dispatch and
            combine all-to-alls travel while the other computes (``train.a2a_overlap``): one
            micro-batch's forward beside another's backward, without pp and under ``1f1b`` (run as
            combined 1F1B) and ``dualpipev``
            (:func:`check_layout` says where it runs; :mod:`meshfold.plan.overlap` what it hides).

    Runs on meshfold as ``meshfold train`` with :meth:`train_overrides` (bf16 compute over fp32
    master weights; ``train.data_parallel = sharding``).
    """

    spec: FoldSpec
    mbs: int = 1
    vpp: int = 1
    recompute: str = "none"
    sharding: str = "fsdp"
    schedule: str = "1f1b"
    a2a_overlap: bool = False

    def __post_init__(self):
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"Layout.recompute = {self.recompute!r}; valid: {list(RECOMPUTE)}")
        if self.vpp > 1 and self.schedule in ("1f1b", "gpipe"):
            object.__setattr__(self, "schedule", "interleaved-1f1b")

    @property
    def megatron(self) -> bool:
        """A comparison row (the paper's Megatron-Core), not something meshfold runs."""
        return self.sharding in MEGATRON_SHARDINGS

    def train_overrides(self, model: str, seq: int, global_batch: int) -> list[str]:
        """``meshfold train --set`` overrides that run this layout (bf16 compute over fp32 masters)."""
        s = self.spec
        m = global_batch // (s.dp * self.mbs)
        return [f"model.name={model}", f"fold.world_size={s.world_size}", f"fold.tp={s.tp}", f"fold.cp={s.cp}",
                f"fold.pp={s.pp}", f"fold.ep={s.ep}", f"fold.etp={s.etp}", f"train.batch={global_batch}",
                f"train.seq={seq}", f"train.microbatches={m}", f"train.schedule={self.schedule}",
                f"train.virtual={self.vpp}", f"train.recompute={self.recompute}",
                f"train.data_parallel={self.sharding}", "train.dtype=bfloat16"] + (
                    ["train.a2a_overlap=true"] if self.a2a_overlap else [])

    def paper_config(self) -> str:
        """The paper's notation CP/TP/EP/PP/ETP, e.g. ``1/2/8/8/1``."""
        s = self.spec
        return f"{s.cp}/{s.tp}/{s.ep}/{s.pp}/{s.etp}"

    def describe(self) -> str:
        """Compact one-line form: attention view | MoE view | knobs."""
        s = self.spec
        rc = {"none": "", "selective": " rc-sel", "full": " rc"}[self.recompute]
        sched = f" {self.schedule}" if s.pp > 1 else ""
        ovl = " a2a-ovl" if self.a2a_overlap else ""
        knobs = f"mbs{self.mbs} vpp{self.vpp}{rc} {self.sharding}{sched}{ovl}"
        return f"tp{s.tp} cp{s.cp} dp{s.dp} pp{s.pp} | ep{s.ep} etp{s.etp} edp{s.edp} | {knobs}"


@dataclass(frozen=True)
class Estimate:
    """Cost of one layout: per-GPU memory (bytes) and step-time terms (seconds).

    ``memory`` has the terms of :data:`MEMORY_TERMS` for the pipeline stage that needs most;
    ``time`` has :data:`TIME_TERMS`, summing to ``step_time``. ``feasible`` is False when the
    memory exceeds the usable memory, and ``reason`` then says by how much. ``collectives``: the
    bytes of every collective one step issues, per (kind, mesh dim).
    """

    layout: Layout
    memory: dict[str, float]
    time: dict[str, float]
    step_time: float
    mfu: float
    feasible: bool
    reason: str = ""
    detail: dict[str, float] = field(default_factory=dict, compare=False)

    @cached_property
    def collectives(self) -> dict[tuple[str, str], float]:
        """``{(kind, dim): bytes per step}`` of global rank 0 (pipeline rank 0), in ``meshfold
        dryrun``'s format (:func:`meshfold.plan.collectives.collective_bytes`; every pipeline
        rank: :attr:`collectives_per_rank`)."""
        return self.collectives_per_rank[0]

    @cached_property
    def collectives_per_rank(self) -> list[dict[tuple[str, str], float]]:
        """Per pipeline rank, the model's step (:func:`~meshfold.plan.collectives.collective_bytes`)
        plus the training loop's own (:func:`~meshfold.plan.collectives.loop_collectives`: token
        counts, gradient norm), as ``meshfold dryrun`` records a step: :attr:`traffic_per_rank`'s
        bytes, what the time model's communication terms are computed from."""
        out = []
        for t in self.traffic_per_rank:
            c: dict = {}
            for (kind, dim, _), (nbytes, _) in t.items():
                c[kind, dim] = c.get((kind, dim), 0.0) + nbytes
            out.append({key: v for key, v in c.items() if v})
        return out

    @cached_property
    def traffic_per_rank(self) -> list[dict[tuple[str, str, str], list[float]]]:
        """Per pipeline rank, ``{(kind, dim, when): [bytes, calls] per step}``: the model's
        (:func:`~meshfold.plan.collectives.collective_traffic`) and the loop's
        (:func:`~meshfold.plan.collectives.loop_traffic`)."""
        d = self.detail
        loop = loop_traffic(self.layout, d["global_batch"])
        out, merged = [], {}   # ranks that issue the same share one dict (and its seconds)
        for t in collective_traffic(d["model"], self.layout, d["seq"], d["global_batch"],
                                    stages=d.get("params_per_rank"), recv=d.get("recv", 1.0),
                                    copy_slots=d.get("copy_slots", 0), fetched=d.get("fetched", (0.0, 0.0))):
            if id(t) not in merged:
                both = {key: list(v) for key, v in t.items()}
                for key, (nbytes, calls) in loop.items():
                    entry = both.setdefault(key, [0.0, 0.0])
                    entry[0] += nbytes
                    entry[1] += calls
                merged[id(t)] = both
            out.append(merged[id(t)])
        return out

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())

    @property
    def tokens_per_s(self) -> float:
        return self.detail.get("tokens", 0.0) / self.step_time


def check_layout(model: ModelShape, layout: Layout, seq: int, global_batch: int) -> str:
    """Why ``layout`` cannot run ``model`` at all (empty string when it can).

    meshfold's rules (``TrainConfig.validate``, ``check_fold``, ``check_pipeline``; a test runs
    every proposed layout through them): heads, KV groups, the dense and shared-expert ffn over
    tp, experts over ep, expert ffn over etp, the sequence over 2 cp tp (cp's load-balanced
    chunks) or tp, the global batch over dp * mbs; pp * vpp chunks of at least one layer each;
    1F1B with at least pp micro-batches, interleaved 1F1B with a multiple of pp; and no
    recomputation under a pipeline with FSDP2, which meshfold runs but the planner does not model
    (its pipeline moments, ``memory._pipeline_activations``, hold no recomputed block's working
    set and were compared with the dry run without recomputation). ``a2a_overlap`` where
    ``check_a2a_overlap`` and ``TrainConfig.validate`` allow it: MoE layers and ep > 1, and two
    micro-batches to take turns (pp = 1: m >= 2 accumulated; pp > 1: 1f1b or dualpipev). The Megatron
    comparison rows (``zero1``) keep Megatron-Core's rules instead: pp * vpp divides the layers,
    cp divides the sequence, and no a2a_overlap (meshfold's, not Megatron-Core's).
    """
    s = layout.spec
    if layout.sharding not in SHARDINGS + MEGATRON_SHARDINGS:
        return f"sharding {layout.sharding!r} unknown; valid: {list(SHARDINGS)} (Megatron, comparison only: zero1)"
    if layout.schedule not in SCHEDULES:
        return f"schedule {layout.schedule!r} unknown; valid: {list(SCHEDULES)}"
    m = global_batch // (s.dp * layout.mbs) if global_batch % (s.dp * layout.mbs) == 0 else 0
    chunks = s.pp * layout.vpp
    split = 2 * s.cp * s.tp if s.cp > 1 else s.tp
    common = (
        (model.heads % s.tp == 0 and model.kv_groups % s.tp == 0,
         f"tp={s.tp} must divide heads={model.heads} and kv_groups={model.kv_groups}"),
        (model.experts % s.ep == 0, f"ep={s.ep} must divide experts={model.experts}"),
        (model.expert_ffn % s.etp == 0, f"etp={s.etp} must divide expert_ffn={model.expert_ffn}"),
        (global_batch % (s.dp * layout.mbs) == 0,
         f"dp*mbs={s.dp * layout.mbs} must divide global batch={global_batch}"),
    )
    overlap = () if not layout.a2a_overlap else (
        (not layout.megatron, "a2a_overlap is meshfold's train.a2a_overlap; the zero1 rows are Megatron-Core's"),
        (s.ep > 1, "a2a_overlap with ep=1: there is no expert all-to-all to overlap; valid: ep > 1"),
        (model.moe_layers > 0, f"a2a_overlap: {model.name} has no MoE layers, so no all-to-all to overlap"),
        (s.pp > 1 or m >= 2, f"a2a_overlap with pp=1 and micro-batches={m}: a forward overlaps another micro-batch's backward; "
                             f"valid: 2 or more (global batch >= 2 dp mbs)"),
        (s.pp == 1 or layout.schedule in ("1f1b", "dualpipev"),
         f"a2a_overlap with pp={s.pp} and schedule {layout.schedule!r}: 1f1b (combined) and dualpipev pair one "
         f"micro-batch's forward with another's backward; valid: schedule '1f1b' or 'dualpipev'"),
    )
    if layout.megatron:
        rules = common + (
            (model.layers % chunks == 0, f"pp*vpp={chunks} must divide layers={model.layers}"),
            (seq % s.cp == 0, f"cp={s.cp} must divide seq={seq}"),
            (layout.vpp == 1 or (s.pp > 1 and m % s.pp == 0),
             f"vpp={layout.vpp} needs pp>1 and micro-batches a multiple of pp={s.pp}"),
        ) + overlap
    else:
        pipelined = s.pp > 1
        rules = common + (
            (model.shared_ffn % s.tp == 0, f"tp={s.tp} must divide shared_ffn={model.shared_ffn}"),
            (not model.dense_layers or model.dense_ffn % s.tp == 0,
             f"tp={s.tp} must divide dense_ffn={model.dense_ffn}"),
            (seq % split == 0, f"seq={seq} must be divisible by {split} (cp={s.cp} gives 2*cp load-balanced "
                               f"chunks, each split over tp={s.tp})"),
            (chunks <= model.layers, f"pp*vpp={chunks} chunks but only layers={model.layers}"),
            (layout.vpp == 2 if layout.schedule in V_SCHEDULES else
             layout.schedule.startswith("interleaved") == (layout.vpp > 1),
             f"schedule {layout.schedule!r} with vpp={layout.vpp}: the interleaved schedules need vpp >= 2, "
             f"zbv and dualpipev 2, gpipe and 1f1b 1"),
            (not pipelined or layout.schedule == "gpipe" or m >= s.pp,
             f"{layout.schedule} needs micro-batches={m} >= pp={s.pp} (gpipe does not)"),
            (not pipelined or not layout.schedule.startswith("interleaved") or m % s.pp == 0,
             f"{layout.schedule} needs micro-batches={m} a multiple of pp={s.pp}"),
            (not pipelined or layout.schedule != "dualpipev" or m >= 2 * s.pp,
             f"dualpipev needs micro-batches={m} >= 2 pp={2 * s.pp}"),
            (not (pipelined and layout.schedule in ZERO_BUBBLE and layout.recompute != "none"),
             f"recompute={layout.recompute!r} with {layout.schedule}: torch's weight pass recomputes a block "
             f"once per parameter group, which the planner does not model; valid: recompute='none'"),
            (not (pipelined and layout.sharding == "fsdp" and layout.recompute != "none"),
             f"recompute={layout.recompute!r} with pp={s.pp} under FSDP2 is not modelled by the planner "
             f"(meshfold runs it); valid: recompute='none', or sharding='allreduce'"),
        ) + overlap
    return next((why for ok, why in rules if not ok), "")


def estimate(model: ModelShape, hw: Hardware, layout: Layout, seq: int, global_batch: int,
             routing: Routing | None = None, placement: str = "static") -> Estimate:
    """Memory per GPU, step-time breakdown and MFU of ``layout`` training ``model``.

    ``routing`` (:mod:`meshfold.plan.routing`; None: balanced) and ``placement`` (``static``,
    ``balanced`` or ``replicated:R``: which experts each ep rank holds, and copies of the hot
    ones) set the rows the busiest ep rank's experts receive: its expert GEMMs, its all-to-all
    bytes and its activations are charged, since every ep rank waits for it. Copies add their
    weights' fetch and their gradients' return over ep and the fetched weights' memory.
    ``layout.a2a_overlap``: each pipeline rank's ep term is less the dispatch and combine seconds
    its paired micro-batches hide (:mod:`meshfold.plan.overlap`); the bubble is charged as without
    it. ``detail``'s ``a2a_s``, ``a2a_hidden_s`` and ``a2a_hidden_fraction``: the slowest rank's
    dispatch + combine seconds per step, the seconds hidden, and their ratio.

    Raises ``ValueError`` (see :func:`check_layout`) when the layout cannot run the model at all;
    a layout that runs but does not fit in memory gives ``feasible=False`` with the reason.
    """
    why = check_layout(model, layout, seq, global_batch)
    placement = parse_placement(placement)
    R = copy_slots(placement)
    why = why or (R and check_replicas(R, model.experts, layout.spec.ep, layout.spec.pp))
    if why:
        raise ValueError(f"layout {layout.describe()} cannot run {model.name}"
                         f"{f' with --placement {placement}' if R else ''}: {why}")
    sp = layout.spec
    tp, cp, dp, pp, ep, etp = sp.tp, sp.cp, sp.dp, sp.pp, sp.ep, sp.etp
    h, n, g, E, k = model.hidden, model.heads, model.kv_groups, model.experts, model.topk
    f_e, f_sh, f_d, V = model.expert_ffn, model.shared_ffn, model.dense_ffn, model.vocab
    b, s, vpp, a = layout.mbs, seq, layout.vpp, BF16
    m = global_batch // (dp * b)           # micro-batches per step
    T = b * s / cp                         # tokens of one attention rank's context chunk
    Tr = T / tp                            # tokens one rank holds between blocks (SP)
    # Routing: per MoE layer, the shares (of all routed pairs) of the busiest ep rank's local
    # experts; they receive that share of the (ep, etp) block's Tr k ep etp pairs. recv: its rows
    # over the balanced Tr k etp (1 balanced), mean over the measured layers (replay).
    routing = Routing() if routing is None else routing
    busy_LE = busiest_rank_shares(routing, placement, E, ep)
    block_pairs = Tr * k * etp * ep
    recv = sum(ep * sum(shares) for shares in busy_LE) / len(busy_LE)
    M_e = recv * Tr * k * etp * ep / E     # mean rows of the busiest rank's local expert GEMMs
    fetched = busiest_rank_fetches(routing, placement, E, ep)  # copies' weights: sent, received

    # ---- compute, one layer forward -------------------------------------------------------------
    # GEMMs: 2*rows*in*out FLOPs each plus a fixed cost per GEMM problem (QKV, O; shared or dense
    # MLP fc1, fc2; fc1, fc2 of each local expert). Memory-bound kernels move bytes at HBM speed:
    # norms, residual adds and rotary on the attention side; router, permute, chunk sort, SwiGLU,
    # probs and unpermute on the MoE side (the token dispatcher, counted below kernel by kernel).
    # The attention core (scores and values); MLA: scores over dn + dr, values of dv, so
    # T s n (d_qk + d_v) executed, = 2 T s n d for GQA. It runs at the measured flash-attention
    # rate of each kernel call's length (Hardware.attention_fraction): cp = 1 is one causal call
    # over s; under cp the ring (meshfold.parallel.ring_attention) calls the kernel on blocks of one
    # chunk, s / (2 cp) tokens: two causal diagonal blocks (T^2 / 4 score pairs), the rest unmasked.
    # Backward executes 2.5x the forward FLOPs (FlashAttention's count) at the backward's rate.
    pair_flops = 2 * n * (model.qk_dim + model.value_dim) / tp  # per (query, key) pair computed, fwd
    core_d = max(model.qk_dim, model.value_dim)
    if cp == 1:
        core_calls = ((T * s / 2 * pair_flops, s, True),)       # (FLOPs, call length, causal)
    else:
        diag = T * T / 4 * pair_flops
        core_calls = ((diag, T / 2, True), (T * s / 2 * pair_flops - diag, T / 2, False))
    c_core = sum(hw.attention_time(f, length, core_d, causal, False) for f, length, causal in core_calls)
    c_core_bwd = sum(hw.attention_time(2.5 * f, length, core_d, causal, True) for f, length, causal in core_calls)
    c_attn = hw.gemm_time(2 * T * model.attn_params / tp, 2) + c_core
    dq, dv = model.qk_dim, model.value_dim  # d and d for GQA; dn + dr and dv for MLA
    attn_bytes = a * (10 * Tr * h + 2 * T * (n * dq + g * (dq + dv) / 2) / tp)   # norms, residuals, rotary
    # MoE layer: expert GEMMs, E/ep local experts of M_e rows each, fc1 [h -> 2 f_e/etp] and
    # fc2 [f_e/etp -> h]; the shared expert, a dense SwiGLU of f_sh split over tp.
    c_shared = hw.gemm_time(6 * T * h * f_sh / tp, 2) if f_sh else 0.0
    # (each local expert at its own rows, experts of equal rows as one group; the mean over the
    # measured layers)
    c_experts = sum(hw.grouped_gemm_time(share * block_pairs, 2 * f_e / etp, h, count)
                    + hw.grouped_gemm_time(share * block_pairs, h, f_e / etp, count)
                    for shares in busy_LE for share, count in Counter(shares).items()) / len(busy_LE)
    # Token dispatcher, bytes each memory-bound kernel reads + writes (elements x a unless said):
    #   permute: gather the Tr k routed rows                  2 Tr k h
    #   sort_chunks_by_idxs after the a2a + ETP all-gather,   4 Tr k etp h   (only with several local
    #     and its inverse before the way back                               experts and several sources)
    #   SwiGLU: read 2 f_e, write f_e per row                  3 Tr k f_e
    #   (the sort and SwiGLU run on the rows received: x recv)
    #   probs multiply (read, write) + unpermute (read)        3 Tr k h, plus the Tr h output written
    #   router: fp32 logits through softmax and top-k          12 Tr E
    sort_rows = recv * Tr * k * etp if (E // ep > 1 and ep * etp > 1) else 0.0
    moe_bytes = a * (5 * Tr * k * h + 4 * sort_rows * h + Tr * h + 3 * recv * Tr * k * f_e) + 12 * Tr * E
    mlp_bytes = {True: moe_bytes + a * 3 * T * f_sh / tp,   # MoE side + shared SwiGLU
                 False: a * 3 * T * f_d / tp}              # dense layer: its SwiGLU over the gathered T
    c_mlp = {True: c_shared + c_experts,
             False: hw.gemm_time(6 * T * h * f_d / tp, 2) if f_d else 0.0}  # dense SwiGLU MLP, split over tp
    # Per layer kind (MoE or dense, ModelShape.is_moe_layer), forward + backward (2 forward, the
    # attention core at its own rate) + recomputation: full runs the forward again, selective all
    # of it but the weight GEMMs (the attention core and the memory-bound kernels).
    # The backward's halves (the zero-bubble schedules run them apart): the weight gradients are
    # one more pass of the forward's weight GEMMs; the input gradients the rest (the other GEMM
    # pass, the attention core's backward, the memory-bound kernels) and the recomputation.
    layer_fbw = {}
    for moe in (True, False):
        hbm = hw.hbm_time(attn_bytes + mlp_bytes[moe])
        c_fwd = c_attn + c_mlp[moe] + hbm
        c_re = {"none": 0.0, "selective": c_core + hbm, "full": c_fwd}[layout.recompute]
        c_w = c_fwd - c_core - hbm
        layer_fbw[moe] = (c_fwd, 2 * c_fwd + (c_core_bwd - 2 * c_core) + c_re - c_w, c_w)
    layer_compute = {moe: sum(fbw) for moe, fbw in layer_fbw.items()}
    head = 3 * hw.gemm_time(2 * T * h * V / tp, 1)

    # ---- memory per GPU (meshfold.plan.memory) ---------------------------------------------------
    memory, mem_detail = memory_terms(model, layout, seq, global_batch, recv=recv, copy_slots=R)
    stages = mem_detail["params_per_rank"]

    # ---- communication: the collectives this step issues (Estimate.collectives) --------------------
    # meshfold.plan.traffic turns each (kind, dim)'s bytes and calls into seconds on that dim's
    # group; per micro-batch what is issued with every micro-batch, plus what is issued once per step.
    detail = {"tokens": global_batch * seq, "microbatches": m, "model": model, "seq": seq,
              "global_batch": global_batch, "recv": recv, "routing": routing.describe(), "placement": placement,
              "busiest_share": recv / ep, "copy_slots": R, "fetched": fetched, **mem_detail}
    draft = Estimate(layout, memory, {}, 0.0, 0.0, True, detail=detail)
    seconds: dict[int, dict] = {}
    for t in draft.traffic_per_rank:   # pipeline ranks that issue the same share one dict
        if id(t) not in seconds:
            seconds[id(t)] = traffic_seconds(hw, sp, t)
    comm = [seconds[id(t)] for t in draft.traffic_per_rank]

    # ---- train.a2a_overlap: what a partner micro-batch's compute hides (meshfold.plan.overlap) ------
    # t: one MoE layer's forward dispatch + combine of one micro-batch (the rank's rows out, its
    # experts' rows back); the phases between hand-overs: the attention side (attention, shared
    # expert, their memory-bound kernels) and the expert side (experts, the dispatcher's kernels)
    a2a_t = collective_seconds(hw, sp, "all_to_all", "ep", (1 + recv) * Tr * k * h * a, 2)
    attn_side = c_attn + c_shared + hw.hbm_time(attn_bytes + mlp_bytes[True] - moe_bytes)
    expert_side = c_experts + hw.hbm_time(moe_bytes)
    passes = 2 if layout.recompute != "none" else 1
    moe_of = [sum(map(model.is_moe_layer, st.layers)) for st in stages]
    a2a = [m * (passes + 1) * n * a2a_t for n in moe_of]    # per step, each pipeline rank
    hidden = [a2a_hidden(pp, m, st.rank, moe_of[st.rank], a2a_t, attn_side, expert_side, layout.schedule)
              if layout.a2a_overlap else 0.0 for st in stages]

    # ---- step time: the slowest pipeline rank sets the pace -----------------------------------------
    def per_microbatch(st) -> dict[str, float]:
        n_moe = moe_of[st.rank]
        t = {"compute": n_moe * layer_compute[True] + (len(st.layers) - n_moe) * layer_compute[False]
             + (head if st.last else 0.0)}
        for term, sec in comm[st.rank][MICROBATCH].items():
            t[term] = t.get(term, 0.0) + sec / m
        if hidden[st.rank]:
            t["ep"] = max(0.0, t["ep"] - hidden[st.rank] / m)
        return t

    def forward_backward(st) -> tuple[float, float, float]:
        """Pipeline rank's seconds per micro-batch: forward, input gradients, weight gradients
        (its collectives half in the forward, half in the input gradients; all-to-alls that
        a2a_overlap hides included: the bubble is charged as without it)."""
        parts = [sum(layer_fbw[model.is_moe_layer(i)][j] for i in st.layers) + (head / 3 if st.last else 0.0)
                 for j in range(3)]
        comm_mb = sum(comm[st.rank][MICROBATCH].values()) / m
        return parts[0] + comm_mb / 2, parts[1] + comm_mb / 2, parts[2]

    mb = [per_microbatch(st) for st in stages]
    slow = max(range(pp), key=lambda r: sum(mb[r].values()))
    reduce = max(range(pp), key=lambda r: sum(comm[r][STEP].values()))
    time = {t: m * mb[slow].get(t, 0.0) + comm[reduce][STEP].get(t, 0.0) for t in TIME_TERMS}
    fbw = forward_backward(stages[slow])
    time["bubble"] = bubble(layout.schedule, pp, vpp, m, *fbw) if pp > 1 else 0.0
    step = sum(time.values())
    flops = model.step_flops(global_batch, seq)
    mfu = flops / (step * sp.world_size * hw.peak_tflops * 1e12)

    worst = sum(memory.values())
    usable = hw.usable_bytes
    feasible = worst <= usable
    reason = "" if feasible else (
        f"out of memory: needs {worst / GIB:.1f} GiB per GPU > {usable / GIB:.1f} GiB usable on {hw.name} ("
        + ", ".join(f"{t} {memory[t] / GIB:.1f}" for t in MEMORY_TERMS) + ")")
    # the time model's kernel rates at this layout (meshfold.plan.curves reports them)
    rc = 0 if layout.recompute == "none" else 1
    core_flops = 3.5 * sum(f for f, _, _ in core_calls)   # forward + 2.5x backward, executed
    peak = hw.peak_tflops * 1e12
    detail.update(flops=flops, rows_per_expert=M_e, peak_flops=peak, slowest_rank=slow, forward_backward=fbw,
                  stage_seconds=[sum(t.values()) for t in mb],   # per micro-batch, each pipeline rank
                  attn_core_s=m * len(stages[slow].layers) * ((1 + rc) * c_core + c_core_bwd),
                  attn_core_fraction=core_flops / ((c_core + c_core_bwd) * peak),
                  expert_s=c_experts,   # one MoE layer's forward expert GEMMs on the busiest ep rank
                  expert_rows=recv * Tr * k * etp,   # the rows they receive
                  expert_gemm_fraction=6 * recv * Tr * k * h * f_e / (c_experts * peak),
                  # the slowest rank's dispatch + combine all-to-alls per step, and what a2a_overlap hides
                  a2a_s=a2a[slow], a2a_hidden_s=hidden[slow],
                  a2a_hidden_fraction=hidden[slow] / a2a[slow] if a2a[slow] else 0.0)
    out = Estimate(layout, memory, time, step, mfu, feasible, reason, detail)
    out.__dict__["traffic_per_rank"] = draft.traffic_per_rank   # computed once (cached_property's slot)
    return out
