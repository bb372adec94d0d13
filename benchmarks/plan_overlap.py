"""What the planner says ``train.a2a_overlap`` buys: the best layouts it runs on, with and without.

    python benchmarks/plan_overlap.py

For each model and GPU count, ``meshfold plan --a2a-overlap``'s search (H100, sequence 4096,
global batch 256): the best feasible layout without pp (each forward beside the previous backward), the
best with pp, where 1F1B runs as combined 1F1B, the
best pp 2 layout turned to dualpipev without recomputation (overlapped forward and backward), and the overall best of the whole
search (which the overlap may not reach: the search tries no dualpipev), each with and without
the overlap. The ep and dp terms show where the time goes: under FSDP2 without pp the overlap
also keeps every block gathered for the step (one all-gather instead of two per micro-batch),
which saves dp time and costs memory. Pure arithmetic (meshfold.plan, no torch): seconds, not a benchmark of a machine.
"""

from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshfold.mesh import FoldSpec  # noqa: E402
from meshfold.plan import MODELS, HARDWARE, Layout, estimate, plan  # noqa: E402

CASES = [("mixtral-8x22b", 128), ("qwen2-57b-a14b", 64), ("deepseek-v3-671b", 1024)]
SEQ, GBS = 4096, 256


def _row(what, off, on) -> str:
    d = on.detail
    return (f"| {what} | {off.layout.describe()} | {100 * off.mfu:.1f}% | {100 * on.mfu:.1f}% | "
            f"{100 * d['a2a_hidden_fraction']:.0f}% of {d['a2a_s']:.2f} s | "
            f"{off.time['ep']:.2f} / {on.time['ep']:.2f} | {off.time['dp']:.2f} / {on.time['dp']:.2f} | "
            f"{sum(off.time.values()):.2f} / {sum(on.time.values()):.2f} | "
            f"{off.memory_total / 2**30:.1f} / {on.memory_total / 2**30:.1f} |")


def main() -> None:
    hw = HARDWARE["h100"]
    print("| model, GPUs | layout | MFU off | MFU on | a2a hidden | ep s off / on | dp s off / on | step s off / on | "
          "GiB off / on |\n|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, gpus in CASES:
        model = MODELS[name]
        found = [e for e in plan(name, gpus, "h100", SEQ, GBS, a2a_overlap=True) if e.feasible]
        best = found[0]
        on_pp1 = [e for e in found if e.layout.a2a_overlap and e.layout.spec.pp == 1]
        if on_pp1:
            on = on_pp1[0]
            off = estimate(model, hw, dataclasses.replace(on.layout, a2a_overlap=False), SEQ, GBS)
            print(_row(f"{name}, {gpus}: best without pp", off, on))
        on_pp = [e for e in found if e.layout.a2a_overlap and e.layout.spec.pp > 1]  # 1f1b, run combined
        if on_pp:
            on = on_pp[0]
            off = estimate(model, hw, dataclasses.replace(on.layout, a2a_overlap=False), SEQ, GBS)
            print(_row(f"{name}, {gpus}: best combined 1F1B (pp {on.layout.spec.pp})", off, on))
        # dualpipev on pp 2 from the best pp 2 layout of the search
        pp2 = next((e for e in found if e.layout.spec.pp == 2 and not e.layout.a2a_overlap), None)
        if pp2 is not None:  # without recomputation, which the planner refuses under dualpipev
            base = dataclasses.replace(pp2.layout, vpp=2, schedule="dualpipev", recompute="none")
            try:
                off = estimate(model, hw, base, SEQ, GBS)
                on = estimate(model, hw, dataclasses.replace(base, a2a_overlap=True), SEQ, GBS)
                print(_row(f"{name}, {gpus}: dualpipev on pp 2", off, on))
            except ValueError as err:  # e.g. fewer micro-batches than dualpipev's 2 pp
                print(f"| {name}, {gpus}: dualpipev on pp 2 | {base.describe()} | {err} | | | | | | |")
        print(f"| {name}, {gpus}: best of the search | {best.layout.describe()} | {100 * best.mfu:.1f}% | | | | | "
              f"{sum(best.time.values()):.2f} | {best.memory_total / 2**30:.1f} |")


if __name__ == "__main__":
    main()
