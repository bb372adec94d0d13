"""``a2a_overlap``: one micro-batch's dispatch and combine all-to-alls travel while another
micro-batch computes (:mod:`meshfold.runtime.overlap`), and nothing else changes.

* Loss and every gradient equal one device in fp64 (and so the schedule without overlap, which
  equals it too: ``test_pipeline``, ``test_accumulation``): accumulated micro-batches in pairs
  without pp (even and odd counts), and DualPipeV's overlapped forward and backward with pp 2 and
  MoE layers, under FSDP2 and recomputation.
* The overlap is counted (:class:`~meshfold.runtime.overlap.TurnStats`): every all-to-all of a
  pair is waited for after the other micro-batch computed (crossed), none without overlap.
"""

import pytest

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
    (FoldSpec(4, tp=2, ep=2), 3, "allreduce", "none"),    # tp2 x dp2 | ep2 x edp2: a pair, then one alone
    (FoldSpec(4, ep=2), 4, "fsdp", "none"),               # dp4 | ep2 x edp2, FSDP2: two pairs
    (FoldSpec(2, ep=2), 2, "fsdp", "selective"),
])
def test_pairs_of_accumulated_microbatches_equal_one_device(worlds, spec, microbatches, data_parallel, recompute):
    stats = _stats(worlds, spec, microbatches, "1f1b", data_parallel, recompute, True)
    # per pair, MoE layer (_config: 3 layers, the first dense) and micro-batch: dispatch and
    # combine, forward and backward; recomputation waits for the re-run forward's too
    expected = (microbatches // 2) * 2 * 2 * (4 if recompute == "none" else 6)
    for waited, crossed, arrived, hand_overs in stats:
        assert waited == expected
        if recompute == "none":
            assert crossed == waited  # each waited for after the other micro-batch's turn
        else:
            assert 0 < crossed <= waited
        assert hand_overs >= crossed


def test_without_overlap_nothing_takes_turns(worlds):
    spec = FoldSpec(2, ep=2)
    for waited, crossed, _, _ in _stats(worlds, spec, 2, "1f1b", "allreduce", "none", False):
        assert waited == crossed == 0


@pytest.mark.parametrize("schedule, data_parallel, recompute", [
    ("dualpipev", "fsdp", "none"), ("dualpipev", "fsdp", "full"), ("dualpipev", "allreduce", "selective"),
    ("1f1b", "fsdp", "none"), ("1f1b", "allreduce", "full")])
def test_overlapped_forward_backward_equals_one_device(worlds, schedule, data_parallel, recompute):
    """dualpipev's own overlapped actions, and 1F1B run as combined 1F1B (combined_1f1b_order)."""
    spec = FoldSpec(4, pp=2, ep=2)
    stats = _stats(worlds, spec, 4, schedule, data_parallel, recompute, True)
    for waited, crossed, _, _ in stats:
        # a forward and a backward each wait for one dispatch and one combine per MoE layer;
        # recomputation adds the backward's re-run forward, whose waits outlast the partner's
        assert waited > 0 and (crossed == waited if recompute == "none" else 0 < crossed < waited)


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
