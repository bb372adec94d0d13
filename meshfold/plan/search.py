"""Which layouts to try, and in which order to show them.

:func:`candidates` walks every FoldSpec of the GPU count that the model's shapes allow and, for
each, every micro-batch size, virtual-pipeline size, pipeline schedule and data-parallel
sharding that meshfold runs (:func:`~meshfold.plan.cost.check_layout` holds meshfold's rules;
tests/plan/test_plan.py runs every proposed layout through ``meshfold train``'s own validation).
:func:`plan` estimates them all and ranks the feasible ones by MFU.

Knobs, as meshfold names them: ``sharding`` = ``parallelize(data_parallel=...)`` (``fsdp``,
``allreduce``); ``mbs`` sets ``train.microbatches`` = B / (dp mbs); ``vpp`` = ``train.virtual``;
``schedule`` = ``train.schedule`` (1f1b, or gpipe where micro-batches < pp, which 1F1B cannot
run; interleaved-1f1b with vpp > 1); ``recompute`` = ``train.recompute``. Pipeline chunks may be
uneven (``Pipeline`` cuts L layers into pp * vpp chunks of ``L // n`` or one more), so pp need not
divide L; virtual stages are tried only where pp * vpp divides L. The paper's Megatron-Core
sharding (``zero1``) is searched only when asked for (``shardings``), for the comparison rows.

Pruning never drops a layout that could rank first: full recomputation only saves memory and
costs a forward pass, so it is tried only where the same layout without it does not fit (and
then both are kept: the one without recomputation, out of memory, and the one with it).
``train.a2a_overlap``, when asked for, is tried beside every layout it runs on (it hides
all-to-all time but holds more memory, so neither variant can be pruned for the other).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterator

from meshfold.mesh import FoldSpec
from meshfold.plan.cost import MEGATRON_SHARDINGS, SHARDINGS, Estimate, Layout, check_layout, estimate
from meshfold.plan.hardware import Hardware, hardware
from meshfold.plan.models import ModelShape, model_shape
from meshfold.plan.placement import check_replicas
from meshfold.plan.routing import Routing, copy_slots, parse_placement

__all__ = ["candidates", "plan", "validate_request"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_request(gpus: int, seq: int, global_batch: int) -> None:
    """Raise ``ValueError`` naming the bad value when a planning request makes no sense."""
    for name, v in (("gpus", gpus), ("seq", seq), ("global batch", global_batch)):
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


def candidates(model: ModelShape, gpus: int, seq: int, global_batch: int,
               shardings: tuple[str, ...] = SHARDINGS, max_mbs: int = 8,
               max_vpp: int = 8) -> Iterator[Layout]:
    """Every layout (without recomputation) that can run ``model`` on ``gpus`` ranks."""
    for pp in _divisors(gpus):
        if pp > model.layers:
            continue
        stage = gpus // pp
        for tp in _divisors(stage):
            if model.heads % tp or model.kv_groups % tp:
                continue
            for cp in _divisors(stage // tp):
                dp = stage // (tp * cp)
                if global_batch % dp:
                    continue
                mbs_choices = [b for b in _divisors(global_batch // dp) if b <= max_mbs]
                for etp in _divisors(stage):
                    if model.expert_ffn % etp:
                        continue
                    for ep in _divisors(stage // etp):
                        if model.experts % ep:
                            continue
                        spec = FoldSpec(gpus, tp=tp, cp=cp, pp=pp, etp=etp, ep=ep)
                        for sharding in shardings:
                            for mbs in mbs_choices:
                                m = global_batch // (dp * mbs)
                                for vpp in range(1, max_vpp + 1):
                                    if vpp > 1 and (pp == 1 or model.layers % (pp * vpp)):
                                        continue
                                    # gpipe only where 1F1B cannot run (it holds all m in flight)
                                    schedule = "gpipe" if (pp > 1 and m < pp and sharding not in
                                                           MEGATRON_SHARDINGS) else "1f1b"
                                    lay = Layout(spec, mbs=mbs, vpp=vpp, sharding=sharding, schedule=schedule)
                                    if not check_layout(model, lay, seq, global_batch):
                                        yield lay


def _rank_key(e: Estimate) -> tuple:
    return (not e.feasible, -e.mfu if e.feasible else e.memory_total)


def plan(model: str | ModelShape | object, gpus: int, hw: str | Hardware = "h100", seq: int = 4096,
         global_batch: int = 256, where: Callable[[Layout], bool] | None = None,
         shardings: tuple[str, ...] = SHARDINGS, max_mbs: int = 8, routing: Routing | None = None,
         placement: str = "static", a2a_overlap: bool = False) -> list[Estimate]:
    """Estimate every layout of ``model`` on ``gpus`` GPUs; best first.

    Args:
        model: a name of ``MODELS``, a :class:`ModelShape`, or any config (``from_config``).
        gpus: world size. hw: a name of ``HARDWARE`` or a :class:`Hardware`.
        seq, global_batch: sequence length and sequences per step.
        where: keep only layouts for which this returns True (e.g. a baseline strategy).
        shardings: data-parallel shardings to try: meshfold's ``"fsdp"``, ``"allreduce"``
            (the default, both); add ``"zero1"`` for the paper's Megatron comparison rows.
        routing, placement: the routing load (:mod:`meshfold.plan.routing`; None: balanced) and
            the expert placement (``static`` | ``balanced`` | ``replicated:R``) each layout is
            costed under: the busiest ep rank's expert GEMMs, all-to-all bytes and activations,
            and the copies' fetch and memory (``estimate``). ``balanced`` tries only the layouts
            ``train.expert_placement = "balanced"`` runs on (ep >= 2, pp = 1), ``replicated:R``
            those ``train.redundant_experts = R`` runs on (also ep dividing R, R <= E).
        a2a_overlap: also estimate each layout that ``train.a2a_overlap`` runs on with it
            (:func:`~meshfold.plan.cost.check_layout`; the schedules tried stay the same, so
            here that is pp = 1 with two micro-batches or more, and 1f1b, run as combined 1F1B);
            both variants are ranked.

    Returns feasible estimates by decreasing MFU, then infeasible ones (out of memory, with
    ``reason``) by increasing memory. Recomputation is tried for a layout only where the layout
    without it is out of memory: selective first, then full where selective is out of memory too;
    every estimate tried is returned, so a constraint that rules recomputation out (the paper's
    Megatron strategies) still finds its out-of-memory layouts.
    """
    shape, hw = model_shape(model), hardware(hw)
    validate_request(gpus, seq, global_batch)
    bad = [s for s in shardings if s not in SHARDINGS + MEGATRON_SHARDINGS]
    if bad:
        raise ValueError(f"unknown sharding {bad}; valid: {list(SHARDINGS + MEGATRON_SHARDINGS)}")
    placement = parse_placement(placement)
    R = copy_slots(placement)
    out = []

    def runs(lay: Layout) -> bool:   # kept by the constraint, and meshfold runs it
        return (where is None or where(lay)) and not check_layout(shape, lay, seq, global_batch)

    for layout in candidates(shape, gpus, seq, global_batch, shardings, max_mbs):
        if where is not None and not where(layout):
            continue
        if placement != "static" and (layout.spec.ep < 2 or layout.spec.pp > 1):
            continue  # meshfold train re-places experts only there
        if R and check_replicas(R, shape.experts, layout.spec.ep, layout.spec.pp):
            continue
        overlapped = replace(layout, a2a_overlap=True)
        for variant in [layout] + ([overlapped] if a2a_overlap and runs(overlapped) else []):
            e = estimate(shape, hw, variant, seq, global_batch, routing, placement)
            out.append(e)
            for mode in ("selective", "full"):  # cheaper recomputation first, each only if still out of memory
                rc = replace(variant, recompute=mode)
                if e.feasible or not runs(rc):
                    break
                e = estimate(shape, hw, rc, seq, global_batch, routing, placement)
                out.append(e)
    if not out:
        raise ValueError(
            f"no layout of {gpus} GPUs can run {shape.name} with seq={seq}, global batch={global_batch}"
            + (" under the given constraint" if where is not None else "")
            + (f" with --placement {placement} (re-placement needs ep >= 2 and pp = 1"
               + (f", copies ep dividing {R} and at most {shape.experts} copy slots" if R else "") + ")"
               if placement != "static" else "")
            + f": the global batch must be divisible by some dp = gpus / (tp*cp*pp) (divisors of {gpus}:"
            f" {_divisors(gpus)}), tp must divide heads={shape.heads} and kv_groups={shape.kv_groups},"
            f" pp must be at most layers={shape.layers}, 2*cp*tp (or tp) must divide seq")
    out.sort(key=_rank_key)
    return out
