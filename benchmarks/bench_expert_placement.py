"""Static against balanced expert placement and hot-expert copies under a skewed router, in one
run on the same ranks.

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
copies' losses are checked bit-equal at every step. With ``--redundant R1,R2`` (default ep and
2 ep) a copy per R also trains beside them with ``R`` copy slots filled once after the warm-up
(:func:`meshfold.plan.placement.replicated`); its busiest rows count each copied expert's rows
split evenly over its instances (the split rule's, to within a row per source rank), and its
losses are checked against static's to a relative 1e-5 (fp32: its expert gradients sum over
the instances in another order). Writes
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
    from meshfold.parallel.expert_placement import expert_params, folded_moe_layers, placement_of, replace_experts
    from meshfold.parallel.transformer import parallelize
    from meshfold.plan.placement import balanced, replica_rank_loads, replicated

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
    copied = {f"copies R={R}": R for R in args.redundant}
    for name in ("static", "balanced", *copied):
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
        rows = [sum(r) for r in zip(*(replica_rank_loads(x, placement_of(layer), layer.comm.copies or (), world_size)
                                      for x, layer in zip(loads, folded_moe_layers(model))))]
        return loss.item(), dt, loads, max(rows)

    same, close, measured = True, True, [None] * args.layers
    for _ in range(args.warmup):
        tokens, targets = batch()
        (la, _, loads, _), (lb, _, _, _) = step("static", tokens, targets), step("balanced", tokens, targets)
        same &= la == lb
        for name in copied:
            close &= abs(step(name, tokens, targets)[0] - la) <= 1e-5 * abs(la)
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
    copy_sets = {}
    for name, R in copied.items():
        chosen_copies = [replicated(m, world_size, R) for m in measured]
        copy_sets[name] = [list(c) for _, c in chosen_copies]
        for layer, (slots, copies) in zip(folded_moe_layers(runs[name][0]), chosen_copies):
            replace_experts(layer, slots, runs[name][1])
            layer.comm.set_copies(copies, E, expert_params(layer))
    times = {name: [] for name in runs}
    busiest = {name: [] for name in runs}
    for i in range(args.steps):
        tokens, targets = batch()
        losses = {}
        names = list(runs)
        for name in (names if i % 2 else names[::-1]):
            losses[name], dt, _, top = step(name, tokens, targets)
            times[name].append(dt)
            busiest[name].append(top)
        same &= losses["static"] == losses["balanced"]
        close &= all(abs(losses[n] - losses["static"]) <= 1e-5 * abs(losses["static"]) for n in copied)
    return dict(step_s={k: statistics.median(v) for k, v in times.items()},
                busiest_rows={k: statistics.mean(v) for k, v in busiest.items()},
                move_s=statistics.median(moves), sent_bytes=sent, same=same, close=close,
                placements=[list(s) for s in chosen], copies=copy_sets,
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
    parser.add_argument("--redundant", default=None,
                        help="copy slots of each copies run, comma-separated (default: ep,2ep; 0: none)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    W = args.world_size
    given = args.redundant or f"{W},{2 * W}"
    args.redundant = [int(x) for x in given.split(",") if int(x)]
    from meshfold.runtime.launch import spawn

    res = spawn(_bench, W, args)
    names = list(res[0]["step_s"])
    step = {k: max(r["step_s"][k] for r in res) for k in names}
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
                   copies_losses_close=all(r["close"] for r in res), copies=res[0]["copies"],
                   hottest_expert_shares_per_layer=res[0]["expert_shares"],
                   load_average=os.getloadavg())
    print(f"{'placement':>13} {'busiest rows':>12} {'step ms':>8} {'tokens/s':>9}")
    for k in names:
        print(f"{k:>13} {rows[k]:>12,.0f} {1e3 * step[k]:>8.1f} {tokens / step[k]:>9,.0f}")
    print(f"one re-placement: {summary['replacement_bytes'] / 2**20:.2f} MiB moved over all ranks, "
          f"{1e3 * move_s:.1f} ms; repaid after {summary['steps_to_repay'] or float('inf'):.1f} steps; "
          f"losses bit-equal: {summary['losses_bit_equal']}; copies' losses within 1e-5: "
          f"{summary['copies_losses_close']}; load average {summary['load_average']}")
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"expert_placement_{W}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(summary, f, indent=2)
    return 0 if summary["losses_bit_equal"] and summary["copies_losses_close"] else 1


if __name__ == "__main__":
    from meshfold.runtime.machine import print_machine

    print_machine()  # the CPU and its bf16 instructions: a timing means nothing without them
    sys.exit(main())
