"""The whole MoE transformer on CPU: a training step vs Hugging Face, fold scaling, memory vs cp.

    python benchmarks/bench_model.py                    # parts a, b, c: about 3-5 minutes
    python benchmarks/bench_model.py --parts a --rounds 3
    python benchmarks/bench_model.py --parts d --rounds 3  # eager vs compiled, fp32 vs bf16: ~10 minutes
    python benchmarks/bench_model.py --parts e --rounds 5  # train.a2a_overlap off vs on: ~5 minutes

Model (every part): Mixtral-style, vocab 256, hidden 256, 4 layers, 8 heads / 4 KV heads,
8 experts of ffn 512, top-2 (softmax, renormalised), fp32, untied head.

(a) **Single process, one thread**: a training step (forward, cross-entropy, backward, AdamW) of
    meshfold's ``MoETransformer`` vs transformers' ``MixtralForCausalLM`` holding the same weights
    (meshfold's ``save_pretrained`` -> transformers' ``from_pretrained``; the logits are checked to
    agree first), batch 8 x 256 tokens. Timed interleaved (one step of each per round), median over
    rounds. FLOPs per step from ``meshfold.train.flops.train_flops_per_step`` (Megatron-Core's
    count, identical for both); the MFU peak is a dense fp32 GEMM (1024^3, one thread) measured
    in the same run just before and just after the steps, the better of the two.
(b) **Folds on gloo ranks** (1, 2, 4 processes, one thread each, on this machine's cores): the
    same step, folded as ``meshfold train`` builds it (``meshfold.train.build.build``: FSDP2
    data parallelism unless a row says ``allreduce``; pp folds with 2 microbatches; AdamW's
    groups from ``build_optimizer``) on the local shards,
    global batch 8 x 256 fixed. tokens/s = global tokens / median step time (the
    slowest rank). MFU against the sum of the ranks' dense GEMM rates, measured concurrently.
(c) **Per-rank peak memory vs cp** at one sequence of 2048 tokens, fold ``cp = world`` (dp = tp =
    ep = 1, all-reduce data parallelism rather than FSDP2, so weights, gradients and optimizer
    state are the same on every rank and only activations can shrink). Each rank, in a fresh process with glibc's mmap threshold at 64 KiB
    (freed tensors go back to the OS): a warm-up step (gradients and AdamW state now exist),
    gradients set to None, ``malloc_trim``, reset of the kernel's peak-RSS counter
    (``/proc/self/clear_refs`` = 5), then one step; ``peak`` = VmHWM - VmRSS before the step:
    activations, temporaries and the re-created gradients. ``peak - grads`` subtracts the
    gradient buffers (the parameter bytes, the same for every cp).

(d) **Eager vs compiled, fp32 vs bf16 compute, 4 gloo ranks** (one thread each), the ``meshfold
    train`` step (``meshfold.train.build.build`` with ``train.compile`` and ``train.dtype``, fold attn tp2
    x dp2 | moe ep4, the default run's) of two models (:data:`STEP_MODELS`), tiny-mixtral's
    otherwise: ``issue`` (4 layers, hidden 512, ffn 1024, its 4 heads and 4 experts top-2, batch
    8 x 512) and ``100m`` (4 layers, hidden 768, 12 heads, 8 experts of ffn 1280 top-2, 96M
    parameters, batch 4 x 512). The four variants (``train.compile`` off / on x ``train.dtype`` float32 / bfloat16,
    fp32 master weights) live side by side on every rank and are timed interleaved, one step of
    each per round; the first step of each (compilation included) is reported apart. Beside them,
    every rank's dense GEMM rate in fp32 and bf16 at the MLP's shape, measured concurrently: the
    ceiling bf16 compute can reach over fp32 on this CPU.

(e) **train.a2a_overlap off vs on, 4 gloo ranks** (one thread each): the ``meshfold train`` step
    (``build``) of a model of hidden 512 with 4 MoE layers (8 experts of ffn 1024, top-2), batch
    16 x 512, on four folds (:data:`OVERLAP_FOLDS`: accumulation under FSDP2 and all-reduce, dualpipev and 1F1B (run as combined 1F1B when on) on pp 2), off and on side by
    side, timed interleaved. Beside the
    step time, the time each rank spends blocked in its expert all-to-alls' waits (the slowest
    rank's): what the overlap is meant to remove; and rank 0's TurnStats (all-to-alls waited for
    after the other micro-batch's turn, and of them those already arrived). There is no peer
    row: transformers has no expert parallelism, and torchtitan's DualPipeV overlap runs on CUDA.

Writes benchmarks/results/model.json; prints markdown tables.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshfold import fold  # noqa: E402
from meshfold.runtime.launch import spawn  # noqa: E402
from meshfold.models import MoETransformer, get_config  # noqa: E402
from meshfold.interop.hf import save_pretrained  # noqa: E402
from meshfold.parallel.batch import shard_batch  # noqa: E402
from meshfold.train.build import build  # noqa: E402
from meshfold.train.config import TrainConfig  # noqa: E402
from meshfold.train.flops import train_flops_per_step  # noqa: E402
from peak_rss import peak_rss_mib  # noqa: E402  (benchmarks/peak_rss.py)

B, S, S_LONG = 8, 256, 2048
FOLDS = {  # world size -> folds timed in part (b); data_parallel defaults to "fsdp"
    1: [dict()],
    2: [dict(), dict(tp=2), dict(ep=2)],
    4: [dict(), dict(tp=2, ep=4), dict(ep=4), dict(ep=4, data_parallel="allreduce"), dict(cp=2, tp=2, ep=4),
        dict(pp=2, ep=2, schedule="1f1b"), dict(pp=2, ep=2, schedule="interleaved-1f1b"),
        dict(pp=2, tp=2, ep=2, schedule="1f1b")],
}
MICROBATCHES = 2  # per pipeline step (pp folds)


def model_config():
    base = get_config("tiny-mixtral")
    moe = replace(base.moe, hidden=256, ffn=512, num_experts=8, topk=2)
    return replace(base, hidden=256, layers=4, heads=8, kv_heads=4, head_dim=32, ffn=512, moe=moe,
                   max_seq=S_LONG)


def job(world_size, fold_kwargs=None, model=None, moe=None, **train):
    """The resolved settings of a ``meshfold train`` job of ``model_config()`` (or ``model`` /
    ``moe`` fields over tiny-mixtral) on ``world_size`` ranks: what ``build`` lays out, as
    training and the dry run do. ``fold_kwargs`` may name ``data_parallel`` and ``schedule``."""
    kw = dict(fold_kwargs or {})
    settings = {"data_parallel": kw.pop("data_parallel", "fsdp"), **train}
    schedule = kw.pop("schedule", None)
    if schedule is not None:
        settings.update(schedule=schedule, virtual=2 if schedule == "interleaved-1f1b" else 1,
                        microbatches=MICROBATCHES)
    model = model or dict(hidden=256, layers=4, heads=8, kv_heads=4, head_dim=32, ffn=512, max_seq=S_LONG)
    moe = moe or dict(ffn=512, num_experts=8, topk=2)
    cfg = TrainConfig(model={"name": "tiny-mixtral", **model}, moe=moe, fold={"world_size": world_size, **kw})
    for key, value in settings.items():
        setattr(cfg.train, key, value)
    return cfg.resolve()


def batch(b, s, seed=0):
    """(tokens, next-token targets) [b, s] from one random byte stream."""
    stream = torch.randint(0, 256, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def gemm_rate(seconds=1.0, size=1024) -> float:
    """Dense fp32 GEMM FLOP/s on this process's threads now: the MFU denominator."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    times = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(times) < 3:
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * size ** 3 / statistics.median(times)


