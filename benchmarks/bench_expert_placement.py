"""Static against balanced expert placement under a skewed router, in one run on the same ranks.

    python benchmarks/bench_expert_placement.py --world-size 4      # gloo ranks on this machine's CPUs

A MoE transformer on ``ep`` = world size (attention dp = world size), its routers' choices
skewed towards a Zipf(``--zipf``) popularity by a fixed expert bias (aux-loss-free bias, never
updated) whose popularity order is a seeded shuffle of the expert ids. Two copies with the same
weights train side by side, steps interleaved: ``static`` (ep rank r holds experts r * E / ep ..)
and ``balanced``, re-placed once after ``--warmup`` steps from the loads measured over them
(:func:`meshfold.plan.placement.balanced`, moved by
:func:`meshfold.parallel.expert_placement.replace_experts`). Reported per placement: the busiest
ep rank's received rows per step (summed over the MoE layers), the slowest rank's median step
time and tokens/s; and the cost of one re-placement (bytes moved over all ranks, seconds, median
of ``--moves`` moves back and forth) against the step time it saves. Before timing, the two
copies' losses are checked bit-equal at every step. Writes
benchmarks/results/expert_placement_W.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(rank, world_size, args):
    import torch
    import torch.distributed as dist

    from meshfold import FoldSpec, fold
    from meshfold.models import MoEConfig
    from meshfold.models.transformer import MoETransformer, TransformerConfig
    from meshfold.parallel.batch import shard_batch
    from meshfold.parallel.data_parallel import reduce_gradients
    from meshfold.parallel.expert_placement import folded_moe_layers, placement_of, replace_experts
    from meshfold.parallel.transformer import parallelize
    from meshfold.plan.placement import balanced, rank_loads

    torch.set_num_threads(1)
    spec = FoldSpec(world_size, ep=world_size)
    folded = fold(spec)
    E = args.experts
    moe = MoEConfig(hidden=args.hidden, ffn=args.ffn, num_experts=E, topk=args.topk, expert_bias=True,
                    aux_loss_coeff=0.0)
    cfg = TransformerConfig(vocab=256, hidden=args.hidden, layers=args.layers, heads=4, kv_heads=4,
                            ffn=args.hidden, moe=moe, first_k_dense=0, max_seq=args.seq)
    popularity = torch.randperm(E, generator=torch.Generator().manual_seed(7))  # expert -> Zipf rank
    bias_E = args.bias * torch.log((popularity + 1.0) ** -args.zipf)
    runs = {}
    for name in ("static", "balanced"):
        torch.manual_seed(0)
        model = MoETransformer(cfg)
        for layer in model.moe_layers():
            layer.router.expert_bias.copy_(bias_E)
        parallelize(model, folded, data_parallel="allreduce")
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(1)

    def batch():
        tokens = torch.randint(0, cfg.vocab, (args.batch * world_size, args.seq + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    def step(name, tokens, targets):
        model, opt = runs[name]
        for layer in model.moe_layers():
            layer.reset_step()
        dist.barrier()
        t0 = time.perf_counter()
        lt, pos = shard_batch(tokens, spec, rank)
        loss = model.loss(lt, shard_batch(targets, spec, rank)[0], pos)
        loss.backward()
        reduce_gradients(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        loads = [layer.step_metrics()["tokens_per_expert"].tolist() for layer in model.moe_layers()]
        rows = [sum(r) for r in zip(*(rank_loads(x, placement_of(layer), world_size)
                                      for x, layer in zip(loads, folded_moe_layers(model))))]
        return loss.item(), dt, loads, max(rows)

    same, measured = True, [None] * args.layers
    for _ in range(args.warmup):
        tokens, targets = batch()
        (la, _, loads, _), (lb, _, _, _) = step("static", tokens, targets), step("balanced", tokens, targets)
        same &= la == lb
        measured = [x if m is None else [a + b for a, b in zip(m, x)] for m, x in zip(measured, loads)]
    layers = folded_moe_layers(runs["balanced"][0])
    chosen = [balanced(m, world_size) for m in measured]
    moves, sent = [], 0
    for i in range(args.moves):  # to the balanced placement and back, ending on it
        target = chosen if i % 2 == 0 else [tuple(range(E))] * len(layers)
        if i == args.moves - 1 and i % 2:
            target = chosen
        dist.barrier()
        t0 = time.perf_counter()
        b = sum(replace_experts(layer, s, runs["balanced"][1]) for layer, s in zip(layers, target))
        moves.append(time.perf_counter() - t0)
        sent = sent or b
    if [placement_of(layer) for layer in layers] != chosen:
        for layer, s in zip(layers, chosen):
            replace_experts(layer, s, runs["balanced"][1])
    times = {"static": [], "balanced": []}
    busiest = {"static": [], "balanced": []}
    for i in range(args.steps):
        tokens, targets = batch()
        losses = {}
        for name in (("static", "balanced") if i % 2 else ("balanced", "static")):
            losses[name], dt, _, top = step(name, tokens, targets)
            times[name].append(dt)
            busiest[name].append(top)
        same &= losses["static"] == losses["balanced"]
    return dict(step_s={k: statistics.median(v) for k, v in times.items()},
                busiest_rows={k: statistics.mean(v) for k, v in busiest.items()},
                move_s=statistics.median(moves), sent_bytes=sent, same=same,
                placements=[list(s) for s in chosen],
                expert_shares=[sorted((x / sum(m) for x in m), reverse=True)[:4] for m in measured])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--zipf", type=float, default=1.2, help="exponent of the router's skew")
    parser.add_argument("--bias", type=float, default=0.06, help="expert bias = bias * log(zipf share)")
    parser.add_argument("--warmup", type=int, default=2, help="steps whose loads decide the placement")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each placement, interleaved")
    parser.add_argument("--moves", type=int, default=5, help="re-placements timed (back and forth)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from meshfold.runtime.launch import spawn

    W = args.world_size
    res = spawn(_bench, W, args)
    step = {k: max(r["step_s"][k] for r in res) for k in ("static", "balanced")}
    rows = res[0]["busiest_rows"]
    tokens = W * args.batch * args.seq
    move_s = max(r["move_s"] for r in res)
    saved = step["static"] - step["balanced"]
    summary = dict(world_size=W, experts=args.experts, topk=args.topk, hidden=args.hidden, ffn=args.ffn,
                   layers=args.layers, tokens_per_step=tokens, zipf=args.zipf, bias=args.bias,
                   busiest_rank_rows_per_step=rows, slowest_rank_step_s=step,
                   tokens_per_s={k: tokens / v for k, v in step.items()},
                   replacement_bytes=sum(r["sent_bytes"] for r in res), replacement_s=move_s,
                   steps_to_repay=(move_s / saved) if saved > 0 else None,
                   losses_bit_equal=all(r["same"] for r in res), placements=res[0]["placements"],
                   hottest_expert_shares_per_layer=res[0]["expert_shares"],
                   load_average=os.getloadavg())
    print(f"{'placement':>9} {'busiest rows':>12} {'step ms':>8} {'tokens/s':>9}")
    for k in ("static", "balanced"):
        print(f"{k:>9} {rows[k]:>12,.0f} {1e3 * step[k]:>8.1f} {tokens / step[k]:>9,.0f}")
    print(f"one re-placement: {summary['replacement_bytes'] / 2**20:.2f} MiB moved over all ranks, "
          f"{1e3 * move_s:.1f} ms; repaid after {summary['steps_to_repay'] or float('inf'):.1f} steps; "
          f"losses bit-equal: {summary['losses_bit_equal']}; load average {summary['load_average']}")
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"expert_placement_{W}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(summary, f, indent=2)
    return 0 if summary["losses_bit_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
