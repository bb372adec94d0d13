"""Peak memory per pipeline stage of each schedule, against 1F1B's: meshfold's own training step
on fake tensors (``meshfold dryrun``'s engine, which tests hold equal to a real gloo step), so
the figures are the real model's bytes, not a formula's.

Mixtral-8x22B cut to 4 layers a pipeline rank (2 chunks of 2 for the interleaved and V
schedules), Table 1's 16-rank fold per stage (tp2 | ep8), bf16 over fp32 masters, FSDP2, seq
4096, one sequence a micro-batch. Per stage: the step's peak of gradients, gathered weights and
activations (``activation_peak_bytes``), the peak of everything (``peak_bytes``), and the
planner's step peak beside it (meshfold.plan: for the zero-bubble schedules, their
micro-batches in flight costed with 1F1B's moments).

    python benchmarks/schedule_memory.py                 # pp 2, 4 and 8 micro-batches (about 3 min)
    python benchmarks/schedule_memory.py --pp 4 --microbatches 8
"""

from __future__ import annotations

import argparse

from meshfold.dryrun.check import Case, _train_config, planned
from meshfold.dryrun.engine import dry_run
from meshfold.mesh import FoldSpec

SCHEDULES = (("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-zb", 2), ("zbv", 2), ("dualpipev", 2))
MIB = 2**20


def measure(pp: int, m: int) -> list[tuple[str, int, float, float, float]]:
    """``(schedule, stage, step peak, peak, planner's step peak)`` per schedule and stage, bytes."""
    out = []
    for schedule, virtual in SCHEDULES:
        if schedule == "dualpipev" and m < 2 * pp:
            continue
        case = Case(f"pp {pp}, {schedule}", "mixtral-8x22b", FoldSpec(16 * pp, tp=2, ep=8, pp=pp), 2 * pp,
                    microbatches=m, schedule=schedule, virtual=virtual)
        est = planned(case)
        for report in dry_run(_train_config(case)):
            mem = est.detail["memory_per_rank"][report.stage]
            out.append((schedule, report.stage, report.activation_peak_bytes, report.peak_bytes,
                        mem["grads"] + mem["buffers"] + mem["activations"]))
    return out


def markdown(rows, pp: int, m: int) -> str:
    base = {stage: peak for schedule, stage, peak, _, _ in rows if schedule == "1f1b"}
    lines = [f"pp {pp}, {m} micro-batches:", "",
             "| schedule | stage | step peak MiB | x 1F1B's | peak MiB | planner's step peak MiB | planner / measured |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for schedule, stage, peak, total, planner in rows:
        lines.append(f"| {schedule} | {stage} | {peak / MIB:,.0f} | {peak / base[stage]:.2f} | {total / MIB:,.0f} | "
                     f"{planner / MIB:,.0f} | {planner / peak:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args(argv)
    print(markdown(measure(args.pp, args.microbatches), args.pp, args.microbatches))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
