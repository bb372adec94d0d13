"""Pipeline parallelism (``pp``) for any model whose layout plan names its blocks.

The plan (:class:`~meshfold.parallel.plan.Plan`) names the block list (``blocks``) and the modules
run before it (``before``, e.g. the embeddings) and after it (``after``, e.g. the final norm and
head). The model is cut into ``pp * virtual`` contiguous *chunks* of blocks (Megatron's "model
chunks"): chunk ``s`` holds blocks ``[s * L // n, (s + 1) * L // n)`` of ``n = pp * virtual``, the
first also the ``before`` modules, the last the ``after`` modules. A chunk runs ``x`` through
its ``before`` modules in order (``m(x)``), its blocks (``block(x, positions)``, with the plan's
``token_ids`` and ``per_token`` inputs as keywords) and its ``after`` modules; the last chunk's output is the logits the loss reads: the model's ``loss_terms(logits,
targets)`` if it defines one (its ``loss`` never runs: a model with a ``loss`` and no
``loss_terms`` is refused, since terms of its own would be lost), else the cross-entropy. Pipeline rank ``r`` holds chunks ``r, r + pp,
r + 2 pp, ...`` (one chunk without virtual stages; ``virtual`` chunks for the interleaved
schedules), or chunks ``r`` and ``2 pp - 1 - r`` for the V schedules
(:func:`~meshfold.catalog.rank_chunks`). Inside a chunk everything is the single-device code, laid out on the rank's stage of
the folded mesh by :func:`~meshfold.parallel.transformer.parallelize` (TP, CP, DP or
FSDP2, EP): both views share the ``pp`` groups, so every attention rank and every MoE rank of a
chunk lives on the same pipeline stage.

Activations move between stages with ``torch.distributed.pipelining`` (``PipelineStage`` over
the ``pp`` process group) and one of its schedules:

===================  ==================================  =============================================
``schedule``         torch class                         needs
===================  ==================================  =============================================
``gpipe``            ``ScheduleGPipe``                   all forwards, then all backwards
``1f1b``             ``Schedule1F1B``                    microbatches >= pp
``interleaved-1f1b`` ``ScheduleInterleaved1F1B``         virtual >= 2, microbatches % pp == 0
``interleaved-zb``   ``ScheduleInterleavedZeroBubble``   virtual >= 2, microbatches % pp == 0
``zbv``              ``ScheduleZBVZeroBubble``           virtual = 2 (a V), microbatches >= pp
``dualpipev``        ``ScheduleDualPipeV``               virtual = 2 (a V), microbatches >= 2 pp
===================  ==================================  =============================================

The three zero-bubble schedules (arXiv 2401.10241; DualPipeV from DeepSeek-V3, arXiv 2412.19437)
split each backward in two: the gradient of the stage's input first (what the previous stage waits
for), the weights' gradients later, to fill what would be a bubble. ``zbv`` and ``dualpipev`` lay
the chunks out in a V: rank ``r`` holds chunks ``r`` and ``2 pp - 1 - r``, so the first and the
last chunk (the embedding and the head) share rank 0. torch runs the split backward only on
stages that are not ``torch.compile``d (``train.compile`` is refused with them).

Each rank's local batch (``B / dp`` sequences) is split into ``microbatches`` along the batch
dim. The loss of a microbatch is its summed cross-entropy over the *global* token count, so the
microbatch losses of all ranks add up to the single-device mean loss and the gradients they
accumulate are the single-device gradients (``scale_grads=False``: nothing is averaged). MoE
balancing losses are computed per microbatch (Megatron's definition) and each enters the backward
scaled by ``1 / microbatches`` (``MoELayer.balancing_scale``, as Megatron-Core scales them), so the
single-device equivalent is gradient accumulation over the same microbatches (:func:`accumulate`).

With ``pp = 1`` a ``Pipeline`` is one chunk, the whole model laid out by ``parallelize``, and its
schedule is gradient accumulation (:func:`accumulate`): training, evaluation and the dry run call
the same ``step``, ``chunks``, ``moe_layers``, ``reduce_gradients`` and ``moe_metrics`` whatever
``pp`` is.

Tied embeddings need the embedding on the first and the head on the last stage to be one tensor;
with ``pp > 1`` that is not supported: ``tie_embeddings`` and a parameter held under two names
(``lm_head.weight = embed.weight``) are errors naming the tie.

Example (4 ranks: pp2 x tp2 | pp2 x ep2)::

    pipe = Pipeline(MoETransformer(cfg), fold(FoldSpec(4, pp=2, tp=2, ep=2)), microbatches=2)
    tokens, positions = shard_batch(global_tokens, spec, rank)
    targets, _ = shard_batch(global_targets, spec, rank)
    loss = pipe.step(tokens, targets, positions)   # the global mean loss, on every rank
    optimizer.step()                               # over pipe.parameters()
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshfold.catalog import SCHEDULES, V_SCHEDULES, ZERO_BUBBLE, check_choice, rank_chunks
from meshfold.models.moe import MoELayer, add_step_entries
from meshfold.models.mtp import counted, depth_inputs
from meshfold.models.transformer import cross_entropy_sum
from meshfold.parallel.data_parallel import hold_fsdp_gradients, reduce_fsdp_gradients, reduce_gradients
from meshfold.parallel.plan import Plan, check_plan, restrict
from meshfold.parallel.recompute import read_twice
from meshfold.parallel.transformer import model_plan, parallelize
from meshfold.placements import sum_in_place
from meshfold.runtime.overlap import TurnStats, run_in_turns

__all__ = ["SCHEDULES", "check_a2a_overlap", "combined_1f1b_order", "ModelChunk", "chunk_layers", "schedule_order", "check_pipeline", "Pipeline", "accumulate", "microbatch_counts",
           "local_microbatch_counts", "model_loss"]


MTP_TARGETS = "_mtp_targets"  # the keyword that hands the first chunk the targets its depths read


def chunk_layers(num_layers: int, num_chunks: int) -> list[list[int]]:
    """Layer ids of each of ``num_chunks`` contiguous, balanced model chunks."""
    if num_chunks > num_layers:
        raise ValueError(f"{num_chunks} pipeline chunks (pp x virtual) but only {num_layers} layers; "
                         f"every chunk needs at least one layer")
    return [list(range(s * num_layers // num_chunks, (s + 1) * num_layers // num_chunks))
            for s in range(num_chunks)]


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register ``module`` under dotted ``path`` of ``root``, with empty modules in between."""
    *parents, last = path.split(".")
    for name in parents:
        if not hasattr(root, name):
            root.add_module(name, nn.Module())
        root = getattr(root, name)
    root.add_module(last, module)


