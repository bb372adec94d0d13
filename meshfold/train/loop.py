"""The per-rank training loop of ``meshfold train``.

Every rank describes the same model on the meta device (same seed), lays it out on the folded
mesh and materializes only its own shards, then trains on its slice of each global batch (batch
over dp, sequence over cp x tp; with pp, through the pipeline schedule). ``model.loss`` is the global mean loss on every rank, and each rank's backward is its
share: the sum of its tokens' cross-entropy over the global token count, so the gradients add up
to the single-device ones. Rank 0 shows progress and writes metrics.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshfold.runtime.malloc import retain_freed_memory
from meshfold.mesh import backend_device_type, fold
from meshfold.parallel.pipeline import Pipeline
from meshfold.models.transformer import MoETransformer
from meshfold.parallel.transformer import parallelize
from meshfold.parallel.compile import compile_model
from meshfold.parallel.batch import batch_rows, shard_batch
from meshfold.parallel.data_parallel import grad_norm, reduce_gradients
from meshfold.plan.hardware import HARDWARE
from meshfold.plan.placement import static
from meshfold.train import checkpoint, faults
from meshfold.train.config import TrainConfig
from meshfold.train.expert_load import ep_load_metrics
from meshfold.train.flops import train_flops_per_step
from meshfold.train.metrics_log import resume_metrics, write_row
from meshfold.train.optim import build_optimizer, lr_at
from meshfold.train.progress import Progress
from meshfold.train.tracking import Profiler, StepMemory, Trackers
from meshfold.train.pruning import FoldedPruner
from meshfold.train.rebalance import Rebalancer
from meshfold.train.rundir import resume_point

__all__ = ["train_rank", "accumulate", "microbatch_counts"]

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def _measure_peak(seconds: float = 0.5, device=None, dtype=torch.float32) -> float:
    """Dense GEMM FLOP/s this process reaches now in the training dtype (all ranks measure at
    once, so the sum is what the machine gives this layout): the MFU denominator, measured in the
    same run."""
    size = 384 if device is None or device.type == "cpu" else 4096
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * size ** 3 * n / (time.perf_counter() - t0)


def _global_loss(model, tokens, targets, spec, rank, backward: bool, microbatches: int = 1) -> float:
    """The global mean loss of one batch (the same on every rank); with ``backward`` its
    gradients accumulate. ``model`` is a parallelized MoETransformer or a Pipeline (which
    micro-batches through its schedule); without pp, ``microbatches`` > 1 accumulates gradients
    over that many slices of each rank's local batch (see :func:`accumulate`)."""
    device = next(model.parameters()).device
    lt, pos = (x.to(device) for x in shard_batch(tokens, spec, rank))
    ltg = shard_batch(targets, spec, rank)[0].to(device)
    if isinstance(model, Pipeline):
        return model.step(lt, ltg, pos, backward=backward).item()
    if microbatches > 1:
        return accumulate(model, lt, ltg, pos, microbatch_counts(ltg, microbatches), backward)
    loss = model.loss(lt, ltg, pos)
    if backward:
        loss.backward()
    return loss.item()


