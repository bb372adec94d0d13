"""Tile-sparse expert GEMMs: speedup over the unmasked GEMM, per density, and of a training step.

    python benchmarks/bench_tile_sparse.py                      # CPU kernels, then training steps
    python benchmarks/bench_tile_sparse.py --parts kernels --shapes coarse --dtypes float32
    python benchmarks/bench_tile_sparse.py --device cuda        # the Triton path (kernels only)

Legend: T = tokens, k = top-k, M = T * k routed rows, K = hidden, N = expert ffn, E = experts.

**kernels**: ``grouped_mm`` (forward, or forward + dX + dW) with a random keep-mask of exactly
density d per expert, at d = 1, 0.75, 0.5, 0.25, timed interleaved with the unmasked call on the
same operands (bench_grouped_gemm's shapes and timer: on CPU the fastest of ``--reps`` rounds,
each round timing every variant once), with freed memory kept for reuse
(:func:`meshfold.malloc.retain_freed_memory`, ``train.retain_cpu_memory``): without it every
large result (dW above all) is page-faulted in afresh on each call, which costs either path
about as much as the dense dW GEMM itself and would hide what the kernels do. Masks: ``tile`` (each bk x bn tile kept at random) and
``tw`` (Guo et al.'s tile-wise pattern: N in stripes of G columns, each keeping its own random
K tiles). Cells are speedups over the unmasked call (> 1: faster). On CPU three executions:
``auto`` (what training runs: ``meshfold.kernels.cpu_sparse.choose`` per op; the ops' choices are
listed as forward/dX/dW, c = compact, m = masked, d = dense), ``compact`` and ``masked`` (forced).
Process CPU seconds are recorded beside the wall clock (JSON): on a shared machine they show
the work done whatever the other tenants took.

**train**: ``meshfold train`` on 2 gloo ranks (ep 2, one thread each) of a model whose experts
dominate the step, with ``[sparsity]`` pruning to 1 - d at step 1 (magnitude score, 64 x 64
tiles), against the same run without sparsity, both with ``train.retain_cpu_memory``; step
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

from bench_grouped_gemm import CPU_SHAPES, CUDA_SHAPES, make_pass, problem, timer  # noqa: E402
from meshfold.kernels import cpu_sparse, grouped_mm  # noqa: E402
from meshfold.runtime.malloc import retain_freed_memory  # noqa: E402

DENSITIES = (1.0, 0.75, 0.5, 0.25)
SHAPES = {"coarse": "coarse E8 top2", "fine": "fine E64 top8"}
# name -> (tile (bk, bn), TW stripe G or None)
PATTERNS = {"cpu": {"tile 64x64": ((64, 64), None), "tw G=128, bk=64": ((64, 64), 128),
                    "tile 128x128": ((128, 128), None)},
            "cuda": {"tile 128x128": ((128, 128), None), "tw G=128, bk=64": ((64, 64), 128)}}
EXECUTIONS = ("auto", "compact", "masked")


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


def choices(x, w, mask) -> str:
    """The ops' executions under the rule: forward/dX/dW as c(ompact), m(asked) or d(ense)."""
    E, K, N = w.shape
    p, pT = cpu_sparse.plan(mask, K, N), cpu_sparse.plan(mask.transpose(1, 2), N, K)
    return "/".join(cpu_sparse.choose(q, x.shape[0], E)[0] for q in (p, pT, p))


