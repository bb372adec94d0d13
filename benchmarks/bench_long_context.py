"""Per-rank activation memory, step peak and step time against sequence length, cp and recomputation.

    python benchmarks/bench_long_context.py                          # S 2k 8k 16k, cp 1 2 4, every recompute mode
    python benchmarks/bench_long_context.py --seqs 32768 --cps 4 --recompute full
    python benchmarks/bench_long_context.py --ep 1 --recompute none   # experts replicated: cp alone
    python benchmarks/bench_long_context.py --seqs 8192 --recompute none --capacity-factor 1.0   # bounded routing
    python benchmarks/bench_long_context.py --seqs 32768 --cps 4 --recompute selective --steps 2  # one step fewer
    PYTHONPATH=/path/to/old/checkout python benchmarks/bench_long_context.py --label before

One training step (forward, backward) of a small MoE transformer on ``cp`` gloo ranks (fold
``cp`` x ``ep = cp``, or ``ep = 1`` with ``--ep 1``; FSDP2, fp32, one sequence of S tokens), for
each S, cp and ``recompute`` mode the code under test offers (a checkout without
``parallelize(recompute=)`` runs ``none`` only, so the same script measures the code before and
after). A dispatch mode (:class:`StoragePeak`) follows every storage the step creates until it is
freed (``benchmarks/storage_peak.py``), exact and independent of the allocator, so ratios
between runs mean something at any load. It splits them into model state (what FSDP2 gathers, reshards and reduce-scatters: weights
and their gradients, which do not shrink with cp) and activations (everything else). Per rank:

* ``activation MiB``: the largest sum of activation bytes alive at once during the step (what
  the forward keeps for backward, each op's working set, the gradients of activations): the
  quantity context parallelism and recomputation are about. Reported for the worst rank and as the mean over ranks
  (with ``ep = cp`` the worst rank is the one whose experts the router favours: dropless
  experts compute every token routed to them; ``--capacity-factor`` bounds them, as a real run
  does, and the JSON then holds each layer's dropped fraction).
* ``kept MiB``: activation bytes alive when the forward returns (saved for backward, the loss).
* ``step peak MiB``: the largest sum of all tracked bytes (activations + model state) alive at
  once, as the earlier ``tracked peak`` (which counted FSDP2's resharded weights as alive until
  the end of the step), and ``model state at peak``.
* ``largest tensor``: the biggest single allocation, in elements (JSON only).
* ``rss MiB``: the resident set the timed step added at its peak (``peak_rss``, JSON only).
* ``step s``: wall time of the second step (the first one warms caches), worst rank, on a
  machine shared with other tenants: compare within one run only. ``step CPU s``: the CPU time
  the rank's process spent in that step (one compute thread), which other tenants' load
  inflates far less than the wall time: the recompute modes' cost is read from it. The first
  step's are in the JSON too (``first_step_s``, ``first_step_cpu_s``); ``--steps 2`` skips the
  second step and reports the first one's time (one-time costs included) where a step takes
  a minute: the memory figures come from the tracked step either way.

The JSON (``benchmarks/results/long_context_<label>.json``) also holds, per point, each rank's
activation MiB and the largest groups (op, shape) alive at the worst rank's activation peak.

Model: vocab 256, hidden 256, 2 layers (``--layers``), 8 query heads over 2 key/value heads (GQA) of dim 32,
qk-norm, 8 experts of ffn 256, top-2, dropless unless ``--capacity-factor`` (sub-sequence dropping,
policy probs: each rank keeps at most ``ceil(cf * T * k / E)`` of its T tokens' pairs per expert, so
the rows a rank's experts receive are at most cf times a balanced share). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import ctypes
import inspect
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from storage_peak import StoragePeak  # noqa: E402

MODES = ("none", "selective", "full")
MIB = 2 ** 20


def _config(layers: int = 2, capacity_factor: float | None = None):
    from meshfold.models import MoEConfig
    from meshfold.models.transformer import TransformerConfig

    return TransformerConfig(vocab=256, hidden=256, layers=layers, heads=8, kv_heads=2, head_dim=32, qk_norm=True,
                             moe=MoEConfig(hidden=256, ffn=256, num_experts=8, topk=2,
                                           capacity_factor=capacity_factor))


def _timed(fn) -> tuple[float, float]:
    """(wall s, CPU s of this process) of ``fn()``."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def _rank(rank, world_size, S, recompute, ep, layers=2, capacity_factor=None, steps=3):
    import torch

    from meshfold.mesh import FoldSpec, fold
    from meshfold.models.transformer import MoETransformer
    from meshfold.parallel.transformer import parallelize
    from meshfold.parallel.batch import shard_batch
    from peak_rss import peak_rss_mib

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD: freed blocks leave the RSS
    torch.set_num_threads(1)
    spec = FoldSpec(world_size, cp=world_size, ep=world_size if ep == "cp" else int(ep))
    folded = fold(spec, "cpu")
    cfg = _config(layers, capacity_factor)
    kwargs = {"recompute": recompute} if recompute != "none" else {}
    model = parallelize(MoETransformer(cfg, device="meta", seed=0), folded, **kwargs)
    tokens = torch.randint(0, cfg.vocab, (1, S), generator=torch.Generator().manual_seed(0))
    local, pos = shard_batch(tokens, spec, rank)

    def step():
        model.loss(local, local, pos).backward()

    box = {}
    if steps == 2:  # the first step is the timed one
        rss = peak_rss_mib(lambda: box.update(first=_timed(step)))
        box["timed"] = box["first"]
    else:
        box["first"] = _timed(step)  # warm-up; gradients stay allocated, as in a training step after the first
        rss = peak_rss_mib(lambda: box.update(timed=_timed(step)))
    with StoragePeak(model) as tracked:
        loss = model.loss(local, local, pos)
        kept, _ = tracked.split(tracked.snapshot())  # what the forward keeps for backward
        loss.backward()
        del loss
    _, state = tracked.split(tracked.at_peak)
    # summed over every rank's tokens by the layer, so the same on every rank
    dropped = [float(m.last_metrics["dropped_fraction"]) for m in model.moe_layers()]
    return {"tracked_mib": tracked.peak / MIB, "activation_mib": tracked.activation_peak() / MIB,
            "state_at_peak_mib": state / MIB,
            "kept_mib": kept / MIB, "largest": tracked.largest, "rss_mib": rss, "step_s": box["timed"][0],
            "step_cpu_s": box["timed"][1], "first_step_s": box["first"][0], "first_step_cpu_s": box["first"][1],
            "dropped_fraction_per_layer": dropped,
            "top_at_activation_peak": tracked.top(tracked.at_act_peak)}


