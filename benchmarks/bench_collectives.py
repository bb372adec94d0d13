"""meshfold's all_to_all_v against torch's own all_to_all_single on the same splits.

Measures, on local gloo ranks (CPU):
* overhead ratio: median time of ``meshfold.placements.all_to_all_v`` (checks, autograd wrapper,
  output allocation) over ``torch.distributed.all_to_all_single`` doing the same work (allocate
  the output, then call), run interleaved in the same processes on the same splits (target
  <= 1.1x); also against torch with an output buffer reused across calls (a lower bound no
  variable-size dispatch can use);
* bytes a dispatch really writes to its sockets (``wchar`` of /proc/self/io around one call, so
  gloo's headers count too) against the minimum (rows that really leave their rank), and what a
  padded, equal-split all-to-all (capacity = max split) would send instead.

With ``--even``: the even-split all-gather / reduce-scatter, meshfold's native path against its
all-to-all path (``set_collective_path("native" | "a2a")``) on the same inputs, interleaved in
the same processes, at several row counts: median time (slowest rank) and bytes written to
sockets (all ranks); fp32 gather and scatter, and the bf16 reduce-scatter (native = upcast to
fp32 first, which "auto" does not take).

Usage: python benchmarks/bench_collectives.py [--world-size 4] [--tokens 4096] [--hidden 512]
       python benchmarks/bench_collectives.py --even --world-size 4 --rows 256,2048,8192
Writes benchmarks/results/collectives.json (--even: collectives_even_W.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _written_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar"))


def _bench(rank, world_size, tokens, hidden, reps, skew, seed):
    import torch
    import torch.distributed as dist

    from meshfold import FoldSpec, fold
    from meshfold.placements import all_to_all_v, exchange_splits

    fm = fold(FoldSpec(world_size, ep=world_size))
    g = torch.Generator().manual_seed(seed + rank)
    # Routed tokens: a skewed destination distribution (some ranks get far more rows).
    weights = torch.rand(world_size, generator=g) ** skew
    dest = torch.multinomial(weights / weights.sum(), tokens, replacement=True, generator=g)
    send = torch.bincount(dest, minlength=world_size).tolist()
    recv = exchange_splits(send, fm.moe, "ep")
    x = torch.randn(tokens, hidden, generator=g)
    out = torch.empty(sum(recv), hidden)
    group = fm.moe.get_group("ep")
    times = {"torch": [], "torch_prealloc": [], "meshfold": []}
    order = list(times)
    for i in range(reps + 3):
        for which in order[i % 3:] + order[:i % 3]:  # rotate to share the noise
            dist.barrier(group)
            t0 = time.perf_counter()
            if which == "torch":  # what a caller of torch does: allocate the output, then call
                dist.all_to_all_single(x.new_empty((sum(recv), hidden)), x, recv, send, group=group)
            elif which == "torch_prealloc":  # lower bound: output buffer reused across calls
                dist.all_to_all_single(out, x, recv, send, group=group)
            else:
                all_to_all_v(x, send, recv, fm.moe, "ep")
            if i >= 3:  # warm-up
                times[which].append(time.perf_counter() - t0)
    row_bytes = hidden * x.element_size()
    minimum = sum(n for j, n in enumerate(send) if j != rank) * row_bytes
    # Bytes really written to sockets by this process during one dispatch (Linux /proc/self/io).
    dist.barrier(group)
    before = _written_bytes()
    all_to_all_v(x, send, recv, fm.moe, "ep")
    sent = _written_bytes() - before
    padded_cap = max(send)
    all_max = [0] * world_size
    dist.all_gather_object(all_max, padded_cap)
    padded = (world_size - 1) * max(all_max) * row_bytes  # equal splits at capacity max(split)
    return dict(torch_s=statistics.median(times["torch"]),
                torch_prealloc_s=statistics.median(times["torch_prealloc"]),
                meshfold_s=statistics.median(times["meshfold"]),
                sent_bytes=sent, min_bytes=minimum, padded_bytes=padded, send=send)


def _bench_even(rank, world_size, rows_list, hidden, reps, seed):
    import torch
    import torch.distributed as dist

    from meshfold import FoldSpec, fold
    from meshfold.placements import all_gather_v, reduce_scatter_v
    from meshfold.placements.collectives import set_collective_path

    fm = fold(FoldSpec(world_size, tp=world_size))
    group = fm.attn.get_group("tp")
    g = torch.Generator().manual_seed(seed + rank)
    out = []
    for rows in rows_list:
        sizes = [rows] * world_size
        cases = {("gather", "fp32"): (all_gather_v, torch.randn(rows, hidden, generator=g)),
                 ("scatter", "fp32"): (reduce_scatter_v, torch.randn(rows * world_size, hidden, generator=g)),
                 ("scatter", "bf16"): (reduce_scatter_v,
                                       torch.randn(rows * world_size, hidden, generator=g).bfloat16())}
        for (kind, dtype), (fn, x) in cases.items():
            times = {"native": [], "a2a": []}
            sent = {}
            for i in range(reps + 2):
                for which in (list(times) if i % 2 else list(times)[::-1]):
                    set_collective_path(which)
                    dist.barrier(group)
                    before = _written_bytes()
                    t0 = time.perf_counter()
                    fn(x, sizes, fm.attn, "tp")
                    dt = time.perf_counter() - t0
                    sent[which] = _written_bytes() - before
                    if i >= 2:
                        times[which].append(dt)
            set_collective_path("auto")
            out.append(dict(kind=kind, dtype=dtype, rows=rows, hidden=hidden,
                            native_s=statistics.median(times["native"]),
                            a2a_s=statistics.median(times["a2a"]),
                            native_bytes=sent["native"], a2a_bytes=sent["a2a"]))
    return out


def _main_even(args) -> int:
    from meshfold.runtime.launch import spawn

    rows = [int(r) for r in args.rows.split(",")]
    res = spawn(_bench_even, args.world_size, rows, args.hidden, args.reps, args.seed)
    table = []
    print(f"{'world':>5} {'kind':>7} {'dtype':>5} {'rows':>6} {'native ms':>9} {'a2a ms':>8} "
          f"{'native/a2a':>10} {'native MB':>9} {'a2a MB':>7}")
    for j, first in enumerate(res[0]):
        per_rank = [r[j] for r in res]
        row = dict(first, world_size=args.world_size,
                   native_ms=1e3 * max(r["native_s"] for r in per_rank),
                   a2a_ms=1e3 * max(r["a2a_s"] for r in per_rank),
                   native_mb=sum(r["native_bytes"] for r in per_rank) / 2**20,
                   a2a_mb=sum(r["a2a_bytes"] for r in per_rank) / 2**20)
        row["ratio"] = row["native_ms"] / row["a2a_ms"]
        table.append(row)
        print(f"{args.world_size:>5} {row['kind']:>7} {row['dtype']:>5} {row['rows']:>6} "
              f"{row['native_ms']:>9.2f} {row['a2a_ms']:>8.2f} {row['ratio']:>10.2f} "
              f"{row['native_mb']:>9.1f} {row['a2a_mb']:>7.1f}")
    out = args.out.replace("collectives.json", f"collectives_even_{args.world_size}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(table, f, indent=2)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096, help="rows sent by each rank")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--skew", type=float, default=3.0, help="higher = more skewed routing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "collectives.json"))
    parser.add_argument("--even", action="store_true",
                        help="even-split all-gather / reduce-scatter: native vs all-to-all path")
    parser.add_argument("--rows", default="256,2048,8192", help="--even: rows per rank, comma-separated")
    args = parser.parse_args(argv)
    if args.even:
        return _main_even(args)
    from meshfold.runtime.launch import spawn

    res = spawn(_bench, args.world_size, args.tokens, args.hidden, args.reps, args.skew, args.seed)
    t_torch = max(r["torch_s"] for r in res)  # a collective takes as long as its slowest rank
    t_mesh = max(r["meshfold_s"] for r in res)
    t_pre = max(r["torch_prealloc_s"] for r in res)
    sent = sum(r["sent_bytes"] for r in res)
    minimum = sum(r["min_bytes"] for r in res)
    padded = sum(r["padded_bytes"] for r in res)
    summary = dict(world_size=args.world_size, tokens_per_rank=args.tokens, hidden=args.hidden,
                   dtype="float32", torch_all_to_all_single_ms=1e3 * t_torch,
                   torch_prealloc_ms=1e3 * t_pre, meshfold_all_to_all_v_ms=1e3 * t_mesh,
                   overhead_ratio=t_mesh / t_torch, overhead_ratio_vs_prealloc=t_mesh / t_pre,
                   bytes_sent=sent, bytes_minimum=minimum, bytes_ratio=sent / minimum,
                   padded_bytes=padded, padded_ratio=padded / minimum,
                   send_splits=[r["send"] for r in res])
    print(f"{'world':>5} {'tokens':>7} {'hidden':>6} {'torch ms':>9} {'prealloc ms':>11} "
          f"{'meshfold ms':>11} {'ratio':>6} {'vs pre':>6} {'MB sent':>8} {'MB min':>7} "
          f"{'padded/min':>10}")
    print(f"{args.world_size:>5} {args.tokens:>7} {args.hidden:>6} {1e3 * t_torch:>9.2f} "
          f"{1e3 * t_pre:>11.2f} {1e3 * t_mesh:>11.2f} {t_mesh / t_torch:>6.3f} "
          f"{t_mesh / t_pre:>6.3f} {sent / 2**20:>8.1f} {minimum / 2**20:>7.1f} "
          f"{padded / minimum:>10.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    from meshfold.runtime.machine import print_machine

    print_machine()  # the CPU and its bf16 instructions: a timing means nothing without them
    sys.exit(main())