def _blocks(model: nn.Module, plan: Plan) -> dict[str, nn.Module]:
    if plan.blocks is None:
        raise ValueError(f"{type(model).__name__}'s plan names no block list (Plan.blocks = None); Pipeline "
                         f"cuts the blocks into stages: set Plan(blocks=..., before=..., after=...)")
    return dict(model.get_submodule(plan.blocks).named_children())


def _loss_terms(model: nn.Module):
    """What the last stage computes from a microbatch's logits: ``model.loss_terms(logits [b, s, V],
    targets [b, s]) -> (loss summed over the tokens, token count)`` if the model defines it, else
    the cross-entropy sum. With ``pp > 1`` the model's own ``loss`` never runs (the stages run its
    pieces), so a model whose ``loss`` may add terms of its own (a z-loss, say) must say what they
    are through ``loss_terms``; one that defines ``loss`` and no ``loss_terms`` is refused."""
    terms = getattr(model, "loss_terms", None)
    if terms is None and callable(getattr(model, "loss", None)):
        raise ValueError(f"{type(model).__name__} defines loss but no loss_terms(logits, targets) -> (sum over "
                         f"tokens, token count): with pp > 1 the pipeline computes the loss from the last "
                         f"stage's logits and never calls loss, so any term of it other than cross-entropy "
                         f"would be lost; define loss_terms (e.g. return cross_entropy_sum(logits, targets), "
                         f"plus your own terms summed over the tokens) and let loss call it")
    return terms if terms is not None else cross_entropy_sum


class ModelChunk(nn.Module):
    """A run of ``model``'s blocks (``layer_ids``: their positions in the plan's block list), with
    the plan's ``before`` modules if it is the first chunk and its ``after`` modules if it is the
    last. ``forward(x)``: tokens (first chunk) or hidden states -> hidden states or logits (last
    chunk). Parameter names are the whole model's (``layers.<i>...``). ``positions`` (absolute,
    this rank's tokens) is set per step, the same for every microbatch. ``plan`` (None: the
    model's own) is checked against the whole model; :meth:`plan` gives the chunk's part of it."""

    def __init__(self, model: nn.Module, layer_ids: list[int], first: bool, last: bool, plan: Plan | None = None):
        super().__init__()
        whole = model_plan(model) if plan is None else plan
        check_plan(model, whole)
        if getattr(getattr(model, "cfg", None), "tie_embeddings", False):  # one tensor on two stages
            raise ValueError("tie_embeddings: the head is the embedding matrix, which a pipeline chunk cannot "
                             "hold on two stages; untie them, or use parallelize without a pipeline")
        self.cfg = getattr(model, "cfg", None)
        blocks = _blocks(model, whole)
        keys = list(blocks)
        self.before_paths = whole.before if first else ()
        self.after_paths = whole.after if last else ()
        for path in self.before_paths + self.after_paths:
            _attach(self, path, model.get_submodule(path))
        _attach(self, whole.blocks, nn.ModuleDict({keys[i]: blocks[keys[i]] for i in layer_ids}))
        self.blocks_path = whole.blocks
        self.whole_plan = whole
        # multi-token prediction: the first chunk embeds each depth's read tokens (the embedding
        # is there), every chunk hands those embeddings on with the hidden state, and the last
        # runs the depths, whose blocks it holds, with the shared head (its last `after` module)
        self.mtp_depth = getattr(self.cfg, "mtp_depth", 0) if self.cfg is not None else 0
        if self.mtp_depth and last:
            _attach(self, "mtp", model.mtp)
        self.positions: torch.Tensor | None = None
        self.inits, self.init_seed = getattr(model, "inits", None), getattr(model, "init_seed", None)

    def block_list(self) -> nn.ModuleDict:
        """This chunk's blocks, keyed as in the whole model's block list."""
        return self.get_submodule(self.blocks_path)

    def forward(self, x: torch.Tensor, *carried: torch.Tensor, **per_token):
        """``per_token``: keyword inputs [b, s] of the microbatch's tokens, passed to every block
        (``block(x, positions, **per_token)``). With multi-token prediction (``mtp_depth`` D) a
        chunk also takes and hands on ``carried``, the D embeddings [b, s, H] of the tokens each
        depth reads, which the first chunk makes from the ``MTP_TARGETS`` keyword (the
        :func:`~meshfold.models.mtp.mtp_targets` [b, s, 1 + D]); the last chunk returns the main
        head's and every depth's logits, [b, s, 1 + D, V]."""
        targets = per_token.pop(MTP_TARGETS, None)
        for path in self.before_paths:
            x = self.get_submodule(path)(x)
        if self.mtp_depth and self.before_paths:
            embed = self.get_submodule(self.before_paths[0])
            carried = tuple(embed(depth_inputs(targets, k)[0]) for k in range(1, self.mtp_depth + 1))
        for block in self.block_list().values():
            x = block(x, self.positions, **per_token)
        if not self.after_paths:  # on to the next chunk (copies: a stage's outputs are its own tensors)
            return (x, *(e.clone() for e in carried)) if self.mtp_depth else x
        if not self.mtp_depth:
            for path in self.after_paths:
                x = self.get_submodule(path)(x)
            return x
        for path in self.after_paths[:-1]:  # what the head and depth 1 read
            x = self.get_submodule(path)(x)
        head = self.get_submodule(self.after_paths[-1])
        logits = [head(x)]
        for depth, e in zip(self.mtp, carried):
            x = depth(x, e, self.positions)
            logits.append(head(x))
        return torch.stack(logits, dim=2)  # [b, s, 1 + D, V]

    def plan(self) -> Plan:
        """The whole model's plan restricted to this chunk (:func:`~meshfold.parallel.plan.restrict`)."""
        return restrict(self.whole_plan, self)


