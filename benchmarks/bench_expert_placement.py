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
split over its instances by the split rule's cuts (to within a row per source rank), and its
losses are checked against static's to a relative 1e-5 (fp32: its expert gradients sum over
the instances in another order); its re-placement (experts moved to the chosen slots, weights and
AdamW moments, then the copies set; median of ``--moves`` moves back and forth) is timed like
balanced's.

With ``--rebalance-every N`` the balanced and copies runs also re-choose during the timed steps as
training does with ``train.rebalance_every = N`` (:class:`meshfold.train.rebalance.Rebalancer`,
the same object and rule: every N timed steps, re-place and re-fill the copies from the loads
summed over the steps since the last choice, keeping the current placement unless the new one
lowers the busiest rank); the first choice is still the one after the warm-up. Reported then:
each timed step's busiest ep rank's rows over the mean rank's, its median over the timed steps,
and per run the number of re-choices (and of those, the ones that moved expert weights), their
bytes moved over all ranks and their seconds (slowest rank, summed). Without the flag the
choice is made once.

Per placement and ep rank, also: the CPU time per step in the expert GEMMs (forward and both
backward GEMMs, :func:`meshfold.kernels.cpu_grouped.rows_mm` and ``dw_mm``), read with
``time.thread_time`` around each call. Each rank runs one intra-op thread, so these GEMMs run
on the calling thread (the autograd engine runs CPU backward there too), and thread time counts
only the time the rank is on a core: the ranks' own GEMM work, which shared cores do not hide
(cache contention with the other ranks may inflate it). And the bytes the copies hold: the
expert weights the GEMMs receive in storage other than the parameters' own (with copies, the
local experts and fetched copies concatenated, kept for backward), and of those the fetched
copies' bytes, per forward of a step. Both are read by wrappers installed here, not by meshfold.

The copies' rows are split by the cuts training sets (:func:`meshfold.plan.placement.split_cuts`
of the loads the copies were chosen from), and each step's busiest rows count them by those cuts.
Per copies run and ep rank, also: the copies' fetch per step (both MoE layers, median over the
timed steps), wall seconds of the forward all-to-all over ep that fetches the copies' weights and
of the backward one that returns their gradients (from the gradient reaching the fetched weights
to it reaching the local ones: the all-to-all and the scatter into the local weights' gradient;
wall time, so a rank also waits there for the others), and the bytes each rank sends to other ep
ranks in each; and after the timed steps, one more untimed step of every run under
:class:`meshfold.runtime.live_bytes.LiveBytes`: each rank's peak of live tensor bytes (weights,
AdamW state, gradients, activations, the copies' weights held for backward), the memory check of
``--data-parallel allreduce`` (the default: every rank holds its parameters whole) against
``--data-parallel fsdp`` (FSDP2).
Writes benchmarks/results/expert_placement_W.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _time_expert_gemms():
    """Wrap the CPU grouped GEMMs so each call adds its thread CPU time to the returned [s]."""
    from meshfold.kernels import cpu_grouped

    spent = [0.0]

    def timed(fn):
        def call(*args):
            t0 = time.thread_time()
            try:
                return fn(*args)
            finally:
                spent[0] += time.thread_time() - t0
        return call

    cpu_grouped.rows_mm, cpu_grouped.dw_mm = timed(cpu_grouped.rows_mm), timed(cpu_grouped.dw_mm)
    return spent


def _count_held_weights(comm, held):
    """Wrap ``comm.local`` so each expert weight it returns in storage other than its
    parameter's adds (bytes held, bytes fetched as copies) to ``held``."""
    from meshfold.placements.params import local_view

    local = comm.local

    def counted(name, p):
        v = local(name, p)
        own = local_view(p)
        if name.startswith("experts.") and v.untyped_storage().data_ptr() != own.untyped_storage().data_ptr():
            held[0] += v.nbytes
            held[1] += v.nbytes * (v.shape[0] - own.shape[0]) // v.shape[0]
        return v

    comm.local = counted


