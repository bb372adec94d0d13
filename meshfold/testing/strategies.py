"""Hypothesis strategies for property-testing resharding code the way meshfold tests itself.

``fold_specs()`` draws valid :class:`~meshfold.mesh.FoldSpec` layouts (any factorization of both
views), ``invalid_fold_kwargs()`` draws layouts that must be rejected, and ``split_sizes()`` draws
per-rank split sizes with the awkward cases (zeros, heavy skew, one rank receiving everything)
over-represented.

Example::

    from hypothesis import given
    from meshfold.testing.strategies import fold_specs

    @given(fold_specs(world_sizes=[4, 8]))
    def test_my_layout(spec):
        assert spec.dp * spec.cp * spec.tp * spec.pp == spec.world_size
"""

from __future__ import annotations

from typing import Sequence

from hypothesis import strategies as st

from meshfold.mesh import FoldSpec

__all__ = ["divisors", "fold_specs", "invalid_fold_kwargs", "placements", "ragged_shards", "split_sizes"]


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def fold_specs(draw, world_sizes: Sequence[int] | None = None, max_world_size: int = 256,
               pp: Sequence[int] | None = None) -> FoldSpec:
    """A valid FoldSpec: world size from ``world_sizes`` (or 1..max_world_size), then every
    dim drawn among the divisors left, so every factorization of both views can appear."""
    W = draw(st.sampled_from(list(world_sizes)) if world_sizes
             else st.integers(1, max_world_size))
    p = draw(st.sampled_from([d for d in divisors(W) if pp is None or d in pp]))
    inner = W // p
    tp = draw(st.sampled_from(divisors(inner)))
    cp = draw(st.sampled_from(divisors(inner // tp)))
    etp = draw(st.sampled_from(divisors(inner)))
    ep = draw(st.sampled_from(divisors(inner // etp)))
    return FoldSpec(W, tp=tp, cp=cp, pp=p, etp=etp, ep=ep)


@st.composite
def invalid_fold_kwargs(draw, max_world_size: int = 256) -> tuple[int, dict]:
    """``(world_size, kwargs)`` for FoldSpec that must raise ValueError: a product that does not
    divide the world, an explicit dp/edp that does not fill it, or a non-positive size."""
    W = draw(st.integers(1, max_world_size))
    kind = draw(st.sampled_from(["indivisible", "wrong_dp", "non_positive"]))
    dim = draw(st.sampled_from(["tp", "cp", "pp", "etp", "ep"]))
    if kind == "indivisible":
        bad = [n for n in range(2, 2 * W + 2) if W % n]
        return W, {dim: draw(st.sampled_from(bad))}
    if kind == "wrong_dp":
        free = draw(st.sampled_from(["dp", "edp"]))
        return W, {free: draw(st.integers(1, 2 * W + 1).filter(lambda v: v != W))}
    return W, {dim: draw(st.integers(-3, 0))}


def split_sizes(n_ranks: int, max_total: int = 64) -> st.SearchStrategy[list[int]]:
    """``n_ranks`` non-negative split sizes with zeros, heavy skew and all-to-one cases."""
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    per = max(max_total // n_ranks, 1)
    uniform = st.lists(st.integers(0, per), min_size=n_ranks, max_size=n_ranks)

    @st.composite
    def all_to_one(draw):
        sizes = [0] * n_ranks
        sizes[draw(st.integers(0, n_ranks - 1))] = draw(st.integers(0, max_total))
        return sizes

    @st.composite
    def skewed(draw):
        sizes = draw(st.lists(st.sampled_from([0, 0, 1, 2]), min_size=n_ranks, max_size=n_ranks))
        sizes[draw(st.integers(0, n_ranks - 1))] += draw(st.integers(max_total // 2, max_total))
        return sizes

    return st.one_of(uniform, all_to_one(), skewed(), st.just([0] * n_ranks))


def ragged_shards(n_ranks: int, dim: int = 0, max_total: int = 64):
    """``RaggedShard(dim, sizes)`` with sizes from :func:`split_sizes`."""
    from meshfold.placements import RaggedShard

    return split_sizes(n_ranks, max_total).map(lambda sizes: RaggedShard(dim, sizes))


def placements(mesh_ndim: int, tensor_ndim: int, partial: bool = False):
    """One DTensor placement per mesh dim (Replicate, Shard(d), optionally Partial), each tensor
    dim sharded over at most one mesh dim (the layouts meshfold's redistribute handles)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    @st.composite
    def draw_placements(draw):
        out, used = [], set()
        for _ in range(mesh_ndim):
            free = [d for d in range(tensor_ndim) if d not in used]
            kinds = ["replicate"] + (["shard"] if free else []) + (["partial"] if partial else [])
            kind = draw(st.sampled_from(kinds))
            if kind == "shard":
                d = draw(st.sampled_from(free))
                used.add(d)
                out.append(Shard(d))
            else:
                out.append(Replicate() if kind == "replicate" else Partial())
        return out

    return draw_placements()
