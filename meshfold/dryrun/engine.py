"""One training step of meshfold's own model and layout code, real or fake, and its report.

:func:`step_report` is the step both sides run: build the model on the meta device, lay it out
with :func:`meshfold.train.build.build` (the one build ``meshfold train`` runs),
materialize this rank's shards, then forward, backward, gradient reduction, gradient norm and
the AdamW step, while :mod:`meshfold.dryrun.record` watches. Under gloo it is a real step
(tests compare the two); :func:`dry_run_rank` runs it for one rank of an N-rank job inside this
process without allocating tensor data:

* the default process group is PyTorch's ``fake`` backend over a ``FakeStore`` (the one
  torchtitan's memory estimator uses): :func:`~meshfold.mesh.fold` builds both views as for a
  real job, and every collective returns at once without touching its output;
* tensors are :class:`~torch._subclasses.fake_tensor.FakeTensor`: shapes, dtypes and storage
  sizes, no data. Materialization gives each parameter fake storage of its shard's size (the
  init's values are skipped: there is nothing to fill);
* the one host read of token counts per MoE layer forward
  (:func:`meshfold.placements.token_dispatch.block_counts`) is answered by a routing model
  (:mod:`meshfold.dryrun.routing`), after issuing the same two count all-gathers; every other
  host read answers 1 (:class:`~meshfold.dryrun.record.HostReads`).

Roles (:func:`representative_ranks`): ranks of one pipeline stage run the same code on the same
shapes, and under balanced routing they send and receive the same rows, so their reports are
equal up to uneven FSDP2 shards; one rank per stage stands for the stage: its first rank (all
coordinates 0 in both views). It holds experts ``0 .. E/ep - 1``, which under :class:`Zipf`
routing receive the most rows, so it is the stage's worst case there too.

Pipeline parallelism (pp > 1): the model is meshfold's :class:`~meshfold.parallel.pipeline.Pipeline`
(the rank's chunks and schedule, as ``meshfold train`` builds it), with each ``PipelineStage``
given its micro-batch's shapes (:func:`_static_stages`; torch's static mode) on both sides: a
stage otherwise infers them from metadata the previous stage sends at the first step, which the
fake backend never delivers. So the step is a steady-state one, without that first-step exchange;
the schedule's warm-up vote on the inference mode (4-byte messages) is still exchanged on both sides
(:func:`meshfold.runtime.compat.pipeline_votes_on_fake_groups`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from unittest import mock

import torch
import torch.distributed as dist

from meshfold.runtime import compat
from meshfold.dryrun.record import CollectiveLog, HostReads, LivePeak, StepRecorder, summary
from meshfold.dryrun import fake_cuda
from meshfold.dryrun.routing import Balanced
from meshfold.placements import token_dispatch

__all__ = ["DEVICES", "RankReport", "step_report", "dry_run_rank", "dry_run", "representative_ranks", "record_block_counts"]

DEVICES = ("cpu", "cuda")  # what the fake tensors of a dry run are on


@dataclass
class RankReport:
    """One rank's step: state bytes, the forward/backward peak, its collectives and host reads.

    ``param_bytes`` / ``grad_bytes`` / ``optimizer_bytes``: this rank's local storage of the
    parameters, of their (reduced) gradients before the optimizer step, and of AdamW's state
    after it. ``activation_peak_bytes``: :class:`~meshfold.dryrun.record.LivePeak` over forward
    and backward (activations, temporaries, FSDP2's gathered weights, gradients as they form).
    ``peak_bytes`` = parameters + optimizer state + that peak (gradients are inside the peak).
    ``expert_rows``: per dispatch (each MoE layer forward, recomputed ones too), the rows each of
    this rank's local experts received, as the dispatch sized them from the block counts.
    ``optimizer_groups``: the names of the optimizer's parameter groups (``build_optimizer``'s).
    ``attention_kernels``: the fused attention kernels forward and backward ran, sorted
    (:data:`~meshfold.dryrun.record.ATTENTION_KERNELS`; none: SDPA's math kernel or the ring's
    plain blocks), which the device chose."""

    rank: int
    stage: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_peak_bytes: int
    collectives: list = field(default_factory=list)
    host_reads: list = field(default_factory=list)
    seconds: float = 0.0
    expert_rows: list = field(default_factory=list)
    optimizer_groups: list = field(default_factory=list)
    attention_kernels: list = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        return self.param_bytes + self.optimizer_bytes + self.activation_peak_bytes

    def collective_summary(self) -> dict:
        return summary(self.collectives)

    def to_json(self) -> dict:
        return {"rank": self.rank, "stage": self.stage, "param_bytes": self.param_bytes,
                "grad_bytes": self.grad_bytes, "optimizer_bytes": self.optimizer_bytes,
                "activation_peak_bytes": self.activation_peak_bytes, "peak_bytes": self.peak_bytes,
                "collectives": self.collectives,
                "collective_summary": [{"kind": k, "dim": d, "bytes": n}
                                       for (k, d), n in sorted(self.collective_summary().items())],
                "host_reads": [{"what": w, "where": s} for w, s in self.host_reads],
                "expert_rows": self.expert_rows, "optimizer_groups": self.optimizer_groups,
                "seconds": round(self.seconds, 3)}


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = getattr(t, "_local_tensor", t)
            total += t.numel() * t.element_size()
    return total


def _optimizer_tensors(opt):
    return [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def step_report(run, rank: int, folded, fake=None, on_counts=None, copies=None) -> RankReport:
    """Build ``run``'s job (a :class:`~meshfold.train.config.Resolved`) on ``folded`` with
    :func:`meshfold.train.build.build`, as ``meshfold train`` builds it (with pp > 1 this rank's
    pipeline chunks), and run one training step on random tokens, recorded. ``fake``: the
    FakeTensorMode of a dry run (None: a real step). ``on_counts``: called with each host read
    of block counts ``C`` (real runs record them for :class:`~meshfold.dryrun.routing.Replay`).
    ``copies``: ``(slots, copies, cuts)`` every MoE layer routes by, fetching the copies each forward
    as after a re-placement with ``train.redundant_experts`` (the weights are not moved: the
    step is costed, not its values)."""
    from meshfold.parallel.data_parallel import grad_norm
    from meshfold.parallel.expert_placement import expert_params
    from meshfold.train.build import build
    from meshfold.train.loop import _global_loss_parts

    t0 = time.perf_counter()
    spec, mcfg, t = run.spec, run.model, run.train
    torch.manual_seed(t.seed)
    with contextlib.ExitStack() as stack:
        if fake is not None:  # fake storage of each shard's size, nothing drawn
            stack.enter_context(mock.patch("meshfold.parallel.transformer.materialize_shards",
                                           lambda module, *a, **k: _fake_materialize(module, fake, folded.device)))
            if folded.device.type == "cuda":
                stack.enter_context(_fsdp_under(fake))
        if spec.pp > 1:
            stack.enter_context(_static_stages(run, fake))
        # init_from: the checkpoint's shapes (its config.json) on the meta device, its values unread
        built = build(run, folded, init_from=False)
    model, opt = built.model, built.optimizer
    for layer in model.moe_layers():
        layer.comm.experts_mesh  # a sub-mesh sliced under fake tensors would read fake coordinates
        if copies is not None:
            layer.comm.set_slots(copies[0])
            layer.comm.set_copies(copies[1], layer.cfg.num_experts, expert_params(layer), copies[2])
    gen = torch.Generator().manual_seed(t.seed)
    tokens = torch.randint(0, mcfg.vocab, (t.batch, t.seq + 1), generator=gen)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    log, reads = CollectiveLog(spec, rank), HostReads(answer=fake is not None)
    recorder = StepRecorder(log, reads)
    expert_rows: list = []
    with contextlib.ExitStack() as stack:
        if fake is not None:
            stack.enter_context(fake)
            stack.enter_context(compat.pipeline_votes_on_fake_groups())  # the first step's vote, as real
        stack.enter_context(_counting_reads(reads, on_counts))
        stack.enter_context(_recording_expert_rows(expert_rows))
        stack.enter_context(recorder)
        buffers = [b for _, b in model.named_buffers()]
        with recorder.measuring(LivePeak(exclude=list(model.parameters()) + buffers)) as peak:
            _global_loss_parts(model, inputs, targets, spec, rank, True, mcfg.mtp_depth)  # as the training step
        model.reduce_gradients()  # a no-op under FSDP2, which reduce-scattered in backward
        grad_bytes = _local_bytes(p.grad for p in model.parameters())
        grad_norm(model).item()  # clipping reads the norm on the host (and scales in place)
        opt.step()
    return RankReport(rank, spec.coords(rank)["attn"]["pp"], _local_bytes(model.parameters()), grad_bytes,
                      _local_bytes(_optimizer_tensors(opt)), peak.peak, log.records, reads.reads,
                      time.perf_counter() - t0, expert_rows, [g["name"] for g in opt.param_groups],
                      sorted(recorder.attention))


def check_dry_run(run) -> None:
    """Refuse, naming the setting, what the dry run's one step cannot stand for (before any
    rank starts); every other setting that changes the step it builds as training does."""
    t = run.train
    if t.compile:
        raise ValueError("train.compile = true: the dry run records the eager step (a compiled kernel has no "
                         "fake-tensor trace of its collectives and peaks); dry-run with train.compile = false")
    if run.cfg.sparsity:
        raise ValueError("[sparsity]: the dry run's one step does not prune (the pruner's scores and masks change "
                         "between steps); dry-run without the [sparsity] section")
    if t.expert_placement != "static":
        raise ValueError(f"train.expert_placement = {t.expert_placement!r}: the dry run's one step has no loads "
                         f"to re-place experts from; dry-run with 'static'")
    if run.model.moe is not None and run.model.moe.capacity_factor is not None:
        raise ValueError(f"moe.capacity_factor = {run.model.moe.capacity_factor}: the dry run's routing "
                         f"models are dropless; use capacity_factor = None")


@contextlib.contextmanager
def _static_stages(run, fake):
    """Pipeline stages built with their micro-batch's shapes (``PipelineStage``'s static mode):
    tokens [b, s] into the first, hidden [b, s, H] between stages, logits [b, s, V] out of the
    last, b = batch / dp / microbatches, s = seq / (cp tp); with ``model.mtp_depth`` D also the
    D embeddings [b, s, H] the depths read between stages, and logits [b, s, 1 + D, V] (the
    main head's and every depth's) out of the last. Without them a stage infers its
    input shapes from the previous stage's first forward, metadata a fake process group never
    delivers."""
    import torch.distributed.pipelining as pipelining

    from meshfold.train.build import DTYPES

    t, spec, mcfg = run.train, run.spec, run.model
    b, s = t.batch // spec.dp // (t.microbatches or spec.pp), t.seq // (spec.cp * spec.tp)
    dtype, D = DTYPES[t.dtype], mcfg.mtp_depth
    real_stage = pipelining.PipelineStage

    def stage(submodule, stage_index, num_stages, device, group=None):
        with fake if fake is not None else contextlib.nullcontext():
            hidden = torch.empty(b, s, mcfg.hidden, dtype=dtype, device=device, requires_grad=True)
            first = torch.empty(b, s, dtype=torch.int64, device=device)
            logits = torch.empty(b, s, *((1 + D,) if D else ()), mcfg.vocab, dtype=dtype, device=device)
        carried = (hidden,) * (1 + D)  # the hidden state, then the depths' embeddings (Pipeline's ModelChunk)
        inputs = first if stage_index == 0 else carried
        outputs = logits if stage_index == num_stages - 1 else carried
        return real_stage(submodule, stage_index, num_stages, device, input_args=inputs, output_args=outputs,
                          group=group)

    with mock.patch.object(pipelining, "PipelineStage", stage):
        yield


@contextlib.contextmanager
def _fsdp_under(fake):
    """FSDP2's empty all-gather buffer, which each parameter group allocates on the mesh's device
    while ``fully_shard`` wraps a module, made under ``fake``: on a CUDA mesh without a GPU only a
    fake tensor can be. The layout itself runs outside the fake mode, as on the CPU: DeviceMesh
    slices, flattens and finds its coordinates with tensor ops, which the fake mode would fake."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    real_empty = torch.empty

    def empty(*args, **kwargs):
        with fake:
            return real_empty(*args, **kwargs)

    original = _fsdp_param_group.FSDPParamGroup.__init__

    def init(self, *args, **kwargs):
        with mock.patch.object(_fsdp_param_group.torch, "empty", empty):
            original(self, *args, **kwargs)

    with mock.patch.object(_fsdp_param_group.FSDPParamGroup, "__init__", init):
        yield