def _time_copy_fetches(comm, spent):
    """Wrap ``comm._fetch_copies`` (the copies' weights fetched over ep, their gradients sent back
    in backward) so each call adds to ``spent``: [forward wall s, backward wall s, weight bytes
    this rank sends to other ep ranks, gradient bytes it sends back]. Backward is timed from the
    gradient reaching the fetched weights to it reaching the local weights they came from."""
    import torch

    fetch = comm._fetch_copies

    class Clock(torch.autograd.Function):
        """Identity; in backward, calls ``at`` when the gradient arrives."""

        @staticmethod
        def forward(ctx, x, at):
            ctx.at = at
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            ctx.at()
            return g, None

    def timed(v_nX):
        routes, me = comm._routing(v_nX.device), comm.ep_rank
        row = v_nX[0].nbytes  # one expert's weight
        spent[2] += row * (sum(routes.send_sizes) - routes.send_sizes[me])
        spent[3] += row * (sum(routes.recv_sizes) - routes.recv_sizes[me])
        began = [0.0]

        def start():
            began[0] = time.perf_counter()

        def stop():
            spent[1] += time.perf_counter() - began[0]

        t0 = time.perf_counter()
        y = fetch(Clock.apply(v_nX, stop))
        spent[0] += time.perf_counter() - t0
        return Clock.apply(y, start)

    comm._fetch_copies = timed


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
    from meshfold.plan.placement import balanced, max_over_mean, replica_rank_loads, replicated, split_cuts
    from meshfold.runtime.live_bytes import LiveBytes
    from meshfold.train.rebalance import Rebalancer

    torch.set_num_threads(1)
    gemm_s = _time_expert_gemms()
    spec = FoldSpec(world_size, ep=world_size)
    folded = fold(spec)
    E = args.experts
    moe = MoEConfig(hidden=args.hidden, ffn=args.ffn, num_experts=E, topk=args.topk, expert_bias=True,
                    aux_loss_coeff=0.0)
    cfg = TransformerConfig(vocab=256, hidden=args.hidden, layers=args.layers, heads=4, kv_heads=4,
                            ffn=args.hidden, moe=moe, first_k_dense=0, max_seq=args.seq)
    popularity = torch.randperm(E, generator=torch.Generator().manual_seed(7))  # expert -> Zipf rank
    bias_E = args.bias * torch.log((popularity + 1.0) ** -args.zipf)
    runs, held, fetches = {}, {}, {}  # held: (bytes, fetched bytes) of expert weights outside the parameters
    copied = {f"copies R={R}": R for R in args.redundant}
    for name in ("static", "balanced", *copied):
        torch.manual_seed(0)
        model = MoETransformer(cfg)
        for layer in model.moe_layers():
            layer.router.expert_bias.copy_(bias_E)
        parallelize(model, folded, data_parallel=args.data_parallel)
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        held[name], fetches[name] = [0, 0], [0.0, 0.0, 0, 0]
        for layer in folded_moe_layers(model):
            _count_held_weights(layer.comm, held[name])
            _time_copy_fetches(layer.comm, fetches[name])
    g = torch.Generator().manual_seed(1)

    def batch():
        tokens = torch.randint(0, cfg.vocab, (args.batch * world_size, args.seq + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    def step(name, tokens, targets, live=None):
        model, opt = runs[name]
        for layer in model.moe_layers():
            layer.reset_step()
        dist.barrier()
        held[name][:], fetches[name][:] = [0, 0], [0.0, 0.0, 0, 0]
        gemm0 = gemm_s[0]
        t0 = time.perf_counter()
        with live or contextlib.nullcontext():
            lt, pos = shard_batch(tokens, spec, rank)
            loss = model.loss(lt, shard_batch(targets, spec, rank)[0], pos)
            loss.backward()
            reduce_gradients(model)
            opt.step()
            opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        gemm[name].append(gemm_s[0] - gemm0)
        fetched[name].append(list(fetches[name]))
        loads = [layer.step_metrics()["tokens_per_expert"].tolist() for layer in model.moe_layers()]
        # each rank's rows as the split rule cut them: by the cuts the layer runs with
        rows = [sum(r) for r in zip(*(replica_rank_loads(x, placement_of(layer), layer.comm.copies or (), world_size,
                                                         layer.comm.cuts if layer.comm.copies else None)
                                      for x, layer in zip(loads, folded_moe_layers(model))))]
        return loss.item(), dt, loads, rows

    gemm = {name: [] for name in runs}  # expert GEMM CPU seconds of each step
    fetched = {name: [] for name in runs}  # each step's copies' fetch: [fwd s, bwd s, bytes sent, bytes sent back]
    same, close, measured = True, True, [None] * args.layers
    for _ in range(args.warmup):
        tokens, targets = batch()
        (la, _, loads, _), (lb, _, _, _) = step("static", tokens, targets), step("balanced", tokens, targets)
        same &= la == lb
        for name in copied:
            close &= abs(step(name, tokens, targets)[0] - la) <= 1e-5 * abs(la)
        measured = [x if m is None else [a + b for a, b in zip(m, x)] for m, x in zip(measured, loads)]

    def place(name, slots, copies):
        """Re-place run ``name`` to ``slots`` (and ``copies``, one entry per layer) and back
        ``--moves`` times, ending on them; -> (median seconds, bytes this rank sent in the first)."""
        model, opt = runs[name]
        layers = folded_moe_layers(model)
        static = [tuple(range(E))] * len(layers)
        moves, sent = [], 0
        for i in range(args.moves):
            there = i % 2 == 0 or i == args.moves - 1
            dist.barrier()
            t0 = time.perf_counter()
            b = 0
            for layer, s, c, m in zip(layers, slots if there else static, copies if there else [()] * len(layers),
                                      measured):
                layer.comm.set_copies((), E, ())
                b += replace_experts(layer, s, opt)
                layer.comm.set_copies(c, E, expert_params(layer), split_cuts(m, s, c, world_size) if c else None)
            moves.append(time.perf_counter() - t0)
            sent = sent or b
        return statistics.median(moves), sent

    chosen = [balanced(m, world_size) for m in measured]
    moved = {"balanced": place("balanced", chosen, [()] * len(chosen))}
    copy_sets = {}
    for name, R in copied.items():
        chosen_copies = [replicated(m, world_size, R) for m in measured]
        copy_sets[name] = [list(c) for _, c in chosen_copies]
        moved[name] = place(name, [s for s, _ in chosen_copies], [c for _, c in chosen_copies])
    times = {name: [] for name in runs}
    for v in (*gemm.values(), *fetched.values()):
        v.clear()  # report the timed steps only
    busiest = {name: [] for name in runs}
    over_mean = {name: [] for name in runs}  # per step: busiest rank's rows / mean rank's
    rebalancers = {name: Rebalancer(runs[name][0], args.rebalance_every, world_size, copied.get(name, 0))
                   for name in ("balanced", *copied)} if args.rebalance_every else {}
    replaced = {name: [] for name in rebalancers}  # per re-choice: (bytes over all ranks, seconds)
    rank_rows = {name: [] for name in runs}  # per step: each ep rank's rows
    last = {}  # per run: the last timed step's loads, per layer and expert
    for i in range(args.steps):
        tokens, targets = batch()
        losses = {}
        names = list(runs)
        for name in (names if i % 2 else names[::-1]):
            losses[name], dt, loads, top = step(name, tokens, targets)
            times[name].append(dt)
            busiest[name].append(max(top))
            over_mean[name].append(max_over_mean(top))
            last[name] = loads
            if name in rebalancers:  # as the training loop: after the step, from its loads
                placed = rebalancers[name].after_step(i + 1, loads, runs[name][1])
                if placed is not None:
                    replaced[name].append((placed["moved_bytes"], placed["seconds"]))
            rank_rows[name].append(top)
        same &= losses["static"] == losses["balanced"]
        close &= all(abs(losses[n] - losses["static"]) <= 1e-5 * abs(losses["static"]) for n in copied)
    peak = {}  # one more step of each run, untimed, under LiveBytes: the bytes alive at its peak
    tokens, targets = batch()
    for name in runs:
        live = LiveBytes()
        live.adopt([p for p in runs[name][0].parameters()])
        live.adopt([t for st in runs[name][1].state.values() for t in st.values() if isinstance(t, torch.Tensor)])
        step(name, tokens, targets, live)
        peak[name] = live.peak
    fetch = {k: [statistics.median(x) for x in zip(*v)] if v else [0.0, 0.0, 0, 0] for k, v in fetched.items()}
    return dict(step_s={k: statistics.median(v) for k, v in times.items()},
                busiest_rows={k: statistics.mean(v) for k, v in busiest.items()},
                over_mean=over_mean, replaced=replaced, last_loads=last,
                rows_per_rank={k: [statistics.mean(r) for r in zip(*v)] for k, v in rank_rows.items()},
                gemm_cpu_s={k: statistics.median(v) for k, v in gemm.items()}, fetch=fetch, peak_bytes=peak,
                held_bytes={k: v[0] for k, v in held.items()}, fetched_bytes={k: v[1] for k, v in held.items()},
                moved=moved, same=same, close=close,
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
    parser.add_argument("--rebalance-every", type=int, default=0,
                        help="re-choose placement and copies every N timed steps, as train.rebalance_every "
                             "(default 0: chosen once after the warm-up)")
    parser.add_argument("--data-parallel", default="allreduce", choices=["allreduce", "fsdp"],
                        help="train.data_parallel of every run (default allreduce)")
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
    gemm = {k: [r["gemm_cpu_s"][k] for r in res] for k in names}  # per ep rank (rank = ep rank)
    held = {k: [r["held_bytes"][k] for r in res] for k in names}
    fetched = {k: [r["fetched_bytes"][k] for r in res] for k in names}
    moved = {k: (max(r["moved"][k][0] for r in res), sum(r["moved"][k][1] for r in res)) for k in res[0]["moved"]}
    move_s = moved["balanced"][0]
    saved = step["static"] - step["balanced"]
    summary = dict(world_size=W, experts=args.experts, topk=args.topk, hidden=args.hidden, ffn=args.ffn,
                   layers=args.layers, tokens_per_step=tokens, zipf=args.zipf, bias=args.bias,
                   busiest_rank_rows_per_step=rows, rows_per_ep_rank=res[0]["rows_per_rank"],
                   slowest_rank_step_s=step,
                   tokens_per_s={k: tokens / v for k, v in step.items()},
                   expert_gemm_cpu_s_per_ep_rank=gemm, copies_held_bytes_per_ep_rank=held,
                   copies_fetched_bytes_per_ep_rank=fetched,
                   replacement_bytes_per_placement={k: v[1] for k, v in moved.items()},
                   replacement_s_per_placement={k: v[0] for k, v in moved.items()},
                   replacement_bytes=moved["balanced"][1], replacement_s=move_s,
                   steps_to_repay=(move_s / saved) if saved > 0 else None,
                   losses_bit_equal=all(r["same"] for r in res), placements=res[0]["placements"],
                   copies_losses_close=all(r["close"] for r in res), copies=res[0]["copies"],
                   hottest_expert_shares_per_layer=res[0]["expert_shares"],
                   rebalance_every=args.rebalance_every,
                   busiest_over_mean_per_step=res[0]["over_mean"], loads_last_step=res[0]["last_loads"],
                   busiest_over_mean_median={k: statistics.median(v) for k, v in res[0]["over_mean"].items()},
                   rebalances={k: dict(count=len(v), moved=sum(1 for b, _ in v if b),
                                       bytes=sum(b for b, _ in v),
                                       seconds=max(sum(s for _, s in r["replaced"][k]) for r in res))
                               for k, v in res[0]["replaced"].items()},
                   data_parallel=args.data_parallel,
                   copies_fetch_s_per_ep_rank={k: [r["fetch"][k][:2] for r in res] for k in names},
                   copies_fetch_bytes_per_ep_rank={k: [r["fetch"][k][2:] for r in res] for k in names},
                   step_peak_bytes_per_ep_rank={k: [r["peak_bytes"][k] for r in res] for k in names},
                   load_average=os.getloadavg())
    print(f"{'placement':>13} {'busiest rows':>12} {'step ms':>8} {'tokens/s':>9} {'rows per ep rank':>28} "
          f"{'expert GEMM CPU ms per ep rank':>32} {'max':>6} {'held MiB per rank':>22} "
          f"{'re-placement MiB, ms':>20}")
    for k in names:
        per_rank = "/".join(f"{1e3 * t:.0f}" for t in gemm[k])
        rank_rows = "/".join(f"{r:,.0f}" for r in res[0]["rows_per_rank"][k])
        mib = "/".join(f"{b / 2**20:.1f}" for b in held[k])
        move = f"{moved[k][1] / 2**20:.1f}, {1e3 * moved[k][0]:.0f}" if k in moved else "-"
        print(f"{k:>13} {rows[k]:>12,.0f} {1e3 * step[k]:>8.1f} {tokens / step[k]:>9,.0f} {rank_rows:>28} "
              f"{per_rank:>32} "
              f"{1e3 * max(gemm[k]):>6.0f} {mib:>22} {move:>20}")
    print(f"one re-placement: {summary['replacement_bytes'] / 2**20:.2f} MiB moved over all ranks, "
          f"{1e3 * move_s:.1f} ms; repaid after {summary['steps_to_repay'] or float('inf'):.1f} steps; "
          f"losses bit-equal: {summary['losses_bit_equal']}; copies' losses within 1e-5: "
          f"{summary['copies_losses_close']}; load average {summary['load_average']}")
    every = f"every {args.rebalance_every} steps" if args.rebalance_every else "once, after the warm-up"
    print(f"busiest ep rank's rows / mean rank's, per timed step (placement and copies chosen {every}):")
    for k in names:
        per_step = " ".join(f"{x:.2f}" for x in summary["busiest_over_mean_per_step"][k])
        rb = summary["rebalances"].get(k)
        again = (f"; {rb['count']} re-choices ({rb['moved']} moving weights), {rb['bytes'] / 2**20:.1f} MiB, "
                 f"{1e3 * rb['seconds']:.0f} ms in all") if rb else ""
        print(f"{k:>13} median {summary['busiest_over_mean_median'][k]:.2f}: {per_step}{again}")
    print(f"copies' fetch per step (both MoE layers; median of the timed steps; slowest rank's wall ms, "
          f"forward weights / backward gradients; MiB each rank sends, weights / gradients), and each rank's "
          f"step peak of live bytes (one untimed step, LiveBytes) under data_parallel = {args.data_parallel}:")
    for k in names:
        f = summary["copies_fetch_s_per_ep_rank"][k]
        b = summary["copies_fetch_bytes_per_ep_rank"][k]
        peaks = summary["step_peak_bytes_per_ep_rank"][k]
        sent = " / ".join("/".join(f"{x[i] / 2**20:.1f}" for x in b) for i in (0, 1))
        print(f"{k:>13} fetch ms {1e3 * max(x[0] for x in f):.1f} / {1e3 * max(x[1] for x in f):.1f}, "
              f"MiB sent {sent}; step peak MiB {'/'.join(f'{p / 2**20:.1f}' for p in peaks)} "
              f"(max {max(peaks) / 2**20:.1f})")
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"expert_placement_{W}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(summary, f, indent=2)
    return 0 if summary["losses_bit_equal"] and summary["copies_losses_close"] else 1


if __name__ == "__main__":
    from meshfold.runtime.machine import print_machine

    print_machine()  # the CPU and its bf16 instructions: a timing means nothing without them
    sys.exit(main())
