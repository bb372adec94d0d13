"""Grouped GEMM for MoE experts: meshfold's kernels against torch baselines measured in the same run.

    python benchmarks/bench_grouped_gemm.py --device cpu    # torch path, shapes scaled down
    python benchmarks/bench_grouped_gemm.py --device cuda   # Triton kernels, full shapes

Legend: T = tokens, k = top-k, M = T * k routed rows, K = hidden, N = expert ffn, E = experts.

Every row is compared with one dense GEMM [M, K] @ [K, N] of equal FLOPs timed in the same run
(``vs_dense`` = dense time / row time, i.e. the fraction of dense TFLOP/s reached). Methods:

* ``meshfold``: ``grouped_mm`` with backend "auto" (Triton on CUDA, torch path on CPU);
* ``F.grouped_mm``: torch's grouped GEMM (CPU fp32/bf16, CUDA bf16);
* ``loop``: one matmul per expert with host-side counts (cuBLAS / MKL per expert);
* ``dense``: the equal-FLOP GEMM itself.

Tile-sparse GEMMs have their own benchmark, ``benchmarks/bench_tile_sparse.py`` (both devices).

Passes: ``fwd`` (y = x @ w_e) and ``fwd+bwd`` (plus dX and dW). Before timing, every grouped
method's outputs (y, dX, dW) at every shape are compared with the
plain per-expert loop in fp32; an error over the dtype's tolerance, or any method failing to run,
stops the benchmark with an exception (non-zero exit). Writes
``benchmarks/results/grouped_gemm_<device>.json`` after every measurement (``complete`` is true
once all ran); prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshfold.kernels import grouped_mm, grouped_mm_reference  # noqa: E402

# name -> (E, top_k, T, K, N): Mixtral-8x7B-like coarse experts, Qwen2-57B/G8T8-like fine ones
CUDA_SHAPES = {
    "coarse E8 top2": (8, 2, 8192, 4096, 14336),
    "fine E64 top8": (64, 8, 4096, 3584, 2560),
}
CPU_SHAPES = {  # scaled down ~4x per dim so the CPU run stays within a few minutes
    "coarse E8 top2": (8, 2, 1024, 1024, 3584),
    "fine E64 top8": (64, 8, 512, 896, 640),
}


def token_counts(M: int, E: int, dist: str) -> list[int]:
    """Rows per expert summing to M: equal, or Zipf-skewed (share of expert i ~ 1 / (i + 1)^1.2)."""
    if dist == "balanced":
        shares = [1.0] * E
    else:
        shares = [1.0 / (i + 1) ** 1.2 for i in range(E)]
    counts = [int(M * s / sum(shares)) for s in shares]
    counts[0] += M - sum(counts)
    return counts


def timer(device: str, reps: int):
    """measure({name: fn}) -> {name: ms}, every fn timed after a warm-up; an error in any fn is
    raised (a method that cannot run is a failure of the benchmark, not a note).

    CUDA: triton's do_bench per fn (median over CUDA events). CPU: ``reps`` rounds that time every
    fn once each (interleaved, so a burst of other load hits all of them) and keep each fn's
    fastest run: the machine is shared and slow runs measure the other load.
    """
    def measure(fns):
        if device == "cuda":
            from triton.testing import do_bench

            return {name: do_bench(fn, warmup=25, rep=100) for name, fn in fns.items()}
        for fn in fns.values():
            fn()
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(reps):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
        return best

    return measure


def check_against_reference(fns: dict, reference, tol: float) -> dict:
    """Each method's outputs (y, or y, dX, dW) against the fp32 reference's, as the largest error
    relative to the reference's largest magnitude; raises if any exceeds ``tol``."""
    want = [t.float() for t in _as_tuple(reference())]
    errors = {}
    for name, fn in fns.items():
        got = _as_tuple(fn())
        errors[name] = max(((g.float() - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
                           for g, r in zip(got, want))
        if not errors[name] <= tol:
            raise AssertionError(f"{name}: relative error {errors[name]:.3g} > {tol} against the reference")
    return errors


def _as_tuple(t):
    return t if isinstance(t, tuple) else (t,)


def methods(x, w, offsets, counts):
    """name -> y = f(x, w): the equal-FLOP dense GEMM (on w[:1]) and the grouped methods."""

    def loop(a, b):
        # split/unbind keep autograd to one gradient buffer per operand (indexing b[i] would not)
        return torch.cat([a_e @ b_e for a_e, b_e in zip(a.split(counts), b.unbind(0))])

    return {
        "dense": lambda a, b: a @ b[0],
        "meshfold": lambda a, b: grouped_mm(a, b, offsets),
        "F.grouped_mm": lambda a, b: F.grouped_mm(a, b, offs=offsets),
        "loop": loop,
    }


def make_pass(fn, x, w, dy, passes):
    """A zero-argument callable running ``fn`` forward, or forward + backward (dX and dW)."""
    if passes == "fwd":
        return lambda: fn(x, w)
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    return lambda: torch.autograd.grad(fn(xg, wg), (xg, wg), dy)


def problem(shape, dist, dtype, device, seed):
    """x [M, K], w [E, K, N], offsets [E], dy [M, N], counts and FLOPs of one forward."""
    E, top_k, T, K, N = shape
    M = T * top_k
    counts = token_counts(M, E, dist)
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, device=device, dtype=dtype, generator=g)
    w = torch.randn(E, K, N, device=device, dtype=dtype, generator=g) / K**0.5
    offsets = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    dy = torch.randn(M, N, device=device, dtype=dtype, generator=g)
    return x, w, offsets, dy, counts, 2 * M * K * N


TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}  # relative to the largest output