def _fake_materialize(module, fake, device) -> None:
    with fake:
        module.to_empty(device=device)


@contextlib.contextmanager
def _counting_reads(reads: HostReads, on_counts):
    """Record each host read of block counts, handing ``C`` to ``on_counts``; under a dry run
    the counts come from the routing model installed by :func:`_routed_counts` instead."""
    original = token_dispatch.block_counts

    def counted(counts_E, mesh, ep="ep", etp="etp"):
        C_QIE, C = original(counts_E, mesh, ep, etp)
        reads.record("block_counts")
        if on_counts is not None:
            on_counts(C)
        return C_QIE, C

    with mock.patch.object(token_dispatch, "block_counts", counted), \
            mock.patch("meshfold.parallel.moe.block_counts", counted):
        yield


@contextlib.contextmanager
def _recording_expert_rows(rows: list):
    """Append to ``rows``, per dispatch, the rows each local expert of this rank receives: from
    the block counts ``C[q][i][e]`` where the dispatch sizes its etp gather and its experts' rows
    (``token_dispatch._etp_sizes``), summed over the (etp, ep) sources, for the ``El`` experts of
    this rank's ep index ``i_me``."""
    original = token_dispatch._etp_sizes

    def sized(C, i_me, El, n_ep, n_etp):
        rows.append([sum(C[q][i][i_me * El + j] for q in range(n_etp) for i in range(n_ep)) for j in range(El)])
        return original(C, i_me, El, n_ep, n_etp)

    with mock.patch.object(token_dispatch, "_etp_sizes", sized):
        yield


