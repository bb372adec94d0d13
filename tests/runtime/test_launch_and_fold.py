"""The local launcher (spawn, World) and the DeviceMeshes built by fold() on real gloo ranks."""

import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import Phase, given, settings

from meshfold.runtime import launch
from meshfold.runtime import launch
from meshfold.runtime.launch import RankError, World, spawn
from meshfold.mesh import VIEWS, FoldSpec, fold
from meshfold.testing.strategies import fold_specs
from meshfold.testing.worlds import cached_fold

pytestmark = pytest.mark.multirank


def _ranks_per_mesh_dim(rank, world_size, spec):
    """On every rank: all_gather the rank number over each dim of both views."""
    fm = fold(spec)
    seen = {}
    for view in VIEWS:
        mesh = fm.view(view)
        for i, d in enumerate(mesh.mesh_dim_names):
            out = [torch.zeros(1, dtype=torch.long) for _ in range(mesh.size(i))]
            dist.all_gather(out, torch.tensor([rank]), group=mesh.get_group(d))
            seen[(view, d)] = [int(t) for t in out]
    counts = (fm.num_process_groups, fm.num_process_groups_unshared)
    fm.destroy()
    return seen, counts


@pytest.mark.parametrize("world_size", [4, 8])
def test_mesh_process_groups_contain_the_predicted_ranks(worlds, world_size):
    world = worlds(world_size)

    @settings(max_examples=8)
    @given(fold_specs(world_sizes=[world_size]))
    def check(spec):
        results = world.run(_ranks_per_mesh_dim, spec)
        assert results[0][1] == spec.process_group_count()  # fold creates what the spec predicts
        for rank, (seen, _) in enumerate(results):
            for (view, d), ranks in seen.items():
                # all_gather order is group-rank order, which must be the sorted group
                assert ranks == spec.group_of(rank, view, d), (spec, rank, view, d)

    check()


def test_fold_shares_process_groups_between_views(worlds):
    from meshfold.mesh import FoldSpec

    # tp == etp rank sets, pp shared, size-1 dims shared: 8 ranks tp2 x dp4 | etp2 x ep4.
    spec = FoldSpec(8, tp=2, etp=2, ep=4)
    (_, (created, unshared)), *_ = worlds(8).run(_ranks_per_mesh_dim, spec)
    # distinct partitions: tp=etp (4 groups), dp=ep (2 groups), size-1 dims (8 singletons)
    assert created == 4 + 2 + 8
    assert unshared == 2 * (8 + 2 + 4 + 8) - 0  # pp(8) dp(2) cp(8) tp(4) | pp(8) edp(8) ep(2) etp(4)
    assert created < unshared


def _two_folds_sharing_tp(rank, world_size):
    """Fold two layouts with the same tp rank groups, release them one by one, and use the
    survivor's tp group in between."""
    from meshfold.mesh import FoldSpec

    a = fold(FoldSpec(world_size, tp=2, ep=world_size))
    b = fold(FoldSpec(world_size, tp=2, ep=2, etp=2))
    shared = a.attn.get_group("tp") is b.attn.get_group("tp") is b.moe.get_group("etp")
    a.destroy()
    t = torch.tensor([rank])
    b_tp = b.attn.get_group("tp")
    dist.all_reduce(t, group=b_tp)  # b's group outlives a
    b.destroy()
    c = fold(FoldSpec(world_size, tp=2, ep=world_size))
    fresh = c.attn.get_group("tp") is not b_tp  # released with b: made anew
    c.destroy()
    return shared, int(t), fresh


def test_folds_share_the_process_groups_of_equal_rank_partitions():
    """A long-lived process that folds many layouts keeps one process group per distinct rank
    partition (each idle gloo group costs a polling thread), released with the last fold using it.
    Its own world: the session's shared worlds hold cached folds (``meshfold.testing.cached_fold``)
    whose groups would outlive ``b`` and make ``c`` reuse them."""
    with World(4, timeout=60.0) as world:
        results = world.run(_two_folds_sharing_tp)
    assert [r[0] for r in results] == [True] * 4
    assert [r[1] for r in results] == [1, 1, 5, 5]  # tp pairs {0, 1} and {2, 3}
    assert [r[2] for r in results] == [True] * 4


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("deliberate failure on rank one")
    dist.barrier()
    return rank


def _hang_in_collective(rank, world_size):
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    else:
        time.sleep(600)


def _sum_of_ranks(rank, world_size):
    t = torch.tensor([rank])
    dist.all_reduce(t)
    return int(t)


def test_spawn_returns_each_ranks_result():
    assert spawn(_sum_of_ranks, 3) == [3, 3, 3]


def _env(rank, world_size, names):
    return {n: os.environ.get(n) for n in names}


def test_ranks_see_the_callers_environment_as_it_is_at_each_start(monkeypatch):
    """Ranks fork from a long-lived forkserver (launch._context); they must still see the
    caller's environment of the moment, not the server's, as spawned processes would."""
    monkeypatch.setenv("MESHFOLD_TEST_UNSET_LATER", "stale")  # in the server's, if this starts it
    spawn(_sum_of_ranks, 2)  # the server is running from here on
    monkeypatch.setenv("MESHFOLD_TEST_SET_LATER", "yes")
    monkeypatch.delenv("MESHFOLD_TEST_UNSET_LATER")
    names = ("MESHFOLD_TEST_SET_LATER", "MESHFOLD_TEST_UNSET_LATER")
    assert spawn(_env, 2, names) == [{names[0]: "yes", names[1]: None}] * 2
    with World(2, timeout=30) as world:
        assert world.run(_env, names) == [{names[0]: "yes", names[1]: None}] * 2


