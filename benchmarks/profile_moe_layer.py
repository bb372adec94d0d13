"""Where one MoE layer's forward + backward spends its time, phase by phase (torch.profiler).

    python benchmarks/profile_moe_layer.py                       # both shapes, fp32 + bf16
    python benchmarks/profile_moe_layer.py --quick --steps 2     # bench_moe_layer.py's --quick shapes

Legend: T = tokens, H = hidden, F = expert ffn, E = experts, k = top-k, N = T*k routed rows.

The layer is bench_moe_layer.py's ``meshfold`` method (same shapes, weights and input). Each
phase of the forward is wrapped in a ``torch.profiler.record_function`` range from outside (the
layer's router and experts modules by forward hooks, its dispatcher / statistics functions and
the experts' GEMMs and activation by wrapping the names the layer and ``expert_ffn`` call), and
each backward node is assigned to the phase whose forward made it (:data:`BACKWARD`). The time of
a phase is the wall time of its top-level events on the calling thread (the CPU pool's workers
run inside them), summed over ``--steps`` profiled steps after a warm-up, divided by the steps.
``other`` is the step's wall time minus every phase (Python, autograd bookkeeping, reshapes).

Each phase's ceiling, measured in the same process:

* expert GEMMs (fwd / bwd): the equal-FLOP dense chain's GEMMs (bench_moe_layer.py's ``dense``:
  ``x @ W1 [H, 2kF]``, ``@ W2 [kF, H]``, and their backward), i.e. dense GEMM speed;
* activation (fwd / bwd): the dense chain's SwiGLU on the same [T, kF] = [N, F] elements;
* router: its GEMM's FLOPs (``2 T H E`` forward, twice that backward) at the dense GEMM rate;
* permute, combine (fwd / bwd): their minimal memory traffic (each of the N rows of H read once
  and written once, 2 N H bytes-per-element, plus the [T, H] side) at the copy bandwidth of a
  large ``copy_`` measured in this process;
* token stats: no ceiling (a few [T, k] integer passes; listed for its absolute time).

``x ceiling`` = phase time / ceiling. Prints a markdown table per shape and dtype and writes
benchmarks/results/moe_layer_profile.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_moe_layer import DTYPES, QUICK_SHAPES, SHAPES, DenseChain, build  # noqa: E402

import meshfold.kernels.ffn as ffn  # noqa: E402
import meshfold.models.moe as moe  # noqa: E402
from meshfold.runtime.malloc import retain_freed_memory  # noqa: E402

FORWARD = {  # name in meshfold.models.moe -> phase
    "drop_pairs": "token stats", "token_stats": "token stats", "balancing_loss_shares": "token stats",
    "routing_metrics": "token stats", "permute": "permute", "unpermute": "combine",
}
BACKWARD = {  # substring of an autograd node's name -> phase
    "grouped_mm": "expert GEMMs", "_SwiGLU": "activation", "_GatherRows": "permute",
    "_CombineTopK": "combine", "AccumulateGrad": "grad accumulate",
    "MmBackward": "router", "LinearBackward": "router", "TBackward": "router", "ToCopyBackward": "router",
    "SoftmaxBackward": "router", "TopkBackward": "router", "DivBackward": "router", "SumBackward": "router",
}
PHASES = ("router", "token stats", "permute", "expert GEMMs", "activation", "combine", "grad accumulate")


def _ranged(name, fn):
    def wrapped(*args, **kwargs):
        with record_function(f"phase::{name}"):
            return fn(*args, **kwargs)

    return wrapped


def instrument(layer) -> None:
    """Wrap the layer's phases in ``phase::`` profiler ranges (module attributes the layer and
    expert_ffn look up at call time, once per process; forward hooks on the router)."""
    if not getattr(moe, "_profiled", False):
        for fn_name, phase in FORWARD.items():
            setattr(moe, fn_name, _ranged(phase, getattr(moe, fn_name)))
        ffn.grouped_mm = _ranged("expert GEMMs", ffn.grouped_mm)
        ffn.swiglu = _ranged("activation", ffn.swiglu)
        moe._profiled = True
    ranges = {}

    def enter(module, args):
        ranges[module] = record_function("phase::router").__enter__()

    def leave(module, args, out):
        ranges.pop(module).__exit__(None, None, None)

    layer.router.register_forward_pre_hook(enter)
    layer.router.register_forward_hook(leave)


def phase_of(name: str) -> tuple[str, str] | None:
    """(phase, "fwd" | "bwd") of a top-level event, or None."""
    if name.startswith("phase::"):
        return name.removeprefix("phase::"), "fwd"
    if name.startswith("autograd::engine::evaluate_function"):
        for key, phase in BACKWARD.items():
            if key in name:
                return phase, "bwd"
        return "other autograd", "bwd"
    return None


def profile_steps(step, steps: int) -> tuple[dict, float]:
    """({(phase, direction): ms per step}, wall ms per step) over ``steps`` profiled steps."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        wall = (time.perf_counter() - t0) * 1e3 / steps
    tid = next(e.thread for e in prof.events() if e.name.startswith("phase::"))
    ms: dict = {}
    for e in prof.events():
        if e.thread != tid or e.cpu_parent is not None:
            continue
        key = phase_of(e.name)
        if key is not None:
            ms[key] = ms.get(key, 0.0) + (e.time_range.end - e.time_range.start) / 1e3 / steps
    return ms, wall