def fold_name(spec, data_parallel="fsdp", schedule=None) -> str:
    pp = f"pp{spec.pp} " if spec.pp > 1 else ""
    how = f" ({data_parallel}{', ' + schedule + f' x{MICROBATCHES} mb' if schedule else ''})" if spec.dp * spec.cp > 1 \
        or spec.edp > 1 or schedule else ""
    return (f"{spec.world_size} rank{'s' if spec.world_size > 1 else ''}: attn {pp}tp{spec.tp} cp{spec.cp} "
            f"dp{spec.dp} | moe {pp}etp{spec.etp} ep{spec.ep} edp{spec.edp}{how}")


# ------------------------------------------------------------------ (a) meshfold vs transformers
def part_a(rounds: int) -> dict:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = model_config()
    ours = MoETransformer(cfg)
    with tempfile.TemporaryDirectory() as path:
        save_pretrained(ours, path)
        hf = transformers.MixtralForCausalLM.from_pretrained(path)  # its defaults: sdpa, grouped_mm
    hf.train()
    tokens, targets = batch(B, S)
    with torch.no_grad():
        agree = (ours(tokens[:1]) - hf(tokens[:1]).logits).abs().max().item()
    if agree > 1e-3:
        raise RuntimeError(f"meshfold and transformers disagree on the logits by {agree:.2e}: not the same model")

    def stepper(model, logits_of):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)

        def step():
            logits = logits_of(model, tokens)
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    steps = {"meshfold": stepper(ours, lambda m, t: m(t)),
             "transformers": stepper(hf, lambda m, t: m(input_ids=t).logits)}
    peak = gemm_rate()
    for step in steps.values():  # warm-up: allocator, AdamW state
        step()
    times = {k: [] for k in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    peak = max(peak, gemm_rate())  # the better of before and after: other load only lowers it
    flops = train_flops_per_step(cfg, B, S)
    rows = []
    for name, ts in times.items():
        dt = statistics.median(ts)
        rows.append(dict(impl=name, step_s=dt, tokens_per_s=B * S / dt, tflops=flops / dt / 1e12,
                         mfu=flops / dt / peak, times=ts))
    hf_impl = dict(attn=hf.config._attn_implementation, experts=getattr(hf.config, "_experts_implementation", None))
    return dict(batch=B, seq=S, threads=1, flops_per_step=flops, peak_gemm_flops=peak,
                logits_max_diff=agree, hf_implementation=hf_impl, rows=rows)


# ------------------------------------------------------------------ (b) folds on gloo ranks
def _train_step(model, opt, tokens, targets, spec, rank) -> float:
    """One step of the folded ``model`` (any pp) as ``meshfold train`` runs it; the global loss."""
    lt, pos = shard_batch(tokens, spec, rank)
    ltg, _ = shard_batch(targets, spec, rank)
    loss = model.step(lt, ltg, pos)
    model.reduce_gradients()  # a no-op under FSDP2, which reduce-scattered in backward
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _build(world_size, kw):
    run = job(world_size, kw)
    torch.manual_seed(0)
    built = build(run, fold(run.spec))
    name = fold_name(run.spec, run.train.data_parallel, kw.get("schedule"))
    return run.spec, built.model, built.optimizer, name


def scaling_worker(rank, world_size, fold_kwargs: list, rounds: int) -> list:
    import torch.distributed as dist

    torch.set_num_threads(1)
    tokens, targets = batch(B, S)

    def summed_gemm_rate():  # all ranks at once: what the machine gives this many processes
        dist.barrier()
        rate = torch.tensor(gemm_rate(seconds=0.5), dtype=torch.float64)
        dist.all_reduce(rate)
        return rate.item()

    peak = summed_gemm_rate()
    out = []
    for kw in fold_kwargs:
        spec, model, opt, name = _build(world_size, kw)
        _train_step(model, opt, tokens, targets, spec, rank)  # warm-up
        times = []
        for _ in range(rounds):
            dist.barrier()
            t0 = time.perf_counter()
            _train_step(model, opt, tokens, targets, spec, rank)
            slowest = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times.append(slowest.item())
        out.append(dict(fold=name, step_s=statistics.median(times), times=times))
        del model, opt
        gc.collect()
    peak = max(peak, summed_gemm_rate())
    return [dict(r, peak_gemm_flops=peak) for r in out]


def part_b(rounds: int) -> dict:
    flops = train_flops_per_step(model_config(), B, S)
    rows = []
    for world, folds in FOLDS.items():
        for r in spawn(scaling_worker, world, folds, rounds, timeout=600)[0]:
            rows.append(dict(world_size=world, **r, tokens_per_s=B * S / r["step_s"],
                             mfu=flops / r["step_s"] / r["peak_gemm_flops"]))
    return dict(batch=B, seq=S, threads_per_rank=1, cpu_count=os.cpu_count(), flops_per_step=flops, rows=rows)


# ------------------------------------------------------------------ (c) memory vs cp
def memory_worker(rank, world_size) -> dict:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: tensors >= 64 KiB are mmapped, freed to the OS
    torch.set_num_threads(1)
    tokens, targets = batch(1, S_LONG)
    # whole replicas (no FSDP2), so weights, gradients and optimizer state are the same for every
    # cp and only activations can shrink
    spec, model, opt, _ = _build(world_size, dict(cp=world_size, data_parallel="allreduce"))
    _train_step(model, opt, tokens, targets, spec, rank)  # gradients, AdamW state, gloo buffers
    t0 = time.perf_counter()
    peak = peak_rss_mib(lambda: _train_step(model, opt, tokens, targets, spec, rank))
    dt = time.perf_counter() - t0
    grad_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return dict(rank=rank, peak_mib=peak, grads_mib=grad_bytes / 2 ** 20, step_s=dt)


def part_c() -> dict:
    rows = []
    for cp in (1, 2, 4):
        ranks = spawn(memory_worker, cp, timeout=600)
        peak = max(r["peak_mib"] for r in ranks)
        grads = ranks[0]["grads_mib"]
        rows.append(dict(cp=cp, tokens_per_rank=S_LONG // cp, peak_mib=peak, grads_mib=grads,
                         activations_mib=peak - grads, per_rank=ranks))
    for r in rows:
        r["vs_cp1"] = r["peak_mib"] / rows[0]["peak_mib"]
        r["activations_vs_cp1"] = r["activations_mib"] / rows[0]["activations_mib"]
    return dict(seq=S_LONG, batch=1, method="VmHWM - VmRSS around one training step, per rank (max over ranks)",
                rows=rows)


# ------------------------------------------------------------------ (d) eager vs compiled, fp32 vs bf16
STEP_MODELS = {  # name -> (model fields, MoE fields, batch, seq)
    "issue": (dict(hidden=512, layers=4, ffn=1024), dict(ffn=1024), 8, 512),  # tiny-mixtral's heads and experts
    "100m": (dict(hidden=768, layers=4, heads=12, kv_heads=4, ffn=1280), dict(ffn=1280, num_experts=8), 4, 512),
}
VARIANTS = [(False, "float32"), (False, "bfloat16"), (True, "float32"), (True, "bfloat16")]  # (compile, dtype)


def step_config(name):
    fields, moe, _, seq = STEP_MODELS[name]
    base = get_config("tiny-mixtral")
    return replace(base, **fields, max_seq=seq, moe=replace(base.moe, hidden=fields["hidden"], topk=2, **moe))


def _rank_gemm_rates(shape, seconds=0.5) -> dict:
    """This rank's GEMM FLOP/s at ``shape`` (m, k, n) in fp32 and bf16, interleaved."""
    m, k, n = shape
    rates = {}
    for dtype in (torch.float32, torch.bfloat16) * 2:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        a @ b
        count, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ b
            count += 1
        rates[str(dtype)] = max(rates.get(str(dtype), 0), 2 * m * k * n * count / (time.perf_counter() - t0))
    return rates


def compile_worker(rank, world_size, name, rounds: int) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    cfg = step_config(name)
    fields, moe, b, s = STEP_MODELS[name]
    tokens, targets = batch(b, s)
    runs = {}
    for compiled, dtype in VARIANTS:
        run = job(world_size, dict(tp=2, ep=4), model={**fields, "max_seq": s}, moe={**moe, "topk": 2},
                  compile=compiled, dtype=dtype)
        torch.manual_seed(0)
        built = build(run, fold(run.spec))
        runs[(compiled, dtype)] = built.model, built.optimizer
    spec = run.spec

    def step(key):
        model, opt = runs[key]
        dist.barrier()
        t0 = time.perf_counter()
        loss = _train_step(model, opt, tokens, targets, spec, rank)
        slowest = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return slowest.item(), loss

    first = {key: step(key) for key in runs}  # compilation, allocator, AdamW state
    times = {key: [] for key in runs}
    losses = {key: [first[key][1]] for key in runs}
    for _ in range(rounds):
        for key in runs:
            dt, loss = step(key)
            times[key].append(dt)
            losses[key].append(loss)
    dist.barrier()
    rates = _rank_gemm_rates((b * s // 2, cfg.hidden, cfg.ffn))  # 2 x 2 ranks per core: one rank's share
    summed = torch.tensor([rates["torch.float32"], rates["torch.bfloat16"]], dtype=torch.float64)
    dist.all_reduce(summed)
    params = sum(p.numel() for p in MoETransformer(cfg, device="meta").parameters())
    return dict(model=name, params=params, batch=b, seq=s, fold=fold_name(spec),
                gemm_flops=dict(float32=summed[0].item(), bfloat16=summed[1].item()),
                rows=[dict(compile=c, dtype=d, first_step_s=first[(c, d)][0], step_s=statistics.median(times[(c, d)]),
                           tokens_per_s=b * s / statistics.median(times[(c, d)]), times=times[(c, d)],
                           losses=losses[(c, d)]) for c, d in runs])


def part_d(rounds: int) -> dict:
    out = {}
    for name in STEP_MODELS:
        r = spawn(compile_worker, 4, name, rounds, timeout=1200)[0]
        base = next(row["tokens_per_s"] for row in r["rows"] if not row["compile"] and row["dtype"] == "float32")
        for row in r["rows"]:
            row["vs_eager_fp32"] = row["tokens_per_s"] / base
        out[name] = r
    return out


# ------------------------------------------------------------------ (e) a2a_overlap off vs on
OVERLAP_MODEL = (dict(hidden=512, layers=4, heads=8, kv_heads=4, head_dim=64, ffn=1024, max_seq=512),
                 dict(ffn=1024, num_experts=8, topk=2), 16, 512)  # model, MoE, batch, seq
OVERLAP_FOLDS = [  # (name, fold, train settings): 4 ranks
    ("dp4 | ep4, fsdp, 4 micro-batches", dict(ep=4), dict(microbatches=4)),
    ("dp4 | ep4, allreduce, 4 micro-batches", dict(ep=4, data_parallel="allreduce"), dict(microbatches=4)),
    ("pp2 x dp2 | pp2 x ep2, fsdp, dualpipev, 4 micro-batches", dict(pp=2, ep=2),
     dict(schedule="dualpipev", virtual=2, microbatches=4)),
    ("pp2 x dp2 | pp2 x ep2, fsdp, 1f1b (combined), 4 micro-batches", dict(pp=2, ep=2),
     dict(schedule="1f1b", microbatches=4)),
]


def overlap_worker(rank, world_size, rounds: int) -> list:
    """Per fold of OVERLAP_FOLDS: the step with ``train.a2a_overlap`` off and on, built side by
    side by ``build`` and timed interleaved (the slowest rank's step), with each rank's time
    blocked in expert all-to-all waits (off: every wait; on: the wait after the other
    micro-batch's turn, TurnStats.wait_s) and rank 0's TurnStats."""
    import torch.distributed as dist

    from meshfold.runtime import overlap

    torch.set_num_threads(1)
    blocked = [0.0]
    wait_for = overlap.wait_for

    def timed(work):  # outside turns every wait blocks; inside, TurnStats times it after the hand-over
        if overlap.in_turns():
            return wait_for(work)
        t0 = time.perf_counter()
        wait_for(work)
        blocked[0] += time.perf_counter() - t0

    overlap.wait_for = timed
    fields, moe, b, s = OVERLAP_MODEL
    tokens, targets = batch(b, s)
    rows = []
    for name, fold_kwargs, settings in OVERLAP_FOLDS:
        runs = {}
        for on in (False, True):
            run = job(world_size, fold_kwargs, model=fields, moe=moe, batch=b, seq=s, a2a_overlap=on, **settings)
            torch.manual_seed(0)
            built = build(run, fold(run.spec))
            runs[on] = built.model, built.optimizer
        spec = run.spec

        def step(on):
            model, opt = runs[on]
            blocked[0] = 0.0
            dist.barrier()
            t0 = time.perf_counter()
            loss = _train_step(model, opt, tokens, targets, spec, rank)
            out = torch.tensor([time.perf_counter() - t0, blocked[0] + model.overlap_stats().wait_s],
                               dtype=torch.float64)
            dist.all_reduce(out, op=dist.ReduceOp.MAX)
            return out[0].item(), out[1].item(), loss, model.overlap_stats()

        for on in runs:  # warm-up: allocator, AdamW state, the turn threads' caches
            step(on)
        seen = {on: [] for on in runs}
        for _ in range(rounds):
            for on in runs:
                seen[on].append(step(on))
        row = dict(fold=name)
        for on, key in ((False, "off"), (True, "on")):
            row[key] = dict(step_s=statistics.median(x[0] for x in seen[on]),
                            blocked_s=statistics.median(x[1] for x in seen[on]),
                            losses=[x[2] for x in seen[on]])
        turns = seen[True][-1][3]
        row["turns"] = dict(waited=turns.waited, crossed=turns.crossed, arrived=turns.arrived)
        row["ratio"] = row["on"]["step_s"] / row["off"]["step_s"]
        rows.append(row)
        del runs
        gc.collect()
    overlap.wait_for = wait_for
    return rows


def part_e(rounds: int) -> dict:
    fields, moe, b, s = OVERLAP_MODEL
    return dict(model=dict(fields, **{f"moe_{k}": v for k, v in moe.items()}), batch=b, seq=s,
                rows=spawn(overlap_worker, 4, rounds, timeout=1800)[0])


def print_part_e(e: dict) -> None:
    print(f"\n(e) train.a2a_overlap off vs on, 4 gloo ranks (1 thread each), batch {e['batch']} x {e['seq']}, "
          f"hidden {e['model']['hidden']}, {e['model']['layers']} MoE layers of {e['model']['moe_num_experts']} "
          f"experts")
    print("| fold | step off (s) | step on (s) | on / off | blocked in a2a off (s) | on (s) | "
          "crossed / waited | arrived / crossed |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in e["rows"]:
        t = r["turns"]
        print(f"| {r['fold']} | {r['off']['step_s']:.3f} | {r['on']['step_s']:.3f} | {r['ratio']:.2f} | "
              f"{r['off']['blocked_s']:.3f} | {r['on']['blocked_s']:.3f} | {t['crossed']} / {t['waited']} | "
              f"{t['arrived']} / {t['crossed']} |")


# ------------------------------------------------------------------ report
def print_tables(res: dict) -> None:
    if "a" in res:
        a = res["a"]
        print(f"\n(a) training step, batch {a['batch']} x {a['seq']}, 1 thread; dense fp32 GEMM peak "
              f"{a['peak_gemm_flops'] / 1e9:.1f} GFLOP/s; {a['flops_per_step'] / 1e9:.1f} GFLOP/step; "
              f"logits agree to {a['logits_max_diff']:.1e}; transformers: {a['hf_implementation']}")
        print("| implementation | step (s) | tokens/s | GFLOP/s | MFU |\n|---|---:|---:|---:|---:|")
        for r in a["rows"]:
            print(f"| {r['impl']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['tflops'] * 1e3:.1f} "
                  f"| {100 * r['mfu']:.1f}% |")
    if "b" in res:
        b = res["b"]
        print(f"\n(b) folded training step on gloo, global batch {b['batch']} x {b['seq']}, 1 thread per rank, "
              f"{b['cpu_count']} CPUs")
        print("| fold | step (s) | tokens/s | MFU (vs the ranks' summed GEMM rate) |\n|---|---:|---:|---:|")
        for r in b["rows"]:
            print(f"| {r['fold']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% |")
    if "c" in res:
        c = res["c"]
        print(f"\n(c) per-rank peak memory of a training step, one sequence of {c['seq']} tokens, fold cp = ranks "
              f"({c['method']})")
        print("| cp | tokens/rank | peak (MiB) | vs cp=1 | grads (MiB) | peak - grads (MiB) | vs cp=1 |\n"
              "|---:|---:|---:|---:|---:|---:|---:|")
        for r in c["rows"]:
            print(f"| {r['cp']} | {r['tokens_per_rank']} | {r['peak_mib']:.0f} | {r['vs_cp1']:.2f} | "
                  f"{r['grads_mib']:.0f} | {r['activations_mib']:.0f} | {r['activations_vs_cp1']:.2f} |")


def print_part_d(d: dict) -> None:
    print("\n(d) training step on 4 gloo ranks (1 thread each), eager vs train.compile, fp32 vs bf16 compute")
    print("| model | params | compile | compute | first step (s) | step (s) | tokens/s | vs eager fp32 |\n"
          "|---|---:|---|---|---:|---:|---:|---:|")
    for r in d.values():
        for row in r["rows"]:
            print(f"| {r['model']} ({r['batch']} x {r['seq']}) | {r['params'] / 1e6:.0f}M | "
                  f"{'on' if row['compile'] else 'off'} | {row['dtype']} | {row['first_step_s']:.1f} | "
                  f"{row['step_s']:.2f} | {row['tokens_per_s']:,.0f} | {row['vs_eager_fp32']:.2f} |")
    for r in d.values():
        g = r["gemm_flops"]
        print(f"- {r['model']}: the ranks' summed GEMM rate at the MLP's shape, fp32 {g['float32'] / 1e9:.0f} "
              f"GFLOP/s, bf16 {g['bfloat16'] / 1e9:.0f} GFLOP/s (bf16 / fp32 = {g['bfloat16'] / g['float32']:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="abc", help="any of a, b, c, d, e")
    ap.add_argument("--rounds", type=int, default=5, help="timed steps per implementation (a) / fold (b)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    res = dict(torch=torch.__version__, machine=platform.machine(), processor=platform.processor(),
               cpu_count=os.cpu_count())
    if "a" in args.parts:
        res["a"] = part_a(args.rounds)
    if "b" in args.parts:
        res["b"] = part_b(max(3, args.rounds - 2))
    if "c" in args.parts:
        res["c"] = part_c()
    if "d" in args.parts:
        res["d"] = part_d(args.rounds)
    if "e" in args.parts:
        res["e"] = part_e(args.rounds)
    print_tables(res)
    if "d" in res:
        print_part_d(res["d"])
    if "e" in res:
        print_part_e(res["e"])
    out = ROOT / "benchmarks" / "results" / "model.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    kept = json.loads(out.read_text()) if out.exists() else {}  # parts not run this time stay
    kept.update(res)
    kept[f"{args.parts}_wall_s"] = time.perf_counter() - t0
    out.write_text(json.dumps(kept, indent=2) + "\n")
    print(f"\nwrote {out.relative_to(ROOT)} ({kept[f'{args.parts}_wall_s']:.0f} s)")


if __name__ == "__main__":
    from meshfold.runtime.machine import print_machine

    print_machine()  # the CPU and its bf16 instructions: a timing means nothing without them
    main()