def bench_kernels(device, shape_names, dtypes, passes, reps, densities) -> list[dict]:
    shapes = CPU_SHAPES if device == "cpu" else CUDA_SHAPES
    measure = timer(device, reps)
    rows = []
    for dtype in dtypes:
        for pass_ in passes:
            for short in shape_names:
                name = SHAPES[short]
                x, w, offsets, dy, _, _ = problem(shapes[name], "balanced", dtype, device, seed=1)
                E, K, N = w.shape
                for pattern, (tile, stripe) in PATTERNS[device].items():
                    g = torch.Generator().manual_seed(2)
                    masks = {d: exact_mask(E, K, N, tile, stripe, d, g).to(device) for d in densities}
                    fns = {"unmasked": make_pass(lambda a, b: grouped_mm(a, b, offsets), x, w, dy, pass_)}
                    modes = EXECUTIONS if device == "cpu" else ("auto",)
                    for d, m in masks.items():
                        for mode in modes:
                            def fn(a, b, m=m, mode=mode):
                                with cpu_sparse.execution(mode):
                                    return grouped_mm(a, b, offsets, tile_mask=m)
                            fns[d, mode] = make_pass(fn, x, w, dy, pass_)
                    cpu_before = time.process_time()
                    times = measure(fns)
                    rows += [dict(shape=name, dtype=str(dtype).removeprefix("torch."), passes=pass_, pattern=pattern,
                                  density=d, execution=mode, ms=times[d, mode], unmasked_ms=times["unmasked"],
                                  speedup=times["unmasked"] / times[d, mode],
                                  rule=choices(x, w, masks[d]) if device == "cpu" else "triton")
                             for d in densities for mode in modes]
                    print(f"  {name} {dtype} {pass_} {pattern}: {time.process_time() - cpu_before:.0f} s CPU",
                          file=sys.stderr, flush=True)
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
        sets += ["sparsity.tile=[64, 64]", f"sparsity.schedule=[{1 - density}]", "sparsity.start_step=1",
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


def print_tables(kernels, train, device, densities):
    if kernels:
        modes = EXECUTIONS if device == "cpu" else ("auto",)
        print("| shape | dtype | pass | pattern | unmasked ms | " + " | ".join(
            f"d={d}: {' / '.join(modes)}" for d in densities) + " | rule (fwd/dX/dW) |")
        print("|---" * (6 + len(densities)) + "|")
        for key in dict.fromkeys((r["shape"], r["dtype"], r["passes"], r["pattern"]) for r in kernels):
            group = {(r["density"], r["execution"]): r for r in kernels
                     if (r["shape"], r["dtype"], r["passes"], r["pattern"]) == key}
            cells = [" / ".join(f"{group[d, m]['speedup']:.2f}" for m in modes) for d in densities]
            rules = " ".join(group[d, "auto"]["rule"] for d in densities)
            print(f"| {' | '.join(key)} | {group[densities[0], 'auto']['unmasked_ms']:.1f} | {' | '.join(cells)} | {rules} |")
    if train:
        print("\n| density | step s | unmasked step s | speedup | compact GEMM share |")
        print("|---|---|---|---|---|")
        for r in train:
            print(f"| {r['density']} | {r['step_s']:.3f} | {r['unmasked_step_s']:.3f} | {r['speedup']:.2f} "
                  f"| {r['compact_gemms']:.2f} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--parts", nargs="+", choices=["kernels", "train"], default=None,
                        help="default: kernels and train on cpu, kernels on cuda")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=None, help="default: cpu float32 bfloat16; cuda bfloat16")
    parser.add_argument("--passes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    parser.add_argument("--reps", type=int, default=3, help="timed rounds on CPU (fastest run kept)")
    parser.add_argument("--densities", type=float, nargs="+", default=list(DENSITIES))
    parser.add_argument("--train-steps", type=int, default=8)
    parser.add_argument("--train-repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    parts = args.parts or (["kernels", "train"] if args.device == "cpu" else ["kernels"])
    dtypes = [getattr(torch, d) for d in args.dtypes or (["float32", "bfloat16"] if args.device == "cpu" else ["bfloat16"])]
    if args.device == "cpu":
        retain_freed_memory()  # as meshfold train does: no page faults on every large buffer, either path
    kernels = (bench_kernels(args.device, args.shapes, dtypes, args.passes, args.reps, args.densities)
               if "kernels" in parts else [])
    train = bench_train(args.train_steps, args.train_repeats) if "train" in parts else []
    env = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
               torch=torch.__version__, threads=torch.get_num_threads(), load_average=os.getloadavg(),
               patterns={k: list(map(str, v)) for k, v in PATTERNS[args.device].items()})
    out = args.out or ROOT / "benchmarks" / "results" / f"tile_sparse_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(env=env, kernels=kernels, train=train), indent=1))
    print_tables(kernels, train, args.device, args.densities)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