def reference_pass(x, w, offsets, dy, passes, tile_mask=None):
    """The plain per-expert loop in fp32 (grouped_mm_reference), forward or forward + backward."""
    return make_pass(lambda a, b: grouped_mm_reference(a, b, offsets, tile_mask), x.float(), w.float(),
                     dy.float(), passes)


def bench_shape(name, shape, dist, dtype, device, passes, measure):
    x, w, offsets, dy, counts, flops = problem(shape, dist, dtype, device, seed=0)
    flops *= 1 if passes == "fwd" else 3
    fns = {m: make_pass(fn, x, w[:1] if m == "dense" else w, dy, passes)
           for m, fn in methods(x, w, offsets, counts).items()}
    grouped = {m: fn for m, fn in fns.items() if m != "dense"}
    errors = check_against_reference(grouped, reference_pass(x, w, offsets, dy, passes), TOL[dtype])
    times = measure(fns)
    base = dict(shape=name, dist=dist, dtype=str(dtype).removeprefix("torch."), passes=passes)
    return [dict(base, method=method, ms=ms, tflops=flops / ms / 1e9, vs_dense=times["dense"] / ms,
                 rel_error=errors.get(method)) for method, ms in times.items()]


def fmt(v, spec):
    return "n/a" if v is None else format(v, spec)


def print_tables(grouped, unit):
    scale = 1e3 if unit == "GFLOP/s" else 1.0
    print(f"| shape | tokens | dtype | pass | method | ms | {unit} | vs dense |")
    print("|---|---|---|---|---|---|---|---|")
    for r in grouped:
        tf = r["tflops"] * scale
        print(f"| {r['shape']} | {r['dist']} | {r['dtype']} | {r['passes']} | {r['method']} | {fmt(r['ms'], '.2f')} "
              f"| {fmt(tf, '.1f')} | {fmt(r['vs_dense'], '.2f')} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", nargs="+", default=None, help="default: cpu fp32 bf16; cuda bf16")
    parser.add_argument("--passes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    parser.add_argument("--reps", type=int, default=4, help="timed rounds on CPU (fastest run kept)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    device = args.device
    shapes = CUDA_SHAPES if device == "cuda" else CPU_SHAPES
    dtypes = [getattr(torch, d) for d in (args.dtypes or (["bfloat16"] if device == "cuda" else ["float32", "bfloat16"]))]
    measure = timer(device, args.reps)
    env = dict(device=torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
               torch=torch.__version__, threads=torch.get_num_threads(), shapes=shapes,
               tolerance={str(k): v for k, v in TOL.items()})
    out = args.out or Path(__file__).resolve().parent / "results" / f"grouped_gemm_{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    grouped = []

    def write(done: bool):  # after every measurement, so a crash keeps what was measured
        out.write_text(json.dumps(dict(env=env, complete=done, grouped=grouped), indent=1))

    for dtype in dtypes:
        for passes in args.passes:
            for name, shape in shapes.items():
                for dist in ("balanced", "skewed"):
                    grouped += bench_shape(name, shape, dist, dtype, device, passes, measure)
                    write(False)
    write(True)
    print_tables(grouped, "TFLOP/s" if device == "cuda" else "GFLOP/s")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    from meshfold.runtime.machine import print_machine

    print_machine()  # the CPU and its bf16 instructions: a timing means nothing without them
    main()
