"""``meshfold plan``: print the best folds for a model on a cluster, and the paper's baselines.

    meshfold plan --model mixtral-8x22b --gpus 128 --gpu h100 --seq 4096 --gbs 256 --compare

The lead wires :func:`configure` and :func:`main` into the ``meshfold`` console script;
``python -m meshfold.plan`` runs the same thing.
"""

from __future__ import annotations

import argparse
import sys

from meshfold.plan.baselines import MEGATRON_STRATEGIES, PAPER_TABLE1, STRATEGIES, STRATEGY_NAMES
from meshfold.plan.cost import MEGATRON_SHARDINGS, TIME_TERMS, Estimate
from meshfold.plan.hardware import ATTENTION_KERNELS, GIB, HARDWARE, MESHFOLD_ATTENTION_KERNEL, hardware
from meshfold.plan.models import MODELS, model_shape
from meshfold.plan.routing import PLACEMENTS, copy_slots, parse_placement, parse_routing_load
from meshfold.plan.search import plan

__all__ = ["configure", "main", "format_table", "placement_overrides"]


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the plan arguments to ``parser`` (a subparser of the ``meshfold`` script)."""
    parser.add_argument("--model", required=True, help=f"model shape; one of {', '.join(sorted(MODELS))}")
    parser.add_argument("--gpus", required=True, type=_positive_int, help="number of GPUs")
    parser.add_argument("--gpu", default="h100", help=f"hardware preset; one of {', '.join(sorted(HARDWARE))}")
    parser.add_argument("--seq", default=4096, type=_positive_int, help="sequence length (default 4096)")
    parser.add_argument("--gbs", default=256, type=_positive_int, help="global batch in sequences (default 256)")
    parser.add_argument("--top", default=10, type=_positive_int, help="how many folds to print (default 10)")
    parser.add_argument("--compare", action="store_true",
                        help="also print the paper's strategies (FSDP, FSDP+EP on meshfold's FSDP2; TP+EP+DP, "
                             "MCore, MCore + folding as Megatron-Core runs them, for comparison)")
    parser.add_argument("--attention-kernel", default=MESHFOLD_ATTENTION_KERNEL, choices=ATTENTION_KERNELS,
                        help="whose measured attention rate costs meshfold's layouts (default "
                             f"{MESHFOLD_ATTENTION_KERNEL}: torch's SDPA flash backend, which meshfold runs); "
                             "the [Megatron] rows keep the preset's fa3")
    parser.add_argument("--routing", default="balanced",
                        help="routing load the layouts are costed under: balanced (default), zipf:S (expert e gets "
                             "a share proportional to (e+1)^-S, as meshfold dryrun --routing), or replay:RUN_DIR "
                             "(the loads a meshfold train run measured, its metrics.jsonl); the busiest ep rank's "
                             "expert GEMMs, all-to-all bytes and activations are charged")
    parser.add_argument("--placement", default="static", metavar="|".join(PLACEMENTS),
                        help="which experts each ep rank holds: static (contiguous blocks, default), balanced "
                             "(re-placed from the routing's loads, as train.expert_placement=balanced) or "
                             "replicated:R (also R copy slots holding the hottest experts, as "
                             "train.redundant_experts=R: only folds with pp = 1 and ep >= 2 dividing R)")
    parser.add_argument("--cp1", action="store_true",
                        help="only folds with cp=1 (the setting of the paper's Table 1)")
    parser.add_argument("--a2a-overlap", action="store_true",
                        help="also cost each fold that train.a2a_overlap runs on with it (two micro-batches in "
                             "turns hide each other's expert all-to-alls; ep > 1, and pp = 1 with m >= 2 or 1f1b, run "
                             "as combined 1F1B): both are "
                             "ranked, and the 'a2a hid' column shows the share of the all-to-alls hidden")


def placement_overrides(placement: str) -> list[str]:
    """``meshfold train --set`` overrides that run ``placement`` (``static``: none)."""
    if placement == "static":
        return []
    R = copy_slots(placement)
    return ["train.expert_placement=balanced"] + ([f"train.redundant_experts={R}"] if R else [])


def _fold(e: Estimate) -> str:
    s = e.layout.spec
    return f"{e.layout.paper_config()} dp{s.dp} edp{s.edp}"


def format_table(rows: list[tuple[str, Estimate]], extra: dict[str, str] | None = None) -> str:
    """A plain-text table: label, fold (CP/TP/EP/PP/ETP), knobs, memory, time terms, MFU (and,
    where a row runs a2a_overlap, the share of its all-to-alls hidden)."""
    overlap = any(e.layout.a2a_overlap for _, e in rows)   # a column only where some row overlaps
    head = ["", "fold CP/TP/EP/PP/ETP", "mbs", "vpp", "sched", "rc", "shard", "mem GiB"] + \
        [f"{t} s" for t in TIME_TERMS] + ["step s", "MFU", "busiest ep"] + (["a2a hid"] if overlap else []) + \
        (["paper"] if extra else [])
    body = []
    for label, e in rows:
        lay = e.layout
        sched = "-" if lay.spec.pp == 1 else {"interleaved-1f1b": "i1f1b"}.get(lay.schedule, lay.schedule)
        rc = {"none": "-", "selective": "sel", "full": "full"}[lay.recompute]
        cells = [label, _fold(e), str(lay.mbs), str(lay.vpp), sched, rc, lay.sharding, f"{e.memory_total / GIB:.1f}"]
        cells += [f"{e.time[t]:.2f}" for t in TIME_TERMS]
        cells += [f"{e.step_time:.2f}", f"{100 * e.mfu:.1f}%" if e.feasible else "OOM",
                  f"{100 * e.detail['busiest_share']:.1f}%"]
        if overlap:
            cells.append(f"{100 * e.detail['a2a_hidden_fraction']:.0f}%" if lay.a2a_overlap else "-")
        if extra:
            cells.append(extra.get(label, ""))
        body.append(cells)
    widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in body])


def main(args: argparse.Namespace) -> int:
    """Run the planner for ``args`` (from :func:`configure`); 0 when a layout fits, 1 when none
    does (as ``meshfold dryrun`` on out-of-memory), 2 on bad input."""
    try:
        shape, megatron_hw = model_shape(args.model), hardware(args.gpu)
        hw = hardware(megatron_hw, attention_kernel=args.attention_kernel)  # the kernel meshfold runs
        where = (lambda lay: lay.spec.cp == 1) if getattr(args, "cp1", False) else None
        routing = parse_routing_load(getattr(args, "routing", "balanced"))
        placement = parse_placement(getattr(args, "placement", "static"))
        results = plan(shape, args.gpus, hw, args.seq, args.gbs, where=where, routing=routing, placement=placement,
                       a2a_overlap=getattr(args, "a2a_overlap", False))
        megatron = plan(shape, args.gpus, megatron_hw, args.seq, args.gbs, where=where,
                        shardings=MEGATRON_SHARDINGS, routing=routing, placement=placement) if args.compare else []
    except ValueError as err:
        print(f"meshfold plan: error: {err}", file=sys.stderr)
        return 2
    feasible = [e for e in results if e.feasible]
    print(f"{shape.name} ({shape.total_params / 1e9:.1f}B params) on {args.gpus} x {hw.name}, seq {args.seq}, "
          f"global batch {args.gbs}: {len(results)} layouts, {len(feasible)} fit in "
          f"{hw.usable_bytes / GIB:.1f} GiB; attention costed at {hw.attention_kernel}; routing "
          f"{routing.describe()}, {placement} placement")
    if feasible:
        print(format_table([(f"#{i + 1}", e) for i, e in enumerate(feasible[:args.top])]))
        best = feasible[0].layout
        sets = best.train_overrides(shape.name, args.seq, args.gbs) + placement_overrides(placement)
        print(f"run #1: meshfold train --set {' --set '.join(sets)}")
    else:
        print("no layout fits in memory; closest:")
        for e in results[:3]:
            print(f"  {_fold(e)} {e.layout.describe()}: {e.reason}")
    if args.compare:
        rows, paper = [], {}
        row = PAPER_TABLE1.get(shape.name)
        for key, keep in STRATEGIES.items():
            pool = megatron if key in MEGATRON_STRATEGIES else results
            best = next((e for e in pool if keep(e.layout)), None)
            if best is None:
                continue
            label = STRATEGY_NAMES[key] + (" [Megatron]" if key in MEGATRON_STRATEGIES else "")
            rows.append((label, best))
            if row is not None and row.gpus == args.gpus and args.seq == 4096 and args.gbs == 256:
                v = row.mfu[key]
                paper[label] = "OOM" if v is None else f"{100 * v:.1f}%"
        print("\nthe paper's strategies (best layout each admits; [Megatron] rows are Megatron-Core's distributed "
              f"optimizer {MEGATRON_SHARDINGS[0]} and schedules, not meshfold, their attention costed at "
              f"{megatron_hw.attention_kernel}; FSDP rows are meshfold's FSDP2):")
        print(format_table(rows, paper or None))
        for label, e in rows:
            if not e.feasible:
                print(f"  {label}: {e.reason}")
    return 0 if feasible else 1