def copy_bandwidth() -> float:
    """Bytes per second of a 64 MiB ``copy_`` (read + write counted), median of 5."""
    src = torch.randn(16 << 20)
    dst = torch.empty_like(src)
    ts = []
    for _ in range(6):
        t0 = time.perf_counter()
        dst.copy_(src)
        ts.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / statistics.median(ts[1:])


def dense_parts(dims, dtype, steps: int) -> dict:
    """ms per step of the dense chain's GEMMs and its SwiGLU, forward and backward."""
    E, k, H, F_, T = dims
    chain = DenseChain(H, F_, k, dtype)
    x = torch.randn(T, H).to(dtype).requires_grad_()
    dy = torch.randn(T, H).to(dtype)
    F = torch.nn.functional

    def step():
        chain.zero_grad(set_to_none=True)
        x.grad = None
        with record_function("phase::gemm"):
            h = x @ chain.w1
        with record_function("phase::act"):
            gate, up = h.chunk(2, dim=-1)
            a = F.silu(gate) * up
        with record_function("phase::gemm"):
            y = a @ chain.w2
        y.backward(dy)

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    out = {"gemm fwd": 0.0, "gemm bwd": 0.0, "act fwd": 0.0, "act bwd": 0.0}
    tid = next(e.thread for e in prof.events() if e.name.startswith("phase::"))
    for e in prof.events():
        if e.thread != tid or e.cpu_parent is not None:
            continue
        t = (e.time_range.end - e.time_range.start) / 1e3 / steps
        if e.name == "phase::gemm":
            out["gemm fwd"] += t
        elif e.name == "phase::act":
            out["act fwd"] += t
        elif "MmBackward" in e.name:
            out["gemm bwd"] += t
        elif any(s in e.name for s in ("SiluBackward", "MulBackward", "SplitBackward")):
            out["act bwd"] += t
    return out


def ceilings(dims, dtype, dense: dict, bw: float) -> dict:
    """{(phase, direction): ceiling ms} (module docstring)."""
    E, k, H, F_, T = dims
    es = torch.finfo(dtype).bits // 8
    N = T * k
    gemm_rate = 2.0 * T * H * 2 * k * F_ * 1.5 / dense["gemm fwd"]  # FLOP per ms, forward
    rows = 2.0 * N * H * es / bw * 1e3  # read + write every routed row once
    return {("expert GEMMs", "fwd"): dense["gemm fwd"], ("expert GEMMs", "bwd"): dense["gemm bwd"],
            ("activation", "fwd"): dense["act fwd"], ("activation", "bwd"): dense["act bwd"],
            ("router", "fwd"): 2.0 * T * H * E / gemm_rate, ("router", "bwd"): 4.0 * T * H * E / gemm_rate,
            ("permute", "fwd"): rows, ("permute", "bwd"): rows + 2.0 * T * H * es / bw * 1e3,
            ("combine", "fwd"): rows / 2 + 2.0 * T * H * es / bw * 1e3, ("combine", "bwd"): 1.5 * rows}