@contextlib.contextmanager
def _routed_counts(routing, topk_of_layer, tokens_of_layer):
    """Replace the ``.tolist()`` of :func:`~meshfold.placements.token_dispatch.block_counts` by
    the routing model's answer (the two count all-gathers still run, as in a real run)."""
    from meshfold.placements.collectives import _group, gather_equal

    calls = [0]

    def routed(counts_E, mesh, ep="ep", etp="etp"):
        C_QIE = gather_equal(gather_equal(counts_E.to(torch.int64), mesh, ep), mesh, etp)
        n_ep, n_etp = _group(mesh, ep)[1], _group(mesh, etp)[1]
        C = routing.block(calls[0], tokens_of_layer() * topk_of_layer(), counts_E.numel(), n_ep, n_etp)
        calls[0] += 1
        return C_QIE, C

    with mock.patch.object(token_dispatch, "block_counts", routed):
        yield


@contextlib.contextmanager
def _on_this_thread():
    """The CPU kernels' row-wise work as one piece on the calling thread, as on an accelerator:
    the fake mode is thread-local, and a fake op costs the same whatever its size, so the
    CPU pool's thousands of cache-sized parts would only multiply the dry run's time. The pool
    schedules and nothing else (its parts write disjoint parts of preallocated outputs)."""
    from meshfold.kernels import combine, cpu_grouped, cpu_pool, ffn

    def inline(tasks):
        for task in tasks:
            task()

    def one_piece(part, length, size, device):
        if length:
            part(0, length)

    with contextlib.ExitStack() as stack:
        for module in (cpu_pool, ffn, combine):
            stack.enter_context(mock.patch.object(module, "in_parts", one_piece))
        for module in (cpu_pool, cpu_grouped):
            stack.enter_context(mock.patch.object(module, "run_tasks", inline))
        stack.enter_context(mock.patch.object(cpu_pool, "single_threaded", lambda fn, *args: fn(*args)))
        yield


