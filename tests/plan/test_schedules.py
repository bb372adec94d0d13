"""The planner's pipeline bubbles (meshfold.plan.schedules) against torch's own schedule orders
played with the same times (meshfold.dryrun.bubble)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshfold.dryrun.bubble import play, played_bubble
from meshfold.dryrun.check import TOLERANCE, bubble_cases, bubble_rows
from meshfold.parallel.pipeline import schedule_order
from meshfold.plan.schedules import bubble, overlapped_pairs

seconds = st.floats(0.05, 3.0)


def test_playing_a_hand_made_order_gives_its_span():
    """pp2, one micro-batch, whole backwards of 2 s: F0 F1 (1 s each), B1, B0: 6 s, each rank
    busy 3 s of them."""
    order = {0: [("F", 0, 0), ("B", 0, 0)], 1: [("F", 1, 0), ("B", 1, 0)]}
    assert play(order, {"F": 1.0, "B": 2.0}, 2) == (6.0, 3.0)
    with pytest.raises(ValueError, match="cannot finish"):
        play({0: [("B", 0, 0), ("F", 0, 0)]}, {"F": 1.0, "B": 2.0}, 1)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev"])
def test_every_action_of_every_micro_batch_is_in_torchs_order(schedule):
    pp, m = 4, 8
    """Each (stage, micro-batch) runs one forward and one backward: whole (B), or split into its
    input (I) and weight (W) halves, each once."""
    order = schedule_order(schedule, pp, 2, m)
    every = [(s, j) for s in range(2 * pp) for j in range(m)]
    ran = {kind: sorted((s, j) for acts in order.values() for k, s, j in acts if k == kind) for kind in "FBIW"}
    assert ran["F"] == every
    assert ran["I"] == ran["W"] and sorted(ran["B"] + ran["I"]) == every


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["interleaved-1f1b", "interleaved-zb"]), st.sampled_from([2, 3, 4, 8]),
       st.integers(1, 4), seconds, seconds, seconds)
def test_interleaved_bubbles_are_torchs_orders_exactly(schedule, pp, rounds, f, b, w):
    m = pp * rounds
    assert bubble(schedule, pp, 2, m, f, b, w) == pytest.approx(played_bubble(schedule, pp, 2, m, f, b, w),
                                                                 rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("case", bubble_cases(), ids=lambda c: c.label)
def test_planner_bubbles_of_the_check_are_within_its_tolerance(case):
    """The planner's forward / backward halves of Mixtral-8x22B on pp 2 and 4: every schedule's
    bubble within the check's 10% of torch's order (zbv with few micro-batches included)."""
    planner, played, _ = bubble_rows(case)
    assert abs(planner / played - 1) <= TOLERANCE, (planner, played)


def test_a_single_stage_schedule_has_no_order_to_play():
    with pytest.raises(ValueError, match="runs without an order of actions"):
        schedule_order("1f1b", 2, 1, 4)


def test_the_planner_refuses_recompute_under_a_zero_bubble_schedule_naming_it():
    import dataclasses

    from meshfold.mesh import FoldSpec
    from meshfold.plan.cost import Layout, check_layout
    from meshfold.plan.models import MODELS

    model = dataclasses.replace(MODELS["mixtral-8x22b"], layers=8)
    lay = Layout(FoldSpec(32, tp=2, ep=8, pp=2), vpp=2, recompute="selective", sharding="allreduce", schedule="zbv")
    assert "recompute='selective' with zbv" in check_layout(model, lay, 4096, 64)
    assert check_layout(model, dataclasses.replace(lay, recompute="none"), 4096, 64) == ""


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev"])
@pytest.mark.parametrize("pp, rounds", [(2, 2), (4, 2), (8, 4)])
def test_micro_batches_in_flight_are_those_of_torchs_order(schedule, pp, rounds):
    """The planner's activations in flight (meshfold.plan.memory.in_flight, in units of a rank's
    layers) are the chunk-micro-batches torch's order holds at a rank's fullest backward: run
    forward, their (weight) backward not yet."""
    import types

    from meshfold.mesh import FoldSpec
    from meshfold.plan.memory import in_flight

    m = pp * rounds
    layout = types.SimpleNamespace(spec=FoldSpec(pp, pp=pp), vpp=2, schedule=schedule)
    for rank, actions in schedule_order(schedule, pp, 2, m).items():
        held, fullest = 0, 0
        for kind, _, _ in actions:
            held += kind == "F"
            fullest = max(fullest, held) if kind in ("B", "I") else fullest
            held -= kind in ("B", "W")
        assert in_flight(layout, m, rank) * 2 == fullest, rank


@pytest.mark.parametrize("pp, m", [(2, 4), (2, 7), (3, 6), (3, 13), (4, 8), (4, 11), (4, 32), (8, 16), (8, 23)])
def test_overlapped_pairs_are_the_overlapped_actions_of_torchs_dualpipev_order(pp, m):
    """What train.a2a_overlap runs in turns under dualpipev: every rank's OVERLAP_F_B actions in
    torch's own ScheduleDualPipeV order (stand-ins for the stages, as schedule_order builds them)."""
    import types

    from torch import nn
    from torch.distributed import pipelining
    from torch.distributed.pipelining.schedules import OVERLAP_F_B

    from meshfold.catalog import rank_chunks

    n = 2 * pp
    stages = [types.SimpleNamespace(stage_index=s, num_stages=n, group_size=pp, group_rank=0, is_first=s == 0,
                                    is_last=s == n - 1, submod=nn.Identity(), has_backward=True)
              for s in rank_chunks(pp, 2, 0, "dualpipev")]
    order = pipelining.ScheduleDualPipeV(stages, m).pipeline_order
    assert sorted(order) == list(range(pp))
    for rank, actions in order.items():
        overlapped = sum(a is not None and a.computation_type == OVERLAP_F_B for a in actions)
        assert overlapped_pairs(pp, m, rank) == overlapped, rank


