"""Tile-sparse expert GEMMs: speedup over the unmasked GEMM, per density, and of a training step.

    python benchmarks/bench_tile_sparse.py                      # CPU kernels, then training steps
    python benchmarks/bench_tile_sparse.py --parts kernels --shapes coarse --dtypes float32
    python benchmarks/bench_tile_sparse.py --device cuda        # the Triton path (kernels only)
    python benchmarks/bench_tile_sparse.py --parts rule         # what cpu_sparse.choose's thresholds are read from
    python benchmarks/bench_tile_sparse.py --parts profile --shapes coarse --densities 0.25   # where the time goes

Legend: T = tokens, k = top-k, M = T * k routed rows, K = hidden, N = expert ffn, E = experts.

**kernels**: ``grouped_mm`` (forward, or forward + dX + dW) with a random keep-mask of exactly
density d per expert, at d = 1, 0.75, 0.5, 0.25, timed interleaved with the unmasked call on the
same operands (bench_grouped_gemm's shapes and timer: on CPU the fastest of ``--reps`` rounds,
each round timing every variant once), with freed memory kept for reuse
(:func:`meshfold.runtime.malloc.retain_freed_memory`, ``train.retain_cpu_memory``): without it
every large result (dW above all) is page-faulted in afresh on each call, which costs either
path about as much as the dense dW GEMM itself and would hide what the kernels do. Before
timing, the compact and masked executions' outputs are checked against the fp32 reference
(bench_grouped_gemm's check). Masks: ``tile`` (each bk x bn tile kept at random) and
``tw`` (Guo et al.'s tile-wise pattern: N in stripes of G columns, each keeping its own random
K tiles). Cells are speedups over the unmasked call (> 1: faster), on CPU with the process CPU time's
speedup in brackets (see :func:`cpu_timer`). On CPU two executions are forced, ``compact`` and
``masked``; training runs ``auto``, which picks one of them per op by
``meshfold.kernels.cpu_sparse.choose`` (the rule column lists its choices as forward/dX/dW,
c = compact, m = masked, d = dense: the unmasked GEMM, taken at density 1).
Each group's process CPU seconds are recorded beside the wall clock (JSON ``group_cpu_s``): on a
shared machine they show the work done whatever the other tenants took.

**train**: ``meshfold train`` on 2 gloo ranks (ep 2, one thread each) of a model whose experts
dominate the step, with ``[sparsity]`` pruning to 1 - d at step 1 (magnitude score, TW with
G = 128 and bk = 64, on 64 x 64 kernel tiles), against the same run without sparsity, both with ``train.retain_cpu_memory``; step
time = median ``step_s`` of steps 3..N, runs interleaved by density, each twice.

Writes benchmarks/results/tile_sparse_<device>.json; prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_grouped_gemm import (CPU_SHAPES, CUDA_SHAPES, TOL, check_against_reference, make_pass, problem,  # noqa: E402
                                reference_pass, timer)
from meshfold.kernels import cpu_sparse, grouped_mm  # noqa: E402
from meshfold.runtime.malloc import retain_freed_memory  # noqa: E402

DENSITIES = (1.0, 0.75, 0.5, 0.25)
SHAPES = {"coarse": "coarse E8 top2", "fine": "fine E64 top8"}
# name -> (tile (bk, bn), TW stripe G or None)
PATTERNS = {"cpu": {"tile 64x64": ((64, 64), None), "tw G=128, bk=64": ((64, 64), 128),
                    "tile 128x128": ((128, 128), None)},
            "cuda": {"tile 128x128": ((128, 128), None), "tw G=128, bk=64": ((64, 64), 128)}}
EXECUTIONS = ("compact", "masked")


def exact_mask(E: int, K: int, N: int, tile, stripe, density: float, g: torch.Generator) -> torch.Tensor:
    """Keep-mask [E, K // bk, N // bn] with exactly round(density * units) units kept per expert;
    a unit is a tile, or (TW) bk rows of one G-column stripe, whose tiles then agree."""
    bk, bn = tile
    kt, nt = K // bk, N // bn
    cols = nt if stripe is None else N // stripe
    units = kt * cols
    keep = torch.zeros(E, units, dtype=torch.bool)
    for e in range(E):
        keep[e, torch.randperm(units, generator=g)[:round(density * units)]] = True
    keep = keep.view(E, kt, cols)
    return keep if stripe is None else keep.repeat_interleave(stripe // bn, dim=2)


def modes(device: str, density: float) -> tuple[str, ...]:
    """Executions timed: on CPU compact and masked (``auto`` runs one of them: the rule column
    says which), but at density 1 only ``auto`` (nothing is pruned, so every execution runs the
    unmasked GEMM); on CUDA the Triton kernels."""
    return EXECUTIONS if device == "cpu" and density < 1 else ("auto",)


def choices(x, w, mask) -> str:
    """The ops' executions under the rule: forward/dX/dW as c(ompact), m(asked) or d(ense)."""
    E, K, N = w.shape
    p, pT = cpu_sparse.plan(mask, K, N), cpu_sparse.plan(mask.transpose(1, 2), N, K)
    return "/".join(cpu_sparse.choose(q, x.shape[0], E)[0] for q in (p, pT, p))


def cpu_timer(reps: int):
    """measure({name: fn}) -> {name: (wall ms, process CPU ms)}: bench_grouped_gemm's CPU timer
    (a warm-up, then ``reps`` interleaved rounds, each fn's fastest kept), keeping the fastest
    process CPU time of each fn too. The CPU pool's workers do not spin between tasks, so CPU
    time is the work done, which other tenants' load can slow (caches, memory bandwidth) but not
    inflate by descheduling, as it does the wall clock."""
    def measure(fns):
        for fn in fns.values():
            fn()
        wall, cpu = dict.fromkeys(fns, float("inf")), dict.fromkeys(fns, float("inf"))
        for _ in range(reps):
            for name, fn in fns.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                fn()
                wall[name] = min(wall[name], (time.perf_counter() - start) * 1e3)
                cpu[name] = min(cpu[name], (time.process_time() - start_cpu) * 1e3)
        return {name: (wall[name], cpu[name]) for name in fns}

    return measure


def bench_kernels(device, shape_names, dtypes, passes, reps, densities, patterns) -> list[dict]:
    shapes = CPU_SHAPES if device == "cpu" else CUDA_SHAPES
    if device == "cpu":
        measure = cpu_timer(reps)
    else:
        cuda_measure = timer(device, reps)

        def measure(fns):
            return {name: (ms, None) for name, ms in cuda_measure(fns).items()}
    rows = []
    for dtype in dtypes:
        for pass_ in passes:
            for short in shape_names:
                name = SHAPES[short]
                x, w, offsets, dy, _, _ = problem(shapes[name], "balanced", dtype, device, seed=1)
                E, K, N = w.shape
                for pattern in patterns:
                    tile, stripe = PATTERNS[device][pattern]
                    g = torch.Generator().manual_seed(2)
                    masks = {d: exact_mask(E, K, N, tile, stripe, d, g).to(device) for d in densities}
                    fns = {"unmasked": make_pass(lambda a, b: grouped_mm(a, b, offsets), x, w, dy, pass_)}
                    for d, m in masks.items():
                        for mode in modes(device, d):
                            def fn(a, b, m=m, mode=mode):
                                with cpu_sparse.execution(mode):
                                    return grouped_mm(a, b, offsets, tile_mask=m)
                            fns[d, mode] = make_pass(fn, x, w, dy, pass_)
                    for d, m in masks.items():  # the fastest execution's numbers, before any timing
                        checked = {f"{pattern} d={d} {mode}": fns[d, mode] for mode in modes(device, d)[:1]}
                        check_against_reference(checked, reference_pass(x, w, offsets, dy, pass_, m), TOL[dtype])
                    cpu_before = time.process_time()
                    times = measure(fns)
                    cpu_s = time.process_time() - cpu_before
                    (base, base_cpu) = times["unmasked"]
                    rows += [dict(shape=name, dtype=str(dtype).removeprefix("torch."), passes=pass_, pattern=pattern,
                                  density=d, execution=mode, ms=times[d, mode][0], unmasked_ms=base,
                                  speedup=base / times[d, mode][0], cpu_ms=times[d, mode][1], unmasked_cpu_ms=base_cpu,
                                  cpu_speedup=base_cpu / times[d, mode][1] if device == "cpu" else None,
                                  rule=choices(x, w, masks[d]) if device == "cpu" else "triton",
                                  group_cpu_s=cpu_s, load_average=os.getloadavg()[0])
                             for d in densities for mode in modes(device, d)]
                    print(f"  {name} {dtype} {pass_} {pattern}: {cpu_s:.0f} s CPU",
                          file=sys.stderr, flush=True)
    return rows


# ----------------------------------------------------------------------------- the rule's thresholds

RULE_SHAPE = (8, 512, 512)  # E, K, N: small enough that narrow stripes and thin experts show
RULE_TILES = ((64, 8), (64, 16), (64, 32), (64, 64))  # at RULE_ROWS rows per expert
RULE_ROWS = (8, 16, 32, 64, 256)  # rows per expert, at 64 x 64 tiles


def bench_rule(reps: int, density: float) -> list[dict]:
    """Compact against masked (and unmasked) forward + backward in fp32 at ``density``, over
    the stripe width (bn of a tile mask) and the rows per expert: what ``choose``'s
    MIN_STRIPE_COLUMNS and MIN_ROWS_PER_EXPERT are read from."""
    measure = cpu_timer(reps)
    E, K, N = RULE_SHAPE
    rows = []
    cases = [(tile, RULE_ROWS[-1]) for tile in RULE_TILES] + [((64, 64), r) for r in RULE_ROWS[:-1]]
    for tile, per_expert in cases:
        g = torch.Generator().manual_seed(3)
        x, dy = torch.randn(E * per_expert, K, generator=g), torch.randn(E * per_expert, N, generator=g)
        w = torch.randn(E, K, N, generator=g) / K**0.5
        offsets = torch.arange(1, E + 1, dtype=torch.int32) * per_expert
        m = exact_mask(E, K, N, tile, None, density, g)
        fns = {"unmasked": make_pass(lambda a, b: grouped_mm(a, b, offsets), x, w, dy, "fwd+bwd")}
        for mode in EXECUTIONS:
            def fn(a, b, mode=mode):
                with cpu_sparse.execution(mode):
                    return grouped_mm(a, b, offsets, tile_mask=m)
            fns[mode] = make_pass(fn, x, w, dy, "fwd+bwd")
        times = measure(fns)
        rows.append(dict(tile=list(tile), rows_per_expert=per_expert, density=density,
                         **{f"{k}_ms": v[0] for k, v in times.items()}, **{f"{k}_cpu_ms": v[1] for k, v in times.items()},
                         compact_over_masked=times["masked"][0] / times["compact"][0],
                         compact_over_masked_cpu=times["masked"][1] / times["compact"][1],
                         rule=choices(x, w, m), load_average=os.getloadavg()[0]))
        print(f"  rule tile {tile} rows/expert {per_expert}: compact / masked {rows[-1]['compact_over_masked']:.2f} "
              f"({rows[-1]['compact_over_masked_cpu']:.2f} CPU)", file=sys.stderr, flush=True)
    return rows


# ----------------------------------------------------------------------------- profile

PROFILED_OPS = 12


def profile(shape_names, dtypes, patterns, density: float) -> list[dict]:
    """Where a forward + backward's work goes: torch.profiler's self CPU time per ATen op of the
    unmasked call and of the compacted one at ``density``, after a warm-up, on one thread (the
    profiler sees only the calling thread, and with one thread the CPU pool runs its tasks
    there): the GEMMs (``aten::mm``) against the gathers, scatters and fills that compacting adds."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    rows = []
    for dtype in dtypes:
        for short in shape_names:
            name = SHAPES[short]
            x, w, offsets, dy, _, flops = problem(CPU_SHAPES[name], "balanced", dtype, "cpu", seed=1)
            E, K, N = w.shape
            runs = {"unmasked": make_pass(lambda a, b: grouped_mm(a, b, offsets), x, w, dy, "fwd+bwd")}
            for pattern in patterns:
                tile, stripe = PATTERNS["cpu"][pattern]
                m = exact_mask(E, K, N, tile, stripe, density, torch.Generator().manual_seed(2))

                def fn(a, b, m=m):
                    with cpu_sparse.execution("compact"):
                        return grouped_mm(a, b, offsets, tile_mask=m)
                runs[pattern] = make_pass(fn, x, w, dy, "fwd+bwd")
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            for label, run in runs.items():
                run()
                with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                    run()
                ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
                total = sum(e.self_cpu_time_total for e in ops) / 1e3
                top = [dict(op=e.key, self_ms=e.self_cpu_time_total / 1e3, calls=e.count) for e in ops[:PROFILED_OPS]]
                rows.append(dict(shape=name, dtype=str(dtype).removeprefix("torch."), run=label,
                                 density=1.0 if label == "unmasked" else density, self_cpu_ms=total, ops=top,
                                 load_average=os.getloadavg()[0]))
                print(f"  profile {name} {dtype} {label}: {total:.0f} ms self CPU", file=sys.stderr, flush=True)
            torch.set_num_threads(threads)
    return rows


# ----------------------------------------------------------------------------- training steps

TRAIN_MODEL = ["model.hidden=512", "model.layers=2", "model.heads=8", "model.kv_heads=4", "model.ffn=512",
               "moe.ffn=1792", "moe.num_experts=8", "moe.topk=2"]
TRAIN_FOLD = ["fold.world_size=2", "fold.tp=1", "fold.ep=2"]
TRAIN_RUN = ["train.batch=8", "train.seq=256", "train.eval_every=1000", "train.ckpt_every=1000", "train.warmup=1",
             "train.retain_cpu_memory=true"]


def train_step_seconds(density: float | None, steps: int, out: Path) -> tuple[list[float], list]:
    """step_s and compact_gemms of a ``meshfold train`` run (steps 3..), unmasked when
    ``density`` is None."""
    sets = TRAIN_MODEL + TRAIN_FOLD + TRAIN_RUN
    if density is not None:
        sets += ["sparsity.tile=[64, 64]", 'sparsity.pattern="tw"', "sparsity.stripe=128",
                 f"sparsity.schedule=[{1 - density}]", "sparsity.start_step=1",
                 "sparsity.steps_per_stage=1", 'sparsity.score="magnitude"']
    args = [a for s in sets for a in ("--set", s)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "meshfold", "train", "--steps", str(steps), "--out-dir", str(out),
                           *args], capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return [r["step_s"] for r in rows if r["step"] >= 3], [r.get("compact_gemms") for r in rows if r["step"] >= 3]


def bench_train(steps: int, repeats: int) -> list[dict]:
    runs: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(repeats):
            for d in (None, *DENSITIES):
                times, compact = train_step_seconds(d, steps, Path(tmp) / f"{d}_{rep}")
                runs.setdefault(d, []).extend(times)
                runs.setdefault(("compact", d), []).extend(compact)
                print(f"  train density {d} round {rep}: median {statistics.median(times):.3f} s", file=sys.stderr,
                      flush=True)
    base = statistics.median(runs[None])
    return [dict(density=d, step_s=statistics.median(runs[d]), unmasked_step_s=base,
                 speedup=base / statistics.median(runs[d]), compact_gemms=statistics.median(
                     [c for c in runs["compact", d] if c is not None] or [0.0])) for d in DENSITIES]


def cell(r: dict) -> str:
    """A speedup: wall clock, and on CPU the process CPU time's in brackets."""
    return f"{r['speedup']:.2f}" + ("" if r["cpu_speedup"] is None else f" ({r['cpu_speedup']:.2f})")


def print_tables(kernels, train, device, densities):
    if kernels:
        print("| shape | dtype | pass | pattern | unmasked ms | " + " | ".join(
            f"d={d}: {' / '.join(modes(device, d))}" for d in densities) + " | rule (fwd/dX/dW) |")
        print("|---" * (6 + len(densities)) + "|")
        for key in dict.fromkeys((r["shape"], r["dtype"], r["passes"], r["pattern"]) for r in kernels):
            group = {(r["density"], r["execution"]): r for r in kernels
                     if (r["shape"], r["dtype"], r["passes"], r["pattern"]) == key}
            cells = [" / ".join(cell(group[d, m]) for m in modes(device, d)) for d in densities]
            first = {d: group[d, modes(device, d)[0]] for d in densities}
            rules = " ".join(first[d]["rule"] for d in densities)
            print(f"| {' | '.join(key)} | {first[densities[0]]['unmasked_ms']:.1f} | {' | '.join(cells)} | {rules} |")
    if train:
        print("\n| density | step s | unmasked step s | speedup | compact GEMM share |")
        print("|---|---|---|---|---|")
        for r in train:
            print(f"| {r['density']} | {r['step_s']:.3f} | {r['unmasked_step_s']:.3f} | {r['speedup']:.2f} "
                  f"| {r['compact_gemms']:.2f} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--parts", nargs="+", choices=["kernels", "train", "rule", "profile"], default=None,
                        help="default: kernels and train on cpu, kernels on cuda")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=None, help="default: cpu float32 bfloat16; cuda bfloat16")
    parser.add_argument("--passes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    parser.add_argument("--reps", type=int, default=3, help="timed rounds on CPU (fastest run kept)")
    parser.add_argument("--densities", type=float, nargs="+", default=list(DENSITIES))
    parser.add_argument("--patterns", nargs="+", default=None, help="default: all of the device's")
    parser.add_argument("--train-steps", type=int, default=8)
    parser.add_argument("--train-repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    parts = args.parts or (["kernels", "train"] if args.device == "cpu" else ["kernels"])
    dtypes = [getattr(torch, d) for d in args.dtypes or (["float32", "bfloat16"] if args.device == "cpu" else ["bfloat16"])]
    if args.device == "cpu":
        retain_freed_memory()  # as meshfold train does: no page faults on every large buffer, either path
    patterns = args.patterns or list(PATTERNS[args.device])
    unknown = set(patterns) - set(PATTERNS[args.device])
    if unknown:
        parser.error(f"--patterns {sorted(unknown)}; valid on {args.device}: {', '.join(PATTERNS[args.device])}")
    kernels = (bench_kernels(args.device, args.shapes, dtypes, args.passes, args.reps, args.densities, patterns)
               if "kernels" in parts else [])
    train = bench_train(args.train_steps, args.train_repeats) if "train" in parts else []
    rule = bench_rule(args.reps, 0.5) if "rule" in parts else []
    profiles = profile(args.shapes, dtypes, patterns, min(args.densities)) if "profile" in parts else []
    env = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
               torch=torch.__version__, threads=torch.get_num_threads(), load_average=os.getloadavg(),
               patterns={k: list(map(str, v)) for k, v in PATTERNS[args.device].items()})
    out = args.out or ROOT / "benchmarks" / "results" / f"tile_sparse_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(env=env, kernels=kernels, train=train, rule=rule, profile=profiles), indent=1))
    print_tables(kernels, train, args.device, args.densities)
    for r in rule:
        print(f"rule | tile {r['tile']} | {r['rows_per_expert']} rows/expert | compact speedup over masked "
              f"{r['compact_over_masked']:.2f} ({r['compact_over_masked_cpu']:.2f} CPU) | over unmasked "
              f"{r['unmasked_ms'] / r['compact_ms']:.2f} | choose: {r['rule']}")
    for r in profiles:
        ops = ", ".join(f"{o['op'].removeprefix('aten::')} {o['self_ms']:.0f} ({o['calls']})" for o in r["ops"][:7])
        print(f"profile | {r['shape']} | {r['dtype']} | {r['run']} | d={r['density']} | {r['self_cpu_ms']:.0f} ms | {ops}")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    from meshfold.runtime.machine import print_machine

    print_machine()  # the CPU and its bf16 instructions: a timing means nothing without them
    main()
