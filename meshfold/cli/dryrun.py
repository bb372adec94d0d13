"""``meshfold dryrun``: one training step of an N-rank job on this machine, without tensor data.

Example (the paper's Mixtral-8x22B on 128 GPUs, folded, pp = 1)::

    meshfold dryrun --model mixtral-8x22b --gpus 128 --fold 1/2/8/1/1 --gbs 256 --mbs 1 --json out.json

``--fold CP/TP/EP/PP/ETP`` is the paper's notation (``CP/TP/EP/PP`` alone: ETP = TP, as
Megatron-Core without folding). Prints each representative rank's memory (parameters,
gradients, optimizer state, activation peak, total against the ``--gpu`` budget) and its
collectives summed per (kind, mesh dim); ``--json`` writes the full per-rank report, with every
collective record. A rank over the GPU's usable memory fails the run (exit 1), naming it.
"""

from __future__ import annotations

import argparse
import json
import sys

from meshfold.catalog import RECOMPUTE

__all__ = ["configure", "main", "parse_fold", "train_config"]

GIB = 1024 ** 3


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML settings file, as meshfold train reads it (sections model, moe, "
                                         "fold, train, data): the job dry-run is the job trained")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one setting, as meshfold train's --set (repeatable)")
    parser.add_argument("--model", help="a named model config (meshfold.models.configs); needed without --config")
    parser.add_argument("--gpus", type=int, help="ranks of the job (world size); needed without --config")
    parser.add_argument("--fold", metavar="CP/TP/EP/PP[/ETP]",
                        help="the fold in the paper's notation; ETP defaults to TP; needed without --config")
    parser.add_argument("--seq", type=int, help="tokens per sequence (default 4096)")
    parser.add_argument("--gbs", type=int, help="global batch in sequences (default 256)")
    parser.add_argument("--mbs", type=int,
                        help="micro-batch in sequences per dp rank: gbs / dp / mbs micro-batches (default 1)")
    parser.add_argument("--recompute", choices=RECOMPUTE, help="activation recomputation (default none)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32", "float64"),
                        help="compute dtype (default bfloat16; master weights and AdamW state: float32 or wider)")
    parser.add_argument("--gpu", default="h100", help="hardware preset whose memory is the budget (default h100)")
    parser.add_argument("--routing", default="balanced", help="balanced (default) or zipf:S, e.g. zipf:1.0")
    parser.add_argument("--placement", default="static",
                        help="expert placement: static (ep rank r holds experts r * E / ep ..), balanced "
                             "(meshfold.plan.placement.balanced of the routing model's loads, as "
                             "train.expert_placement = balanced re-places them) or replicated:R (R copy slots "
                             "filled with the hottest experts, as train.redundant_experts = R; the layers fetch "
                             "the copies and split their rows); with balanced or replicated:R, the busiest ep "
                             "rank is dry-run too")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="what the fake tensors are on: cpu (default), or cuda to run the CUDA branches a GPU "
                             "job takes, on fake CUDA tensors and CUDA meshes (needs torch's CUDA wheel, no GPU)")
    parser.add_argument("--ranks", type=int, nargs="+", help="ranks to dry-run (default: one per pipeline stage)")
    parser.add_argument("--json", metavar="FILE", help="write the per-rank report here")


def parse_fold(text: str, world_size: int) -> dict:
    """``"CP/TP/EP/PP[/ETP]"`` -> TrainConfig's ``fold`` table."""
    parts = text.split("/")
    if len(parts) not in (4, 5) or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--fold {text!r}; valid: CP/TP/EP/PP or CP/TP/EP/PP/ETP of positive integers, "
                         f"e.g. 1/2/8/8/1")
    cp, tp, ep, pp, *etp = (int(p) for p in parts)
    return {"world_size": world_size, "cp": cp, "tp": tp, "ep": ep, "pp": pp, "etp": etp[0] if etp else tp}


# how the settings meshfold train's checks name read in dryrun's own flags
FLAGS = {"train.batch": "--gbs", "train.seq": "--seq", "fold.world_size": "--gpus", "fold.pp": "pp of --fold",
         "train.microbatches": "micro-batches (gbs / dp / --mbs)", "train.dtype": "--dtype",
         "train.recompute": "--recompute", "train.gpu": "--gpu"}


def _in_flags(err: ValueError) -> ValueError:
    """``err`` with each ``train.*`` / ``fold.*`` setting it names replaced by the dryrun flag
    that sets it (``train.batch = 6 is ...`` -> ``--gbs 6 is ...``)."""
    text = str(err).replace(" (train.microbatches, train.schedule, train.virtual)", " (--mbs)")
    for setting, flag in FLAGS.items():
        text = text.replace(f"{setting} = ", f"{flag} " if flag.startswith("--") else f"{flag} = ")
        text = text.replace(setting, flag)
    return ValueError(text)


# the flags' values without --config / --set (meshfold train's defaults are for a laptop run)
DEFAULTS = {"seq": 4096, "gbs": 256, "mbs": 1, "recompute": "none", "dtype": "bfloat16"}


