"""How big a model ``meshfold train`` can start on 4 ranks: per-rank peak memory at construction
and during a training step, whole-first (the old way) vs built on meta and materialized by shard.

    python benchmarks/bench_construction.py                  # 113M and 428M on 4 ranks, 113M on 8
    python benchmarks/bench_construction.py --sizes 113M --ranks 4

gloo ranks on this machine: 4 with fold ``dp2 x tp2 | ep4`` (``meshfold train``'s default
layout), 8 with ``dp4 x tp2 | ep8``;
FSDP2, fp32, AdamW. Model: Mixtral-style, vocab 8192, hidden 512, 16 experts of ffn 1024, top-2,
4 layers (113M) or 16 layers (428M). Each rank, in a process whose glibc maps big blocks (freed
tensors leave the resident set): a small model is built and stepped first (code and caches
loaded), then ``peak_rss_mib`` (:mod:`peak_rss`) of (1) construction -- ``MoETransformer(cfg)``
then ``parallelize`` ("whole", what ``meshfold train`` did before) or
``MoETransformer(cfg, device="meta")`` then ``parallelize`` ("meta", now) -- and (2) one
training step (8 x 128 tokens, forward + backward + AdamW, whose states are created here),
measured from the RSS before construction. Reported against the whole model's fp32 bytes.

"Largest model" extrapolates, per mode, the measured bytes per parameter per rank (the larger of
construction and step, from the largest size run) to the memory this machine has available for
the 4 ranks (MemAvailable at start, minus each rank's resident baseline).

Writes benchmarks/results/construction.json; prints a markdown table.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

SIZES = {"113M": 4, "428M": 16}  # name -> layers


def _config(layers: int, small: bool = False):
    from meshfold.models import MoEConfig
    from meshfold.models.transformer import TransformerConfig

    h, f, v = (64, 64, 64) if small else (512, 1024, 8192)
    return TransformerConfig(vocab=v, hidden=h, layers=layers, heads=8, ffn=f,
                             moe=MoEConfig(hidden=h, ffn=f, num_experts=16, topk=2))


def _rank(rank, world_size, layers, mode):
    import torch

    from meshfold.mesh import FoldSpec, fold
    from meshfold.models.transformer import MoETransformer
    from meshfold.parallel.transformer import parallelize
    from meshfold.parallel.batch import shard_batch
    from peak_rss import _status_kib, peak_rss_mib

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD: big blocks are mmapped
    torch.set_num_threads(1)
    spec = FoldSpec(world_size, tp=2, ep=world_size)
    folded = fold(spec, "cpu")
    box = {}

    def build(cfg):
        box["model"] = parallelize(MoETransformer(cfg, device="meta" if mode == "meta" else None, seed=0), folded)
        box["opt"] = torch.optim.AdamW(box["model"].parameters(), lr=1e-4, foreach=False)

    def step(cfg):
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.vocab, (8, 128), generator=g)
        local, pos = shard_batch(tokens, spec, rank)
        box["model"].loss(local, local, pos).backward()
        box["opt"].step()
        box["opt"].zero_grad(set_to_none=True)

    small = _config(2, small=True)
    build(small)
    step(small)
    box.clear()
    cfg = _config(layers)
    base = _status_kib("VmRSS:") / 1024
    construct = peak_rss_mib(lambda: build(cfg))
    after_build = _status_kib("VmRSS:") / 1024
    stepped = peak_rss_mib(lambda: step(cfg)) + after_build - base
    n = sum(p.numel() for p in MoETransformer(cfg, device="meta").parameters())
    return {"construct_mib": construct, "step_mib": stepped, "baseline_mib": base,
            "whole_fp32_mib": 4 * n / 2 ** 20, "params": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--ranks", nargs="+", type=int, default=[4, 8], choices=[4, 8])
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from meshfold.runtime.launch import spawn

    avail_mib = next(int(line.split()[1]) for line in open("/proc/meminfo")
                     if line.startswith("MemAvailable:")) / 1024
    rows = []
    for world in args.ranks:
        for size in args.sizes if world == 4 else args.sizes[:1]:
            for mode in ("whole", "meta"):
                ranks = spawn(_rank, world, SIZES[size], mode, timeout=900)
                worst = max(ranks, key=lambda r: max(r["construct_mib"], r["step_mib"]))
                rows.append({"ranks": world, "size": size, "mode": mode, **worst})
                print(f"{world} ranks {size} {mode}: {worst}", flush=True)
    largest = {}
    for world in args.ranks:
        for mode in ("whole", "meta"):
            r = [x for x in rows if x["mode"] == mode and x["ranks"] == world][-1]
            per_param = max(r["construct_mib"], r["step_mib"]) / r["params"]  # MiB per parameter per rank
            largest[f"{world} ranks {mode}"] = (avail_mib - world * r["baseline_mib"]) / (world * per_param)
    out = {"cpu": platform.processor() or platform.machine(), "mem_available_mib": avail_mib,
           "rows": rows, "largest_params": largest}
    Path(__file__).with_name("results").mkdir(exist_ok=True)
    Path(__file__).with_name("results").joinpath("construction.json").write_text(json.dumps(out, indent=1))
    print("\n| ranks | model | mode | whole fp32 MiB | construction peak MiB (x whole) | step peak MiB (x whole) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        w = r["whole_fp32_mib"]
        print(f"| {r['ranks']} | {r['size']} | {r['mode']} | {w:.0f} | {r['construct_mib']:.0f} ({r['construct_mib'] / w:.2f}x) "
              f"| {r['step_mib']:.0f} ({r['step_mib'] / w:.2f}x) |")
    for world in args.ranks:
        before, after = largest[f"{world} ranks whole"], largest[f"{world} ranks meta"]
        print(f"largest model startable on {world} ranks here ({avail_mib / 1024:.1f} GiB available): "
              f"whole-first {before / 1e6:.0f}M, meta {after / 1e6:.0f}M parameters ({after / before:.2f}x)")


if __name__ == "__main__":
    from meshfold.runtime.machine import print_machine

    print_machine()  # the CPU and its bf16 instructions: a timing means nothing without them
    main()
