"""One MoE layer, forward + backward, single process: meshfold vs a dense GEMM chain vs Hugging Face.

    python benchmarks/bench_moe_layer.py                 # both shapes, fp32 + bf16, timing + memory
    python benchmarks/bench_moe_layer.py --rounds 3 --no-memory
    python benchmarks/bench_moe_layer.py --malloc system    # glibc's default allocator policy

Legend: T = tokens, H = hidden, F = expert ffn, E = experts, k = top-k.

Methods, all at the same shape and dtype, timed interleaved (one step of each per round; the
median over rounds is reported):

* ``dense``: the baseline, a dense SwiGLU chain of equal FLOPs,
  ``x [T, H] @ W1 [H, 2kF] -> silu(gate) * up -> @ W2 [kF, H]``: the k expert FFNs every token
  visits, fused into one GEMM pair (no routing, no permutation).
* ``meshfold``: ``MoELayer`` (fp32 router, dropless, grouped GEMM through meshfold.kernels).
* ``experts_only``: the ceiling of ``meshfold``: exactly the expert computation it runs
  (``meshfold.kernels.expert_ffn``: grouped GEMM, SwiGLU, grouped GEMM, and their backward
  with the gradients of the rows and of both weights) on rows already permuted, with the same
  per-expert row counts as meshfold's routing of the same input. No router, no permute, no
  combine: the fraction of dense it reaches is what the grouped expert GEMMs allow at this shape.
* ``hf_eager`` / ``hf_grouped_mm``: transformers' ``MixtralSparseMoeBlock`` with
  ``experts_implementation`` "eager" (a Python loop over the experts hit) or "grouped_mm"
  (sort + ``F.grouped_mm``). Its router runs in the model dtype. hf_eager is 5-50x slower than
  the rest, so it is timed in only ``--eager-rounds`` rounds (default 1, after its warm-up).

meshfold and HF share weights (HF's are copied into meshfold), so they route identically.
FLOPs counted: the expert GEMMs only, ``18 T k H F`` per forward + backward (3 GEMMs of
``2 T k H F`` each way, x3 for fwd + bwd), identical for every method; the router (``6 T H E``)
is left out. ``vs_dense`` = dense time / method time = the fraction of the dense chain's FLOP/s.
``CPU ms`` / ``vs_dense_cpu``: the same from process CPU time (all threads; includes OpenMP
spin-waits), which other processes on a shared machine disturb far less than wall time.

Allocator (``--malloc``): ``retain`` (default) calls :func:`meshfold.runtime.malloc.retain_freed_memory`
before timing (``meshfold train`` does with ``train.retain_cpu_memory=true``), so large buffers
are reused instead of page-faulted in again every step; ``system`` keeps glibc's default (mmap
per buffer >= 32 MiB). Both apply to every method of the run alike.

Memory: each (shape, dtype, method) runs in a fresh subprocess with glibc's mmap threshold fixed
at 64 KiB (so freed tensors go back to the OS). After a warm-up step, grads set to None,
``malloc_trim`` and a reset of the kernel's peak-RSS counter (``/proc/self/clear_refs`` = 5), it
runs one forward + backward; ``peak`` = VmHWM - VmRSS before the step: activations, temporaries
and the new weight gradients. ``peak - grads`` removes the gradient buffers (the size of the
weights, 4x larger for an E=8, k=2 MoE than for its dense chain: a property of the model, not
of the implementation). Writes benchmarks/results/moe_layer.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from peak_rss import peak_rss_mib  # noqa: E402  (benchmarks/peak_rss.py)

from meshfold.runtime.malloc import retain_freed_memory  # noqa: E402
from meshfold.models import MoEConfig, MoELayer  # noqa: E402
from meshfold.kernels import expert_ffn  # noqa: E402

# name -> (E, k, H, F, T)
SHAPES = {
    "coarse E8 top2": (8, 2, 512, 1024, 4096),
    "fine E64 top8": (64, 8, 512, 256, 2048),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
METHODS = ("dense", "meshfold", "experts_only", "hf_eager", "hf_grouped_mm")


class DenseChain(torch.nn.Module):
    """The equal-FLOP baseline: the k expert FFNs of every token as one SwiGLU GEMM pair."""

    def __init__(self, H, F_, k, dtype):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(H, 2 * k * F_, dtype=dtype) * H ** -0.5)
        self.w2 = torch.nn.Parameter(torch.randn(k * F_, H, dtype=dtype) * (k * F_) ** -0.5)

    def forward(self, x_TH):
        gate, up = (x_TH @ self.w1).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.w2


def hf_block(E, k, H, F_, dtype, impl):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=H, intermediate_size=F_, num_local_experts=E, num_experts_per_tok=k,
                        router_jitter_noise=0.0, experts_implementation=impl)
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.normal_(std=H ** -0.5)
        block.experts.gate_up_proj.normal_(std=H ** -0.5)
        block.experts.down_proj.normal_(std=F_ ** -0.5)
    return block.to(dtype)


def meshfold_layer(E, k, H, F_, dtype):
    layer = MoELayer(MoEConfig(hidden=H, ffn=F_, num_experts=E, topk=k, renormalize=True), dtype=dtype)
    ref = hf_block(E, k, H, F_, torch.float32, "eager")  # same weights (and routing) as the HF rows
    with torch.no_grad():
        layer.router.weight.copy_(ref.gate.weight)
        layer.experts.w_gate_up.copy_(ref.experts.gate_up_proj.reshape(E, 2, F_, H).permute(0, 3, 1, 2))
        layer.experts.w_down.copy_(ref.experts.down_proj.transpose(1, 2))
    return layer


class ExpertsOnly(torch.nn.Module):
    """meshfold's expert computation alone, on expert-major rows x_NH with fixed offsets_E."""

    def __init__(self, layer: MoELayer, offsets_E: torch.Tensor):
        super().__init__()
        self.w_gate_up = torch.nn.Parameter(layer.experts.w_gate_up.detach().clone())  # [E, H, 2, F]
        self.w_down = torch.nn.Parameter(layer.experts.w_down.detach().clone())  # [E, F, H]
        self.register_buffer("offsets_E", offsets_E)

    def forward(self, x_NH):
        return expert_ffn(x_NH, self.w_gate_up, self.w_down, self.offsets_E, "swiglu")


