"""Context-parallel attention: ring (meshfold.parallel.ring_attention) against the old all-gather +
[S/cp, S] mask path, per rank, at a few sequence lengths; cp = 1 (plain ``is_causal`` SDPA on one
rank) is the baseline, measured in the same run.

One step = forward + backward of the attention core on this rank's queries (q [B, h, S/cp, d],
k / v [B, g, S/cp, d], the load-balanced chunk layout of ``shard_batch``), through the hook
``parallelize`` installs (``RingContext``, method "ring" or "gather"). Reported per rank
(max over ranks): tracked peak memory (``torch.distributed._tools.mem_tracker.MemTracker``, every
tensor the step allocates, inputs included; allocations inside a fused kernel are not seen), the
largest single tensor, and the median step time over ``--reps`` timed steps after one warm-up.

Usage: python benchmarks/bench_ring_attention.py [--seq 2048 8192 16384] [--cp 1 2 4] [--reps 3]
Writes benchmarks/results/ring_attention.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(rank, world_size, seqs, heads, kv_heads, head_dim, reps):
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils._python_dispatch import TorchDispatchMode

    from meshfold.mesh import FoldSpec
    from meshfold.models.attention import CausalMaskCache, attend
    from meshfold.parallel.context import RingContext
    from meshfold.parallel.batch import local_positions
    from meshfold.testing.worlds import cached_fold

    class Largest(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.n = max(self.n, t.numel() * t.element_size())
            return out

    cp = world_size
    spec = FoldSpec(cp, cp=cp)
    mesh = cached_fold(spec).stage("attn") if cp > 1 else None
    rows = []
    for S in seqs:
        pos = local_positions(S, spec, rank)
        s = pos.numel()
        g = torch.Generator().manual_seed(rank)
        q = torch.randn(1, heads, s, head_dim, generator=g)
        k, v, do = (torch.randn(1, n, s, head_dim, generator=g) for n in (kv_heads, kv_heads, heads))
        methods = ["ring", "gather"] if cp > 1 else ["is_causal"]
        for method in methods:
            if cp > 1:
                hook = RingContext(mesh, cp, CausalMaskCache(), method)
                fn = lambda a, b, c: hook(a, b, c, pos)  # noqa: E731
            else:
                fn = attend

            def step():
                a, b, c = (t.detach().requires_grad_() for t in (q, k, v))
                fn(a, b, c).backward(do)

            step()  # warm-up
            mt, largest = MemTracker(), Largest()
            with mt, largest:
                step()
            peak = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
            times = []
            for _ in range(reps):
                if cp > 1:
                    dist.barrier(group=mesh.get_group("cp"))
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            rows.append(dict(seq=S, cp=cp, method=method, peak_mib=peak / 2**20, largest_mib=largest.n / 2**20,
                             step_s=statistics.median(times)))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 8192, 16384])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)

    from meshfold.runtime.launch import spawn

    rows = []
    for cp in args.cp:
        per_rank = spawn(_bench, cp, args.seq, args.heads, args.kv_heads, args.head_dim, args.reps)
        for i, row in enumerate(per_rank[0]):  # max over ranks: the step is as slow as its slowest rank
            rows.append({**row, **{key: max(r[i][key] for r in per_rank) for key in ("peak_mib", "largest_mib", "step_s")}})
    base = {r["seq"]: r for r in rows if r["cp"] == 1}
    print(f"load average {os.getloadavg()[0]:.1f}; B = 1, heads {args.heads} / kv {args.kv_heads}, "
          f"head dim {args.head_dim}, fp32, forward + backward")
    print("| S | cp | path | peak / rank (MiB) | vs cp=1 | largest tensor (MiB) | step (s) | vs cp=1 |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        b = base.get(r["seq"])
        rel_m = f"{r['peak_mib'] / b['peak_mib']:.2f}" if b else "-"
        rel_t = f"{r['step_s'] / b['step_s']:.2f}" if b else "-"
        print(f"| {r['seq']} | {r['cp']} | {r['method']} | {r['peak_mib']:.1f} | {rel_m} | {r['largest_mib']:.1f} "
              f"| {r['step_s']:.3f} | {rel_t} |")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "ring_attention.json")
    with open(out, "w") as f:
        json.dump(dict(args=vars(args), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    from meshfold.runtime.machine import print_machine

    print_machine()  # the CPU and its bf16 instructions: a timing means nothing without them
    sys.exit(main())
