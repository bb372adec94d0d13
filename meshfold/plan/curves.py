"""The time model's predicted curves away from Table 1: sequence length, expert granularity, GPU count
and global batch.

Each sweep plans every point from scratch (the best feasible layout the search finds, as a user of
``meshfold plan`` would get) and reports its MFU with the step split into compute, the layer
collectives, data-parallel traffic and the pipeline. These are predictions, not measurements:
benchmarks/RESULTS.md, "Planner: the time model away from Table 1", lists them with the
measurement that would falsify each term.

    python -m meshfold.plan.curves            # all four tables (a few minutes on 2 CPU cores)
    python -m meshfold.plan.curves seq        # one of: seq, granularity, scaling, batch
    python -m meshfold.plan.curves table1     # Table 1 against the planner (benchmarks/RESULTS.md)
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable

from meshfold.plan.baselines import PAPER_TABLE1, STRATEGIES, STRATEGY_NAMES, paper_spec
from meshfold.plan.cost import MEGATRON_SHARDINGS, SHARDINGS, Estimate, Layout, estimate
from meshfold.plan.hardware import Hardware, hardware
from meshfold.plan.models import MODELS, ModelShape
from meshfold.plan.search import plan

__all__ = ["best", "granular", "causal_mfu", "seq_sweep", "granularity_sweep", "scaling_sweep",
           "batch_sweep", "table1_rows", "SWEEPS"]

MIXTRAL = MODELS["mixtral-8x22b"]
TOKENS = 256 * 4096  # the paper's global batch in tokens (GBS 256 at seq 4096)


def best(model: ModelShape, gpus: int, seq: int, global_batch: int, hw: str | Hardware = "h100",
         where: Callable[[Layout], bool] | None = None) -> Estimate:
    """The feasible layout of highest MFU; ``ValueError`` naming the request when none fits."""
    for e in plan(model, gpus, hw, seq, global_batch, where=where):
        if e.feasible:
            return e
    raise ValueError(f"no layout of {gpus} GPUs fits {model.name} at seq={seq}, global batch={global_batch}")


def granular(base: ModelShape, g: int, topk: int) -> ModelShape:
    """``base`` with each expert split into ``g`` (E g experts of ffn f_e / g), routed top-``topk``:
    the paper's G8T8 is ``granular(mixtral-8x22b, 8, 8)``."""
    if base.expert_ffn % g:
        raise ValueError(f"granularity g={g} must divide expert_ffn={base.expert_ffn}")
    return dataclasses.replace(base, name=f"{base.name}-g{g}t{topk}", experts=base.experts * g,
                               expert_ffn=base.expert_ffn // g, topk=topk)


def causal_mfu(e: Estimate, model: ModelShape, seq: int, global_batch: int) -> float:
    """MFU with the causal count of attention FLOPs (the s^2 term halved, newer Megatron-Core's
    count): the paper's count credits the masked half of the scores, which grows with s."""
    d_sum = model.qk_dim + model.value_dim
    masked = 3 * global_batch * model.layers * seq * seq * model.heads * d_sum  # half of 6 B L s^2 n (dq + dv)
    gpus = e.layout.spec.world_size
    return (e.detail["flops"] - masked) / (e.step_time * gpus * e.detail["peak_flops"])


def _layout(e: Estimate) -> str:
    """CP/TP/EP/PP/ETP, dp and the knobs, without the ``|`` of ``Layout.describe`` (markdown)."""
    return f"{e.layout.paper_config()} dp{e.layout.spec.dp} {e.layout.describe().split('| ')[-1]}"


def _row(label: str, e: Estimate, model: ModelShape, seq: int, gbs: int) -> dict:
    t, step = e.time, e.step_time
    comm = sum(t[k] for k in ("tp", "cp", "ep", "etp"))
    return {"point": label, "layout": _layout(e),
            "mfu": e.mfu, "mfu_causal": causal_mfu(e, model, seq, gbs), "compute": t["compute"] / step,
            "attn_core": e.detail["attn_core_s"] / step, "layer_comm": comm / step, "cp": t["cp"] / step,
            "ep_etp": (t["ep"] + t["etp"]) / step, "dp": t["dp"] / step, "pp_bubble": (t["pp"] + t["bubble"]) / step,
            "expert_eff": e.detail["expert_gemm_fraction"], "attn_eff": e.detail["attn_core_fraction"]}


def seq_sweep(model: ModelShape = MIXTRAL, gpus: int = 128, tokens: int = TOKENS,
              seqs: tuple[int, ...] = (4096, 8192, 16384, 32768, 65536, 131072), hw: str = "h100") -> list[dict]:
    """MFU against sequence length at a fixed GPU count and tokens per step (cp free)."""
    return [_row(f"s={s // 1024}k", best(model, gpus, s, tokens // s, hw), model, s, tokens // s) for s in seqs]


def granularity_sweep(base: ModelShape = MIXTRAL, gpus: int = 128, seq: int = 4096, gbs: int = 256,
                      points: tuple[tuple[int, int], ...] = ((1, 2), (2, 4), (4, 8), (8, 8), (8, 16), (16, 32)),
                      hw: str = "h100") -> list[dict]:
    """MFU against expert granularity (g, top-k) of ``base``, Table 1's setting (cp = 1)."""
    rows = []
    for g, k in points:
        m = granular(base, g, k)
        rows.append(_row(f"G{g}T{k}", best(m, gpus, seq, gbs, hw, where=lambda lay: lay.spec.cp == 1), m, seq, gbs))
    return rows


def scaling_sweep(model: ModelShape = MIXTRAL, gpus: tuple[int, ...] = (64, 128, 256, 512, 1024), seq: int = 4096,
                  gbs: int = 256, hw: str = "h100") -> list[dict]:
    """Strong scaling: MFU against GPU count at a fixed global batch (cp = 1)."""
    return [_row(f"{n} GPUs", best(model, n, seq, gbs, hw, where=lambda lay: lay.spec.cp == 1), model, seq, gbs)
            for n in gpus]


def batch_sweep(model: ModelShape = MIXTRAL, gpus: int = 128, seq: int = 4096,
                batches: tuple[int, ...] = (32, 64, 128, 256, 512, 1024), hw: str = "h100") -> list[dict]:
    """MFU against global batch at a fixed GPU count (cp = 1)."""
    return [_row(f"GBS {b}", best(model, gpus, seq, b, hw, where=lambda lay: lay.spec.cp == 1), model, seq, b)
            for b in batches]


def table1_rows(hw: str = "h100") -> list[dict]:
    """Table 1 of arXiv 2504.14960 against the planner: best layout per strategy (cp = 1; the
    Megatron strategies planned with Megatron's zero1), meshfold's own best layout, and the paper's
    own MCore configs at Megatron-Core's defaults (mbs 1, no vpp, no recomputation, zero1)."""
    rows = []
    for name, row in PAPER_TABLE1.items():
        results = plan(name, row.gpus, hw, 4096, 256, where=lambda lay: lay.spec.cp == 1,
                       shardings=SHARDINGS + MEGATRON_SHARDINGS)
        for key, keep in STRATEGIES.items():
            e = next(e for e in results if keep(e.layout))
            rows.append({"model": f"{name} ({row.gpus})", "what": STRATEGY_NAMES[key], "paper": row.mfu[key],
                         "planner": e.mfu if e.feasible else None, "layout": _layout(e)})
        e = next(e for e in results if e.layout.sharding in SHARDINGS)
        rows.append({"model": f"{name} ({row.gpus})", "what": "meshfold's best (not in the paper)", "paper": "-",
                     "planner": e.mfu if e.feasible else None, "layout": _layout(e)})
        for key in ("mcore", "mcore+folding"):
            e = estimate(MODELS[name], hardware(hw), Layout(paper_spec(row, key), sharding="zero1"), 4096, 256)
            rows.append({"model": f"{name} ({row.gpus})", "what": f"paper's {STRATEGY_NAMES[key]} config",
                         "paper": row.mfu[key], "planner": e.mfu, "layout": e.layout.paper_config()})
    return rows


def format_table1(rows: list[dict]) -> str:
    """A markdown table of :func:`table1_rows`: paper MFU, planner MFU, their relative difference."""
    pct = lambda v: "OOM" if v is None else v if isinstance(v, str) else f"{100 * v:.1f}%"
    def diff(r: dict) -> str:
        if r["planner"] is None or not isinstance(r["paper"], float):
            return ""
        return f"{100 * (r['planner'] / r['paper'] - 1):+.1f}%"
    lines = ["| model (GPUs) | strategy | paper MFU | planner MFU | difference | layout |", "|---|---|---|---|---|---|"]
    return "\n".join(lines + [f"| {r['model']} | {r['what']} | {pct(r['paper'])} | {pct(r['planner'])} | {diff(r)} | "
                              f"{r['layout']} |" for r in rows])


SWEEPS = {"seq": seq_sweep, "granularity": granularity_sweep, "scaling": scaling_sweep, "batch": batch_sweep}
_COLUMNS = (("mfu", "MFU"), ("mfu_causal", "MFU causal"), ("compute", "compute"), ("attn_core", "attn core"),
            ("attn_eff", "attn eff"), ("expert_eff", "expert eff"), ("layer_comm", "tp+cp+ep+etp"), ("cp", "cp"),
            ("ep_etp", "ep+etp"), ("dp", "dp"), ("pp_bubble", "pp+bubble"))


def format_rows(rows: list[dict]) -> str:
    """A markdown table: point, layout, MFU (paper's and causal count), then shares of the step
    (``attn eff`` and ``expert eff`` are fractions of peak of those kernels)."""
    head = ["point", "layout CP/TP/EP/PP/ETP"] + [name for _, name in _COLUMNS]
    body = [[r["point"], r["layout"]] + [f"{100 * r[key]:.1f}%" for key, _ in _COLUMNS] for r in rows]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in body])


def main(argv: list[str]) -> int:
    """Print the named sweeps (all four when none is named) as markdown tables; 2 on a bad name."""
    names = argv or list(SWEEPS)
    bad = [n for n in names if n not in SWEEPS and n != "table1"]
    if bad:
        print(f"unknown sweep {bad}; valid: {list(SWEEPS) + ['table1']}", file=sys.stderr)
        return 2
    for name in names:
        if name == "table1":
            print("\n## table1 (" + table1_rows.__doc__.splitlines()[0] + ")\n")
            print(format_table1(table1_rows()))
            continue
        print(f"\n## {name} ({SWEEPS[name].__doc__.splitlines()[0]})\n")
        print(format_rows(SWEEPS[name]()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