def test_spawn_raises_with_the_failing_rank_and_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankError) as err:
        spawn(_raise_on_rank_one, 3)
    assert err.value.rank == 1
    assert "deliberate failure on rank one" in str(err.value)
    assert "_raise_on_rank_one" in err.value.remote_traceback
    assert time.monotonic() - start < 60


def test_spawn_fails_within_the_timeout_when_a_rank_hangs():
    start = time.monotonic()
    with pytest.raises((RankError, TimeoutError)):
        spawn(_hang_in_collective, 2, timeout=4)
    assert time.monotonic() - start < 4 + 60  # collective timeout + process start-up


def test_world_survives_a_failure_by_restarting():
    with World(2, timeout=30) as world:
        assert world.run(_sum_of_ranks) == [1, 1]
        with pytest.raises(RankError) as err:
            world.run(_raise_on_rank_one)
        assert err.value.rank == 1
        assert world.run(_sum_of_ranks) == [1, 1]


def _pid(rank, world_size):
    return os.getpid()


def _raise_after_a_collective(rank, world_size):
    dist.barrier()
    raise ValueError(f"deliberate failure on rank {rank}")


def test_a_failure_every_rank_finishes_keeps_the_world_up(worlds):
    """When every rank returns or raises, no collective is left half done: the ranks stay up, so a
    property test shrinking a failing example does not start a world per try."""
    world = worlds(2)
    pids = world.run(_pid)
    with pytest.raises(RankError) as err:
        world.run(_raise_after_a_collective)
    assert {err.value.rank, *(r for r, _ in err.value.others)} == {0, 1}
    assert "deliberate failure on rank" in err.value.summary
    assert world.run(_pid) == pids and world.run(_sum_of_ranks) == [1, 1]


def _fold_and_pid(rank, world_size, spec):
    fm = cached_fold(spec)
    return os.getpid(), fm.attn.size(fm.attn.mesh_dim_names.index("tp"))


def test_a_failing_example_shrinks_on_the_same_ranks(worlds):
    """The way meshfold.testing.strategies.fold_specs says to write a multi-rank property (ranks
    return, the test process asserts): hypothesis shrinks a failing fold to the smallest one on
    the same processes, every step a fold the constraints allow."""
    world = worlds(4)
    pids = world.run(_pid)
    tried = []

    @settings(max_examples=10, phases=[Phase.generate, Phase.shrink], derandomize=True, database=None)
    @given(fold_specs(world_sizes=[4], pp=[1], heads=2, experts=2))
    def check(spec):
        tried.append(spec)
        results = world.run(_fold_and_pid, spec)
        assert [pid for pid, _ in results] == pids
        assert results[0][1] == 1, f"tp = {spec.tp}"  # a deliberate failure for every tp > 1

    with pytest.raises(AssertionError, match="tp = 2"):
        check()
    assert all(s.tp <= 2 and s.ep <= 2 for s in tried)  # heads and experts = 2 bound both, also when shrinking
    assert tried[-1] == FoldSpec(4, tp=2)  # shrunk to the simplest failing fold
    assert world.run(_pid) == pids


def _listening_addresses(rank, world_size):
    """Hex local addresses of the TCP sockets this process listens on (Linux /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A = LISTEN
                    out.append(fields[1].split(":")[0])
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp (Linux only)")
def test_ranks_listen_on_loopback_only(worlds):
    for addresses in worlds(2).run(_listening_addresses):
        assert addresses, "expected gloo to listen somewhere"
        # 127.0.0.1 in /proc/net/tcp is 0100007F; IPv6 loopback is ...0001
        assert all(a == "0100007F" or a.endswith("01000000") for a in addresses), addresses


TORCHRUN_SCRIPT = """
import os, sys
from meshfold.runtime.launch import spawn
from tests.runtime.test_launch_and_fold import _sum_of_ranks
result = spawn(_sum_of_ranks, 2)
with open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"]), "w") as f:
    f.write(repr(result))
"""


def test_spawn_runs_unchanged_under_torchrun(tmp_path):
    script = tmp_path / "under_torchrun.py"
    script.write_text(TORCHRUN_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with socket.socket() as s:  # torchrun needs a concrete port; a brief race is acceptable here
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", port, "--local-addr", "127.0.0.1", str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}").read_text() == "[1, 1]"


def _imported(rank, world_size, names):
    import sys

    return [name for name in names if name in sys.modules]


def test_ranks_fork_with_the_sessions_preloaded_modules_and_preload_refuses_unknown_names():
    """tests/conftest.py preloads meshfold's modules into the server ranks fork from, so a new rank
    starts with them imported (this module imports none of them); a name that does not import is
    refused, not skipped by the server."""
    from tests.conftest import PRELOAD_MODULES

    assert spawn(_imported, 1, PRELOAD_MODULES) == [list(PRELOAD_MODULES)]
    with pytest.raises(ValueError, match=r"no module named \['meshfold.no_such_module'\]"):
        launch.preload("meshfold.no_such_module")
