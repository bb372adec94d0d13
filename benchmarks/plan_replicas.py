"""The planner with hot-expert copies: the best layout under a skewed routing with the static
placement, a balanced re-placement and ``replicated:R`` copy slots, and what the copies cost.
Planner figures (closed formulas), no timing.

    python benchmarks/plan_replicas.py --model mixtral-8x22b --gpus 128 1024 --routing zipf:1.2

Rows per GPU count: ``static`` (any layout), ``static, pp = 1`` (the layouts re-placement runs
on, for a like-for-like baseline), ``balanced`` and each ``replicated:R`` (``--copies``; the
planner tries only the layouts ``meshfold train`` runs them on: ep >= 2, pp = 1, ep dividing R).
For the copies: the busiest ep rank's share of the routed pairs, the memory the fetched copies
keep for backward (``Estimate.detail["copies_bytes"]``) and the ep
all-to-all seconds, and the same layout's MFU re-placed without copies. Prints a table and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import time

from meshfold.plan import hardware, plan
from meshfold.plan.cost import estimate
from meshfold.plan.hardware import GIB, MESHFOLD_ATTENTION_KERNEL
from meshfold.plan.models import model_shape
from meshfold.plan.routing import parse_routing_load
from plan_routing import report  # benchmarks/plan_routing.py: the table and the JSON


def _row(gpus, label, e, hw, shape, skew) -> dict:
    lay = e.layout
    row = {"gpus": gpus, "case": label, "layout": f"{lay.paper_config()} dp{lay.spec.dp} edp{lay.spec.edp} "
           f"| {lay.describe().split('| ')[-1]}", "mem_gib": round(e.memory_total / GIB, 1),
           "step_s": round(e.step_time, 2), "mfu": round(e.mfu, 6), "compute_s": round(e.time["compute"], 2),
           "ep_s": round(e.time["ep"], 2), "dp_s": round(e.time["dp"], 2),
           "busiest_ep_share": round(e.detail["busiest_share"], 6),
           "copies_gib": round(e.detail["copies_bytes"] / GIB, 2)}
    if e.detail.get("copy_slots"):  # the same layout re-placed without copies
        plain = estimate(shape, hw, lay, 4096, 256, skew, "balanced")
        row["same_layout_balanced_mfu"] = round(plain.mfu, 6)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mixtral-8x22b")
    p.add_argument("--gpus", type=int, nargs="+", default=[128, 1024])
    p.add_argument("--gpu", default="h100")
    p.add_argument("--routing", default="zipf:1.2")
    p.add_argument("--copies", type=int, nargs="+", default=[2, 4, 8], help="R of replicated:R (default 2 4 8)")
    p.add_argument("--cp1", action="store_true", help="only cp = 1 (faster at large GPU counts)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    shape, skew = model_shape(args.model), parse_routing_load(args.routing)
    hw = hardware(hardware(args.gpu), attention_kernel=MESHFOLD_ATTENTION_KERNEL)  # as meshfold plan costs them
    cp1 = (lambda lay: lay.spec.cp == 1) if args.cp1 else (lambda lay: True)
    cases = [("static", "static", cp1), ("static, pp = 1", "static", lambda lay: cp1(lay) and lay.spec.pp == 1),
             ("balanced", "balanced", cp1)] + [(f"replicated:{R}", f"replicated:{R}", cp1) for R in args.copies]
    rows = []
    for gpus in args.gpus:
        for label, placement, where in cases:
            t0 = time.perf_counter()
            found = [e for e in plan(shape, gpus, hw, 4096, 256, where=where, routing=skew, placement=placement)
                     if e.feasible]
            if found:
                rows.append(_row(gpus, label, found[0], hw, shape, skew))
                rows[-1]["search_s"] = round(time.perf_counter() - t0, 1)
    cols = ["gpus", "case", "layout", "mem_gib", "step_s", "mfu", "compute_s", "ep_s", "dp_s", "busiest_ep_share",
            "copies_gib", "same_layout_balanced_mfu", "search_s"]
    report(rows, cols, args, skew, ("mfu", "busiest_ep_share", "same_layout_balanced_mfu"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