def microbatch_counts(local_targets_bs: torch.Tensor, microbatches: int) -> list[float]:
    """Counted target tokens (!= -100) of each global micro-batch, from this rank's own [b, s]
    targets: micro-batch i is the i-th slice of every dp rank's rows, and without pp every
    global token sits on exactly one rank, so one all-reduce of the local counts sums them."""
    b = local_targets_bs.shape[0]
    counts_m = (local_targets_bs.reshape(microbatches, b // microbatches, -1) != -100).sum(dim=(1, 2)).double()
    dist.all_reduce(counts_m)
    return counts_m.tolist()


def accumulate(model, tokens_bs, targets_bs, positions, counts: list[float], backward: bool) -> float:
    """Gradient accumulation without pp: this rank's local ``tokens_bs`` / ``targets_bs`` ([b, s])
    cut into ``len(counts)`` micro-batches along the batch dim, one forward + backward each.

    ``model.loss`` of micro-batch i is its global mean, ``sum_i / counts[i]``; weighting it by
    ``counts[i] / sum(counts)`` makes the micro-batches add up to the whole batch's mean loss and
    gradients (up to summation order), as Pipeline's schedules do. MoE balancing losses are
    computed per micro-batch (Megatron-Core's definition) and each enters the backward scaled by
    1 / microbatches, as under Pipeline and in Megatron-Core (``MoELayer.balancing_scale``), so
    their gradient is the mean over the micro-batches. Under FSDP2 only the last backward
    reduce-scatters.
    """
    m, total = len(counts), sum(counts)
    sync = getattr(model, "set_requires_gradient_sync", None)
    layers = model.moe_layers()
    for layer in layers:
        layer.balancing_scale = 1 / m
    loss = 0.0
    try:
        for i, (tokens_ms, targets_ms) in enumerate(zip(tokens_bs.chunk(m), targets_bs.chunk(m))):
            if sync is not None and backward:
                sync(i == m - 1)
            part = model.loss(tokens_ms, targets_ms, positions) * (counts[i] / total)
            if backward:
                part.backward()
            loss += part.item()
    finally:
        for layer in layers:
            layer.balancing_scale = 1.0
    return loss


def _all_sum(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().clone().double()
    dist.all_reduce(t)
    return t


def _rank_device() -> torch.device:
    """This rank's compute device, from the process group's config: under gloo (local spawn, or
    torchrun on CPUs) the CPU; under NCCL (torchrun on GPUs, as ``nccl`` or ``cpu:gloo,cuda:nccl``)
    the GPU the launcher selected from LOCAL_RANK."""
    device_type = backend_device_type()
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if device_type != "cpu":
        raise ValueError(f"process group backend {dist.get_backend_config()!r} computes on {device_type!r}; "
                         f"meshfold train runs on 'cpu' (gloo) or 'cuda' (nccl)")
    return torch.device("cpu")


def train_rank(rank: int, world_size: int, cfg: TrainConfig) -> dict:
    spec, mcfg = cfg.validate()
    t = cfg.train
    injected = faults.parse()
    out = Path(t.out_dir)
    ckpt_dir = out / "checkpoints"
    torch.manual_seed(t.seed)
    device = _rank_device()
    if device.type == "cpu" and t.retain_cpu_memory:
        retain_freed_memory()  # reuse large activation buffers across steps (meshfold.runtime.malloc)
    folded = fold(spec, device.type)
    compute = DTYPES[t.dtype]
    last = resume_point(out, t.resume)  # rank 0's choice, once every rank sees the folder
    if t.init_from is not None and last is None:  # (a resume reads its own checkpoint instead)
        from meshfold.interop.hf import from_pretrained
        from meshfold.parallel.recompute import apply_recompute

        # laid out as parallelize lays it out, each rank reading only its own slices (pp = 1)
        model = from_pretrained(t.init_from, mesh=folded, dtype=DTYPES[t.master_dtype], cfg=mcfg,
                                compute_dtype=compute)
        apply_recompute(model.layers, t.recompute)
    else:
        # built on the meta device: parallelize / Pipeline lay it out, then each rank materializes
        # only its own shards on its device (the same global weights on every fold, for this seed)
        model = MoETransformer(mcfg, dtype=DTYPES[t.master_dtype], device="meta")  # master weights
        if spec.pp > 1:  # from here on, "model" is this rank's pipeline chunks
            model = Pipeline(model, folded, t.microbatches or spec.pp, t.schedule, t.virtual,
                             data_parallel=t.data_parallel, compute_dtype=compute, recompute=t.recompute)
        else:
            parallelize(model, folded, data_parallel=t.data_parallel, compute_dtype=compute, recompute=t.recompute)
    if t.compile:
        for module in model.chunks if isinstance(model, Pipeline) else [model]:
            compile_model(module)
    opt = build_optimizer(model, t)
    from meshfold.data.corpus import load_corpus
    from meshfold.data.mixture import load_mixture

    corpus = (load_mixture(cfg.data.paths, cfg.data.weights, cfg.data.val_fraction) if cfg.data.weights
              else load_corpus(cfg.data.paths or None, cfg.data.val_fraction))
    own_rows = batch_rows(t.batch, spec, rank)  # the only rows of each global batch this rank reads
    sp = mcfg.moe.expert_sparsity if mcfg.moe is not None else None
    pruner = FoldedPruner(model, sp, opt) if sp is not None else None
    start, skipped = 0, 0
    resumed_from = None
    rebalancer = Rebalancer(model, t.rebalance_every, spec.ep) if t.expert_placement == "balanced" else None
    if last is not None:
        state = checkpoint.load(last, model, opt)
        start, skipped = state["step"], state.get("skipped", 0)
        resumed_from = str(last)
        saved = state.get("expert_placement")  # the weights are saved in expert order whatever it is
        if rebalancer is not None and saved and saved["ep"] == spec.ep:
            rebalancer.restore(saved["slots"], opt)
    peak = _all_sum(torch.tensor(_measure_peak(device=device, dtype=DTYPES[t.dtype]), device=device)).item()
    peak_hw = hardware_peak(t, world_size)
    flops = train_flops_per_step(mcfg, t.batch, t.seq)
    n_global = t.batch * t.seq
    if rank == 0 and (note := resume_metrics(out / "metrics.jsonl", start, skipped, resumed_from or "")):
        print(note, flush=True)
    metrics_file = open(out / "metrics.jsonl", "a") if rank == 0 else None
    progress = Progress(t.steps, start) if rank == 0 else None
    memory = StepMemory(device, t.tensor_memory, state=lambda: _state_tensors(model, opt))
    profiler = Profiler(t, out, rank, device)
    trackers = Trackers(t, out, start) if rank == 0 else None
    if rank == 0 and resumed_from:
        print(f"resumed from {resumed_from} at step {start}", flush=True)
    last_good = resumed_from
    history = []
    # each MoE layer's expert placement (meshfold.plan.placement) during the step: the metrics'
    # per-ep-rank rows follow it; a balanced run's placements change between steps
    expert_slots = [static(mcfg.moe.num_experts, spec.ep) for _ in mcfg.moe_layer_ids]
    end = t.steps if t.stop_at is None else min(t.steps, t.stop_at)
    for step in range(start, end):
        n = step + 1  # steps are counted from 1 in logs, checkpoints and settings
        profiler.begin(n)
        with memory.step():  # this rank's peaks over the step, its evaluation excluded
            t0 = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = lr_at(n, t)
            tokens, targets = corpus.batch("train", step, t.batch, t.seq, t.seed, rows=own_rows)
            for layer in model.moe_layers():
                layer.reset_step()  # the step's MoE metrics cover all of its micro-batches
            if rebalancer is not None:
                expert_slots = [tuple(slots) for slots in rebalancer.placements()]
            faults.before_step(injected, rank, n)
            loss = _global_loss(model, tokens, targets, spec, rank, backward=True,
                                microbatches=t.microbatches or 1)  # the same on every rank
            if faults.loss_is_nan(injected, n):
                loss = float("nan")  # all ranks stop or skip together
            if math.isfinite(loss):
                record = _update(model, opt, pruner, t, n, loss, skipped, n_global, flops, (peak_hw, peak), t0)
                if rebalancer is not None:  # outside step_s: its cost is recorded apart
                    placed = rebalancer.after_step(n, record["tokens_per_expert"], opt)
                    if placed is not None:
                        record["expert_placement"] = placed
        if math.isfinite(loss):
            record["memory"] = memory.gather()  # every rank's peaks of the step (a collective)
            if "tokens_per_expert" in record:
                record.update(ep_load_metrics(record["tokens_per_expert"], expert_slots, spec.ep))
            if cfg.data.weights:  # the mixture's draw, summed over a run to check it against the weights
                record["data_rows"] = corpus.rows_by_source(step, t.batch, t.seed)
            if n % t.eval_every == 0 or n == t.steps:
                record["val_loss"] = evaluate(model, corpus, cfg, spec, rank)
                for name, part in getattr(corpus, "parts", {}).items():
                    record.setdefault("val_loss_by_source", {})[name] = evaluate(model, part, cfg, spec, rank)
            if rank == 0:
                write_row(metrics_file, record)
                progress.update(record)
                trackers.log(record)
            history.append(record)
        elif t.skip_nonfinite:
            opt.zero_grad(set_to_none=True)
            for layer in model.moe_layers():
                layer.discard_bias_counts()  # this step's routing must not steer the bias
            skipped += 1
            if rank == 0:
                progress.note(f"step {n}: loss {loss} is not finite: skipped (train.skip_nonfinite; "
                              f"{skipped} skipped so far)")
        else:
            raise FloatingPointError(
                f"non-finite loss {loss} at step {n}; last good checkpoint: "
                f"{last_good or 'none (no checkpoint saved yet)'}; set train.skip_nonfinite=true "
                f"to skip such steps instead")
        if n % t.ckpt_every == 0 or n == end:  # skipped steps too: the schedule stays on time
            state = {"step": n, "skipped": skipped, "fold": cfg.fold, "model": cfg.model,
                     "moe": cfg.moe, "sparsity": cfg.sparsity, "seed": t.seed,
                     "dtype": t.dtype, "master_dtype": t.master_dtype,
                     "world_size": world_size, "train_steps": t.steps, "init_from": t.init_from}
            if rebalancer is not None:
                state["expert_placement"] = {"ep": spec.ep, "slots": rebalancer.placements()}
            crash = faults.crash_in_save(injected, n)
            last_good = str(checkpoint.save(ckpt_dir, n, model, opt, state, crash_before_rename=crash))
        profiler.end(n)
    if rank == 0:
        progress.close()
        metrics_file.close()
        trackers.close()
    return {"final_loss": history[-1]["loss"] if history else None, "steps": len(history),
            "start": start, "checkpoint": last_good}


def _state_tensors(model, opt):
    """The tensors a step starts with: weights, buffers, gradients and the optimizer's state."""
    for p in model.parameters():
        yield p
        yield p.grad
    for _, b in model.named_buffers():
        yield b
    for state in opt.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def hardware_peak(t, world_size: int) -> float | None:
    """The job's peak FLOP/s from ``train.peak_tflops`` or the ``train.gpu`` preset (dense BF16,
    shared with ``meshfold plan``), or None where neither is set (a CPU has no datasheet peak)."""
    per_rank = t.peak_tflops or (HARDWARE[t.gpu].peak_tflops if t.gpu else None)
    return per_rank * 1e12 * world_size if per_rank else None


def _update(model, opt, pruner, t, n, loss, skipped, n_global, flops, peaks, t0) -> dict:
    """Reduce gradients, prune, clip, step; returns step ``n``'s metrics.

    ``peaks`` = (hardware peak or None, measured GEMM rate), both FLOP/s of the whole job: ``mfu``
    is model FLOP/s over the hardware peak, as Megatron-Core and the paper report it;
    ``mfu_of_measured_gemm`` is over the dense GEMM rate these ranks reached in this run."""
    peak_hw, peak = peaks
    for module in model.chunks if isinstance(model, Pipeline) else [model]:
        reduce_gradients(module)  # a no-op under FSDP2, which reduce-scattered in backward
    if pruner is not None:
        pruner.accumulate()
        pruner.step(n)  # between backward and optimizer.step, as TilePruner wants
    gnorm = grad_norm(model).item()
    if t.grad_clip and gnorm > t.grad_clip:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(t.grad_clip / gnorm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    for layer in model.moe_layers():
        if layer.cfg.expert_bias:
            layer.update_expert_bias()
    dt = time.perf_counter() - t0
    record = {"step": n, "loss": loss, "lr": opt.param_groups[0]["lr"], "grad_norm": gnorm,
              "tokens_per_s": n_global / dt, "mfu": flops / dt / peak_hw if peak_hw else None,
              "mfu_of_measured_gemm": flops / dt / peak, "step_s": dt,
              "skipped_steps": skipped}
    moe = _moe_metrics(model)
    if moe:
        record["aux_losses"] = {k: sum(m["losses"][k] for m in moe) for k in moe[0]["losses"]}
        record["tokens_per_expert"] = [m["tokens_per_expert"] for m in moe]
        record["dropped_fraction"] = sum(m["dropped_fraction"] for m in moe) / len(moe)
    if pruner is not None:
        record.update(pruner.metrics())
    return record


def _moe_metrics(model) -> list[dict]:
    """Per MoE layer, in layer order, over every micro-batch of the step: losses, tokens per
    expert, dropped fraction (collective: ``step_metrics`` sums over the stage's ranks; with pp,
    the stages' layers are gathered)."""
    mine = []
    for i, b in model.moe_blocks():
        m = b.mlp.step_metrics()
        mine.append((i, {"losses": {k: float(v) for k, v in m["losses"].items()},
                         "tokens_per_expert": m["tokens_per_expert"].tolist(),
                         "dropped_fraction": float(m["dropped_fraction"])}))
    if not isinstance(model, Pipeline):
        return [m for _, m in mine]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [m for _, m in sorted({i: m for part in everyone for i, m in part}.items())]


@torch.no_grad()
def evaluate(model, corpus, cfg, spec, rank) -> float:
    """Mean held-out loss over ``eval_batches`` fixed validation batches."""
    t = cfg.train
    rows = batch_rows(t.batch, spec, rank)
    total = 0.0
    model.eval()
    try:
        for i in range(t.eval_batches):
            tokens, targets = corpus.batch("val", i, t.batch, t.seq, t.seed, rows=rows)
            total += _global_loss(model, tokens, targets, spec, rank, backward=False)
    finally:
        model.train()
    return total / t.eval_batches
