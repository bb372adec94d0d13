"""The planner against the dry run: each memory term and each collective's bytes, side by side.

The planner (:func:`~meshfold.plan.cost.estimate`) states what one step of a layout costs from
closed formulas; ``meshfold dryrun`` (:func:`~meshfold.dryrun.dry_run`) runs that step of
meshfold's own code on fake tensors and records it. :func:`compare` puts the two next to each
other for one layout, term by term, so a formula that drifts from the code shows up as a ratio
away from 1 (benchmarks/RESULTS.md, "Planner against the dry run", has the table and what each row means).

Like is compared with like (per rank of a pipeline stage, per step):

* ``params``, ``optimizer``: the rank's local storage, as both report it.
* ``grads (sharded)``: the planner's sharded fp32 gradients (``4 x local params / dp cp`` dense,
  ``/ edp`` experts) against the dry run's ``grad_bytes``, the reduced gradients the optimizer
  steps on.
* ``step peak (grads + buffers + activations)``: the planner's gradients (unsharded while
  accumulating), FSDP2's gathered weights (``buffers``) and the activations against the dry
  run's ``activation_peak_bytes``, the peak of everything forward and backward create and keep
  alive: activations, temporaries, gathered weights, gradients as they form.
* ``total``: the planner's memory per GPU against the dry run's ``peak_bytes``.
* one row per ``(kind, dim)`` collective either side issues, in bytes per step.

A real-shape step costs the dry run seconds per layer on a CPU, so both sides run the same reduced model (``layers``) and the same number of micro-batches
(``global_batch = dp x mbs x microbatches``): per-layer terms scale with the layer count and
per-micro-batch terms with the micro-batches, while hidden sizes, heads, experts, the sequence
and the fold keep every byte of a layer the real one. With pp > 1 each pipeline stage is
compared by its first rank (:func:`pipeline_cases`: the pipeline's memory moments, its send /
recv over pp, FSDP2 under a schedule, uneven chunks, the embedding and the head's stages).

    python -m meshfold.dryrun.check            # the table of benchmarks/RESULTS.md (minutes: one process a stage)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshfold.mesh import FoldSpec
from meshfold.plan.cost import Layout, estimate
from meshfold.plan.hardware import hardware
from meshfold.plan.stages import FP32, expert_shard
from meshfold.plan.models import MODELS
from meshfold.plan.routing import Routing

__all__ = ["Case", "Row", "compare", "cases", "pipeline_cases", "replica_cases", "bubble_cases", "bubble_rows", "rows", "planned", "planned_collectives", "dry_run_names", "markdown",
           "TOLERANCE"]

TOLERANCE = 0.10  # every term within 10%: the accuracy the planner states (docs/plan.md)


@dataclass(frozen=True)
class Case:
    """One comparison: ``model`` (a name of both ``MODELS`` and meshfold's configs) cut to
    ``layers`` layers, on ``spec`` with ``microbatches`` of ``mbs`` sequences of ``seq`` tokens
    per dp rank, bf16 compute over fp32 masters, FSDP2 (``meshfold train``'s); with pp > 1
    through ``schedule`` with ``virtual`` chunks per rank (``train.schedule``, ``train.virtual``)."""

    label: str
    model: str
    spec: FoldSpec
    layers: int = 1
    seq: int = 4096
    mbs: int = 1
    microbatches: int = 1
    recompute: str = "none"
    schedule: str = "1f1b"
    virtual: int = 1
    zipf: float = 0.0          # the routing: zipf:S (0: balanced)
    placement: str = "static"  # static | balanced | replicated:R (meshfold.plan.routing.parse_placement)

    @property
    def global_batch(self) -> int:
        return self.spec.dp * self.mbs * self.microbatches

    def describe(self) -> str:
        s = self.spec
        return (f"{self.model} ({self.layers} layer{'s' * (self.layers > 1)}) on {s.world_size} ranks, "
                f"{s.cp}/{s.tp}/{s.ep}/{s.pp}/{s.etp}, seq {self.seq}, mbs {self.mbs} x {self.microbatches} "
                f"micro-batches, recompute {self.recompute}"
                + (f", {self.schedule}" + (f" virtual {self.virtual}" if self.virtual > 1 else "") if s.pp > 1 else "")
                + (f", routing zipf:{self.zipf:g}" if self.zipf else "")
                + (f", {self.placement} placement" if self.placement != "static" else ""))


@dataclass(frozen=True)
class Row:
    """One term of pipeline rank ``stage``: the planner's bytes, the dry run's, and planner / dry
    run (None when the dry run has 0 bytes: then the planner must have 0 too)."""

    term: str
    planner: float
    dryrun: float
    stage: int = 0

    @property
    def ratio(self) -> float | None:
        return self.planner / self.dryrun if self.dryrun else None

    @property
    def within(self) -> bool:
        if not self.dryrun:
            return not self.planner
        return abs(self.ratio - 1) <= TOLERANCE


def _train_config(case: Case):
    from meshfold.train.config import TrainConfig

    s = case.spec
    cfg = TrainConfig(model={"name": case.model, "layers": case.layers},
                      fold={"world_size": s.world_size, "tp": s.tp, "cp": s.cp, "pp": s.pp, "ep": s.ep,
                            "etp": s.etp})
    t = cfg.train
    t.batch, t.seq, t.dtype, t.recompute = case.global_batch, case.seq, "bfloat16", case.recompute
    t.microbatches, t.schedule, t.virtual = case.microbatches, case.schedule, case.virtual
    return cfg


def planned(case: Case, routing=None, placement: str = "static"):
    """The planner's :class:`~meshfold.plan.cost.Estimate` of ``case`` (on the reduced model)
    under the dry run's ``routing`` (None or Balanced: balanced; Zipf: the same shares) and
    ``placement`` (``static``, ``balanced`` or ``replicated:R``)."""
    shape = dataclasses.replace(MODELS[case.model], layers=case.layers)
    lay = Layout(case.spec, mbs=case.mbs, vpp=case.virtual, recompute=case.recompute, sharding="fsdp",
                 schedule=case.schedule)
    return estimate(shape, hardware("h100"), lay, case.seq, case.global_batch, _plan_routing(routing), placement)


def _plan_routing(routing) -> Routing:
    """The planner's routing load of a dry-run routing model (Replay has none: it is counts)."""
    from meshfold.dryrun.routing import Balanced, Zipf

    if routing is None or type(routing) is Balanced:
        return Routing()
    if isinstance(routing, Zipf):
        return Routing("zipf", routing.s)
    raise ValueError(f"routing {routing.describe()}; the planner compares under balanced or zipf:S")


def placed_routing(case: Case, routing, placement: str):
    """The dry run's routing model of ``case`` under ``placement``: ``routing`` itself for
    ``static``; else :class:`~meshfold.dryrun.routing.Placed` by the planner's choice
    (:func:`meshfold.plan.routing.placed`) of the routing's shares, so both sides place the same
    experts and copies. With its busiest ep rank (the one to dry-run)."""
    from meshfold.dryrun.routing import Placed
    from meshfold.plan.placement import replica_rank_loads, split_cuts
    from meshfold.plan.routing import placed

    if placement == "static":
        return routing, 0
    shares = _plan_routing(routing).shares_LE(MODELS[case.model].experts)[0]
    slots, copies = placed(shares, placement, case.spec.ep)
    per_rank = replica_rank_loads(shares, slots, copies, case.spec.ep)
    cuts = split_cuts(shares, slots, copies, case.spec.ep) if copies else None
    return Placed(routing, slots, copies, cuts), max(range(case.spec.ep), key=lambda i: (per_rank[i], -i))


def planned_collectives(est, stage: int) -> dict[tuple[str, str], float]:
    """The planner's ``{(kind, dim): bytes}`` of pipeline rank ``stage`` under the dry run's
    routing: the model's step (equal etp counts where E divides each rank's pairs under balanced
    routing, and always under Zipf, which routes the same counts from every rank; see
    :func:`~meshfold.plan.collectives.collective_bytes`) plus the training loop's collectives."""
    from meshfold.plan.collectives import collective_bytes, loop_collectives

    d, s = est.detail, est.layout.spec
    model = d["model"]
    pairs = d["seq"] * est.layout.mbs // (s.cp * s.tp) * model.topk
    ragged = d["routing"] == "balanced" and pairs % model.experts != 0
    c = dict(collective_bytes(model, est.layout, d["seq"], d["global_batch"], ragged=ragged, recv=d["recv"],
                              copy_slots=d["copy_slots"], fetched=d["fetched"])[stage])
    for key, v in loop_collectives(est.layout, d["global_batch"]).items():
        c[key] = c.get(key, 0.0) + v
    return c


def dry_run_names(spec, rank: int, collectives: dict) -> dict[tuple[str, str], float]:
    """``collectives`` renamed as the dry run's log names them on ``rank``: a group spanning the
    same ranks as another dim (edp = dp, ep = tp on some folds) takes the name
    :func:`meshfold.dryrun.dim_names` gives it (the MoE view's for all-to-alls)."""
    from meshfold.dryrun.record import dim_names
    from meshfold.mesh import VIEWS

    names = {"attn": dim_names(spec, rank, "attn"), "moe": dim_names(spec, rank, "moe")}
    out: dict = {}
    for (kind, dim), v in collectives.items():
        dims = tuple(dim.split("+"))
        view = "moe" if all(d in VIEWS["moe"] and d not in VIEWS["attn"] for d in dims) else "attn"
        ranks = frozenset(spec.group_of(rank, view, dims))
        key = (kind, names["moe" if kind == "all_to_all" else "attn"].get(ranks, dim))
        out[key] = out.get(key, 0.0) + v
    return out


def rows(est, report) -> list[Row]:
    """The rows of one pipeline stage: ``est`` (planner) against ``report`` (a dry-run
    :class:`~meshfold.dryrun.RankReport` of that stage), memory first, then collectives."""
    s = est.layout.spec
    mem, st = est.detail["memory_per_rank"][report.stage], est.detail["params_per_rank"][report.stage]
    sharded_grads = FP32 * (st.dense / (s.dp * s.cp) + st.experts * expert_shard(est.detail["model"], s))
    r = report.stage
    out = [Row("params", mem["params"], report.param_bytes, r),
           Row("grads (sharded)", sharded_grads, report.grad_bytes, r),
           Row("optimizer", mem["optimizer"], report.optimizer_bytes, r),
           Row("step peak (grads + buffers + activations)", mem["grads"] + mem["buffers"] + mem["activations"],
               report.activation_peak_bytes, r),
           Row("total", sum(mem.values()), report.peak_bytes, r)]
    want = dry_run_names(s, report.rank, planned_collectives(est, r))
    got = report.collective_summary()
    for kind, dim in sorted(set(want) | set(got)):
        out.append(Row(f"{kind} {dim}", want.get((kind, dim), 0.0), got.get((kind, dim), 0), r))
    return out


def compare(case: Case, routing=None, placement: str | None = None) -> list[Row]:
    """Planner against dry run for ``case`` under ``routing`` (a dry-run routing model; None: the
    case's, ``zipf`` or balanced) and ``placement`` (None: the case's): one dry-run process per
    pipeline stage, its first rank
    (:func:`~meshfold.dryrun.representative_ranks`: with pp = 2 the first stage, with the
    embedding, and the last, with the head and the loss; ep rank 0, the busiest under Zipf with
    the static placement; under another placement, the first rank of the busiest ep rank),
    memory and collectives (:func:`rows`), then its expert work (:func:`expert_work`)."""
    from meshfold.dryrun.engine import dry_run, representative_ranks
    from meshfold.dryrun.routing import Zipf

    routing = routing if routing is not None else Zipf(case.zipf) if case.zipf else None
    placement = case.placement if placement is None else placement
    est = planned(case, routing, placement)
    dry, busiest = placed_routing(case, routing, placement)
    ranks = None if placement == "static" else [
        case.spec.rank("moe", pp=p, edp=0, ep=busiest, etp=0) for p in range(case.spec.pp)]
    out = []
    for report in dry_run(_train_config(case), dry, ranks if ranks != representative_ranks(case.spec) else None):
        out += rows(est, report) + expert_work(est, report)
    return out


def expert_work(est, report) -> list[Row]:
    """The rank's expert work per MoE layer forward, planner against dry run: the rows its local
    experts receive (the planner's busiest ep rank, ``recv x Tr k etp``; the dry run's as its
    dispatch sized them, :attr:`~meshfold.dryrun.RankReport.expert_rows`, mean over dispatches)
    and the seconds of their fc1 and fc2 grouped GEMMs (the planner's ``expert_s``; the dry run's
    rows costed by the same ``Hardware.grouped_gemm_time``, each local expert at its rows)."""
    if not report.expert_rows:
        return []
    hw, model, s = hardware("h100"), est.detail["model"], est.layout.spec
    h, f = model.hidden, model.expert_ffn / s.etp
    calls = report.expert_rows
    seconds = sum(hw.grouped_gemm_time(r, 2 * f, h, 1) + hw.grouped_gemm_time(r, h, f, 1)
                  for rows_El in calls for r in rows_El) / len(calls)
    got = sum(map(sum, calls)) / len(calls)
    r = report.stage
    return [Row("expert rows (per MoE forward)", est.detail["expert_rows"], got, r),
            Row("expert GEMM s (per MoE forward)", est.detail["expert_s"], seconds, r)]


def _paper(name: str, layers: int, **kw) -> Case:
    """One pipeline stage's ranks of the paper's Table 1 folded config of ``name`` (pp = 1; its
    pipeline is :func:`pipeline_cases`'), with ``layers`` layers."""
    from meshfold.plan.baselines import PAPER_TABLE1, paper_spec

    row = PAPER_TABLE1[name]
    s = paper_spec(row, "mcore+folding")
    stage = FoldSpec(s.world_size // s.pp, tp=s.tp, cp=s.cp, ep=s.ep, etp=s.etp)
    return Case(f"{name} Table 1 folding {s.cp}/{s.tp}/{s.ep}/{s.pp}/{s.etp}, one stage", name, stage, layers, **kw)


def cases() -> list[Case]:
    """The cases of the table in benchmarks/RESULTS.md."""
    return [
        _paper("mixtral-8x22b", 1, microbatches=2),
        _paper("qwen2-57b-a14b", 1, microbatches=2),
        _paper("mixtral-8x22b-g8t8", 1, microbatches=2),
        _paper("llama3-8x70b", 1, microbatches=2),
        Case("cp 2, etp 2", "mixtral-8x22b", FoldSpec(16, tp=2, cp=2, ep=4, etp=2), 1, microbatches=1),
        Case("full recompute", "qwen2-57b-a14b", FoldSpec(16, tp=2, ep=8), 1, microbatches=2, recompute="full"),
        *pipeline_cases(),
        *replica_cases(),
    ]


def replica_cases() -> list[Case]:
    """Hot-expert copies under Zipf 1.2 (``replicated:R``): the dry run's layers fetch the copies
    (one all-to-all over ep per expert weight, their gradients back) and split the copied
    experts' rows; compared on the busiest ep rank's first rank. One layer of Mixtral-8x22B:
    ep8 with one copy a rank (seconds), and ep4 with one copy a rank beside two experts."""
    return [
        Case("copies, ep 8, replicated:8", "mixtral-8x22b", FoldSpec(16, tp=2, ep=8), 1, zipf=1.2,
             placement="replicated:8"),
        Case("copies, ep 4, replicated:4", "mixtral-8x22b", FoldSpec(16, tp=2, ep=4), 1, zipf=1.2,
             placement="replicated:4"),
    ]


def pipeline_cases() -> list[Case]:
    """pp = 2 of the Table 1 folds' attention / MoE views (two stages of 16 ranks), one layer a
    stage except where the split is uneven: every schedule ``Pipeline`` runs at real shapes."""
    return [
        Case("pp 2, 1f1b, 4 micro-batches > pp", "mixtral-8x22b", FoldSpec(32, tp=2, ep=8, pp=2), 2,
             microbatches=4),
        Case("pp 2, 1f1b, 2 micro-batches = pp", "qwen2-57b-a14b", FoldSpec(32, tp=2, ep=4, pp=2), 2,
             microbatches=2),
        Case("pp 2, gpipe, 1 micro-batch < pp", "mixtral-8x22b-g8t8", FoldSpec(32, tp=4, ep=8, pp=2), 2,
             microbatches=1, schedule="gpipe"),
        Case("pp 2, 1f1b, uneven: 3 layers (1 + 2)", "mixtral-8x22b", FoldSpec(32, tp=2, ep=8, pp=2), 3,
             microbatches=2),
        Case("pp 2, interleaved-1f1b, virtual 2", "mixtral-8x22b", FoldSpec(32, tp=2, ep=8, pp=2), 4,
             microbatches=2, schedule="interleaved-1f1b", virtual=2),
    ]



def bubble_cases() -> list[Case]:
    """The multi-stage schedules (torch runs gpipe and 1f1b without an order of actions) on the
    pipeline cases' Mixtral-8x22B fold, pp 2 and 4, at pp and 4 pp micro-batches."""
    out = []
    for pp in (2, 4):
        for schedule in ("interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev"):
            for m in sorted({pp * (2 if schedule == "dualpipev" else 1), 4 * pp}):
                out.append(Case(f"pp {pp}, {schedule}, {m} micro-batches", "mixtral-8x22b",
                                FoldSpec(16 * pp, tp=2, ep=8, pp=pp), 4 * pp, microbatches=m, schedule=schedule,
                                virtual=2))
    return out


def bubble_rows(case: Case) -> tuple[float, float, tuple[float, float, float]]:
    """``(planner's bubble, torch's order played, (f, b, w))`` of ``case``, seconds per step:
    both from the planner's forward, input- and weight-gradient seconds per micro-batch of its
    slowest pipeline rank (:mod:`meshfold.dryrun.bubble`)."""
    from meshfold.dryrun.bubble import played_bubble

    est = planned(case)
    fbw = est.detail["forward_backward"]
    return est.time["bubble"], played_bubble(case.schedule, case.spec.pp, case.virtual, case.microbatches, *fbw), fbw


def _fmt(n: float) -> str:
    """MiB, or bytes (``B``) under 1 MiB: the statistics' all-reduces are a few hundred bytes."""
    return f"{n / 2**20:,.1f}" if n >= 2**20 or not n else f"{n:,.0f} B"


def markdown(results: list[tuple[Case, list[Row]]]) -> str:
    """The table: one block of rows per case, MiB per rank per step (the expert rows: rows and
    seconds per MoE layer forward), ratio = planner / dry run."""
    lines = ["| case | term | planner MiB | dry run MiB | planner / dry run |", "|---|---|---:|---:|---:|"]
    for case, rs in results:
        for i, r in enumerate(rs):
            ratio = "-" if r.ratio is None else f"{r.ratio:.3f}" + ("" if r.within else " **x**")
            where = case.label if i == 0 else ""
            if case.spec.pp > 1 and (i == 0 or rs[i - 1].stage != r.stage):
                where += f"{', ' if where else ''}stage {r.stage}"
            fmt = (lambda n: f"{n:,.4g}") if r.term.startswith("expert") else _fmt  # rows, seconds
            lines.append(f"| {where} | {r.term} | {fmt(r.planner)} | {fmt(r.dryrun)} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    import time

    parser = argparse.ArgumentParser(prog="python -m meshfold.dryrun.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", type=int, nargs="+", help="indices of cases() to run (default all)")
    parser.add_argument("--bubbles", action="store_true", help="the planner's pipeline bubbles against torch's "
                        "schedule orders played with the same times (seconds: no dry run needed)")
    args = parser.parse_args(argv)
    if args.bubbles:
        lines = ["| case | f, b, w ms per micro-batch | planner bubble ms | torch's order ms | planner / torch |",
                 "|---|---|---:|---:|---:|"]
        bad = 0
        for case in bubble_cases():
            planner, played, fbw = bubble_rows(case)
            ratio = planner / played
            bad += abs(ratio - 1) > TOLERANCE
            lines.append(f"| {case.label} | {', '.join(f'{x * 1e3:.2f}' for x in fbw)} | {planner * 1e3:.2f} | "
                         f"{played * 1e3:.2f} | {ratio:.3f}{'' if abs(ratio - 1) <= TOLERANCE else ' **x**'} |")
        print("\n".join(lines))
        print(f"{bad} bubble(s) outside {TOLERANCE:.0%}")
        return 1 if bad else 0
    chosen = cases() if not args.case else [cases()[i] for i in args.case]
    results, bad = [], 0
    for case in chosen:
        t0 = time.perf_counter()
        rs = compare(case)
        print(f"{case.label}: {case.describe()}; {time.perf_counter() - t0:.0f} s", flush=True)
        results.append((case, rs))
        bad += sum(not r.within for r in rs)
    print(markdown(results))
    print(f"{bad} term(s) outside {TOLERANCE:.0%}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