class _CountedCalls:
    """What each forward of a chunk added to its MoE layers' expert-bias counts.

    ``torch.distributed.pipelining`` (dynamic shapes) runs every stage's forward once more than
    the schedule's microbatches at its first step and whenever it switches between training and
    evaluation, to infer the shapes it sends: the first stage on the real first microbatch, later
    stages on uninitialized tensors. Those runs come before the step's microbatches, so after a
    step with ``microbatches + j`` calls the first ``j`` are taken back out of the counts (each
    forward *adds* to them: MoELayer.forward). The step's sums (``MoELayer.step_metrics``) are
    rebuilt from the other calls' own entries, never by subtraction: a later stage's extra run
    reads uninitialized memory, whose losses may be NaN. Their other per-forward state (losses,
    metrics) is overwritten by the microbatches that follow."""

    def __init__(self, chunk: nn.Module):
        self.layers = [m for m in chunk.modules() if isinstance(m, MoELayer)]
        self.log: list[tuple[list, list]] = []  # per call: each layer's state before, after
        chunk.register_forward_pre_hook(self._before)
        chunk.register_forward_hook(self._after)

    def _state(self) -> list:
        return [(m._bias_counts, m._step, m._step_entry) for m in self.layers]

    def _before(self, module, args):
        self.log.append((self._state(), []))

    def _after(self, module, args, output):
        self.log[-1][1].extend(self._state())

    def forget_extra(self, microbatches: int) -> None:
        extra = len(self.log) - microbatches
        if extra > 0:
            for k, m in enumerate(self.layers):
                for before, after in self.log[:extra]:
                    (b, _, _), (a, _, _) = before[k], after[k]
                    if a is not b:  # a training forward counted (evaluation does not)
                        m._bias_counts = m._bias_counts - (a if b is None else a - b)
                step = self.log[0][0][k][1]  # the step's sums before the first call
                for before, after in self.log[extra:]:
                    if after[k][1] is not before[k][1]:  # a training forward added its entry
                        step = add_step_entries(step, after[k][2])
                m._step = step
        self.log.clear()


def check_pipeline(pp: int, cfg, microbatches: int, schedule: str, virtual: int, num_blocks: int | None = None,
                   tied: bool = False) -> None:
    """Raise ``ValueError`` naming the setting if this pipeline cannot run (no process needed).
    ``cfg``: a :class:`~meshfold.models.transformer.TransformerConfig` (its layers and tied
    embeddings), or None with ``num_blocks`` (and ``tied``: whether the model ties its
    embedding and head) for a model of one's own."""
    check_choice("schedule", schedule, SCHEDULES)
    if not (isinstance(virtual, int) and virtual >= 1):
        raise ValueError(f"virtual = {virtual!r}; valid: an integer >= 1")
    interleaved = schedule.startswith("interleaved")
    if schedule in V_SCHEDULES and virtual != 2:
        raise ValueError(f"schedule {schedule!r} with virtual = {virtual}: the V schedules hold exactly "
                         f"2 chunks per rank (set virtual = 2)")
    if schedule not in V_SCHEDULES and interleaved != (virtual > 1):
        raise ValueError(f"schedule {schedule!r} with virtual = {virtual}: the interleaved schedules "
                         f"need virtual >= 2 chunks per rank, gpipe and 1f1b virtual = 1")
    if not (isinstance(microbatches, int) and microbatches >= 1):
        raise ValueError(f"microbatches = {microbatches!r}; valid: an integer >= 1")
    if schedule != "gpipe" and microbatches < pp:
        raise ValueError(f"microbatches = {microbatches} < pp = {pp}: {schedule} needs at least "
                         f"one microbatch per stage")
    if interleaved and microbatches % pp:
        raise ValueError(f"microbatches = {microbatches} is not a multiple of pp = {pp} "
                         f"(the interleaved schedules run them in rounds of pp)")
    if schedule == "dualpipev" and microbatches < 2 * pp:
        raise ValueError(f"microbatches = {microbatches} < 2 pp = {2 * pp}: dualpipev needs at least one "
                         f"microbatch per chunk")
    if (tied or (cfg is not None and cfg.tie_embeddings)) and pp > 1:
        raise ValueError("tie_embeddings with pp > 1: the embedding (first stage) and the head "
                         "(last stage) would have to be one tensor; untie them or use pp = 1")
    chunk_layers(cfg.layers if cfg is not None else num_blocks, pp * virtual)


def _split_backward(chunk: nn.Module) -> None:
    """Ready a chunk for the zero-bubble schedules' backward in two passes: input gradients, then
    weight gradients (torch's ``stage_backward_input`` / ``stage_backward_weight``). The weight pass
    finds the weights the forward used among the chunk's ``parameters()``, so FSDP2 keeps them
    gathered from the forward until the step's end (no reshard after forward, as torchtitan does
    under pp; the schedule reshards each chunk after its last backward), and each pass recomputes a
    checkpointed block (:func:`~meshfold.parallel.recompute.read_twice`)."""
    from torch.distributed.fsdp import FSDPModule

    _keep_gathered(chunk)
    read_twice(chunk)