@pytest.mark.parametrize("pp, m", [(2, 2), (2, 5), (4, 4), (4, 9), (8, 32)])
def test_combined_1f1b_pairs_each_steady_forward_with_a_backward(pp, m):
    """1F1B under train.a2a_overlap (combined_1f1b_order): every micro-batch's forward and
    backward once on each rank, in dependency order (a rank's backward of k after its forward of
    k), and overlapped_pairs counts its OVERLAP_F_B actions."""
    from torch.distributed.pipelining.schedules import FORWARD, OVERLAP_F_B

    from meshfold.parallel.pipeline import combined_1f1b_order

    for rank, actions in combined_1f1b_order(pp, m).items():
        flat = [b for a in actions for b in (a.sub_actions if a.computation_type == OVERLAP_F_B else (a,))]
        forwards = [a.microbatch_index for a in flat if a.computation_type == FORWARD]
        backwards = [a.microbatch_index for a in flat if a.computation_type != FORWARD]
        assert forwards == backwards == list(range(m)) and {a.stage_index for a in flat} == {rank}
        assert all(flat.index(next(a for a in flat if a.computation_type == FORWARD and a.microbatch_index == k))
                   < flat.index(next(a for a in flat if a.computation_type != FORWARD and a.microbatch_index == k))
                   for k in range(m))
        overlapped = sum(a.computation_type == OVERLAP_F_B for a in actions)
        assert overlapped_pairs(pp, m, rank, "1f1b") == overlapped == m - min(pp - rank, m), rank


def test_without_pp_each_forward_pairs_with_the_previous_backward():
    assert [overlapped_pairs(1, m, 0, "1f1b") for m in (1, 2, 3, 8)] == [0, 1, 2, 7]
    with pytest.raises(ValueError, match="schedule 'gpipe'"):
        overlapped_pairs(2, 8, 0, "gpipe")
