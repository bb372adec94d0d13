"""Ragged placements, variable-size collectives and redistribute on real gloo ranks.

Every check runs on every rank of a shared world. Each rank rebuilds *all* ranks' inputs from the
example's seed, so it can compute the single-process reference (gather everything, recompute with
plain slicing and autograd) locally and compare its own piece and its own gradient with it.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from meshfold.mesh import VIEWS
from meshfold.placements import (RaggedShard, RaggedTensor, all_gather_v, all_to_all_v,
                                 exchange_splits, redistribute, reduce_scatter_v, set_debug_checks)
from meshfold.testing.strategies import fold_specs, split_sizes
from meshfold.testing.worlds import cached_fold

pytestmark = pytest.mark.multirank

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def _data(seed, rank, shape, noncontig=False, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    t = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    if noncontig:  # same values, transposed storage
        return torch.empty(tuple(reversed(shape)), dtype=dtype).T.copy_(t)
    return t


def _tol(dtype):
    return {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]


# ---- collectives -------------------------------------------------------------------------------
def _check_collective(rank, world_size, case):
    spec, view, dim, kind, splits, F, dtype, noncontig, seed = case
    fm = cached_fold(spec)
    group = spec.group_of(rank, view, dim)
    G, me = len(group), group.index(rank)
    tol = _tol(dtype)

    def inputs(pos):  # every group member's input, identical on every rank
        rows = sum(splits[pos]) if kind == "a2a" else (splits[0][pos] if kind == "gather" else sum(splits[0]))
        return _data(seed, group[pos], (rows, F), noncontig and pos == me, dtype)

    def weights(pos, rows):
        return _data(seed + 7, group[pos], (rows, F), dtype=dtype)

    xs = [inputs(p).detach().requires_grad_(True) for p in range(G)]
    if kind == "a2a":  # splits[i][j]: rows rank i sends to rank j
        def ref_out(k):
            return torch.cat([xs[i][sum(splits[i][:k]):sum(splits[i][:k + 1])] for i in range(G)])
        out = all_to_all_v(xs[me], splits[me], [splits[i][me] for i in range(G)], fm.view(view), dim)
    elif kind == "gather":
        sizes = splits[0]

        def ref_out(k):
            return torch.cat(xs)
        out = all_gather_v(xs[me], sizes, fm.view(view), dim)
    else:
        sizes = splits[0]

        def ref_out(k):
            start = sum(sizes[:k])
            acc = torch.stack([x[start:start + sizes[k]].float() if dtype in (torch.float16, torch.bfloat16)
                               else x[start:start + sizes[k]] for x in xs]).sum(0)
            return acc.to(dtype)
        out = reduce_scatter_v(xs[me], sizes, fm.view(view), dim)
    expected = ref_out(me)
    torch.testing.assert_close(out, expected.detach(), rtol=tol, atol=tol)
    (out.double() * weights(me, out.shape[0]).double()).sum().backward()
    grad = xs[me].grad.clone()
    for x in xs:
        x.grad = None
    total = sum((ref_out(k).double() * weights(k, ref_out(k).shape[0]).double()).sum() for k in range(G))
    total.backward()
    torch.testing.assert_close(grad, xs[me].grad, rtol=tol * 10, atol=tol * 10)
    return out.shape[0]


@st.composite
def collective_cases(draw, world_size):
    spec = draw(fold_specs(world_sizes=[world_size]))
    view = draw(st.sampled_from(sorted(VIEWS)))
    dim = draw(st.sampled_from(VIEWS[view]))
    G = getattr(spec, dim)
    kind = draw(st.sampled_from(["a2a", "gather", "scatter"]))
    rows = G if kind == "a2a" else 1
    splits = [draw(split_sizes(G, max_total=12)) for _ in range(rows)]
    dtype = draw(st.sampled_from(DTYPES))
    return (spec, view, dim, kind, splits, draw(st.integers(1, 3)), dtype, draw(st.booleans()),
            draw(st.integers(0, 10**6)))


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_collectives_match_single_process_reference(worlds, world_size):
    world = worlds(world_size)

    @settings(max_examples=12 if world_size < 8 else 8)
    @given(collective_cases(world_size))
    def check(case):
        world.run(_check_collective, case)

    check()


def _zero_rows_everywhere(rank, world_size):
    """Ranks that send and receive nothing at all still get a (zero) gradient."""
    from meshfold.mesh import FoldSpec

    fm = cached_fold(FoldSpec(world_size, ep=world_size))
    x = torch.zeros(0, 3, dtype=torch.float64, requires_grad=True)
    out = all_to_all_v(x, [0] * world_size, [0] * world_size, fm.moe, "ep")
    out.sum().backward()
    return tuple(out.shape), tuple(x.grad.shape)


def test_zero_size_contributions_everywhere(worlds):
    assert worlds(4).run(_zero_rows_everywhere) == [((0, 3), (0, 3))] * 4


def _full_of_partial(rank, world_size):
    """RaggedShard over ep, Partial over etp: the whole tensor is the ragged concat of the etp
    sums; its gradient reaches every summand once (each rank's own slice)."""
    from meshfold.mesh import FoldSpec

    fm = cached_fold(FoldSpec(world_size, ep=2, etp=world_size // 2))
    mesh = fm.moe["ep", "etp"]
    sizes = [3, 1]
    i, q = mesh.get_local_rank("ep"), mesh.get_local_rank("etp")
    summands = [[_data(7, 10 * e + t, (n, 2)) for t in range(world_size // 2)] for e, n in enumerate(sizes)]
    x = summands[i][q].clone().requires_grad_()
    full = RaggedTensor(x, mesh, [RaggedShard(0, sizes), Partial()]).full_tensor()
    want = torch.cat([sum(parts) for parts in summands])
    w = _data(8, 0, (sum(sizes), 2))
    (full * w).sum().backward()
    return torch.equal(full, want), torch.equal(x.grad, w[sum(sizes[:i]):sum(sizes[:i + 1])])


def test_ragged_tensor_full_tensor_sums_partial_and_gathers_ragged(worlds):
    assert worlds(4).run(_full_of_partial) == [(True, True)] * 4


def _replicated_that_differs(rank, world_size):
    """RaggedShard over ep, Replicate over etp, debug checks on: (whether rows that do agree over
    etp give the whole tensor, the errors raised when the etp ranks of ep rank 0 hold different
    rows)."""
    from meshfold.mesh import FoldSpec

    fm = cached_fold(FoldSpec(world_size, ep=2, etp=world_size // 2))
    mesh = fm.moe["ep", "etp"]
    i, q = mesh.get_local_rank("ep"), mesh.get_local_rank("etp")
    sizes = [3, 1]
    rows = _data(7, i, (sizes[i], 2))
    placements = [RaggedShard(0, sizes), Replicate()]
    errors = []
    set_debug_checks(True)
    try:
        full = RaggedTensor(rows, mesh, placements).full_tensor()
        try:
            RaggedTensor(rows + q * (i == 0), mesh, placements)  # only ep rank 0's etp ranks differ
        except ValueError as err:
            errors.append(str(err))
    finally:
        set_debug_checks(False)
    return torch.equal(full, torch.cat([_data(7, e, (n, 2)) for e, n in enumerate(sizes)])), errors


def test_replicate_over_ranks_that_hold_different_data_is_an_error_naming_the_dim(worlds):
    """With debug checks on, every rank raises (those whose group agrees too: nobody is left in a
    collective), naming the mesh dim that is not replicated."""
    for full_is_right, errors in worlds(4).run(_replicated_that_differs):
        assert full_is_right
        assert len(errors) == 1 and "mesh dim 'etp' is Replicate() but its ranks hold different data" in errors[0]


def _exchange(rank, world_size, send):
    from meshfold.mesh import FoldSpec

    fm = cached_fold(FoldSpec(world_size, ep=world_size))
    return exchange_splits(send[rank], fm.moe, "ep")


def test_exchange_splits_transposes_the_send_matrix(worlds):
    send = [[0, 5, 1, 0], [2, 0, 0, 9], [0, 0, 0, 0], [3, 3, 3, 3]]
    recv = worlds(4).run(_exchange, send)
    assert recv == [[send[i][j] for i in range(4)] for j in range(4)]


# ---- redistribute ------------------------------------------------------------------------------
def _mesh_and_pos(spec, view, dim):
    fm = cached_fold(spec)
    mesh = fm.view(view)
    return mesh, list(mesh.mesh_dim_names).index(dim)


def _placed(mesh, i, p):
    out = [Replicate()] * mesh.ndim
    out[i] = p
    return out


def _check_redistribute(rank, world_size, case):
    spec, view, dim, sizes_a, sizes_b, F, seed = case
    mesh, i = _mesh_and_pos(spec, view, dim)
    G, me = mesh.size(i), mesh.get_local_rank(dim)
    N = sum(sizes_a)
    sizes_b = _rescale(sizes_b, N)
    full = _data(seed, 0, (N, F))  # the global tensor, same on every rank
    weight = _data(seed + 1, 0, (N, F))  # loss = sum(full * weight): d loss / d full = weight

    def piece(sizes):
        return full[sum(sizes[:me]):sum(sizes[:me + 1])]

    chunk = torch.tensor_split(torch.arange(N), [min(N, -(-N // G) * k) for k in range(1, G)])[me]
    src_local = full[chunk].clone().requires_grad_(True)
    src = DTensor.from_local(src_local, mesh, _placed(mesh, i, Shard(0)), run_check=False,
                             shape=full.shape, stride=full.stride())
    a = redistribute(src, mesh, _placed(mesh, i, RaggedShard(0, sizes_a)))
    assert isinstance(a, RaggedTensor)
    torch.testing.assert_close(a.local, piece(sizes_a), rtol=0, atol=0)
    b = redistribute(a, mesh, _placed(mesh, i, RaggedShard(0, sizes_b)))
    torch.testing.assert_close(b.local, piece(sizes_b), rtol=0, atol=0)
    back = redistribute(b, mesh, _placed(mesh, i, Shard(0)))
    assert isinstance(back, DTensor)
    torch.testing.assert_close(back.to_local(), src_local, rtol=0, atol=0)  # round trip
    replicated = redistribute(b, mesh, [Replicate()] * mesh.ndim)
    torch.testing.assert_close(replicated.to_local(), full, rtol=0, atol=0)
    torch.testing.assert_close(b.full_tensor(), full, rtol=0, atol=0)
    # gradient through Shard -> Ragged -> Ragged: each rank's loss on its own piece
    (b.local * weight[sum(sizes_b[:me]):sum(sizes_b[:me + 1])]).sum().backward()
    torch.testing.assert_close(src_local.grad, weight[chunk], rtol=0, atol=0)
    # gradient through Ragged -> Replicate (one replicated loss)
    x = piece(sizes_a).clone().requires_grad_(True)
    rep = redistribute(RaggedTensor(x, mesh, _placed(mesh, i, RaggedShard(0, sizes_a))), mesh,
                       [Replicate()] * mesh.ndim)
    (rep.to_local() * weight).sum().backward()
    torch.testing.assert_close(x.grad, weight[sum(sizes_a[:me]):sum(sizes_a[:me + 1])], rtol=0, atol=0)
    # Replicate -> Ragged: the replicated input's gradient is the whole weight on every rank
    y = full.clone().requires_grad_(True)
    yd = DTensor.from_local(y, mesh, [Replicate()] * mesh.ndim, run_check=False)
    sl = redistribute(yd, mesh, _placed(mesh, i, RaggedShard(0, sizes_b)))
    torch.testing.assert_close(sl.local, piece(sizes_b), rtol=0, atol=0)
    (sl.local * weight[sum(sizes_b[:me]):sum(sizes_b[:me + 1])]).sum().backward()
    torch.testing.assert_close(y.grad, weight, rtol=0, atol=0)
    # Partial -> Ragged: reduce-scatter-v of per-rank partial sums; gradient = weight (replicated)
    part = _data(seed + 2, rank, (N, F)).requires_grad_(True)
    pd = DTensor.from_local(part, mesh, _placed(mesh, i, Partial()), run_check=False)
    rs = redistribute(pd, mesh, _placed(mesh, i, RaggedShard(0, sizes_a)))
    group = spec.group_of(rank, view, dim)
    total = sum(_data(seed + 2, r, (N, F)) for r in group)
    torch.testing.assert_close(rs.local, total[sum(sizes_a[:me]):sum(sizes_a[:me + 1])], rtol=1e-12, atol=1e-12)
    (rs.local * weight[sum(sizes_a[:me]):sum(sizes_a[:me + 1])]).sum().backward()
    torch.testing.assert_close(part.grad, weight, rtol=0, atol=0)
    return True


def _rescale(sizes, total):
    """Sizes with the same pattern (zeros stay zero where possible) summing to ``total``."""
    out = list(sizes)
    s = sum(out)
    if s == total:
        return out
    if s == 0:
        out[-1] = total
        return out
    out = [n * total // s for n in out]
    out[max(range(len(out)), key=lambda j: sizes[j])] += total - sum(out)
    return out


@st.composite
def redistribute_cases(draw, world_size):
    spec = draw(fold_specs(world_sizes=[world_size]))
    view = draw(st.sampled_from(sorted(VIEWS)))
    dim = draw(st.sampled_from(VIEWS[view]))
    G = getattr(spec, dim)
    return (spec, view, dim, draw(split_sizes(G, 16)), draw(split_sizes(G, 16)),
            draw(st.integers(1, 3)), draw(st.integers(0, 10**6)))


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_redistribute_matches_reference_and_round_trips(worlds, world_size):
    world = worlds(world_size)

    @settings(max_examples=10 if world_size < 8 else 6)
    @given(redistribute_cases(world_size))
    def check(case):
        world.run(_check_redistribute, case)

    check()


# ---- moving between the folded views ------------------------------------------------------------
def _check_relabel(rank, world_size, spec, seed):
    fm = cached_fold(spec)
    N = 2 * world_size
    full = _data(seed, 0, (N, 3))
    tokens = [Replicate(), Shard(0), Shard(0), Shard(0)]  # batch over every non-pp dim
    from torch.distributed.tensor import distribute_tensor

    x = distribute_tensor(full, fm.attn, tokens)
    y = redistribute(x, fm.moe, tokens)
    assert y.device_mesh is fm.moe
    same_storage = y.to_local().data_ptr() == x.to_local().data_ptr()
    torch.testing.assert_close(y.full_tensor(), full, rtol=0, atol=0)
    # A move that would change local data must raise on every rank, not return the input.
    only_dp = [Replicate(), Shard(0), Replicate(), Replicate()]
    only_ep = [Replicate(), Replicate(), Shard(0), Replicate()]
    x2 = distribute_tensor(full, fm.attn, only_dp)
    raised = None
    try:
        redistribute(x2, fm.moe, only_ep)
    except ValueError as err:
        raised = str(err)
    return same_storage, raised


@pytest.mark.parametrize("world_size", [4, 8])
def test_moving_between_folded_views_relabels_without_copy(worlds, world_size):
    world = worlds(world_size)

    @settings(max_examples=6)
    @given(fold_specs(world_sizes=[world_size]), st.integers(0, 1000))
    def check(spec, seed):
        results = world.run(_check_relabel, spec, seed)
        for same_storage, raised in results:
            assert same_storage
            same_rows = spec.dp == spec.ep and spec.cp * spec.tp == spec.etp
            if spec.dp == 1 and spec.ep == 1:
                same_rows = True  # both replicate every non-pp dim
            if same_rows:
                assert raised is None
            else:
                assert raised and "local data would change" in raised

    check()


# ---- misuse ------------------------------------------------------------------------------------
def _misuse(rank, world_size):
    from meshfold.mesh import FoldSpec

    fm = cached_fold(FoldSpec(world_size, ep=world_size))
    errors = {}

    def catch(name, fn):
        try:
            fn()
        except ValueError as err:
            errors[name] = str(err)

    x = torch.ones(4, 2)
    catch("sum", lambda: all_to_all_v(x, [2] * world_size, [1] * world_size, fm.moe, "ep"))
    catch("negative", lambda: all_to_all_v(x, [5, -1] + [0] * (world_size - 2), [4] + [0] * (world_size - 1), fm.moe, "ep"))
    catch("ragged_negative", lambda: RaggedShard(0, [3, -1]))
    catch("bad_dim", lambda: all_gather_v(x, [4] * world_size, fm.moe, "tp"))
    catch("gather_size", lambda: all_gather_v(x, [3] * world_size, fm.moe, "ep"))
    catch("ragged_local", lambda: RaggedTensor(x, fm.moe, [Replicate(), Replicate(), RaggedShard(0, [1] * world_size), Replicate()]))
    catch("unsupported", lambda: redistribute(
        RaggedTensor(x[: 1], fm.moe, [Replicate(), Replicate(), RaggedShard(0, [1] * world_size), Replicate()]),
        fm.moe, [Replicate(), Replicate(), RaggedShard(1, [2] + [0] * (world_size - 1)), Replicate()]))
    # ranks disagree on the splits: with the debug check on, every rank raises (no hang)
    set_debug_checks(True)
    try:
        outs = [1] * world_size
        if rank == 0:
            outs = [2] + [1] * (world_size - 1)  # rank 0 expects 2 rows from itself, sends itself 1
        catch("disagree", lambda: all_to_all_v(torch.ones(world_size, 2), [1] * world_size, outs, fm.moe, "ep"))
        catch("disagree_gather", lambda: all_gather_v(torch.ones(1, 2), [1] * world_size if rank else [1] * (world_size - 1) + [2], fm.moe, "ep"))
    finally:
        set_debug_checks(False)
    return errors


def test_misuse_raises_clear_errors(worlds):
    for errors in worlds(4).run(_misuse):
        assert "input_splits sum to 8 but the local tensor has 4 rows" in errors["sum"]
        assert "must be non-negative" in errors["negative"] and "-1" in errors["negative"]
        assert "must be non-negative" in errors["ragged_negative"]
        assert "mesh has no dim 'tp'" in errors["bad_dim"]
        assert "sizes[" in errors["gather_size"] and "has 4 rows" in errors["gather_size"]
        assert "should hold 1 rows but its local tensor has 4" in errors["ragged_local"]
        assert "changes the sharded tensor dim" in errors["unsupported"]
        assert "rank 0 sends 1 rows to rank 0, but rank 0 expects 2" in errors["disagree"]
        assert "ranks disagree on sizes" in errors["disagree_gather"]
