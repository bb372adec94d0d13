"""One MoE layer, forward + backward, single process: meshfold vs a dense GEMM chain vs torchtitan and Hugging Face.

    python benchmarks/bench_moe_layer.py --no-memory     # both shapes, fp32 + bf16, every method
    python benchmarks/bench_moe_layer.py --quick --rounds 3 --no-memory   # smaller shapes, ~1 min
    python benchmarks/bench_moe_layer.py --malloc system    # glibc's default allocator policy
    python benchmarks/bench_moe_layer.py --no-torchtitan    # without the torchtitan rows

Legend: T = tokens, H = hidden, F = expert ffn, E = experts, k = top-k.

Shapes: ``fine`` H 1024, F 512, E 64, top-8 and ``coarse`` H 1024, F 3584, E 8, top-2, both at
T = 4096 (``--quick``: H 512 and T 2048 / 4096 with smaller F, for a fast look).

Methods, all at the same shape and dtype, timed interleaved (one step of each per round, the
order reversed every other round; medians over rounds are reported):

* ``dense``: the baseline, a dense SwiGLU chain of equal FLOPs,
  ``x [T, H] @ W1 [H, 2kF] -> silu(gate) * up -> @ W2 [kF, H]``: the k expert FFNs every token
  visits, fused into one GEMM pair (no routing, no permutation).
* ``meshfold``: ``MoELayer`` (fp32 router, dropless, grouped GEMM through meshfold.kernels).
* ``meshfold_fused``: the same layer with ``fused_rows`` (what ``train.compile`` sets): the
  combine and the permute's backward as compiled one-pass loops (meshfold.kernels.combine).
* ``experts_only``: the ceiling of ``meshfold``: exactly the expert computation it runs
  (``meshfold.kernels.expert_ffn``: grouped GEMM, SwiGLU, grouped GEMM, and their backward
  with the gradients of the rows and of both weights) on rows already permuted, with the same
  per-expert row counts as meshfold's routing of the same input. No router, no permute, no
  combine: the fraction of dense it reaches is what the grouped expert GEMMs allow at this shape.
* ``titan``: torchtitan's ``MoE`` (``torchtitan.models.common.moe``, PyPI 0.3.0) with its
  ``LocalTokenDispatcher`` (argsort, gather, ``scatter_add`` combine), as shipped: its
  ``GroupedExperts`` casts rows and weights to bf16 for ``torch._grouped_mm`` whatever the model
  dtype (so its fp32 rows compute the experts in bf16), and its router asks for an fp32
  autocast, which CPU autocast does not support: on CPU the gate runs in the model dtype.
* ``titan_nocast`` (fp32 only): the same module with those bf16 casts removed (experts in the
  model dtype; the same three ``torch._grouped_mm`` calls), the fair fp32 comparison.
* ``hf_eager`` / ``hf_grouped_mm``: transformers' ``MixtralSparseMoeBlock`` with
  ``experts_implementation`` "eager" (a Python loop over the experts hit) or "grouped_mm"
  (sort + ``F.grouped_mm``). Its router runs in the model dtype.

hf_eager and both torchtitan methods run 5-50x slower than the rest on CPU (torchtitan hands
``torch._grouped_mm`` its [E, F, H] weights transposed, and its combine is a deterministic
``scatter_add``), so they are timed in only ``--slow-rounds`` rounds (default 1, after a warm-up).

Every layer has the same weights (HF's, copied into meshfold and torchtitan), so in fp32 they
route identically. Before timing, each method's output for the same input is compared with
meshfold's: ``rel_err`` = ||y - y_meshfold|| / ||y_meshfold||, which must stay within
``AGREE_TOL`` (1e-4 for fp32 peers that compute in fp32; 3e-2 where bf16 rounds the experts or
the router, where a near-tie may also route a few tokens differently: 6e-2); a larger error stops the
run. torchtitan is not a dependency: point ``--torchtitan-path`` (or the environment variable
``MESHFOLD_TORCHTITAN_PATH``) at a directory it is installed into, e.g.
``pip install --no-deps --target DIR torchtitan==0.3.0 spmd-types==0.2.3 tyro`` (the modules its
MoE imports); without it the run stops and says so, unless ``--no-torchtitan``.

FLOPs counted: the expert GEMMs only, ``18 T k H F`` per forward + backward (3 GEMMs of
``2 T k H F`` each way, x3 for fwd + bwd), identical for every method; the router (``6 T H E``)
is left out. ``vs_dense`` = dense time / method time = the fraction of the dense chain's FLOP/s
(median over rounds of the per-round ratio). ``mf_speedup`` = method time / meshfold time (per
round, median): how many times faster meshfold runs than that method.
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

SLOW = ("hf_eager", "titan", "titan_nocast")  # timed in --slow-rounds rounds only
# name -> (E, k, H, F, T)
SHAPES = {
    "coarse E8 top2": (8, 2, 1024, 3584, 4096),
    "fine E64 top8": (64, 8, 1024, 512, 4096),
}
QUICK_SHAPES = {  # --quick: the same expert counts and top-k, a quarter to an eighth of the FLOPs
    "coarse E8 top2": (8, 2, 512, 1024, 4096),
    "fine E64 top8": (64, 8, 512, 256, 2048),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
METHODS = ("dense", "meshfold", "meshfold_fused", "experts_only", "titan", "titan_nocast", "hf_eager", "hf_grouped_mm")
TITAN_METHODS = ("titan", "titan_nocast")
PEERS = ("titan", "titan_nocast", "hf_grouped_mm", "hf_eager", "meshfold_fused")  # outputs compared with meshfold's
TITAN_ENV = "MESHFOLD_TORCHTITAN_PATH"
TITAN_INSTALL = ("pip install --no-deps --target DIR torchtitan==0.3.0 spmd-types==0.2.3 tyro, then "
                 f"--torchtitan-path DIR or {TITAN_ENV}=DIR (or --no-torchtitan to leave it out)")


def agree_tol(method: str, dtype_name: str) -> float:
    """Largest ||y - y_meshfold|| / ||y_meshfold|| accepted: fp32 peers computing in fp32 must
    match to fp32 rounding; bf16 experts (and a bf16 router, whose near-ties may route a few
    tokens elsewhere) to bf16's."""
    return 1e-4 if dtype_name == "fp32" and method != "titan" else 6e-2


