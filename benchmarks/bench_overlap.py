"""Shared expert overlapped with the dispatch all-to-all, against the same layer waiting for it.

    python benchmarks/bench_overlap.py --world-size 4            # gloo ranks on this machine's CPUs
    torchrun --nproc-per-node N benchmarks/bench_overlap.py      # NCCL, one GPU per rank

One folded MoE layer (``ep`` = world size, tp = etp = 1, a shared expert), forward + backward,
timed interleaved in the same processes on the same input: ``overlap`` (``FoldedComm.overlap =
True``: the all-to-all over ``ep`` is started with ``async_op=True``, the shared expert computes,
then it is waited; in backward the gradient's all-to-all overlaps the shared expert's backward)
and ``wait`` (``overlap = False``: the synchronous dispatch, then the shared expert). Median step
time of the slowest rank; ratio = overlap / wait (below 1 is a gain). Before timing, the two
variants' outputs and input gradients are checked bitwise equal.

On one rank (a one-GPU machine) the all-to-all moves nothing between devices: the figure is then
the cost of the asynchronous machinery (two autograd nodes, a work handle, the NCCL-stream
launch of a local copy), not a gain. Writes benchmarks/results/overlap_W.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(rank, world_size, tokens, hidden, ffn, shared_ffn, experts, topk, reps, dtype_name):
    import torch

    from meshfold import FoldSpec, fold
    from meshfold.models import MoEConfig, MoELayer
    from meshfold.parallel.moe import parallelize_moe

    dtype = getattr(torch, dtype_name)
    fm = fold(FoldSpec(world_size, ep=world_size))
    device = fm.device
    cfg = MoEConfig(hidden=hidden, ffn=ffn, num_experts=experts, topk=topk, shared_ffn=shared_ffn)
    torch.manual_seed(0)
    layer = MoELayer(cfg, dtype=dtype).to(device)
    parallelize_moe(layer, fm)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype)

    def step(overlap):
        layer.comm.overlap = overlap
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.float().square().sum().backward()
        return y.detach(), xi.grad

    (ya, ga), (yb, gb) = step(True), step(False)
    same = bool(torch.equal(ya, yb) and torch.equal(ga, gb))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = {True: [], False: []}
    for i in range(reps + 2):
        for overlap in ((True, False) if i % 2 else (False, True)):
            layer.zero_grad(set_to_none=True)
            sync()
            torch.distributed.barrier()
            t0 = time.perf_counter()
            step(overlap)
            sync()
            if i >= 2:
                times[overlap].append(time.perf_counter() - t0)
    return dict(overlap_s=statistics.median(times[True]), wait_s=statistics.median(times[False]),
                same=same, device=str(device))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4, help="gloo ranks (ignored under torchrun)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--shared-ffn", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from meshfold.runtime.launch import spawn, under_torchrun

    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.world_size
    if args.experts % world:
        args.experts = world * max(1, args.experts // world)
    res = spawn(_bench, world, args.tokens, args.hidden, args.ffn, args.shared_ffn, args.experts,
                args.topk, args.reps, args.dtype)
    t_on = max(r["overlap_s"] for r in res)
    t_off = max(r["wait_s"] for r in res)
    summary = dict(world_size=world, device=res[0]["device"], tokens_per_rank=args.tokens, hidden=args.hidden,
                   ffn=args.ffn, shared_ffn=args.shared_ffn, experts=args.experts, topk=args.topk,
                   dtype=args.dtype, overlap_ms=1e3 * t_on, wait_ms=1e3 * t_off, ratio=t_on / t_off,
                   bitwise_equal=all(r["same"] for r in res), load_average=os.getloadavg())
    print(f"{'world':>5} {'device':>6} {'tokens':>6} {'overlap ms':>10} {'wait ms':>8} {'ratio':>6} {'equal':>5}")
    print(f"{world:>5} {summary['device'][:6]:>6} {args.tokens:>6} {1e3 * t_on:>10.2f} {1e3 * t_off:>8.2f} "
          f"{t_on / t_off:>6.3f} {str(summary['bitwise_equal']):>5}")
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"overlap_{world}.json")
    if not under_torchrun() or int(os.environ.get("RANK", 0)) == 0:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["bitwise_equal"] else 1


if __name__ == "__main__":
    from meshfold.runtime.machine import print_machine

    print_machine()  # the CPU and its bf16 instructions: a timing means nothing without them
    sys.exit(main())