def train_config(args):
    """The :class:`~meshfold.train.config.TrainConfig` a ``meshfold train`` of these settings uses:
    ``--config`` / ``--set`` as ``meshfold train`` reads them, then the flags given; without
    ``--config`` / ``--set``, ``--model``, ``--gpus`` and ``--fold`` name the job."""
    from meshfold.train.config import TrainConfig, load_config

    settings = args.config is not None or bool(args.set)
    if settings:
        cfg = load_config(args.config, args.set)
    else:
        missing = [f for f, v in (("--model", args.model), ("--gpus", args.gpus), ("--fold", args.fold)) if v is None]
        if missing:
            raise ValueError(f"{', '.join(missing)}: name the job with --model, --gpus and --fold, or give "
                             f"meshfold train's settings with --config / --set")
        cfg = TrainConfig(model={"name": args.model})
        for key, value in DEFAULTS.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
    if args.model is not None:  # names the model; the [model] settings given with it still apply
        cfg.model = {**cfg.model, "name": args.model}
    if args.fold is not None:
        cfg.fold = parse_fold(args.fold, args.gpus if args.gpus is not None else cfg.fold.get("world_size", 1))
    elif args.gpus is not None:
        cfg.fold = {**cfg.fold, "world_size": args.gpus}
    t = cfg.train
    for key, name in (("gbs", "batch"), ("seq", "seq"), ("dtype", "dtype"), ("recompute", "recompute"),
                      ("gpu", "gpu")):
        if getattr(args, key) is not None:
            setattr(t, name, getattr(args, key))
    try:
        cfg.check_types()
        spec = cfg.fold_spec()  # the fold's one-line errors, as meshfold layout and train give them
        if args.mbs is not None and t.batch % spec.dp == 0:  # (else validate names it) the micro-batches --mbs makes
            per_rank = t.batch // spec.dp
            if args.mbs < 1 or per_rank % args.mbs:
                raise ValueError(f"--mbs {args.mbs}: gbs / dp = {per_rank} sequences per dp rank is not a "
                                 f"multiple of it (valid: divisors of {per_rank})")
            t.microbatches = per_rank // args.mbs
        cfg.resolve()  # the model's and the settings' checks, as meshfold train runs them
    except ValueError as err:
        if settings:
            raise
        raise _in_flags(err) from None
    return cfg


def _gib(n: int) -> str:
    return f"{n / GIB:9.2f}"


def _placed(routing, placement: str, cfg, spec, hw):
    """(the routing model under ``placement``, report lines, the busiest ep rank): rows each ep
    rank's experts receive per step under the static and the chosen placement, the busiest
    rank's share, and its expert GEMM time (forward + backward) at the GPU's GEMM rate; with
    copies, which experts are copied where."""
    from meshfold.dryrun.routing import Placed, expert_rows
    from meshfold.plan.placement import max_over_mean, replica_rank_loads, split_cuts, static
    from meshfold.plan.routing import placed

    mcfg = cfg.model_config()
    moe = mcfg.moe
    microbatches = cfg.train.microbatches or spec.pp
    if moe is None:
        raise ValueError(f"--placement {placement}: model {cfg.model['name']!r} has no MoE layers")
    E = moe.num_experts
    pairs = cfg.train.batch // spec.dp // microbatches * cfg.train.seq // (spec.cp * spec.tp) * moe.topk
    loads = expert_rows(routing, pairs, E, spec.ep, spec.etp)  # one micro-batch, one layer
    slots, copies = placed(loads, placement, spec.ep)
    scale = microbatches * len(mcfg.moe_layer_ids)  # rows per step over the MoE layers
    two = 2 if moe.expert_kind == "swiglu" else 1
    lines = [f"expert rows per ep rank per step ({len(mcfg.moe_layer_ids)} MoE layers x "
             f"{microbatches} micro-batches; each etp rank computes ffn / etp of them):"]
    busiest = 0
    for name, s, c in (("static", static(E, spec.ep), ()), (placement, slots, copies)):
        rows = [scale * x for x in replica_rank_loads(loads, s, c, spec.ep)]
        top = max(range(spec.ep), key=lambda r: (rows[r], -r))
        flops = 3 * 2 * rows[top] * moe.hidden * (two + 1) * moe.ffn // spec.etp  # fwd + 2x bwd
        lines.append(f"  {name:>8}: busiest ep rank {top} {round(rows[top]):,} rows ({rows[top] / sum(rows):.1%} of "
                     f"all, max/mean {max_over_mean(rows):.2f}), expert GEMMs {hw.gemm_time(flops, 0) * 1e3:.1f} ms "
                     f"at {hw.name}'s GEMM rate; placement {list(s) if len(s) <= 64 else '(E > 64)'}"
                     + (f"; copies {list(c)} (ep rank k holds copies[k * {len(c) // spec.ep} ..])" if c else ""))
        busiest = top
        if placement == "static":
            break
    cuts = split_cuts(loads, slots, copies, spec.ep) if copies else None  # the split training sets
    return Placed(routing, slots, copies, cuts), lines, busiest


