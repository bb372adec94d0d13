"""A/B of one MoE layer, forward + backward: this tree's meshfold against another git revision's,
timed interleaved in one process.

    python benchmarks/ab_moe_layer.py --base main            # both shapes, fp32 + bf16
    python benchmarks/ab_moe_layer.py --base HEAD~3 --rounds 21 --shapes "fine E64 top8"
    python benchmarks/ab_moe_layer.py --base integ --quick --rounds 9   # the smaller shapes

Why: on a shared machine the step time of one layer varies by 2x and more between runs minutes
apart (other tenants), far more than a refactoring could change it, so two runs of
bench_moe_layer.py cannot tell "within noise" from "slower". Here the base revision's package is
extracted (``git archive``) and imported under another name (``meshfold_base``, its custom ops
under the ``meshfold_base::`` namespace), both layers get the same weights and input (the shapes
and config of bench_moe_layer.py's ``meshfold`` rows), and each round runs one step of each, in
alternating order. Reported per shape and dtype: the median step of each, and the median and
range over rounds of the per-round ratio new / base (1.00 = same speed; both saw the same load).
Also the median per-round ratio of process CPU time (all threads), which time-sharing with
other tenants disturbs less than wall time. Writes benchmarks/results/moe_layer_ab.json.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_moe_layer import DTYPES, QUICK_SHAPES, SHAPES  # noqa: E402  (benchmarks/bench_moe_layer.py)

from meshfold.runtime.malloc import retain_freed_memory  # noqa: E402
import meshfold.models as new_models  # noqa: E402


def import_revision(rev: str, where: Path):
    """``meshfold.models`` of git revision ``rev``, imported as ``meshfold_base.models``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "meshfold"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    pkg = where / "meshfold_base"
    (where / "meshfold").rename(pkg)
    renames = [(r"\b(from|import) meshfold\b", r"\1 meshfold_base"), (r"meshfold::", "meshfold_base::"),
               (r"torch\.ops\.meshfold\b", "torch.ops.meshfold_base")]
    for path in pkg.rglob("*.py"):
        text = path.read_text()
        for pattern, repl in renames:
            text = re.sub(pattern, repl, text)
        path.write_text(text)
    sys.path.insert(0, str(where))
    import meshfold_base.models as base_models

    return base_models


def layer_pair(dims: tuple, dtype: torch.dtype, base_models):
    """The new and the base MoELayer with the same weights (bench_moe_layer.py's config)."""
    E, k, H, F_, _ = dims
    kwargs = dict(hidden=H, ffn=F_, num_experts=E, topk=k, renormalize=True)
    torch.manual_seed(0)
    new = new_models.MoELayer(new_models.MoEConfig(**kwargs), dtype=dtype)
    base = base_models.MoELayer(base_models.MoEConfig(**kwargs), dtype=dtype)
    base.load_state_dict(new.state_dict())
    return new, base


def step_fn(layer, x, dy):
    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(dy)

    return step


def timed(step) -> tuple[float, float]:
    """(wall ms, process CPU ms) of one step."""
    t0, c0 = time.perf_counter(), time.process_time()
    step()
    return (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3


def run_case(shape: str, dims: tuple, dtype_name: str, rounds: int, base_models) -> dict:
    dtype = DTYPES[dtype_name]
    E, k, H, F_, T = dims
    x = torch.randn(1, T, H, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
    dy = torch.randn(1, T, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    new, base = layer_pair(dims, dtype, base_models)
    with torch.no_grad():
        same = torch.equal(new(x), base(x))
    steps = {"new": step_fn(new, x, dy), "base": step_fn(base, x, dy)}
    for _ in range(2):  # warm-up: oneDNN primitives, allocator, pool threads
        for s in steps.values():
            s()
    ms = {"new": [], "base": []}
    cpu = {"new": [], "base": []}
    for r in range(rounds):
        for name in (("new", "base") if r % 2 == 0 else ("base", "new")):
            wall, c = timed(steps[name])
            ms[name].append(wall)
            cpu[name].append(c)
    ratios = sorted(a / b for a, b in zip(ms["new"], ms["base"]))
    cpu_ratio = statistics.median(a / b for a, b in zip(cpu["new"], cpu["base"]))
    return {"shape": shape, "dtype": dtype_name, "rounds": rounds, "same_output": same,
            "new_ms": statistics.median(ms["new"]), "base_ms": statistics.median(ms["base"]),
            "ratio_median": statistics.median(ratios), "ratio_min": ratios[0], "ratio_max": ratios[-1],
            "cpu_ratio_median": cpu_ratio,
            "new_all_ms": ms["new"], "base_all_ms": ms["base"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="main", help="git revision to compare against")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--quick", action="store_true", help="bench_moe_layer.py's QUICK_SHAPES")
    ap.add_argument("--dtypes", nargs="*", default=list(DTYPES))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "moe_layer_ab.json"))
    args = ap.parse_args()
    if not retain_freed_memory():  # bench_moe_layer.py's default allocator policy
        sys.exit("needs glibc (meshfold.runtime.malloc.retain_freed_memory)")
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.base], check=True,
                         capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        base_models = import_revision(args.base, Path(tmp))
        shapes = QUICK_SHAPES if args.quick else SHAPES
        rows = [run_case(s, shapes[s], d, args.rounds, base_models) for s in args.shapes for d in args.dtypes]
    print(f"new = this tree, base = {args.base} ({rev}); {args.rounds} rounds, {torch.get_num_threads()} threads")
    print("| shape | dtype | new ms | base ms | new / base, median (min-max over rounds) | CPU time new / base "
          "| same output |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['dtype']} | {r['new_ms']:.1f} | {r['base_ms']:.1f} | {r['ratio_median']:.3f} "
              f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | {r['cpu_ratio_median']:.3f} | {r['same_output']} |")
    meta = {"command": "python " + " ".join(sys.argv), "base": args.base, "base_commit": rev,
            "torch": torch.__version__, "threads": torch.get_num_threads()}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    from meshfold.runtime.machine import print_machine

    print_machine()  # the CPU and its bf16 instructions: a timing means nothing without them
    main()
