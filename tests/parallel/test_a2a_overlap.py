"""``a2a_overlap``: one micro-batch's dispatch and combine all-to-alls travel while another
micro-batch computes (:mod:`meshfold.runtime.overlap`), and nothing else changes.

* Loss and every gradient equal one device in fp64 (and so the schedule without overlap, which
  equals it too: ``test_pipeline``, ``test_accumulation``): accumulated micro-batches without pp
  (each forward beside the previous one's backward), DualPipeV's overlapped forward and backward
  and combined 1F1B with pp 2 (and pp 4) and MoE layers, under FSDP2 and recomputation.
* Where the sums keep their order, the step is bitwise the plain one, its MoE metrics and
  expert-bias counts included (bf16 compute under FSDP2, recomputation).
* The overlap is counted (:class:`~meshfold.runtime.overlap.TurnStats`): the all-to-alls of a
  pair are waited for after the other micro-batch computed (crossed).
"""

import dataclasses

import pytest
import torch

from meshfold.mesh import FoldSpec
from meshfold.parallel.pipeline import check_a2a_overlap
from tests.parallel.test_pipeline import _run

pytestmark = pytest.mark.multirank


def _stats(worlds, spec, microbatches, schedule, data_parallel, recompute, overlap):
    """Each rank's (waited, crossed, arrived, hand-overs) of one step checked against one device
    (test_pipeline's check; with pp also the same batch's evaluation): pp 1 three layers (the
    first dense), pp 2 one MoE block a chunk."""
    virtual = 2 if schedule == "dualpipev" else 1
    case = (spec, microbatches * spec.dp, 4 * spec.cp * spec.tp, 5, schedule, virtual, microbatches, data_parallel,
            0.01)
    layers, dense = (2 * spec.pp, 0) if spec.pp > 1 else (3, 1)
    return [(s.waited, s.crossed, s.arrived, s.hand_overs)
            for s in worlds(spec.world_size).run(_run, case, recompute, layers, spec.pp > 1, overlap, dense)]


@pytest.mark.parametrize("spec, microbatches, data_parallel, recompute", [
    (FoldSpec(2, ep=2), 2, "allreduce", "none"),          # dp2 | ep2: one pair
    (FoldSpec(4, tp=2, ep=2), 3, "allreduce", "none"),    # tp2 x dp2 | ep2 x edp2: two pairs (odd m)
    (FoldSpec(4, ep=2), 4, "fsdp", "none"),               # dp4 | ep2 x edp2, FSDP2: three pairs
    (FoldSpec(2, ep=2), 2, "fsdp", "selective"),
])
def test_accumulated_microbatches_in_turns_equal_one_device(worlds, spec, microbatches, data_parallel, recompute):
    stats = _stats(worlds, spec, microbatches, "1f1b", data_parallel, recompute, True)
    # per pair (micro-batch i + 1's forward beside i's backward: m - 1 of them) and MoE layer
    # (_config: 3 layers, the first dense): the forward's dispatch and combine and the backward's
    # two gradient all-to-alls in turns (a recomputation keeps its turn: plain waits, not counted)
    pairs = microbatches - 1
    for waited, crossed, arrived, hand_overs in stats:
        assert waited == pairs * 2 * 4
        # each waited for after the other's turn, but where the other had already finished
        assert waited - pairs <= crossed <= waited
        assert hand_overs >= crossed


@pytest.mark.parametrize("schedule, data_parallel, recompute", [
    ("dualpipev", "fsdp", "none"), ("dualpipev", "fsdp", "full"), ("dualpipev", "allreduce", "selective"),
    ("1f1b", "fsdp", "none"), ("1f1b", "allreduce", "full")])
def test_overlapped_forward_backward_equals_one_device(worlds, schedule, data_parallel, recompute):
    """dualpipev's own overlapped actions, and 1F1B run as combined 1F1B (combined_1f1b_order)."""
    spec = FoldSpec(4, pp=2, ep=2)
    stats = _stats(worlds, spec, 4, schedule, data_parallel, recompute, True)
    for waited, crossed, _, _ in stats:
        # a forward and a backward each wait for one dispatch and one combine per MoE layer (a
        # recomputation keeps its turn, and the backward's waits after it may outlast the forward)
        assert waited > 0 and (crossed == waited if recompute == "none" else 0 < crossed <= waited)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