def run(shape: str, dims, dtype_name: str, steps: int) -> dict:
    dtype = DTYPES[dtype_name]
    layer, step, _ = build("meshfold", dims, dtype)
    instrument(layer)
    step()  # warm-up
    ms, wall = profile_steps(step, steps)
    dense = dense_parts(dims, dtype, steps)
    ceil = ceilings(dims, dtype, dense, copy_bandwidth())
    _, eo_step, _ = build("experts_only", dims, dtype)
    _, dense_step, _ = build("dense", dims, dtype)
    eo_step(), dense_step()
    t_eo, t_dense = [], []
    for r in range(steps + 1):
        for name, s, ts in (("eo", eo_step, t_eo), ("dense", dense_step, t_dense))[:: 1 if r % 2 else -1]:
            t0 = time.perf_counter()
            s()
            ts.append((time.perf_counter() - t0) * 1e3)
    phases = []
    for phase in PHASES + ("other autograd",):
        for d in ("fwd", "bwd"):
            if (phase, d) in ms:
                c = ceil.get((phase, d))
                phases.append({"phase": phase, "dir": d, "ms": ms[(phase, d)], "ceiling_ms": c,
                               "x_ceiling": ms[(phase, d)] / c if c else None})
    other = wall - sum(p["ms"] for p in phases)
    phases.append({"phase": "other (Python, reshapes, glue)", "dir": "", "ms": other, "ceiling_ms": None,
                   "x_ceiling": None})
    return {"shape": shape, "dims": dims, "dtype": dtype_name, "steps": steps, "wall_ms": wall,
            "experts_only_vs_dense": statistics.median(d / e for d, e in zip(t_dense, t_eo)),
            "dense_ms": statistics.median(t_dense), "experts_only_ms": statistics.median(t_eo),
            "phases": phases, "loadavg": os.getloadavg()}


def print_case(c: dict) -> None:
    E, k, H, F_, T = c["dims"]
    print(f"\n### {c['shape']} (H {H}, F {F_}, T {T}) {c['dtype']}: profiled step {c['wall_ms']:.0f} ms; "
          f"dense {c['dense_ms']:.0f} ms, experts_only {c['experts_only_ms']:.0f} ms "
          f"(experts-only ceiling {c['experts_only_vs_dense']:.2f} of dense); load {c['loadavg'][0]:.2f}")
    print("| phase | dir | ms | share | ceiling ms | x ceiling |")
    print("|---|---|---|---|---|---|")
    for p in c["phases"]:
        f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
        print(f"| {p['phase']} | {p['dir']} | {p['ms']:.1f} | {p['ms'] / c['wall_ms']:.0%} | "
              f"{f(p['ceiling_ms'], '.1f')} | {f(p['x_ceiling'], '.1f')} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="bench_moe_layer.py's QUICK_SHAPES")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--dtypes", nargs="*", default=list(DTYPES))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "moe_layer_profile.json"))
    args = ap.parse_args()
    for name, valid in (("shapes", SHAPES), ("dtypes", DTYPES)):
        bad = [v for v in getattr(args, name) if v not in valid]
        if bad:
            sys.exit(f"--{name} {bad}: valid: {', '.join(valid)}")
    if not retain_freed_memory():  # bench_moe_layer.py's default allocator policy
        sys.exit("needs glibc (meshfold.runtime.malloc.retain_freed_memory)")
    shapes = QUICK_SHAPES if args.quick else SHAPES
    cases = []
    for shape in args.shapes:
        for dt in args.dtypes:
            cases.append(run(shape, shapes[shape], dt, args.steps))
            print_case(cases[-1])
    meta = {"command": "python " + " ".join(sys.argv), "torch": torch.__version__,
            "threads": torch.get_num_threads()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "cases": cases}, indent=1))


if __name__ == "__main__":
    from meshfold.runtime.machine import print_machine

    print_machine()  # the CPU and its bf16 instructions: a timing means nothing without them
    main()