def _keep_gathered(model: nn.Module, in_turns: bool = False) -> None:
    """FSDP2 keeps each block of ``model`` gathered from its forward until the backward's end (no
    reshard after forward; nothing for a model without FSDP2). ``in_turns``: two micro-batches
    run a block's forward (or one its forward, the other its backward) in turns (a2a_overlap),
    while FSDP2 keeps one state per block, set for one pass at a time. Two hooks around FSDP2's
    make each forward look like the only one:

    * entering: the block is marked idle, so FSDP2 registers this forward's post-backward hook
      (it skips that for a block already in forward, or in backward, and the gradients of this
      forward would then wait in the parameters' compute dtype to be summed with another
      micro-batch's, not moved to the fp32 accumulation);
    * leaving: the block is marked in forward, so FSDP2's post-forward does not reshard it (it
      reshards an idle block whatever the setting: the first to leave set it idle).

    A recomputation's forward (inside a backward) is left to FSDP2, as without turns."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    def entering(module, args):
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside a backward
            state = module._get_fsdp_state()
            state._training_state = TrainingState.IDLE
            for group in state._fsdp_param_groups:
                group._training_state = TrainingState.IDLE

    def leaving(module, args, output):
        for group in module._get_fsdp_state()._fsdp_param_groups:
            group._training_state = TrainingState.FORWARD

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_reshard_after_forward(False, recurse=False)
            if in_turns:
                m.register_forward_pre_hook(entering, prepend=True)
                m.register_forward_hook(leaving, prepend=True)


def check_a2a_overlap(spec, microbatches: int, schedule: str) -> None:
    """Raise ``ValueError`` naming the setting when ``train.a2a_overlap`` cannot run: it needs
    expert all-to-alls (``ep`` > 1) and two micro-batches to take turns: without pp, two or more
    accumulated micro-batches (each forward beside the previous one's backward); with pp, ``1f1b`` (run as :func:`combined_1f1b_order`)
    or ``dualpipev``, whose steady states pair one micro-batch's forward with another's backward
    (torch's ``OVERLAP_F_B`` actions)."""
    if spec.ep == 1:
        raise ValueError("a2a_overlap with fold.ep = 1: there is no expert all-to-all to overlap; set ep > 1")
    if spec.pp == 1 and microbatches < 2:
        raise ValueError(f"a2a_overlap with microbatches = {microbatches}: a forward overlaps another micro-batch's backward; "
                         f"valid: 2 or more")
    if spec.pp > 1 and schedule not in ("1f1b", "dualpipev"):
        raise ValueError(f"a2a_overlap with fold.pp = {spec.pp} and schedule {schedule!r}: 1f1b (combined) and "
                         f"dualpipev pair one micro-batch's forward with another's backward; set one of them")


def _forward_only(stages: list, microbatches: int, loss_fn):
    """An evaluation schedule of a V layout's ``stages``: each rank runs every micro-batch through
    its first chunk, then through its second (the V's way back). torch 2.13's V schedules evaluate
    by running their training order without its backwards, which fails where the V turns on one
    rank (the hand-off between its two chunks is a backward's); this order has only forwards."""
    from torch.distributed.pipelining.schedules import (FORWARD, _Action, _add_send_recv, _add_unshard_reshard,
                                                        _PipelineScheduleRuntime)

    pp = stages[0].group_size
    held = {r: rank_chunks(pp, 2, r, "zbv") for r in range(pp)}
    ranks = {s: r for r, chunks in held.items() for s in chunks}
    schedule = _PipelineScheduleRuntime(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    schedule.stage_index_to_group_rank = ranks  # its constructor set a loop's on the stages
    for stage in stages:
        stage.stage_index_to_group_rank = ranks
    # lowered as _prepare_schedule_with_comms does, whose check wants every backward
    order = {r: _add_unshard_reshard([_Action(s, FORWARD, i) for s in chunks for i in range(microbatches)])
             for r, chunks in held.items()}
    schedule.pipeline_order_with_comms = _add_send_recv(order, stage_to_rank=ranks.__getitem__, num_stages=2 * pp)
    return schedule


def combined_1f1b_order(pp: int, microbatches: int) -> dict[int, list]:
    """1F1B with its steady state's forward and backward overlapped, as Megatron-Core's combined
    1F1B runs it: pipeline rank r runs ``w = min(pp - r, m)`` forwards (one more than 1F1B's
    warm-up), then each micro-batch k's backward beside micro-batch k + w's forward (torch's
    ``OVERLAP_F_B`` action), then the last w backwards. 1F1B's own steady state cannot pair
    them: its last stage runs micro-batch k's forward and then the same k's backward. The extra
    warm-up forward keeps the ranks free of cycles (rank r's k-th pair needs rank r + 1's k-th
    pair's input gradient, which needs only rank r's (k-1)-th pair's output) and costs one
    micro-batch's activations more than 1F1B's in flight. torch's runtime adds the sends and
    receives (``_prepare_schedule_with_comms``)."""
    from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD, OVERLAP_F_B, _Action

    order = {}
    for r in range(pp):
        w = min(pp - r, microbatches)
        actions = [_Action(r, FORWARD, i) for i in range(w)]
        actions += [_Action(-1, OVERLAP_F_B, None, (_Action(r, FORWARD, w + k), _Action(r, FULL_BACKWARD, k)))
                    for k in range(microbatches - w)]
        actions += [_Action(r, FULL_BACKWARD, k) for k in range(microbatches - w, microbatches)]
        order[r] = actions
    return order


def _overlapped_forward_backward(stats: list):
    """What runs torch's ``OVERLAP_F_B`` actions (DualPipeV's steady state: one micro-batch's
    forward on one chunk beside another's whole backward on the other) for ``train.a2a_overlap``:
    the two in turns (:func:`meshfold.runtime.overlap.run_in_turns`), so that each one's
    dispatch and combine all-to-alls travel while the other computes. torch runs the two one after
    the other; around the turns this does what its runtime does for each (wait for the received
    activations and gradients first, hand the outputs to this rank's other chunk after). Each
    action's :class:`~meshfold.runtime.overlap.TurnStats` is appended to ``stats``."""
    from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD, _wait_batch_p2p

    def run(action, ctx) -> None:
        schedule = ctx.schedule_ref
        f, b = action.sub_actions
        if (f.computation_type, b.computation_type) != (FORWARD, FULL_BACKWARD):
            raise ValueError(f"overlapped action {action}: a2a_overlap runs a forward beside a full backward")
        stages = {stage.stage_index: stage for stage in schedule._stages}
        fs, bs = stages[f.stage_index], stages[b.stage_index]
        fi, bi = f.microbatch_index, b.microbatch_index
        for stage in (fs, bs):
            schedule._assert_unsharded(stage)
        if not fs.is_first and f.stage_index - 1 not in stages:
            _wait_batch_p2p(schedule.fwd_recv_ops.pop((f.stage_index, fi)))
        if not bs.is_last and b.stage_index + 1 not in stages:
            _wait_batch_p2p(schedule.bwd_recv_ops.pop((b.stage_index, bi)))

        def forward():  # meshfold's steps never ask the schedule for its outputs
            out = fs.forward_one_chunk(fi, ctx.arg_mbs[fi], ctx.kwarg_mbs[fi], save_forward_output=False)
            schedule._maybe_compute_loss(fs, out, ctx.target_mbs, fi)
            return out

        def backward():
            loss = schedule._maybe_get_loss(bs, bi)
            schedule.backward_counter[b.stage_index] += 1
            last = schedule.backward_counter[b.stage_index] == schedule._n_microbatches
            bs.backward_one_chunk(bi, loss=loss, full_backward=True, last_backward=last)

        (out, _), seen = run_in_turns(forward, backward)
        stats.append(seen)
        if f.stage_index + 1 in stages:  # the V turns on this rank
            stages[f.stage_index + 1].set_local_fwd_input(out, fi)
        if b.stage_index - 1 in stages:
            stages[b.stage_index - 1].set_local_bwd_input(bs.get_local_bwd_output(bi), bi)

    return run


def schedule_order(schedule: str, pp: int, virtual: int, microbatches: int) -> dict[int, list[tuple[str, int, int]]]:
    """Every pipeline rank's compute actions, in the order torch's class for ``schedule`` runs
    them: ``(kind, stage, micro-batch)``, kind ``F`` (forward), ``B`` (whole backward), ``I``
    (input gradients) or ``W`` (weight gradients); an overlapped pair (DualPipeV's) as its two
    actions in order. Built on stand-ins for the stages (the classes read only their places),
    so no process group is needed. The multi-stage schedules only: torch runs ``gpipe`` and
    ``1f1b`` without an order of actions."""
    import types

    from torch.distributed import pipelining
    from torch.distributed.pipelining.schedules import OVERLAP_F_B

    if schedule in ("gpipe", "1f1b"):
        raise ValueError(f"schedule {schedule!r} runs without an order of actions; valid: "
                         f"{[s for s in SCHEDULES if s not in ('gpipe', '1f1b')]}")
    check_pipeline(pp, None, microbatches, schedule, virtual, num_blocks=pp * virtual)
    n = pp * virtual
    stages = [types.SimpleNamespace(stage_index=s, num_stages=n, group_size=pp, group_rank=0, is_first=s == 0,
                                    is_last=s == n - 1, submod=nn.Identity(), has_backward=True)
              for s in rank_chunks(pp, virtual, 0, schedule)]
    order = getattr(pipelining, _SCHEDULE_CLASSES[schedule])(stages, microbatches).pipeline_order
    out = {}
    for rank, actions in order.items():
        flat = [sub for a in actions if a is not None
                for sub in (a.sub_actions if a.computation_type == OVERLAP_F_B else (a,))]
        out[rank] = [(a.computation_type.value, a.stage_index, a.microbatch_index) for a in flat
                     if a.computation_type.value in ("F", "B", "I", "W")]
    return out


_SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
                     "interleaved-zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
                     "dualpipev": "ScheduleDualPipeV"}


class Pipeline:
    """This rank's model chunks of ``model`` on ``folded`` and a pipeline schedule over them.

    ``model`` is the whole single-device model, either with identical weights on every rank
    (e.g. seeded alike) or built on the meta device (``MoETransformer(cfg, device="meta")``),
    in which case each rank materializes only the shards of its own chunks; each rank keeps only
    its chunks' layers. ``schedule`` is one of :data:`SCHEDULES`,
    ``virtual`` the number of chunks per rank (interleaved schedule), ``data_parallel`` and
    ``compute_dtype`` as in :func:`~meshfold.parallel.transformer.parallelize`: with a
    compute dtype narrower than the model's, the micro-batches' gradients accumulate in the
    model's (master) dtype (FSDP2: in its fp32 reduce dtype, while the schedule turns gradient
    sync off) and are summed in fp32. ``recompute`` (none | selective | full): activation
    checkpointing of every block of this rank's chunks, as in ``parallelize``; a block's recompute
    runs when the schedule runs that microbatch's backward of the block. ``a2a_overlap``
    (``train.a2a_overlap``, :func:`check_a2a_overlap`): two micro-batches take turns
    (:mod:`meshfold.runtime.overlap`) so that one's expert all-to-alls travel while the other
    computes: with pp = 1 each accumulated micro-batch's forward beside the previous one's
    backward (:func:`accumulate`); with pp, ``1f1b`` runs as
    :func:`combined_1f1b_order` and ``dualpipev`` with its overlapped forward and backward;
    :meth:`overlap_stats` counts what each step saw.
    """

    def __init__(self, model: nn.Module, folded, microbatches: int, schedule: str = "1f1b",
                 virtual: int = 1, data_parallel: str = "fsdp", compute_dtype: torch.dtype | None = None,
                 recompute: str = "none", plan: Plan | None = None, a2a_overlap: bool = False):
        from torch.distributed import pipelining

        spec = folded.spec
        pp = spec.pp
        plan = model_plan(model) if plan is None else plan
        if a2a_overlap:
            check_a2a_overlap(spec, microbatches, schedule)
        self.a2a_overlap, self.turn_stats = a2a_overlap, []
        if pp == 1:  # one chunk, the whole model; its schedule is gradient accumulation
            parallelize(model, folded, plan, data_parallel=data_parallel, compute_dtype=compute_dtype,
                        recompute=recompute)
            if a2a_overlap:  # two micro-batches in one block at once: neither may reshard it
                _keep_gathered(model, in_turns=True)
            self._accumulating(model, folded, microbatches, plan)
            return
        self._loss_terms = _loss_terms(model)
        num_blocks = len(_blocks(model, plan))
        tied = getattr(getattr(model, "cfg", None), "tie_embeddings", False)
        check_pipeline(pp, None, microbatches, schedule, virtual, num_blocks, tied)
        self.folded, self.microbatches, self._token_ids = folded, microbatches, plan.token_ids
        self._per_token = plan.per_token
        n = pp * virtual
        layers = chunk_layers(num_blocks, n)
        r = folded.attn.get_local_rank("pp")
        self.stage_ids = rank_chunks(pp, virtual, r, schedule)
        self.chunks = [ModelChunk(model, layers[s], first=s == 0, last=s == n - 1, plan=plan) for s in self.stage_ids]
        self._block_lists = [c.block_list() for c in self.chunks]
        for chunk in self.chunks:
            parallelize(chunk, folded, data_parallel=data_parallel, compute_dtype=compute_dtype, recompute=recompute)
            if schedule in ZERO_BUBBLE:
                _split_backward(chunk)
            if a2a_overlap:  # a forward and a backward of one chunk may run in turns: keep it gathered
                _keep_gathered(chunk, in_turns=True)
        group = folded.attn["pp"].get_group()
        stages = [pipelining.PipelineStage(c, s, n, folded.device, group=group)
                  for c, s in zip(self.chunks, self.stage_ids)]
        self.has_last = any(s == n - 1 for s in self.stage_ids)
        for layer in self.moe_layers():
            layer.balancing_scale = 1 / microbatches
        self._calls = [_CountedCalls(c) for c in self.chunks]
        self._n_global = None
        self._mtp = self.chunks[0].mtp_depth  # every chunk reads the model's config
        self._mtp_weight = getattr(self.chunks[0].cfg, "mtp_loss_weight", 0.0)
        self._parts: list[torch.Tensor] = []  # per micro-batch on the last stage: each term's mean [1 + D]
        cls = getattr(pipelining, _SCHEDULE_CLASSES[schedule])
        self.schedule = cls(stages if len(stages) > 1 else stages[0], microbatches, loss_fn=self._loss,
                            scale_grads=False)
        self._evaluation = _forward_only(stages, microbatches, self._loss) if schedule in V_SCHEDULES else self.schedule
        if a2a_overlap:
            from torch.distributed.pipelining.schedules import OVERLAP_F_B, _PipelineScheduleRuntime

            if schedule == "1f1b":  # Megatron-Core's combined 1F1B; evaluation stays plain 1F1B's
                self.schedule = _PipelineScheduleRuntime(stages, microbatches, loss_fn=self._loss, scale_grads=False)
                self.schedule._prepare_schedule_with_comms(combined_1f1b_order(pp, microbatches))
            self.schedule.register_custom_function(OVERLAP_F_B, _overlapped_forward_backward(self.turn_stats))

    @classmethod
    def laid_out(cls, model: nn.Module, folded, microbatches: int = 1, plan: Plan | None = None,
                 a2a_overlap: bool = False) -> "Pipeline":
        """The ``pp = 1`` pipeline of a ``model`` already laid out on ``folded`` (by ``parallelize``
        or a checkpoint loader such as ``from_pretrained``); ``a2a_overlap`` as in the constructor."""
        if folded.spec.pp != 1:
            raise ValueError(f"pp = {folded.spec.pp}: Pipeline.laid_out takes a model laid out whole (pp = 1); "
                             f"build Pipeline(model, folded, ...) from the single-device model instead")
        self = cls.__new__(cls)
        if a2a_overlap:
            check_a2a_overlap(folded.spec, microbatches, "1f1b")
            _keep_gathered(model, in_turns=True)
        self.a2a_overlap, self.turn_stats = a2a_overlap, []
        self._accumulating(model, folded, microbatches, model_plan(model) if plan is None else plan)
        return self

    def _accumulating(self, model: nn.Module, folded, microbatches: int, plan: Plan) -> None:
        if not (isinstance(microbatches, int) and microbatches >= 1):
            raise ValueError(f"microbatches = {microbatches!r}; valid: an integer >= 1")
        self.folded, self.microbatches, self._per_token = folded, microbatches, plan.per_token
        self.stage_ids, self.chunks, self.has_last = [0], [model], True
        self._block_lists = [model.get_submodule(plan.blocks)] if plan.blocks is not None else []
        self._calls, self._n_global, self.schedule = [], None, None

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """A micro-batch's share of the step's objective. With multi-token prediction (D depths)
        ``logits`` [b, s, 1 + D, V] and ``targets`` [b, s, 1 + D]: each term's sum over its counted
        positions by the whole batch's count of them (``_n_global`` [1 + D]), the main head's by
        the model's ``loss_terms``, then ``main + mtp_loss_weight / D * sum_k`` (the model's
        objective, :func:`~meshfold.models.mtp.mtp_objective`)."""
        if not self._mtp:
            return self._loss_terms(logits, targets)[0] / self._n_global
        sums = [self._loss_terms(logits.select(2, 0), targets[..., 0])[0]]
        sums += [cross_entropy_sum(logits.select(2, k), depth_inputs(targets, k)[1])[0]
                 for k in range(1, self._mtp + 1)]
        means = torch.stack(sums) / self._n_global  # [1 + D]
        self._parts.append(means.detach())
        return means[0] + self._mtp_weight / self._mtp * means[1:].sum()

    # ---- what a training loop needs of a model: this rank's part of it -----------------------
    def parameters(self):
        """This rank's parameters (all its chunks), e.g. for the optimizer."""
        return (p for c in self.chunks for p in c.parameters())

    def named_parameters(self):
        """``(name, parameter)`` of this rank's chunks, named as in the whole model
        (``layers.<i>...``), so checkpoints of any fold and pp agree."""
        return ((n, p) for c in self.chunks for n, p in c.named_parameters())

    def named_buffers(self):
        return ((n, b) for c in self.chunks for n, b in c.named_buffers())

    def moe_layers(self):
        """This rank's MoE layers, in layer order."""
        return [m for c in self.chunks for m in c.modules() if isinstance(m, MoELayer)]

    def moe_blocks(self):
        """``(layer id, block)`` of this rank's blocks holding an MoE layer (the id: the block's
        key in the block list, an int for an ``nn.ModuleList``)."""
        return [(int(i) if i.isdigit() else i, b) for blocks in self._block_lists for i, b in blocks.named_children()
                if any(isinstance(m, MoELayer) for m in b.modules())]

    def reduce_gradients(self) -> None:
        """Sum every chunk's replicated gradients over the ranks that hold copies (a no-op under
        FSDP2, which reduce-scattered them in the backward)."""
        for chunk in self.chunks:
            reduce_gradients(chunk)

    def moe_metrics(self) -> list[dict]:
        """Per MoE layer of the whole model, in layer order, over every micro-batch of the step:
        losses, tokens per expert, dropped fraction. A collective: ``step_metrics`` sums over the
        stage's ranks, and with pp > 1 the stages' layers are gathered from every rank."""
        mine = []
        for i, b in self.moe_blocks():
            m = b.mlp.step_metrics()
            mine.append((i, {"losses": {k: float(v) for k, v in m["losses"].items()},
                             "tokens_per_expert": m["tokens_per_expert"].tolist(),
                             "dropped_fraction": float(m["dropped_fraction"])}))
        if self.schedule is None:
            return [m for _, m in mine]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return [m for _, m in sorted({i: m for part in everyone for i, m in part}.items())]

    def train(self, mode: bool = True):
        for c in self.chunks:
            c.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor,
             backward: bool = True, **per_token: torch.Tensor) -> torch.Tensor:
        """One forward + backward of this rank's local batch (from ``shard_batch``), microbatched
        through the schedule; gradients accumulate in the parameters. Returns the global mean
        loss (cross-entropy, without the balancing losses, which are in the gradients), the same
        value on every rank. ``backward=False``: forward only (evaluation). With ``pp = 1`` the
        micro-batches run one after the other (:func:`accumulate`); its evaluation runs the whole
        local batch at once. ``per_token``: the plan's ``per_token`` inputs (all of them, no
        other), this rank's [b, s, ...] laid out like ``tokens``; the model's ``loss`` gets them
        as keywords (pp = 1), every stage's blocks their microbatch's slices (pp > 1)."""
        _check_per_token(per_token, self._per_token, tokens)
        self.turn_stats.clear()
        if self.schedule is None:
            return self._accumulate_step(tokens, targets, positions, backward, per_token)[0]
        if tokens.shape[0] % self.microbatches:
            raise ValueError(f"local batch of {tokens.shape[0]} sequences is not divisible by "
                             f"microbatches = {self.microbatches}")
        if self._mtp and (targets.dim() != 3 or targets.shape[-1] != 1 + self._mtp):
            raise ValueError(f"targets have shape {tuple(targets.shape)}; valid with mtp_depth = {self._mtp}: "
                             f"[b, s, {1 + self._mtp}] (mtp_targets of the global batch, sharded like the tokens)")
        # counted positions of each term of the loss: the main head's (and each MTP depth's)
        count = (targets != -100).sum().double() if not self._mtp else counted(targets).sum((0, 1)).double()
        sum_in_place(count, self.folded.attn)  # every pp stage holds the same data: pp x the global count
        self._n_global = count / self.folded.spec.pp
        self._parts.clear()
        if self._mtp:  # the first stage embeds the tokens each depth reads
            per_token = {**per_token, MTP_TARGETS: targets}
        for chunk in self.chunks:
            chunk.positions = positions
        losses: list[torch.Tensor] = []
        for calls in self._calls:
            calls.log.clear()
        # return_outputs=False: torch's last stage would otherwise keep every micro-batch's
        # logits [b, s, V] until the step ends, to merge them into an output nobody reads.
        # Only a rank holding the first stage hands the schedule the tokens: later stages receive
        # activations (and torch 2.11's shape inference refuses inputs given to them).
        inputs = (tokens,) if 0 in self.stage_ids else ()
        # every stage's blocks get the token ids: the schedule splits keyword inputs into the
        # microbatches along the batch dim and hands each stage its microbatch's
        if self._token_ids is not None:
            per_token = {**per_token, self._token_ids: tokens}
        if backward:
            self.schedule.step(*inputs, target=targets, losses=losses, return_outputs=False, **per_token)
        else:
            with torch.no_grad():
                self._evaluation.eval(*inputs, target=targets, losses=losses, return_outputs=False, **per_token)
        for calls in self._calls:
            calls.forget_extra(self.microbatches)
        share = torch.zeros((), dtype=torch.float64, device=count.device)
        if self.has_last:
            share += torch.stack([x.detach() for x in losses]).sum().double()
        sum_in_place(share, self.folded.attn)  # only the last stage's ranks hold losses
        return share

    def step_parts(self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor,
                   backward: bool = True, **per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """:meth:`step`, and the parts of the loss the model reports apart (``loss_parts`` beyond
        ``"loss"``, e.g. the main and multi-token-prediction losses), weighted over the
        micro-batches as the loss is; with pp > 1 the multi-token-prediction parts, from each
        micro-batch's terms on the last stage (other models: no parts, ``{}``)."""
        if self.schedule is not None:
            loss = self.step(tokens, targets, positions, backward, **per_token)
            if not self._mtp:
                return loss, {}
            means = torch.zeros(1 + self._mtp, dtype=torch.float64, device=loss.device)
            if self.has_last:  # the last m: torch's shape inference may have run the loss first
                means += torch.stack(self._parts[-self.microbatches:]).sum(0).double()
            sum_in_place(means, self.folded.attn)  # only the last stage's ranks hold them
            return loss, {"main": means[0], "mtp": means[1:].mean(), "mtp_depths": means[1:]}
        _check_per_token(per_token, self._per_token, tokens)
        self.turn_stats.clear()
        return self._accumulate_step(tokens, targets, positions, backward, per_token)

    def overlap_stats(self) -> TurnStats:
        """What the last step's micro-batches in turns saw (``train.a2a_overlap``; all zeros
        without it): this rank's all-to-alls waited for, in flight while another micro-batch
        computed, and already arrived when waited for."""
        return sum(self.turn_stats, TurnStats())

    def _accumulate_step(self, tokens, targets, positions, backward: bool, per_token: dict):
        model = self.chunks[0]
        if self.microbatches > 1 and backward:
            counts = microbatch_counts(targets, self.microbatches)
            parts: dict = {}
            loss = accumulate(model, tokens, targets, positions, counts, backward, parts, per_token,
                              self.a2a_overlap, self.turn_stats)
            return torch.tensor(loss, dtype=torch.float64), parts
        loss, parts = model_loss(model, tokens, targets, positions, **per_token)
        if backward:
            loss.backward()
        return torch.tensor(loss.item(), dtype=torch.float64), parts


def _check_per_token(given: dict, named: tuple[str, ...], tokens: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``given`` holds exactly the plan's ``per_token`` inputs, each
    [b, s, ...] like ``tokens`` [b, s]."""
    if set(given) != set(named):
        raise ValueError(f"step got per-token inputs {sorted(given)} but the plan's per_token names {list(named)}; "
                         f"valid: exactly those (add the others to Plan(per_token=...))")
    for name, t in given.items():
        if not isinstance(t, torch.Tensor) or tuple(t.shape[:2]) != tuple(tokens.shape):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"per-token input {name!r} is {shape}; valid: a tensor [b, s, ...] laid out like the "
                             f"tokens {tuple(tokens.shape)} (shard_batch it as they are)")


def model_loss(model, tokens, targets, positions, **per_token) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(model's loss, {name: detached part})``: from ``model.loss_parts`` where the model has one
    (its ``"loss"`` entry and the rest), else ``model.loss`` and no parts; ``per_token`` inputs
    reach either as keywords."""
    loss_parts = getattr(model, "loss_parts", None)
    if loss_parts is None:
        return model.loss(tokens, targets, positions, **per_token), {}
    out = dict(loss_parts(tokens, targets, positions, **per_token))
    return out.pop("loss"), out


def local_microbatch_counts(targets: torch.Tensor, microbatches: int) -> torch.Tensor:
    """Counted positions of each term of the loss in each of ``microbatches`` slices of this rank's
    ``targets`` along the batch dim, fp64 [m, 1 + D]: [b, s] next-token targets give the main
    head's (!= -100, D = 0); multi-token prediction's side-by-side [b, s, 1 + D] targets
    (:func:`~meshfold.models.mtp.mtp_targets`) also each depth's
    (:func:`~meshfold.models.mtp.counted`)."""
    b = targets.shape[0]
    if b % microbatches:
        raise ValueError(f"local batch of {b} sequences is not divisible by microbatches = {microbatches}")
    known = (targets != -100).unsqueeze(-1) if targets.dim() == 2 else counted(targets)  # [b, s, 1 + D]
    return known.reshape(microbatches, -1, known.shape[-1]).sum(dim=1).double()


def microbatch_counts(local_targets: torch.Tensor, microbatches: int) -> list[list[float]]:
    """:func:`local_microbatch_counts` of every global micro-batch, from this rank's own targets:
    micro-batch i is the i-th slice of every dp rank's rows, and without pp every global token
    sits on exactly one rank, so one all-reduce of the local counts sums them (one read to the
    host, however many terms)."""
    counts_mt = local_microbatch_counts(local_targets, microbatches)
    dist.all_reduce(counts_mt)
    return counts_mt.tolist()


def accumulate(model, tokens_bs, targets_bs, positions, counts: list, backward: bool,
               parts: dict | None = None, per_token: dict | None = None, overlap: bool = False,
               stats: list | None = None) -> float:
    """Gradient accumulation without pp: this rank's local ``tokens_bs`` / ``targets_bs`` ([b, s],
    or multi-token prediction's [b, s, 1 + D]) cut into ``len(counts)`` micro-batches along the
    batch dim, one forward + backward each of ``model`` (laid out whole by ``parallelize``);
    ``per_token`` inputs [b, s, ...] are cut alike and reach the model's loss as keywords.

    ``counts[i]``: micro-batch i's counted target tokens, or a list of its counted positions per
    term of the loss (:func:`microbatch_counts`: the main head's, then each MTP depth's).
    ``model.loss`` of micro-batch i is its global mean, ``sum_i / counts[i]``; weighting it by
    ``counts[i] / sum(counts)`` makes the micro-batches add up to the whole batch's mean loss and
    gradients (up to summation order), as the pipeline schedules do. With several terms each is
    weighted by its own share (``model.loss_parts(..., weights=)``): a depth-k prediction counts
    only where two targets are known, so where -100 targets mask a micro-batch unevenly its share
    of depth-k positions is not its share of main targets. MoE balancing losses are
    computed per micro-batch (Megatron-Core's definition) and each enters the backward scaled by
    1 / microbatches, as with pp > 1 and in Megatron-Core (``MoELayer.balancing_scale``), so
    their gradient is the mean over the micro-batches. Under FSDP2 only the last backward
    reduce-scatters. ``parts`` (a dict, filled in): the model's loss parts (:func:`model_loss`),
    weighted as the loss is.

    ``overlap`` (``train.a2a_overlap``): combined, as Megatron-Core's combined 1F1B on one stage:
    micro-batch i + 1's forward runs beside micro-batch i's backward, the two in turns
    (:func:`meshfold.runtime.overlap.run_in_turns`), so that one's dispatch and combine
    all-to-alls travel while the other computes; the same values. Never two backwards at once:
    under FSDP2 two micro-batches' gradients would meet in the compute dtype in the gathered
    weights before reaching its fp32 accumulation. ``stats`` (a list, appended to): each pair's
    :class:`~meshfold.runtime.overlap.TurnStats`. Under FSDP2 the gradients are then reduced once,
    after the last micro-batch (:func:`~meshfold.parallel.data_parallel.hold_fsdp_gradients`),
    and the model must keep its blocks gathered after their forward (:class:`Pipeline` sets it).
    """
    rows = [list(c) if isinstance(c, (list, tuple)) else [c] for c in counts]
    totals = [sum(column) for column in zip(*rows)]
    m = len(rows)
    sync = getattr(model, "set_requires_gradient_sync", None)
    layers = [x for x in model.modules() if isinstance(x, MoELayer)]
    for layer in layers:
        layer.balancing_scale = 1 / m
    cut = {name: t.chunk(m) for name, t in (per_token or {}).items()}
    pieces = list(zip(tokens_bs.chunk(m), targets_bs.chunk(m)))

    def forward(i: int) -> tuple[torch.Tensor, dict]:
        """Micro-batch i's forward: (its weighted loss, its weighted parts)."""
        tokens_ms, targets_ms = pieces[i]
        inputs = {name: cut_[i] for name, cut_ in cut.items()}
        # a term no position of the batch counts is 0 / 0 in the whole batch too (NaN)
        w = [c / t if t else float("nan") for c, t in zip(rows[i], totals)]
        if len(w) > 1:  # one weight per term: the model scales each mean by its own
            named = dict(model.loss_parts(tokens_ms, targets_ms, positions, weights=w, **inputs))
            return named.pop("loss"), named
        part, named = model_loss(model, tokens_ms, targets_ms, positions, **inputs)
        return part * w[0], {name: value * w[0] for name, value in named.items()}

    loss = 0.0
    try:
        done = []
        if overlap and backward:  # combined: forward i + 1 beside backward i, in turns
            if sync is not None:  # FSDP2: reduce once all are done
                hold_fsdp_gradients(model)
            done.append(forward(0))
            for i in range(1, m):
                (ahead, _), seen = run_in_turns(lambda i=i: forward(i), done[-1][0].backward)
                done.append(ahead)
                if stats is not None:
                    stats.append(seen)
            done[-1][0].backward()
            if sync is not None:
                reduce_fsdp_gradients(model)
        else:
            for i in range(m):
                if sync is not None and backward:
                    sync(i == m - 1)
                done.append(forward(i))
                if backward:
                    done[-1][0].backward()
        for part, named in done:
            loss += part.item()
            if parts is not None:
                for name, value in named.items():
                    parts[name] = parts.get(name, 0) + value
    finally:
        for layer in layers:
            layer.balancing_scale = 1.0
    return loss