def use_torchtitan(path: str | None) -> None:
    """Make torchtitan importable from ``path`` (appended to sys.path, so that its directory's
    own copies of common packages never shadow this environment's), or stop naming how to."""
    if path:
        if not Path(path).is_dir():
            sys.exit(f"--torchtitan-path {path!r} is not a directory; {TITAN_INSTALL}")
        sys.path.append(path)
    try:
        import torchtitan.models.common.moe  # noqa: F401
    except ImportError as e:
        sys.exit(f"torchtitan is not importable ({e}); {TITAN_INSTALL}")


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


def titan_block(E, k, H, F_, dtype, cast: bool):
    """torchtitan's MoE with HF's weights (so it routes like the other methods). ``cast``: as
    shipped (bf16 experts); otherwise its experts compute in the model dtype."""
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    cfg = MoE.Config(
        num_experts=E, load_balance_coeff=None,  # no aux-loss-free bias, like the other methods
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=H, hidden_dim=F_, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=k)),
        router=TokenChoiceTopKRouter.Config(num_experts=E, gate=Linear.Config(in_features=H, out_features=E),
                                            top_k=k, score_func="softmax", route_norm=True))
    block = cfg.build()
    ref = hf_block(E, k, H, F_, torch.float32, "eager")
    inner = block.routed_experts.inner_experts
    with torch.no_grad():
        block.router.gate.weight.copy_(ref.gate.weight)
        gate_EFH, up_EFH = ref.experts.gate_up_proj.chunk(2, dim=1)  # [E, 2F, H]: gate rows, then up
        inner.w1_EFD.copy_(gate_EFH)
        inner.w3_EFD.copy_(up_EFH)
        inner.w2_EDF.copy_(ref.experts.down_proj)  # [E, H, F]
    if not cast:
        inner.forward = _same_dtype_experts.__get__(inner)
    return block.to(dtype)


def _same_dtype_experts(self, x_RD, num_tokens_per_expert_E):
    """torchtitan ``GroupedExperts.forward`` on one device without its bf16 casts: the same
    three ``torch._grouped_mm`` calls (gate, up, down) in the model dtype."""
    offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    gate = torch._grouped_mm(x_RD, self.w1_EFD.transpose(-2, -1), offs=offsets_E)
    up = torch._grouped_mm(x_RD, self.w3_EFD.transpose(-2, -1), offs=offsets_E)
    return torch._grouped_mm(F.silu(gate) * up, self.w2_EDF.transpose(-2, -1), offs=offsets_E)


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


