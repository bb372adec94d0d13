"""The per-rank training loop of ``meshfold train``: build, restore, loop, finish.

Every rank builds the same job (:func:`meshfold.train.build.build`: the model described on the
meta device with the same seed, laid out on the folded mesh as a
:class:`~meshfold.parallel.pipeline.Pipeline`, each rank materializing only its own shards),
then trains on its slice of each global batch (batch over dp, sequence over cp x tp) through the
model's schedule (pipeline stages with pp > 1, gradient accumulation with pp = 1). The step's
loss is the global mean loss on every rank, and each rank's backward is its share: the sum of
its tokens' cross-entropy over the global token count, so the gradients add up to the
single-device ones. Rank 0 shows progress and writes metrics.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshfold.runtime.malloc import retain_freed_memory
from meshfold.mesh import backend_device_type, fold
from meshfold.models.mtp import mtp_targets
from meshfold.parallel.pipeline import Pipeline
from meshfold.parallel.batch import batch_rows, shard_batch
from meshfold.parallel.data_parallel import grad_norm
from meshfold.plan.hardware import HARDWARE
from meshfold.plan.placement import static
from meshfold.train import checkpoint, faults
from meshfold.train.build import DTYPES, Built, build
from meshfold.train.config import Resolved
from meshfold.train.expert_load import ep_load_metrics
from meshfold.train.flops import train_flops_per_step
from meshfold.train.metrics_log import resume_metrics, write_row
from meshfold.train.optim import lr_at
from meshfold.train.progress import Progress
from meshfold.train.rundir import resume_point
from meshfold.train.tracking import Profiler, StepMemory, Trackers

__all__ = ["train_rank", "evaluate", "hardware_peak"]


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


def _global_loss(model: Pipeline, tokens, targets, spec, rank, backward: bool) -> float:
    """The global mean loss of one global batch (the same on every rank), this rank's rows of it
    run through ``model``'s schedule (micro-batches, gradient accumulation with pp = 1); with
    ``backward`` its gradients accumulate."""
    return _global_loss_parts(model, tokens, targets, spec, rank, backward)[0]


def _global_loss_parts(model: Pipeline, tokens, targets, spec, rank, backward: bool, mtp_depth: int = 0
                       ) -> tuple[float, dict]:
    """:func:`_global_loss` and the loss's parts for the metrics: with ``mtp_depth`` > 0,
    ``loss`` (the main head's cross-entropy), ``mtp_loss`` (the mean over the depths) and
    ``mtp_losses`` (each depth's); the first value is then the objective ``loss +
    model.mtp_loss_weight * mtp_loss``."""
    device = next(model.parameters()).device
    if mtp_depth:  # every depth's targets side by side, before the sequence is cut over cp x tp
        targets = mtp_targets(targets, mtp_depth)
    lt, pos = (x.to(device) for x in shard_batch(tokens, spec, rank))
    ltg = shard_batch(targets, spec, rank)[0].to(device)
    loss, parts = model.step_parts(lt, ltg, pos, backward=backward)
    named = {}
    if "mtp" in parts:
        named = {"loss": float(parts["main"]), "mtp_loss": float(parts["mtp"]),
                 "mtp_losses": [float(x) for x in parts["mtp_depths"]]}
    return loss.item(), named


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


def train_rank(rank: int, world_size: int, run: Resolved) -> dict:
    """Train ``run`` on this rank: build, restore, loop, finish. Returns the final loss, the
    steps trained, the step started from and the newest checkpoint."""
    t = run.train
    injected = faults.parse()
    out = Path(t.out_dir)
    torch.manual_seed(t.seed)
    device = _rank_device()
    if device.type == "cpu" and t.retain_cpu_memory:
        retain_freed_memory()  # reuse large activation buffers across steps (meshfold.runtime.malloc)
    folded = fold(run.spec, device.type)
    last = resume_point(out, t.resume)  # rank 0's choice, once every rank sees the folder
    built = build(run, folded, init_from=last is None)  # a resume reads its own checkpoint instead
    from meshfold.data.corpus import load_corpus
    from meshfold.data.mixture import load_mixture

    data = run.cfg.data
    corpus = (load_mixture(data.paths, data.weights, data.val_fraction) if data.weights
              else load_corpus(data.paths or None, data.val_fraction))
    start, skipped = _restore(last, built, run.spec)
    if rank == 0 and (note := resume_metrics(out / "metrics.jsonl", start, skipped, str(last or ""))):
        print(note, flush=True)  # the rows the checkpoint covers are kept, a torn or later row is not
    log = _Log(run, rank, world_size, device, built, start)
    if rank == 0 and last is not None:
        print(f"resumed from {last} at step {start}", flush=True)
    history, last_good = _loop(run, rank, world_size, built, corpus, log, injected, start, skipped,
                               str(last) if last is not None else None)
    log.close()
    return {"final_loss": history[-1]["loss"] if history else None, "steps": len(history),
            "start": start, "checkpoint": last_good}


def _restore(last, built: Built, spec) -> tuple[int, int]:
    """Load checkpoint ``last`` (None: a fresh run) into ``built``; returns (step, skipped steps)."""
    if last is None:
        return 0, 0
    state = checkpoint.load(last, built.model, built.optimizer)
    saved = state.get("expert_placement")  # the weights are saved in expert order whatever it is
    if built.rebalancer is not None and saved and saved["ep"] == spec.ep:
        built.rebalancer.restore(saved["slots"], built.optimizer, saved.get("copies"), saved.get("cuts"))
    return state["step"], state.get("skipped", 0)


class _Log:
    """Where a rank's steps are measured and shown: the job's peak FLOP/s, metrics.jsonl, the
    progress line and trackers (rank 0), memory peaks and the profiler."""

    def __init__(self, run: Resolved, rank: int, world_size: int, device, built: Built, start: int):
        t, out = run.train, Path(run.train.out_dir)
        self.rank = rank
        measured = _all_sum(torch.tensor(_measure_peak(device=device, dtype=DTYPES[t.dtype]), device=device)).item()
        self.peaks = (hardware_peak(t, world_size), measured)
        self.flops = train_flops_per_step(run.model, t.batch, t.seq)
        self.metrics_file = open(out / "metrics.jsonl", "a") if rank == 0 else None
        self.progress = Progress(t.steps, start) if rank == 0 else None
        self.memory = StepMemory(device, t.tensor_memory, state=lambda: _state_tensors(built.model, built.optimizer))
        self.profiler = Profiler(t, out, rank, device)
        self.trackers = Trackers(t, out, start) if rank == 0 else None

    def write(self, record: dict) -> None:
        if self.rank == 0:
            write_row(self.metrics_file, record)
            self.progress.update(record)
            self.trackers.log(record)

    def note(self, text: str) -> None:
        if self.rank == 0:
            self.progress.note(text)

    def close(self) -> None:
        if self.rank == 0:
            self.progress.close()
            self.metrics_file.close()
            self.trackers.close()


def _loop(run: Resolved, rank, world_size, built: Built, corpus, log: _Log, injected, start: int,
          skipped: int, last_good: str | None) -> tuple[list[dict], str | None]:
    """Steps ``start + 1`` .. the run's end: train, record, evaluate, checkpoint. Returns the
    metrics rows and the newest checkpoint."""
    t, spec, model, opt = run.train, run.spec, built.model, built.optimizer
    own_rows = batch_rows(t.batch, spec, rank)  # the only rows of each global batch this rank reads
    history = []
    # each MoE layer's expert placement (meshfold.plan.placement) during the step: the metrics'
    # per-ep-rank rows follow it; a balanced run's placements change between steps
    expert_slots = [static(run.model.moe.num_experts, spec.ep) for _ in run.model.moe_layer_ids]
    expert_copies = expert_cuts = None
    end = t.steps if t.stop_at is None else min(t.steps, t.stop_at)
    for step in range(start, end):
        n = step + 1  # steps are counted from 1 in logs, checkpoints and settings
        log.profiler.begin(n)
        with log.memory.step():  # this rank's peaks over the step, its evaluation excluded
            t0 = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = lr_at(n, t)
            tokens, targets = corpus.batch("train", step, t.batch, t.seq, t.seed, rows=own_rows)
            for layer in model.moe_layers():
                layer.reset_step()  # the step's MoE metrics cover all of its micro-batches
            if built.rebalancer is not None:
                expert_slots = [tuple(slots) for slots in built.rebalancer.placements()]
                expert_copies, expert_cuts = built.rebalancer.copies(), built.rebalancer.cuts()
            faults.before_step(injected, rank, n)
            loss, parts = _global_loss_parts(model, tokens, targets, spec, rank, True, run.model.mtp_depth)  # all ranks
            if faults.loss_is_nan(injected, n):
                loss = float("nan")  # all ranks stop or skip together
            if math.isfinite(loss):
                record = _update(built, t, n, loss, skipped, t.batch * t.seq, log.flops, log.peaks, t0)
                record.update(parts)  # with MTP: loss is the main head's, mtp_loss apart
                if built.rebalancer is not None:  # outside step_s: its cost is recorded apart
                    placed = built.rebalancer.after_step(n, record["tokens_per_expert"], opt)
                    if placed is not None:
                        record["expert_placement"] = placed
        if math.isfinite(loss):
            record["memory"] = log.memory.gather()  # every rank's peaks of the step (a collective)
            if "tokens_per_expert" in record:
                record.update(ep_load_metrics(record["tokens_per_expert"], expert_slots, spec.ep, expert_copies,
                                               expert_cuts))
            if run.cfg.data.weights:  # the mixture's draw, summed over a run to check it against the weights
                record["data_rows"] = corpus.rows_by_source(step, t.batch, t.seed)
            if n % t.eval_every == 0 or n == t.steps:
                record["val_loss"] = evaluate(model, corpus, run.cfg, spec, rank, run.model.mtp_depth)
                for name, part in getattr(corpus, "parts", {}).items():
                    record.setdefault("val_loss_by_source", {})[name] = evaluate(model, part, run.cfg, spec, rank,
                                                                                   run.model.mtp_depth)
            log.write(record)
            history.append(record)
        elif t.skip_nonfinite:
            opt.zero_grad(set_to_none=True)
            for layer in model.moe_layers():
                layer.discard_bias_counts()  # this step's routing must not steer the bias
            skipped += 1
            log.note(f"step {n}: loss {loss} is not finite: skipped (train.skip_nonfinite; "
                     f"{skipped} skipped so far)")
        else:
            raise FloatingPointError(
                f"non-finite loss {loss} at step {n}; last good checkpoint: "
                f"{last_good or 'none (no checkpoint saved yet)'}; set train.skip_nonfinite=true "
                f"to skip such steps instead")
        if n % t.ckpt_every == 0 or n == end:  # skipped steps too: the schedule stays on time
            last_good = _save(run, world_size, built, n, skipped, faults.crash_in_save(injected, n))
        log.profiler.end(n)
    return history, last_good


def _save(run: Resolved, world_size: int, built: Built, n: int, skipped: int, crash: bool) -> str:
    """Checkpoint step ``n``; returns its folder."""
    cfg, t = run.cfg, run.train
    state = {"step": n, "skipped": skipped, "fold": cfg.fold, "model": cfg.model,
             "moe": cfg.moe, "sparsity": cfg.sparsity, "seed": t.seed,
             "dtype": t.dtype, "master_dtype": t.master_dtype,
             "world_size": world_size, "train_steps": t.steps, "init_from": t.init_from}
    if built.rebalancer is not None:
        state["expert_placement"] = {"ep": run.spec.ep, "slots": built.rebalancer.placements(),
                                     "copies": built.rebalancer.copies(), "cuts": built.rebalancer.cuts()}
    return str(checkpoint.save(Path(t.out_dir) / "checkpoints", n, built.model, built.optimizer, state,
                               crash_before_rename=crash))


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


def _update(built: Built, t, n, loss, skipped, n_global, flops, peaks, t0) -> dict:
    """Reduce gradients, prune, clip, step; returns step ``n``'s metrics.

    ``peaks`` = (hardware peak or None, measured GEMM rate), both FLOP/s of the whole job: ``mfu``
    is model FLOP/s over the hardware peak, as Megatron-Core and the paper report it;
    ``mfu_of_measured_gemm`` is over the dense GEMM rate these ranks reached in this run."""
    model, opt, pruner = built.model, built.optimizer, built.pruner
    peak_hw, peak = peaks
    model.reduce_gradients()
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
    moe = model.moe_metrics()
    if moe:
        record["aux_losses"] = {k: sum(m["losses"][k] for m in moe) for k in moe[0]["losses"]}
        record["tokens_per_expert"] = [m["tokens_per_expert"] for m in moe]
        record["dropped_fraction"] = sum(m["dropped_fraction"] for m in moe) / len(moe)
    if model.a2a_overlap:  # this rank's (rank 0 writes the row)
        turns = model.overlap_stats()
        record["a2a_overlap"] = {"waited": turns.waited, "crossed": turns.crossed, "arrived": turns.arrived,
                                 "wait_s": turns.wait_s}
    if pruner is not None:
        record.update(pruner.metrics())
    return record




@torch.no_grad()
def evaluate(model, corpus, cfg, spec, rank, mtp_depth: int = 0) -> float:
    """Mean held-out loss (the main head's cross-entropy) over ``eval_batches`` fixed validation
    batches; ``mtp_depth``: the model's multi-token-prediction depths."""
    t = cfg.train
    rows = batch_rows(t.batch, spec, rank)
    total = 0.0
    model.eval()
    try:
        for i in range(t.eval_batches):
            tokens, targets = corpus.batch("val", i, t.batch, t.seq, t.seed, rows=rows)
            loss, parts = _global_loss_parts(model, tokens, targets, spec, rank, False, mtp_depth)
            total += parts.get("loss", loss)  # the main head's cross-entropy
    finally:
        model.train()
    return total / t.eval_batches