@contextlib.contextmanager
def _without_profiler_ranges():
    """``torch.profiler.record_function`` ranges (FSDP2 opens several per group and pass: about 12k
    in a 56-layer step) as no-ops while no profiler runs. Each is an op the fake mode cannot
    cache, a full fake dispatch that records nothing: no tensor, no collective, no host read.
    Under a running profiler (someone profiling the dry run) they stay."""
    from torch.autograd import profiler

    if torch.autograd._profiler_enabled():
        yield
        return
    with mock.patch.object(profiler.record_function, "__enter__", lambda self: self), \
            mock.patch.object(profiler.record_function, "__exit__", lambda self, *exc: None):
        yield


def representative_ranks(spec) -> list[int]:
    """One rank per pipeline stage: the stage's first rank (see the module docstring)."""
    per_stage = spec.world_size // spec.pp
    return [s * per_stage for s in range(spec.pp)]


def dry_run_rank(run, rank: int, routing=None, device: str = "cpu") -> RankReport:
    """:func:`step_report` for ``rank`` of ``run``'s fold (a resolved config), on the fake backend in this process
    (which must have no process group yet; it has none again afterwards). ``device``: ``"cpu"``,
    or ``"cuda"`` for fake CUDA tensors on a fold whose meshes are CUDA meshes, as under NCCL
    (:mod:`meshfold.dryrun.fake_cuda`: needs torch's CUDA wheel, no GPU)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshfold.mesh import fold
    from torch.nn.modules.module import register_module_forward_pre_hook

    from meshfold.models.moe import MoELayer

    check_dry_run(run)
    spec, mcfg = run.spec, run.model
    if dist.is_initialized():
        raise RuntimeError("dry_run_rank needs a process without a process group (it starts the fake one)")
    if device not in DEVICES:
        raise ValueError(f"device = {device!r}; valid: {', '.join(DEVICES)}")
    routing = Balanced() if routing is None else routing
    shims = fake_cuda.fake_cuda() if device == "cuda" else contextlib.nullcontext()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=spec.world_size)
    try:
        with shims:  # before the fold: a CUDA mesh asks for the current device
            folded = fold(spec, device)
            fake = FakeTensorMode(allow_non_fake_inputs=True)
            current = {"tokens": 0, "topk": mcfg.moe.topk if mcfg.moe else 1}

            def see_tokens(module, args):  # the MoE layer's tokens, whatever micro-batch or recompute
                if isinstance(module, MoELayer):
                    current["tokens"] = args[0].numel() // args[0].shape[-1]

            hook = register_module_forward_pre_hook(see_tokens)
            try:
                with _routed_counts(routing, lambda: current["topk"], lambda: current["tokens"]), \
                        _on_this_thread(), _without_profiler_ranges():
                    placed = getattr(routing, "copies", ())  # a Placed model with copies: the layers fetch them
                    return step_report(run, rank, folded, fake=fake,
                                       copies=(routing.slots, routing.copies, routing.cuts) if placed else None)
            finally:
                hook.remove()
    finally:
        dist.destroy_process_group()


def dry_run(cfg, routing=None, ranks=None, last_here: bool = False, device: str = "cpu") -> list[RankReport]:
    """:func:`dry_run_rank` for each rank of ``ranks`` of ``cfg`` (a
    :class:`~meshfold.train.config.TrainConfig`, resolved here once) (default :func:`representative_ranks`),
    each in a fresh process: DTensor caches dispatch plans by mesh equality (in C++ too), so a
    second fold of the same spec in one process would run on the first one's destroyed groups.
    The processes fork from :mod:`meshfold.runtime.launch`'s server, which has imported torch once, and
    run side by side, one per core. ``last_here``: the last rank runs in this process instead
    (meanwhile), for a caller that has made no fold and exits afterwards (``meshfold dryrun``).
    ``device``: as for :func:`dry_run_rank`."""
    import concurrent.futures
    import os

    from meshfold.runtime import launch

    run = cfg.resolve()  # the settings' one-line errors, before any process starts
    check_dry_run(run)
    if device not in DEVICES:
        raise ValueError(f"device = {device!r}; valid: {', '.join(DEVICES)}")
    if device == "cuda" and fake_cuda.why_unavailable():
        raise ValueError(f"device = 'cuda': {fake_cuda.why_unavailable()}")
    chosen = representative_ranks(run.spec) if ranks is None else list(ranks)
    elsewhere = chosen[:-1] if last_here else chosen
    if not elsewhere:
        return [dry_run_rank(run, r, routing, device) for r in chosen]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with concurrent.futures.ProcessPoolExecutor(min(len(elsewhere), cores), mp_context=launch.process_context(),
                                                max_tasks_per_child=1) as pool:
        futures = [pool.submit(_dry_run_rank_with_env, dict(os.environ), run, r, routing, device)
                   for r in elsewhere]
        here = [dry_run_rank(run, chosen[-1], routing, device)] if last_here else []
        return [f.result() for f in futures] + here


def _dry_run_rank_with_env(environ: dict, *args) -> RankReport:
    """:func:`dry_run_rank` in a process forked from a server started earlier: with the caller's
    environment of now, as a spawned process would have."""
    import os

    os.environ.clear()
    os.environ.update(environ)
    return dry_run_rank(*args)


def record_block_counts():
    """``(calls, on_counts)``: pass ``on_counts`` to a real :func:`step_report`; ``calls`` then
    holds its block counts in read order (for :class:`~meshfold.dryrun.routing.Replay`)."""
    calls: list = []
    return calls, calls.append