def build(method, dims, dtype):
    """(module, step, output) where step() runs one forward + backward from fresh gradients and
    output() is the forward's result without gradients (None where not comparable)."""
    E, k, H, F_, T = dims
    x = torch.randn(1, T, H, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
    dy = torch.randn(1, T, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    if method == "dense":
        module = DenseChain(H, F_, k, dtype)
    elif method in ("meshfold", "meshfold_fused"):
        module = meshfold_layer(E, k, H, F_, dtype)
        module.fused_rows = method == "meshfold_fused"
    elif method == "experts_only":
        module, x_NH, dy_NH = experts_only(E, k, H, F_, dtype, x[0].detach())

        def step():
            module.zero_grad(set_to_none=True)
            x_NH.grad = None
            module(x_NH).backward(dy_NH)

        return module, step, lambda: None
    elif method in TITAN_METHODS:
        module = titan_block(E, k, H, F_, dtype, cast=method == "titan")
    else:
        module = hf_block(E, k, H, F_, dtype, method.removeprefix("hf_"))

    def step():
        module.zero_grad(set_to_none=True)
        x.grad = None
        y = module(x) if method != "dense" else module(x[0]).unsqueeze(0)
        y.backward(dy)

    def output():
        if method == "dense":
            return None
        with torch.no_grad():
            return module(x)

    return module, step, output


def flops(dims) -> float:
    E, k, H, F_, T = dims
    return 18.0 * T * k * H * F_


# ----------------------------------------------------------------------------- memory


def memory_worker(method, dims, dtype_name) -> dict:
    module, step, _ = build(method, dims, DTYPES[dtype_name])
    step()  # warm-up: lazy inits, kernel caches
    module.zero_grad(set_to_none=True)
    grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    return {"peak_MB": peak_rss_mib(step), "grads_MB": grad_bytes / 2**20}


def measure_memory(method, dims, dtype_name, titan_path) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    if titan_path:
        env[TITAN_ENV] = titan_path
    out = subprocess.run([sys.executable, __file__, "--memory-worker", method, json.dumps(dims), dtype_name],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- timing


def check_agreement(outputs: dict, dtype_name: str) -> dict:
    """{method: rel_err} of every peer's output against meshfold's; stops the run past
    :func:`agree_tol` (a benchmark of layers that compute different things measures nothing)."""
    ref = outputs.get("meshfold")
    errors = {}
    for m, y in outputs.items():
        if m not in PEERS or y is None or ref is None:
            continue
        errors[m] = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
        if errors[m] > agree_tol(m, dtype_name):
            sys.exit(f"{m} ({dtype_name}) disagrees with meshfold: rel_err {errors[m]:.2e} > "
                     f"{agree_tol(m, dtype_name):.0e}")
    return errors


def time_shape(dims, dtype_name, rounds, methods, eager_rounds) -> tuple[dict, dict, dict]:
    """({method: [wall s per round]}, {method: [CPU s per round]}, {method: rel_err})."""
    built = {m: build(m, dims, DTYPES[dtype_name]) for m in methods}
    errors = check_agreement({m: b[2]() for m, b in built.items()}, dtype_name)
    steps = {m: b[1] for m, b in built.items()}
    for s in steps.values():
        s()  # warm-up
    times = {m: [] for m in methods}
    cpu = {m: [] for m in methods}
    for r in range(rounds):
        order = methods if r % 2 == 0 else methods[::-1]
        for m in order:  # interleaved: a slow spell on the shared CPU hits every method
            if m in SLOW and r >= eager_rounds:
                continue
            t0, c0 = time.perf_counter(), time.process_time()
            steps[m]()
            times[m].append(time.perf_counter() - t0)
            cpu[m].append(time.process_time() - c0)
    return times, cpu, errors


def ratio(num: list, den: list) -> float | None:
    """Median over the rounds both ran of num / den (per-round ratios: both saw the same load)."""
    pairs = list(zip(num, den))
    return statistics.median(a / b for a, b in pairs) if pairs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--slow-rounds", dest="eager_rounds", type=int, default=1,
                    help=f"rounds for {', '.join(SLOW)} (5-50x slower than the others on CPU)")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--quick", action="store_true", help="smaller shapes (QUICK_SHAPES)")
    ap.add_argument("--malloc", choices=("retain", "system"), default="retain",
                    help="retain: keep freed memory for reuse (meshfold.runtime.malloc); system: glibc default")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--dtypes", nargs="*", default=list(DTYPES))
    ap.add_argument("--methods", nargs="*", default=list(METHODS))
    ap.add_argument("--torchtitan-path", default=os.environ.get(TITAN_ENV),
                    help=f"directory torchtitan 0.3.0 is installed into (default: ${TITAN_ENV})")
    ap.add_argument("--no-torchtitan", action="store_true", help="leave the torchtitan methods out")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "moe_layer.json"))
    ap.add_argument("--memory-worker", nargs=3, metavar=("METHOD", "DIMS", "DTYPE"))
    args = ap.parse_args()
    for name, valid in (("shapes", SHAPES), ("dtypes", DTYPES), ("methods", METHODS)):
        bad = [v for v in getattr(args, name) if v not in valid]
        if bad:
            sys.exit(f"--{name} {bad}: valid: {', '.join(valid)}")
    methods = [m for m in args.methods if not (args.no_torchtitan and m in TITAN_METHODS)]
    if any(m in TITAN_METHODS for m in methods):
        use_torchtitan(args.torchtitan_path)
    if args.memory_worker:
        method, dims, dt = args.memory_worker
        print(json.dumps(memory_worker(method, tuple(json.loads(dims)), dt)))
        return

    if args.malloc == "retain" and not retain_freed_memory():
        sys.exit("--malloc retain needs glibc; use --malloc system")
    shapes = QUICK_SHAPES if args.quick else SHAPES
    t_start = time.perf_counter()
    rows = []
    for shape in args.shapes:
        dims = shapes[shape]
        E, k, H, F_, T = dims
        for dt in args.dtypes:
            ms = [m for m in methods if not (m == "titan_nocast" and dt != "fp32")]  # bf16: = titan
            times, cpu, errors = time_shape(dims, dt, args.rounds, ms, args.eager_rounds)
            mem = {} if args.no_memory else {m: measure_memory(m, dims, dt, args.torchtitan_path) for m in ms
                                             if m != "experts_only"}  # its rows are inputs, not comparable
            for m in ms:
                med = statistics.median(times[m])
                row = {"shape": shape, "E": E, "k": k, "H": H, "F": F_, "T": T, "dtype": dt, "method": m,
                       "ms": med * 1e3, "tokens_per_s": T / med, "GFLOPs": flops(dims) / med / 1e9,
                       "vs_dense": ratio(times["dense"], times[m]) if "dense" in times else None,
                       "mf_speedup": ratio(times[m], times["meshfold"]) if "meshfold" in times else None,
                       "cpu_ms": statistics.median(cpu[m]) * 1e3,
                       "vs_dense_cpu": ratio(cpu["dense"], cpu[m]) if "dense" in cpu else None,
                       "rel_err": errors.get(m), "tol": agree_tol(m, dt) if m in errors else None,
                       "rounds": len(times[m])}
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
            "eager_rounds": args.eager_rounds, "seconds": elapsed, "quick": args.quick,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor(),
            "loadavg_end": os.getloadavg(),
            "flops_counted": "expert GEMMs, 18*T*k*H*F per fwd+bwd"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"\n{elapsed:.0f} s, load average at the end {os.getloadavg()}; wrote {args.out}")


def print_row(r, header=False):
    if header:
        print("| shape | dtype | method | ms | GFLOP/s | vs dense | meshfold speedup | rel err (tol) | CPU ms "
              "| vs dense (CPU) | peak MB | grads MB | peak/dense | (peak-grads)/dense |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    err = "-" if r["rel_err"] is None else f"{r['rel_err']:.1e} ({r['tol']:.0e})"
    print(f"| {r['shape']} | {r['dtype']} | {r['method']} | {r['ms']:.1f} | "
          f"{r['GFLOPs']:.1f} | {f(r['vs_dense'])} | {f(r['mf_speedup'])} | {err} | {r['cpu_ms']:.1f} | "
          f"{f(r['vs_dense_cpu'])} | "
          f"{f(r.get('peak_MB'), 1)} | {f(r.get('grads_MB'), 1)} | "
          f"{f(r.get('peak_vs_dense'))} | {f(r.get('peak_minus_grads_vs_dense'))} |", flush=True)


if __name__ == "__main__":
    from meshfold.runtime.machine import print_machine

    print_machine()  # the CPU and its bf16 instructions: a timing means nothing without them
    main()
