"""meshfold.runtime.simulated: the collectives and per-rank host logic meshfold runs under LocalTensorMode."""

import pytest
import torch
import torch.distributed as dist

from meshfold.mesh import FoldSpec, fold
from meshfold.placements.collectives import _group, all_to_all_v, gather_equal
from meshfold.runtime.simulated import per_rank, pick, simulated_ranks
from meshfold.testing.worlds import rank_values, simulated_world

SPEC = FoldSpec(4, ep=2)  # two ep groups, {0, 1} and {2, 3}: collectives must keep them apart


def test_outside_the_mode_per_rank_is_the_plain_call():
    assert simulated_ranks() is None
    assert pick([5, 6, 7], 2) == 7
    assert per_rank(lambda a, b: (a + b, [a]))(1, 2) == (3, [1])


def test_per_rank_runs_once_per_rank_and_recombines():
    with simulated_world(4) as mode:
        mesh = fold(SPEC).stage("moe")
        me = _group(mesh, "ep")[2]  # 0, 1, 0, 1
        assert pick([10, 20], me) + 0 == pick([10, 20], me)  # a per-rank int, not a Python one
        rows = per_rank(lambda t, i: t[: i + 1].sum())(mode.rank_map(lambda r: torch.arange(4) * r), me)
        assert {r: int(v) for r, v in rank_values(rows).items()} == {0: 0, 1: 1, 2: 0, 3: 3}


def test_gather_equal_keeps_each_group_apart():
    """torch 2.13's simulated list all_gather copies the last group's tensors to every rank;
    meshfold's gather (simulated.all_gather) gives each group its own members' tensors."""
    with simulated_world(4) as mode:
        mesh = fold(SPEC).stage("moe")
        got = rank_values(gather_equal(mode.rank_map(lambda r: torch.tensor([r])), mesh, "ep"))
        assert {r: v.flatten().tolist() for r, v in got.items()} == {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
        parts = [torch.empty(1, dtype=torch.int64) for _ in range(2)]
        dist.all_gather(parts, mode.rank_map(lambda r: torch.tensor([r])), group=mesh.get_group("ep"))
        assert rank_values(parts[0])[0].item() == 2  # torch's own: group {2, 3}'s rows on rank 0


def test_all_to_all_v_takes_each_ranks_own_splits():
    send = {0: [1, 2], 1: [3, 0], 2: [2, 2], 3: [0, 1]}  # rows rank r sends to each rank of its group
    recv = {0: [1, 3], 1: [2, 0], 2: [2, 0], 3: [2, 1]}
    with simulated_world(4) as mode:
        folded = fold(SPEC)
        mesh, rank = folded.stage("moe"), folded.attn.get_rank()  # rank: a per-rank int
        x = mode.rank_map(lambda r: torch.arange(sum(send[r])) + 100 * r)
        ins, outs = pick([send[r] for r in range(4)], rank), pick([recv[r] for r in range(4)], rank)
        y = {r: v.tolist() for r, v in rank_values(all_to_all_v(x, ins, outs, mesh, "ep")).items()}
        assert y == {0: [0, 100, 101, 102], 1: [1, 2], 2: [200, 201], 3: [202, 203, 300]}
        recv[2] = [1, 1]  # rank 2 expects one row from rank 3, which sends it none
        with pytest.raises(ValueError, match="rank 2 expects"):
            all_to_all_v(x, ins, pick([recv[r] for r in range(4)], rank), mesh, "ep")
