"""Interleaved 1F1B's memory moments (meshfold.plan.interleaved) follow torch's order of ops.

The planner once counted interleaving's moments as 1F1B's (every group gathered, every gradient
formed after the first backward): 1.25x the dry run's step peak on both stages of Mixtral's pp 2 x
virtual 2 (tests/dryrun/test_plan_vs_dryrun.py compares the two at real shapes).
"""

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshfold.mesh import FoldSpec
from meshfold.plan.interleaved import ChunkBytes, interleaved_order, interleaved_peak
from meshfold.plan.memory import in_flight


def _torch_order(pp, v, m, rank):
    """torch's own op list for ``rank`` (its idle slots dropped), from the schedule's method on
    the four attributes it reads, so no process group or stages are needed."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    rounds = max(1, m // pp)
    self = SimpleNamespace(n_local_stages=v, microbatches_per_round=m // rounds, pp_group_size=pp, _n_microbatches=m)
    return [(a.computation_type.value, a.stage_index, a.microbatch_index)
            for a in ScheduleInterleaved1F1B._calculate_single_rank_operations(self, rank) if a is not None]


@st.composite
def _schedules(draw):
    """(pp, v, m, rank) that torch's schedule accepts: m a multiple of its rounds, max(1, m // pp)."""
    pp, v = draw(st.integers(2, 5)), draw(st.integers(2, 4))
    m = draw(st.sampled_from([n for n in range(1, 3 * pp + 1) if n % max(1, n // pp) == 0]))
    return pp, v, m, draw(st.integers(0, pp - 1))


@settings(max_examples=60, deadline=None)
@given(_schedules())
def test_the_order_is_torchs_interleaved_1f1b(schedule):
    assert interleaved_order(*schedule) == _torch_order(*schedule)


def _chunks(rank, pp, v, given):
    """The rank's chunks, every byte 0 but those ``given`` ({chunk: {field: bytes}})."""
    zero = dict(params=0.0, sharded=0.0, gathered=0.0, root=0.0, regather=0.0, new_grad=0.0, stored=0.0,
                output=0.0, reduce=0.0)
    return {rank + k * pp: ChunkBytes(**{**zero, **given.get(rank + k * pp, {})}) for k in range(v)}


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 5), st.integers(2, 4), st.integers(1, 4), st.data())
def test_most_chunk_microbatches_in_flight_are_the_warm_up_of_in_flight(pp, v, rounds, data):
    """With one byte of activations per chunk-micro-batch the peak is the most in flight, which is
    ``v`` x :func:`in_flight`'s count in chunks (Korthikanti et al.'s formula, m a multiple of pp)."""
    m, rank = rounds * pp, data.draw(st.integers(0, pp - 1))
    chunks = _chunks(rank, pp, v, {rank + k * pp: {"stored": 1.0} for k in range(v)})
    peak = interleaved_peak(chunks, interleaved_order(pp, v, m, rank), last_chunk=pp * v - 1, loss=0.0, m=m)
    layout = SimpleNamespace(spec=FoldSpec(pp, pp=pp), vpp=v, schedule="interleaved-1f1b")
    assert peak == pytest.approx(v * in_flight(layout, m, rank))


def test_a_chunks_gradients_are_unsharded_from_its_first_backward_to_its_reduction():
    """pp 2, v 2, m 2, rank 0: F0 F1 of chunk 0, F0 F1 of chunk 2, B0 B1 of chunk 2, B0 B1 of
    chunk 0. Chunk 2's gradients are reduced (sharded) before chunk 0 forms any, so the peak is
    chunk 0's unsharded beside chunk 2's shard, or chunk 2's unsharded alone: never both whole."""
    order = interleaved_order(2, 2, 2, 0)
    for p0, p2, expected in ((100.0, 10.0, 4 * (100 + 1)), (10.0, 100.0, 4 * 100)):
        chunks = _chunks(0, 2, 2, {0: {"params": p0, "sharded": 1.0}, 2: {"params": p2, "sharded": 1.0}})
        assert interleaved_peak(chunks, order, last_chunk=3, loss=0.0, m=2) == expected


def test_a_chunks_groups_are_gathered_from_its_backward_to_its_next_forward_or_reduction():
    """pp 2, v 2, m 2, rank 1: F0 F1 of chunk 1, F0 of chunk 3, B0, F1, B1 of chunk 3, B0 B1 of
    chunk 1. Chunk 3's forward between its backwards reshards it (B1 re-gathers: its weights and
    the re-gather's transient), and its reduction before chunk 1's backwards frees it, so chunk 1
    re-gathers beside nothing of chunk 3's."""
    order = interleaved_order(2, 2, 2, 1)
    chunks = _chunks(1, 2, 2, {1: {"gathered": 10.0, "regather": 20.0},
                                 3: {"gathered": 100.0, "regather": 200.0, "new_grad": 1000.0}})
    # new_grad (a backward right after a backward of the same chunk) never happens to chunk 3
    assert interleaved_peak(chunks, order, last_chunk=3, loss=0.0, m=2) == 300.0
    chunks = _chunks(1, 2, 2, {1: {"gathered": 10.0, "new_grad": 1000.0}, 3: {"gathered": 100.0}})
    assert interleaved_peak(chunks, order, last_chunk=3, loss=0.0, m=2) == 1010.0