def test_overlapped_forward_backward_on_pp4_equals_one_device(worlds, schedule):
    """pp 4 (8 ranks, FSDP2, 8 micro-batches): the longer warm-ups and every rank's pairs."""
    stats = _stats(worlds, FoldSpec(8, pp=4, ep=2), 8, schedule, "fsdp", "none", True)
    assert all(0 < crossed == waited for waited, crossed, _, _ in stats)


@pytest.mark.parametrize("spec, microbatches, schedule, match", [
    (FoldSpec(2, ep=1), 2, "1f1b", "fold.ep = 1"),
    (FoldSpec(2, ep=2), 1, "1f1b", "microbatches = 1"),
    (FoldSpec(4, pp=2, ep=2), 4, "interleaved-1f1b", "schedule 'interleaved-1f1b'"),
])
def test_unsupported_overlap_is_refused_naming_the_setting(spec, microbatches, schedule, match):
    with pytest.raises(ValueError, match=match):
        check_a2a_overlap(spec, microbatches, schedule)


def _side_by_side(rank, world_size, spec, data_parallel, recompute, dtype_name, schedule="1f1b"):
    """The same step of two Pipelines built alike, without and with a2a_overlap, on one batch:
    each one's loss, every gradient (local shard), MoE metrics and expert-bias counts."""
    from meshfold.models.transformer import MoETransformer
    from meshfold.parallel.batch import shard_batch
    from meshfold.parallel.pipeline import Pipeline
    from meshfold.testing.worlds import cached_fold
    from tests.parallel.test_pipeline import _config

    cfg = _config(spec, 0.01, layers=4 if spec.pp > 1 else 3)
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, expert_bias=True), first_k_dense=0)
    m = 4 if spec.pp > 1 else 2
    tokens = torch.randint(0, cfg.vocab, (m * spec.dp, 8), generator=torch.Generator().manual_seed(3))
    local, pos = shard_batch(tokens, spec, rank)
    out = []
    for overlap in (False, True):
        model = MoETransformer(cfg, dtype=torch.float32, device="meta", seed=0)
        pipe = Pipeline(model, cached_fold(spec), m, schedule, data_parallel=data_parallel,
                        compute_dtype=getattr(torch, dtype_name), recompute=recompute, a2a_overlap=overlap)
        for layer in pipe.moe_layers():
            layer.reset_step()
        loss = pipe.step(local, local.roll(-1, 1), pos).item()
        pipe.reduce_gradients()
        grads = [p.grad.to_local().clone() for p in pipe.parameters()]
        counts = [layer._bias_counts.clone() for layer in pipe.moe_layers()]
        out.append((loss, grads, pipe.moe_metrics(), counts))
    (l0, g0, m0, c0), (l1, g1, m1, c1) = out
    return (l0 == l1, all(torch.equal(a, b) for a, b in zip(g0, g1)), m0 == m1,
            all(torch.equal(a, b) for a, b in zip(c0, c1)))


@pytest.mark.parametrize("spec, data_parallel, recompute, dtype_name, schedule", [
    (FoldSpec(2, ep=2), "fsdp", "none", "bfloat16", "1f1b"),       # one pair: two-term fp32 sums, bitwise
    (FoldSpec(2, ep=2), "allreduce", "full", "float32", "1f1b"),
    (FoldSpec(4, pp=2, ep=2), "fsdp", "full", "float32", "1f1b"),  # combined 1F1B
])
def test_the_overlapped_step_is_bitwise_the_plain_one_metrics_and_bias_counts_included(
        worlds, spec, data_parallel, recompute, dtype_name, schedule):
    """Where the gradient sums have the same order, the step is bitwise the plain one: loss,
    gradients (under FSDP2 with bf16 compute each micro-batch's gradients reach the fp32
    accumulation on their own, as without turns), the MoE metrics (balancing losses, tokens per
    expert) and the expert-bias counts (a recomputation replays saved state without the other
    micro-batch counting into it)."""
    for loss, grads, metrics, counts in worlds(spec.world_size).run(
            _side_by_side, spec, data_parallel, recompute, dtype_name, schedule):
        assert (metrics, counts) == (True, True)
        assert (loss, grads) == (True, True) or spec.pp > 1  # pp: the last stage's sums may order apart
