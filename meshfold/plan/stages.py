"""What one rank of each pipeline stage holds: its layers, its parameters, the FSDP2 groups it gathers.

The planner's memory model (:mod:`meshfold.plan.memory`) and its interleaved-1F1B moments
(:mod:`meshfold.plan.interleaved`) both start from these counts. Layers are cut as
``meshfold.parallel.pipeline.chunk_layers`` cuts them; parameters are split as ``parallelize``
lays them out (:meth:`~meshfold.plan.models.ModelShape.layer_params`); groups are those
``fully_shard_folded`` makes.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshfold.catalog import rank_chunks
from meshfold.plan.models import ModelShape

__all__ = ["BF16", "FP32", "StageParams", "stage_layers", "stage_params", "expert_shard", "wide_shared",
           "regathered"]

BF16, FP32 = 2, 4  # bytes


def stage_layers(layers: int, pp: int, vpp: int, schedule: str = "1f1b") -> list[list[int]]:
    """Layer ids each pipeline rank holds, as ``meshfold.parallel.pipeline.chunk_layers`` cuts them
    (rank r: chunks r, r + pp, ..., or r and 2 pp - 1 - r under the V schedules:
    :func:`~meshfold.catalog.rank_chunks`; a test compares the two)."""
    n = pp * vpp
    chunks = [list(range(i * layers // n, (i + 1) * layers // n)) for i in range(n)]
    return [[i for c in sorted(rank_chunks(pp, vpp, r, schedule)) for i in chunks[c]] for r in range(pp)]


def expert_shard(model: ModelShape, spec) -> float:
    """Share of a rank's ``E / ep`` local experts that FSDP2's ``edp`` shard holds on the
    fullest edp rank. ``fully_shard_folded`` shards the experts' dim 0 where edp divides E / ep,
    else their hidden dim (``expert_shard_placement``): ``1 / edp`` whenever edp divides either.
    Otherwise dim 0 in torch.chunk pieces padded to the first, ``ceil(E / ep / edp) / (E / ep)``
    (both collectives move the padded piece)."""
    local = model.experts // spec.ep
    if local % spec.edp == 0 or model.hidden % spec.edp == 0:
        return 1 / spec.edp
    return -(-local // spec.edp) / local


@dataclass(frozen=True)
class StageParams:
    """Parameters one rank of pipeline rank ``rank`` holds before data-parallel sharding:
    ``dense`` (attention-mesh weights: layers' non-expert weights, and ``ends``), ``experts``
    (MoE-mesh weights), ``ends`` (embedding, head, final norm on this rank), ``head`` (the head
    alone), the layer ids, and whether it holds the last chunk (the head and the loss)."""

    rank: int
    layers: tuple[int, ...]
    dense: float
    experts: float
    ends: float
    head: float
    last: bool

    @property
    def total(self) -> float:
        return self.dense + self.experts


def stage_params(model: ModelShape, layout) -> list[StageParams]:
    """Per pipeline rank, the parameters one of its ranks holds under ``layout``'s tp / ep / etp
    (before dp x cp / edp sharding): the numbers ``parallelize`` gives every rank's local tensors,
    ``to_local().numel()`` summed (tests/plan/test_plan.py checks it on gloo)."""
    s = layout.spec
    vocab_parallel = layout.sharding == "zero1"  # Megatron's; meshfold replicates them over tp
    moe, dense = model.layer_params(True), model.layer_params(False)
    n = s.pp * layout.vpp
    out = []
    for r, ids in enumerate(stage_layers(model.layers, s.pp, layout.vpp, layout.schedule)):
        kinds = [moe if model.is_moe_layer(i) else dense for i in ids]
        emb = model.embedding_params / (s.tp if vocab_parallel else 1)
        first, last = r == 0, n - 1 in rank_chunks(s.pp, layout.vpp, r, layout.schedule)
        head = emb if last and not model.tie_embeddings else 0.0
        ends = (emb if first else 0.0) + head + (model.hidden if last else 0.0)
        layer_dense = sum(p.replicated + p.tp_split / s.tp for p in kinds)
        experts = sum(p.experts for p in kinds) / (s.ep * s.etp)
        out.append(StageParams(r, tuple(ids), layer_dense + ends, experts, ends, head, last))
    return out


def wide_shared(model: ModelShape, layout, layers) -> float:
    """Parameters of the gated shared experts of ``layers``, which FSDP2 gathers in fp32 under tp > 1."""
    if layout.spec.tp == 1 or not (model.shared_ffn and model.shared_gate):
        return 0.0
    return sum(map(model.is_moe_layer, layers)) * 3 * model.hidden * model.shared_ffn / layout.spec.tp


def regathered(model: ModelShape, layout, layers) -> tuple[float, float]:
    """(parameters of the largest FSDP2 group among ``layers`` that a backward re-gathers, x2 for
    experts sharded off dim 0; parameters of the largest weight: the experts' fused gate/up
    [E / ep, h, 2 f_e / etp], else the dense MLP's)."""
    s = layout.spec
    groups, largest = [0.0], [0.0]
    for moe in {model.is_moe_layer(i) for i in layers}:
        p = model.layer_params(moe)
        if s.dp * s.cp > 1:
            groups.append(p.replicated + p.tp_split / s.tp)
        if moe and s.edp > 1:
            off_dim0 = (model.experts // s.ep) % s.edp != 0
            groups.append((2 if off_dim0 else 1) * p.experts / (s.ep * s.etp))
        largest.append(2 / 3 * (p.experts / (s.ep * s.etp) if moe else model.dense_ffn * 3 * model.hidden / s.tp))
    return max(groups), max(largest)
