"""bf16 compute over fp32 master weights against pure fp32: a folded training step on CPU ranks.

    python benchmarks/bench_mixed_precision.py                 # both shapes, about 2 minutes
    python benchmarks/bench_mixed_precision.py --rounds 9 --shapes "fine E64 top8"

Model: Mixtral-style, vocab 256, hidden 256, 2 MoE layers, 8 heads / 4 KV heads, untied head;
MoE shapes as bench_moe_layer.py's at half the hidden size, equal expert FLOPs per token:
coarse = 8 experts of ffn 512, top-2; fine = 64 experts of ffn 128, top-8. Global batch 8 x 256.

Fold: 2 gloo ranks (one thread each, on this machine's cores), attention dp2, experts ep2, FSDP2
(``parallelize``), AdamW. Per shape, each rank builds three models with the same weights: pure
fp32 (the baseline), bf16 compute over fp32 masters (``compute_dtype=bfloat16``: FSDP2's
MixedPrecisionPolicy, fp32 reduce-scatter) and, for reference, pure bf16 (bf16 masters). Each
round runs one training step of each, in rotating order, so all saw the same load; reported:
tokens/s of the median step (slowest rank) and the median of the per-round ratios to fp32.
Memory, per rank (max over ranks), in a process whose glibc maps blocks >= 64 KiB (freed
tensors leave the resident set): ``step peak`` = VmHWM - VmRSS before one step after a warm-up
(activations, temporaries, the compute-dtype copies FSDP2 gathers, the gradients re-created),
and ``state`` = bytes of this rank's parameter shards + gradients + AdamW moments.

Writes benchmarks/results/mixed_precision.json; prints a markdown table.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshfold import FoldSpec, fold  # noqa: E402
from meshfold.runtime.launch import spawn  # noqa: E402
from meshfold.models import MoETransformer, get_config  # noqa: E402
from meshfold.parallel.transformer import parallelize  # noqa: E402
from meshfold.parallel.batch import shard_batch  # noqa: E402
from peak_rss import peak_rss_mib  # noqa: E402  (benchmarks/peak_rss.py)

B, S = 8, 256
SHAPES = {"coarse E8 top2": (8, 2, 512), "fine E64 top8": (64, 8, 128)}  # experts, top-k, expert ffn
# name -> (master dtype, compute dtype); the first is the baseline
PRECISIONS = {"fp32": (torch.float32, None), "bf16 + fp32 master": (torch.float32, torch.bfloat16),
              "pure bf16": (torch.bfloat16, None)}


def model_config(shape: str):
    E, k, ffn = SHAPES[shape]
    base = get_config("tiny-mixtral")
    moe = replace(base.moe, hidden=256, ffn=ffn, num_experts=E, topk=k)
    return replace(base, hidden=256, layers=2, heads=8, kv_heads=4, head_dim=32, ffn=512, moe=moe, max_seq=S)


def _state_mib(model, opt) -> float:
    n = 0
    for p in model.parameters():
        local = p.to_local()
        n += 2 * local.numel() * local.element_size()  # the shard and its gradient
        n += sum(v.to_local().numel() * v.element_size() for k, v in opt.state[p].items() if k != "step")
    return n / 2 ** 20


def worker(rank, world_size, shape: str, rounds: int) -> dict:
    import torch.distributed as dist

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: freed tensors go back to the OS
    torch.set_num_threads(1)
    spec = FoldSpec(world_size, ep=world_size)
    folded = fold(spec)
    cfg = model_config(shape)
    stream = torch.randint(0, 256, (B, S + 1), generator=torch.Generator().manual_seed(0))
    lt, pos = shard_batch(stream[:, :-1].contiguous(), spec, rank)
    ltg, _ = shard_batch(stream[:, 1:].contiguous(), spec, rank)
    runs = {}
    for name, (master, compute) in PRECISIONS.items():
        torch.manual_seed(0)
        model = parallelize(MoETransformer(cfg, dtype=master), folded, compute_dtype=compute)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        runs[name] = (model, opt)

    def step(name):
        model, opt = runs[name]
        model.loss(lt, ltg, pos).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    out = {}
    for name in PRECISIONS:
        step(name)  # warm-up: AdamW state, gloo buffers
        peak = peak_rss_mib(lambda: step(name))
        out[name] = dict(step_peak_mib=peak, state_mib=_state_mib(*runs[name]), times=[])
    names = list(PRECISIONS)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate who goes first
            dist.barrier()
            t0 = time.perf_counter()
            step(name)
            slowest = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            out[name]["times"].append(slowest.item())
    return out


def run(shape: str, rounds: int, world_size: int) -> dict:
    ranks = spawn(worker, world_size, shape, rounds, timeout=900)
    base = ranks[0]["fp32"]["times"]
    rows = []
    for name in PRECISIONS:
        times = ranks[0][name]["times"]
        ratios = [b / t for b, t in zip(base, times)]  # > 1: faster than fp32 in that round
        rows.append(dict(precision=name, step_s=statistics.median(times), tokens_per_s=B * S / statistics.median(times),
                         speed_vs_fp32=statistics.median(ratios), speed_range=(min(ratios), max(ratios)),
                         step_peak_mib=max(r[name]["step_peak_mib"] for r in ranks),
                         state_mib=max(r[name]["state_mib"] for r in ranks), times=times))
    fp32 = rows[0]
    for r in rows:
        r["step_peak_vs_fp32"] = r["step_peak_mib"] / fp32["step_peak_mib"]
    return dict(shape=shape, experts_topk_ffn=SHAPES[shape], rows=rows)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="timed steps per precision")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    ap.add_argument("--world-size", type=int, default=2)
    args = ap.parse_args()
    t0 = time.perf_counter()
    flags = Path("/proc/cpuinfo").read_text()
    res = dict(torch=torch.__version__, cpu=cpu_model(), cpu_count=os.cpu_count(), batch=B, seq=S,
               fold=f"{args.world_size} ranks: attn dp{args.world_size} | moe ep{args.world_size}, FSDP2",
               bf16_isa=[f for f in ("avx512_bf16", "amx_bf16") if f in flags],
               shapes=[run(s, args.rounds, args.world_size) for s in args.shapes.split(",")])
    res["wall_s"] = time.perf_counter() - t0
    print(f"\n{res['fold']}, global batch {B} x {S}, 1 thread per rank; {res['cpu']} "
          f"({res['cpu_count']} CPUs; bf16 instructions: {', '.join(res['bf16_isa']) or 'none'}); torch {res['torch']}")
    print("| shape | precision | step (s) | tokens/s | speed vs fp32 (range) | step peak (MiB) | vs fp32 | "
          "state (MiB) |\n|---|---|---:|---:|---:|---:|---:|---:|")
    for s in res["shapes"]:
        for r in s["rows"]:
            lo, hi = r["speed_range"]
            print(f"| {s['shape']} | {r['precision']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                  f"{r['speed_vs_fp32']:.2f} ({lo:.2f}-{hi:.2f}) | {r['step_peak_mib']:.0f} | "
                  f"{r['step_peak_vs_fp32']:.2f} | {r['state_mib']:.1f} |")
    out = ROOT / "benchmarks" / "results" / "mixed_precision.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"\nwrote {out.relative_to(ROOT)} ({res['wall_s']:.0f} s)")


if __name__ == "__main__":
    from meshfold.runtime.machine import print_machine

    print_machine()  # the CPU and its bf16 instructions: a timing means nothing without them
    main()
