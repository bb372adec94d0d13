"""Memory moments of interleaved 1F1B (vpp > 1), counted per chunk along torch's order of ops.

Under interleaving a pipeline rank holds ``v`` chunks and runs a later chunk's backwards before
an earlier chunk's have formed any gradients (pp 2, v 2, m 2, rank 0: F0 F1 of chunk 0, F0 F1 of
chunk 2, B0 B1 of chunk 2, B0 B1 of chunk 0). 1F1B's moments (``memory._pipeline_activations``)
assume one chunk, every group gathered and every gradient formed after the first backward, and
over-state the peak by a quarter there (benchmarks/RESULTS.md, *Planner against the dry run*). Here each
backward is a moment, summing what is alive when it starts, chunk by chunk:

* **gradients**: fp32, unsharded (sync off until the last backward), of each chunk whose backward
  has run at least once, its embedding or head included;
* **gathered weights**: the root (embedding / final norm / head: gathered from forward to
  backward, fp32 under tp > 1) and the bf16 groups of each other chunk whose last op was a
  backward (``reshard_after_backward=False`` under pipelining; a forward reshards them after it);
  the chunk in backward re-gathers its groups if its last op was a forward, FSDP2's flat
  all-gather output beside its weights (and, off dim 0, the copy it chunk-cats from), else it has
  them and adds its largest weight's new bf16 gradient in place to the fp32 one;
* **activations**: each chunk-micro-batch whose forward has run and whose backward has not (the
  one in backward among them), and the output its stage keeps for the next rank (not on the
  last chunk);
* the last chunk's loss backward (three fp32 [Tr, V], the head's bf16 copy) as in 1F1B, and each
  chunk's gradient reduction after its last backward (torch's ``REDUCE_GRAD``): its fp32
  gradients and weights, and under tp > 1 for a chunk with the root one fp32 all-reduce output of
  the root's largest gradient (with m > 1 its new bf16 gradient too), as at 1F1B's end; after it
  the chunk holds only its sharded fp32 gradients: no weights, its root resharded too.

Legend: c = chunk (stage index ``r + k pp``), j = micro-batch, v = chunks per rank, m = micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshfold.catalog import rank_chunks, remote_neighbours
from meshfold.plan.models import ModelShape
from meshfold.plan.stages import BF16, FP32, StageParams, expert_shard, regathered, wide_shared

__all__ = ["interleaved_order", "ChunkBytes", "interleaved_peak", "interleaved_activations"]


def interleaved_order(pp: int, v: int, m: int, rank: int, chunks: list[int] | None = None) -> list[tuple[str, int, int]]:
    """Rank ``rank``'s ops as ``(F | B, chunk, micro-batch)`` in the order
    ``torch.distributed.pipelining.ScheduleInterleaved1F1B`` runs them (its idle slots left out; a
    test compares the two): rounds of ``m // rounds`` micro-batches (``rounds = max(1, m // pp)``)
    sweep the rank's chunks, ``(v - 1) rounds' + 2 (pp - 1 - rank)`` warm-up forwards, then one
    forward and one backward at a time, backwards sweeping the chunks last to first. ``chunks``:
    the rank's chunks in the order it sweeps them (default ``rank, rank + pp, ...``)."""
    chunks = chunks or [k * pp + rank for k in range(v)]
    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
    total = m * v
    done = {"F": [0] * v, "B": [0] * v}
    out = []

    def emit(kind: str, local: int) -> None:
        out.append((kind, chunks[local], done[kind][local]))
        done[kind][local] += 1

    for op in range(total + warmup):  # warm-up forwards, 1F1B pairs, cool-down backwards
        if op < total:
            emit("F", (op // per_round) % v)
        if op >= warmup:
            emit("B", v - 1 - ((op - warmup) // per_round) % v)
    return out


@dataclass(frozen=True)
class ChunkBytes:
    """What one chunk of a rank weighs (bytes, but ``params`` and ``sharded``: parameter counts).
    ``params``: its local parameters before data-parallel sharding, embedding / head included
    (4 bytes each as unsharded gradients); ``sharded``: those FSDP2 keeps on this rank after the
    reduce-scatter; ``gathered``: its layers' groups when gathered (bf16, gated shared experts in
    fp32); ``root``: its embedding / final norm / head when gathered (fp32 under tp > 1);
    ``regather``: the largest group's transient bytes while re-gathered (FSDP2's flat output, and
    its copy off dim 0); ``new_grad``: the largest weight's bf16 gradient; ``stored``: one
    micro-batch's kept activations; ``output``: the output torch's stage keeps per micro-batch
    until its backward (hidden [b, s / (cp tp), h] bf16, the logits [b, s / (cp tp), V] on the
    last chunk); ``reduce``: what the reduction after its last backward adds (under tp > 1 the
    root's largest gradient summed out of place over tp, 0 elsewhere)."""

    params: float
    sharded: float
    gathered: float
    root: float
    regather: float
    new_grad: float
    stored: float
    output: float
    reduce: float


def interleaved_peak(chunks: dict[int, ChunkBytes], order, *, last_chunk: int, loss: float, m: int) -> float:
    """Peak bytes of gradients, gathered weights and activations of one rank over ``order``
    (:func:`interleaved_order`): the largest backward moment (module docstring). After a chunk's
    m-th backward torch's ``REDUCE_GRAD`` reduce-scatters its gradients (4 bytes per ``sharded``
    parameter stay) and reshards its groups and root. ``loss``: the loss backward's working set
    besides the in-flight activations and outputs."""
    last_op, formed, reduced, in_flight = {}, set(), set(), []
    moments = []

    def held(skip: int) -> float:
        """Gradients, activations, and the weights gathered by chunks other than ``skip``."""
        out = 0.0
        for k, op in last_op.items():
            ch = chunks[k]
            if k in reduced:
                out += FP32 * ch.sharded
                continue
            out += FP32 * ch.params if k in formed else 0.0
            if k != skip:  # groups unsharded after a backward, resharded after a forward
                out += ch.root + (ch.gathered if op == "B" else 0.0)
        return out + sum(chunks[k].stored + chunks[k].output for k in in_flight)

    for kind, c, j in order:
        if kind == "F":
            in_flight.append(c)
            last_op[c] = "F"
            continue
        ch = chunks[c]
        now = held(c) + ch.root
        if c == last_chunk:  # the loss backward, before the chunk's layers re-gather
            moments.append(now + loss)
        moments.append(now + ch.gathered + (ch.regather if last_op[c] == "F" else ch.new_grad))
        last_op[c] = "B"
        formed.add(c)
        in_flight.remove(c)
        if j == m - 1:  # REDUCE_GRAD: this chunk's gradients and weights all there, then sharded
            moments.append(held(-1) + ch.reduce)
            reduced.add(c)
    return max(moments)


def interleaved_activations(model: ModelShape, layout, seq: int, m: int, st: StageParams, acts: dict,
                            logits: float, head_copy: float, gathered: float) -> float:
    """Interleaved 1F1B (vpp > 1): the rank's peak moment counted chunk by chunk along torch's
    order (:func:`interleaved_peak`), with the receive buffers as in
    ``memory._pipeline_activations``, less the gradients (4 bytes per local parameter) and
    ``gathered`` (all groups and the root), which ``memory_terms``' other terms hold. ``acts``:
    ``{moe: layer_activations(...)}``; ``logits``, ``head_copy``: the loss backward's three fp32
    [Tr, V] and the head's bf16 copy."""
    s, a = layout.spec, BF16
    n = s.pp * layout.vpp
    Tr_h = layout.mbs * seq / (s.cp * s.tp) * model.hidden
    cut = [list(range(i * model.layers // n, (i + 1) * model.layers // n)) for i in range(n)]
    emb, wide = model.embedding_params, FP32 if s.tp > 1 else a
    chunks = {}
    mine = rank_chunks(s.pp, layout.vpp, st.rank, layout.schedule)
    for c in mine:
        ids, dense, experts = cut[c], 0.0, 0.0
        for i in ids:
            lp = model.layer_params(model.is_moe_layer(i))
            dense, experts = dense + lp.replicated + lp.tp_split / s.tp, experts + lp.experts / (s.ep * s.etp)
        first, last = c == 0, c == n - 1
        head = emb if last and not model.tie_embeddings else 0.0
        ends = (emb if first else 0.0) + head + (model.hidden if last else 0.0)
        group, largest = regathered(model, layout, ids)
        reduce = (FP32 + (a if m > 1 else 0.0)) * max(emb if first else 0.0, head) if s.tp > 1 else 0.0
        chunks[c] = ChunkBytes(
            params=dense + experts + ends, sharded=(dense + ends) / (s.dp * s.cp) + experts * expert_shard(model, s),
            gathered=a * (dense + experts) + (FP32 - a) * wide_shared(model, layout, ids), root=wide * ends,
            regather=a * group, new_grad=a * largest, stored=sum(acts[model.is_moe_layer(i)][0] for i in ids),
            output=a * (Tr_h if not last else layout.mbs * seq / (s.cp * s.tp) * model.vocab), reduce=reduce)
    neighbours = remote_neighbours(s.pp, layout.vpp, st.rank, layout.schedule)
    peak = interleaved_peak(chunks, interleaved_order(s.pp, layout.vpp, m, st.rank, mine), last_chunk=n - 1,
                            loss=logits + head_copy, m=m)
    return m * neighbours * a * Tr_h + peak - FP32 * st.total - gathered