def _check_json_target(path: str) -> None:
    """``--json``'s folder exists and takes files."""
    import os
    from pathlib import Path

    folder = Path(path).resolve().parent
    if Path(path).is_dir():
        raise ValueError(f"--json {path} is a folder; give a file path for the report")
    if not folder.is_dir():
        raise ValueError(f"--json {path}: the folder {folder} does not exist; create it or give a path "
                         f"in an existing folder")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--json {path}: the folder {folder} is not writable; give a path in a writable folder")


def main(args: argparse.Namespace) -> int:
    import time

    from meshfold.dryrun.engine import dry_run
    from meshfold.dryrun.routing import parse_routing
    from meshfold.plan.hardware import hardware
    from meshfold.plan.placement import check_replicas
    from meshfold.plan.routing import copy_slots, parse_placement

    if args.json:
        _check_json_target(args.json)  # before the dry run, not after its minutes of work
    routing = parse_routing(args.routing)
    args.placement = parse_placement(args.placement)
    hw = hardware(args.gpu)
    cfg = train_config(args)
    spec = cfg.fold_spec()
    if args.placement == "balanced" and spec.ep == 1:  # as meshfold train refuses it
        raise ValueError(f"--placement balanced with ep = 1 (--fold {args.fold}): one ep rank holds every "
                         f"expert, so there is nothing to re-place; valid: --placement static, or balanced "
                         f"with EP >= 2")
    R = copy_slots(args.placement)
    mcfg = cfg.model_config()
    why = R and mcfg.moe is not None and check_replicas(R, mcfg.moe.num_experts, spec.ep, spec.pp)
    if why:  # as meshfold train refuses train.redundant_experts = R
        raise ValueError(f"--placement {args.placement} with {why}")
    if args.ranks:
        bad = [r for r in args.ranks if not 0 <= r < spec.world_size]
        if bad:
            raise ValueError(f"--ranks {bad}: out of range [0, {spec.world_size})")
    placement_lines = []
    if args.placement != "static" or args.routing != "balanced":
        routing, placement_lines, busiest = _placed(routing, args.placement, cfg, spec, hw)
        if args.ranks is None and args.placement != "static":
            from meshfold.dryrun.engine import representative_ranks

            first = spec.rank("moe", pp=0, edp=0, ep=busiest, etp=0)
            args.ranks = sorted(set(representative_ranks(spec)) | {first})
    from meshfold.runtime import launch

    launch.preload("meshfold.dryrun")  # for the other ranks' processes: this command's code cannot change
    t0 = time.perf_counter()
    reports = dry_run(cfg, routing, args.ranks, last_here=True, device=args.device)  # the command exits after it
    wall = time.perf_counter() - t0
    budget = hw.usable_bytes
    t, name = cfg.train, cfg.train.init_from or cfg.model.get("name", "model")
    fold_text = args.fold or f"{spec.cp}/{spec.tp}/{spec.ep}/{spec.pp}/{spec.etp}"
    print(f"meshfold dryrun: {name} on {spec.world_size} ranks, fold {fold_text} "
          f"(tp{spec.tp} cp{spec.cp} dp{spec.dp} pp{spec.pp} | etp{spec.etp} ep{spec.ep} edp{spec.edp}), "
          f"gbs {t.batch} x seq {t.seq}, {t.microbatches or spec.pp} micro-batches, {t.dtype} on fake {args.device}, "
          f"recompute {t.recompute}, data_parallel {t.data_parallel}, routing {routing.describe()}; {wall:.1f} s")
    print(f"{'rank':>5} {'stage':>5} {'params':>9} {'grads':>9} {'optim':>9} {'act.peak':>9} {'peak':>9}  GiB "
          f"(usable on {hw.name}: {budget / GIB:.2f})")
    for r in reports:
        print(f"{r.rank:>5} {r.stage:>5} {_gib(r.param_bytes)} {_gib(r.grad_bytes)} {_gib(r.optimizer_bytes)} "
              f"{_gib(r.activation_peak_bytes)} {_gib(r.peak_bytes)}")
    for line in placement_lines:
        print(line)
    for r in reports:
        print(f"rank {r.rank}: {len(r.collectives)} collectives, {len(r.host_reads)} host reads "
              f"({sum(1 for w, _ in r.host_reads if w == 'block_counts')} of block counts)")
        for (kind, dim), n in sorted(r.collective_summary().items()):
            print(f"  {kind:>14} over {dim:<10} {n / 2 ** 20:12.1f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": name, "world_size": spec.world_size, "fold": fold_text,
                       "routing": routing.describe(), "gpu": hw.name, "usable_bytes": budget,
                       "wall_s": round(wall, 2), "ranks": [r.to_json() for r in reports]}, f, indent=1)
    over = [r for r in reports if r.peak_bytes > budget]
    for r in over:
        print(f"meshfold dryrun: rank {r.rank} runs out of memory: peak {r.peak_bytes / GIB:.2f} GiB > "
              f"{budget / GIB:.2f} GiB usable on {hw.name}", file=sys.stderr)
    return 1 if over else 0