def _ratio(x, ref):
    return f" ({x / ref:.2f}x)" if ref else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", nargs="+", type=int, default=[2048, 8192, 16384])
    ap.add_argument("--cps", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--recompute", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--ep", default="cp", choices=["cp", "1"],
                    help="experts over ep = cp ranks (default), or replicated (ep = 1, edp = cp): "
                         "every rank then computes exactly its own tokens' experts")
    ap.add_argument("--layers", type=int, default=2,
                    help="transformer blocks (default 2); with L blocks full recompute keeps L block inputs "
                         "and, in backward, one block's working set, so its peak falls towards 1/L of none's")
    ap.add_argument("--capacity-factor", type=float, default=None,
                    help="bounded routing: each expert keeps at most ceil(cf * T * k / E) of a rank's T tokens' "
                         "pairs (sub-sequence dropping, highest weights first); default dropless")
    ap.add_argument("--steps", type=int, default=3, choices=[2, 3],
                    help="3 (default): warm-up, timed step, tracked step; 2: the first step is timed "
                         "(with its one-time costs), then the tracked step")
    ap.add_argument("--label", default="after")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from meshfold.runtime.launch import spawn
    from meshfold.parallel.transformer import parallelize

    offered = MODES if "recompute" in inspect.signature(parallelize).parameters else ("none",)
    modes = [m for m in args.recompute if m in offered]
    rows = []
    for S in args.seqs:
        for cp in args.cps:
            for mode in modes:
                t0 = time.perf_counter()
                ranks = spawn(_rank, cp, S, mode, args.ep, args.layers, args.capacity_factor, args.steps,
                              timeout=3600)
                worst = max(ranks, key=lambda r: r["activation_mib"])
                row = {"S": S, "cp": cp, "ep": cp if args.ep == "cp" else 1, "layers": args.layers,
                       "recompute": mode, "capacity_factor": args.capacity_factor, "steps": args.steps, **worst,
                       "tracked_mib": max(r["tracked_mib"] for r in ranks),
                       "activation_mean_mib": sum(r["activation_mib"] for r in ranks) / cp,
                       "activation_per_rank_mib": [r["activation_mib"] for r in ranks],
                       "step_s": max(r["step_s"] for r in ranks),
                       "step_cpu_s": max(r["step_cpu_s"] for r in ranks),
                       "first_step_cpu_s": max(r["first_step_cpu_s"] for r in ranks), "wall_s": time.perf_counter() - t0,
                       "load": os.getloadavg()[0]}
                rows.append(row)
                print({k: v for k, v in row.items() if k != "top_at_activation_peak"}, flush=True)
    out = {"label": args.label, "cpu": _cpu(), "load": os.getloadavg(), "rows": rows}
    results = Path(__file__).with_name("results")
    results.mkdir(exist_ok=True)
    results.joinpath(f"long_context_{args.label}.json").write_text(json.dumps(out, indent=1))
    base = {(r["S"], r["cp"], r["recompute"]): r for r in rows}
    routing = "dropless" if args.capacity_factor is None else f"capacity factor {args.capacity_factor:g}"
    timed = "second step" if args.steps == 3 else "first step"
    print(f"\n{args.label}, {routing}, step times of the {timed} (load {os.getloadavg()[0]:.1f}):")
    print("| S | cp | recompute | activation MiB, worst rank (x cp=1) (x none) | rank mean (x cp=1) | kept MiB "
          "| step peak MiB | model state at peak | step s (x none) (x cp=1) | step CPU s (x none) (x cp=1) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        one = base.get((r["S"], 1, r["recompute"]), {})
        none = base.get((r["S"], r["cp"], "none"), {})
        act = f"{r['activation_mib']:.0f}" + _ratio(r["activation_mib"], one.get("activation_mib")) \
            + _ratio(r["activation_mib"], none.get("activation_mib"))
        mean = f"{r['activation_mean_mib']:.0f}" + _ratio(r["activation_mean_mib"], one.get("activation_mean_mib"))
        t = f"{r['step_s']:.2f}" + _ratio(r["step_s"], none.get("step_s")) + _ratio(r["step_s"], one.get("step_s"))
        c = f"{r['step_cpu_s']:.2f}" + _ratio(r["step_cpu_s"], none.get("step_cpu_s")) \
            + _ratio(r["step_cpu_s"], one.get("step_cpu_s"))
        print(f"| {r['S']} | {r['cp']} | {r['recompute']} | {act} | {mean} | {r['kept_mib']:.0f} | "
              f"{r['tracked_mib']:.0f} | {r['state_at_peak_mib']:.1f} | {t} | {c} |")


def _cpu() -> str:
    try:
        info = dict(map(str.strip, line.split(":", 1)) for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if ":" in line)
        return f"{info['model name']} (family {info['cpu family']}, model {info['model']}), " \
               f"{os.cpu_count()} vCPU"
    except (OSError, KeyError):
        return platform.processor() or platform.machine()


if __name__ == "__main__":
    from meshfold.runtime.machine import print_machine

    print_machine()  # the CPU and its bf16 instructions: a timing means nothing without them
    main()
