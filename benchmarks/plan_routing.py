"""The planner under routing skew: the best layout under balanced routing, under a skewed one
with the static placement and with a balanced placement, and the balanced winner costed again
under the skew (what a run planned for balanced routing would get). Planner figures, no timing.

    python benchmarks/plan_routing.py --model mixtral-8x22b --gpus 128 1024 --cp1 --routing zipf:1.2

Prints a table and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json

from meshfold.plan import hardware, plan
from meshfold.plan.cost import estimate
from meshfold.plan.hardware import GIB, MESHFOLD_ATTENTION_KERNEL
from meshfold.plan.models import model_shape
from meshfold.plan.routing import parse_routing_load


def _row(gpus, label, e) -> dict:
    lay = e.layout
    return {"gpus": gpus, "case": label, "layout": f"{lay.paper_config()} dp{lay.spec.dp} edp{lay.spec.edp} "
            f"| {lay.describe().split('| ')[-1]}", "mem_gib": round(e.memory_total / GIB, 1),
            "fits": e.feasible, "step_s": round(e.step_time, 2), "mfu": round(e.mfu, 6),
            "compute_s": round(e.time["compute"], 2), "ep_s": round(e.time["ep"], 2),
            "busiest_ep_share": round(e.detail["busiest_share"], 6)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mixtral-8x22b")
    p.add_argument("--gpus", type=int, nargs="+", default=[128, 1024])
    p.add_argument("--gpu", default="h100")
    p.add_argument("--routing", default="zipf:1.2")
    p.add_argument("--cp1", action="store_true", help="only cp = 1 (faster at large GPU counts)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    shape, skew = model_shape(args.model), parse_routing_load(args.routing)
    hw = hardware(hardware(args.gpu), attention_kernel=MESHFOLD_ATTENTION_KERNEL)  # as meshfold plan costs them
    where = (lambda lay: lay.spec.cp == 1) if args.cp1 else None
    rows = []
    for gpus in args.gpus:
        best = {}
        for routing, placement in ((None, "static"), (skew, "static"), (skew, "balanced")):
            found = [e for e in plan(shape, gpus, hw, 4096, 256, where=where, routing=routing, placement=placement)
                     if e.feasible]
            name = f"{routing.describe() if routing else 'balanced'}, {placement}"
            best[name] = found[0]
            rows.append(_row(gpus, f"best under {name}", found[0]))
        winner = next(iter(best.values())).layout
        for placement in ("static", "balanced"):
            e = estimate(shape, hw, winner, 4096, 256, skew, placement)
            rows.append(_row(gpus, f"balanced winner under {skew.describe()}, {placement}", e))
    report(rows, ["gpus", "case", "layout", "mem_gib", "fits", "step_s", "mfu", "compute_s", "ep_s",
                  "busiest_ep_share"], args, skew)
    return 0


def report(rows: list[dict], cols: list[str], args, skew, percent=("mfu", "busiest_ep_share")) -> None:
    """Print ``rows`` as a table of ``cols`` (``percent`` ones as %, a missing cell as -) and
    write them to ``args.json`` when given."""
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{100 * r[c]:.1f}%" if c in percent and c in r else str(r.get(c, "-")) for c in cols))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "gpu": args.gpu, "routing": skew.describe(), "cp1": args.cp1,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