def experts_only(E, k, H, F_, dtype, x_TH):
    """(module, rows x_NH, grad dy_NH): the rows per expert are those meshfold's router gives x_TH."""
    layer = meshfold_layer(E, k, H, F_, dtype)
    with torch.no_grad():
        _, experts_TK, _ = layer.router(x_TH)
    counts_E = torch.bincount(experts_TK.reshape(-1), minlength=E)
    module = ExpertsOnly(layer, torch.cumsum(counts_E, 0).to(torch.int32))
    N = experts_TK.numel()
    x_NH = torch.randn(N, H, generator=torch.Generator().manual_seed(3)).to(dtype).requires_grad_()
    dy_NH = torch.randn(N, H, generator=torch.Generator().manual_seed(4)).to(dtype)
    return module, x_NH, dy_NH


def build(method, shape, dtype):
    """(module, step) where step() runs one forward + backward from fresh gradients."""
    E, k, H, F_, T = SHAPES[shape]
    x = torch.randn(1, T, H, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
    dy = torch.randn(1, T, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    if method == "dense":
        module = DenseChain(H, F_, k, dtype)
    elif method == "meshfold":
        module = meshfold_layer(E, k, H, F_, dtype)
    elif method == "experts_only":
        module, x_NH, dy_NH = experts_only(E, k, H, F_, dtype, x[0].detach())

        def step():
            module.zero_grad(set_to_none=True)
            x_NH.grad = None
            module(x_NH).backward(dy_NH)

        return module, step
    else:
        module = hf_block(E, k, H, F_, dtype, method.removeprefix("hf_"))

    def step():
        module.zero_grad(set_to_none=True)
        x.grad = None
        y = module(x) if method != "dense" else module(x[0]).unsqueeze(0)
        y.backward(dy)

    return module, step


def flops(shape) -> float:
    E, k, H, F_, T = SHAPES[shape]
    return 18.0 * T * k * H * F_


# ----------------------------------------------------------------------------- memory


def memory_worker(method, shape, dtype_name) -> dict:
    module, step = build(method, shape, DTYPES[dtype_name])
    step()  # warm-up: lazy inits, kernel caches
    module.zero_grad(set_to_none=True)
    grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    return {"peak_MB": peak_rss_mib(step), "grads_MB": grad_bytes / 2**20}


def measure_memory(method, shape, dtype_name) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    out = subprocess.run([sys.executable, __file__, "--memory-worker", method, shape, dtype_name],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- timing


def time_shape(shape, dtype_name, rounds, methods, eager_rounds) -> dict:
    steps = {m: build(m, shape, DTYPES[dtype_name])[1] for m in methods}
    for s in steps.values():
        s()  # warm-up
    times = {m: [] for m in methods}
    cpu = {m: [] for m in methods}
    for r in range(rounds):
        for m in methods:  # interleaved: a slow spell on the shared CPU hits every method
            if m == "hf_eager" and r >= eager_rounds:
                continue
            t0, c0 = time.perf_counter(), time.process_time()
            steps[m]()
            times[m].append(time.perf_counter() - t0)
            cpu[m].append(time.process_time() - c0)
    return ({m: statistics.median(ts) for m, ts in times.items()},
            {m: statistics.median(cs) for m, cs in cpu.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--eager-rounds", type=int, default=1,
                    help="rounds for hf_eager (5-50x slower than the others; keeps the run ~4 min)")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--malloc", choices=("retain", "system"), default="retain",
                    help="retain: keep freed memory for reuse (meshfold.runtime.malloc); system: glibc default")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--dtypes", nargs="*", default=list(DTYPES))
    ap.add_argument("--methods", nargs="*", default=list(METHODS))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "moe_layer.json"))
    ap.add_argument("--memory-worker", nargs=3, metavar=("METHOD", "SHAPE", "DTYPE"))
    args = ap.parse_args()
    if args.memory_worker:
        print(json.dumps(memory_worker(*args.memory_worker)))
        return

    if args.malloc == "retain" and not retain_freed_memory():
        sys.exit("--malloc retain needs glibc; use --malloc system")
    t_start = time.perf_counter()
    rows = []
    for shape in args.shapes:
        E, k, H, F_, T = SHAPES[shape]
        for dt in args.dtypes:
            med, cpu = time_shape(shape, dt, args.rounds, args.methods, args.eager_rounds)
            mem = {} if args.no_memory else {m: measure_memory(m, shape, dt) for m in args.methods
                                             if m != "experts_only"}  # its rows are inputs, not comparable
            for m in args.methods:
                row = {"shape": shape, "E": E, "k": k, "H": H, "F": F_, "T": T, "dtype": dt, "method": m,
                       "ms": med[m] * 1e3, "tokens_per_s": T / med[m], "GFLOPs": flops(shape) / med[m] / 1e9,
                       "vs_dense": med["dense"] / med[m] if "dense" in med else None,
                       "cpu_ms": cpu[m] * 1e3,
                       "vs_dense_cpu": cpu["dense"] / cpu[m] if "dense" in cpu else None}
                if m in mem:
                    row.update(mem[m])
                    d = mem.get("dense")
                    if d:
                        row["peak_vs_dense"] = mem[m]["peak_MB"] / d["peak_MB"]
                        row["peak_minus_grads_vs_dense"] = ((mem[m]["peak_MB"] - mem[m]["grads_MB"])
                                                            / (d["peak_MB"] - d["grads_MB"]))
                rows.append(row)
                print_row(row, header=len(rows) == 1)
    elapsed = time.perf_counter() - t_start
    meta = {"command": "python " + " ".join(sys.argv), "rounds": args.rounds, "malloc": args.malloc,
            "eager_rounds": args.eager_rounds, "seconds": elapsed,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor(),
            "flops_counted": "expert GEMMs, 18*T*k*H*F per fwd+bwd"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"\n{elapsed:.0f} s; wrote {args.out}")


def print_row(r, header=False):
    if header:
        print("| shape | dtype | method | ms | tokens/s | GFLOP/s | vs dense | CPU ms | vs dense (CPU) | peak MB "
              "| grads MB | peak/dense | (peak-grads)/dense |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    print(f"| {r['shape']} | {r['dtype']} | {r['method']} | {r['ms']:.1f} | {r['tokens_per_s']:.0f} | "
          f"{r['GFLOPs']:.1f} | {f(r['vs_dense'])} | {r['cpu_ms']:.1f} | {f(r['vs_dense_cpu'])} | "
          f"{f(r.get('peak_MB'), 1)} | {f(r.get('grads_MB'), 1)} | "
          f"{f(r.get('peak_vs_dense'))} | {f(r.get('peak_minus_grads_vs_dense'))} |", flush=True)


if __name__ == "__main__":
    main()
