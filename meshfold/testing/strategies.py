"""Hypothesis strategies for property-testing resharding code the way meshfold tests itself.

``fold_specs()`` draws valid :class:`~meshfold.mesh.FoldSpec` layouts (any factorization of both
views, or those that fit a model's sizes and a batch), ``invalid_fold_kwargs()`` draws layouts
that must be rejected, and ``split_sizes()`` draws per-rank split sizes with the awkward cases
(zeros, heavy skew, one rank receiving everything) over-represented.

Example::

    from hypothesis import given
    from meshfold.testing.strategies import fold_specs

    @given(fold_specs(world_sizes=[4, 8]))
    def test_my_layout(spec):
        assert spec.dp * spec.cp * spec.tp * spec.pp == spec.world_size
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from hypothesis import strategies as st

from meshfold.mesh import FoldSpec

__all__ = ["divisors", "fold_specs", "invalid_fold_kwargs", "placements", "ragged_shards", "split_sizes"]


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class _Limits:
    """What a drawn fold must satisfy (see :func:`fold_specs`); every field None: anything."""

    pp: tuple[int, ...] | None = None
    tp: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None
    ep: tuple[int, ...] | None = None
    etp: tuple[int, ...] | None = None
    tp_divides: tuple[int, ...] = ()  # heads, kv_heads, ffn, shared_ffn
    ep_divides: tuple[int, ...] = ()  # experts
    etp_divides: tuple[int, ...] = ()  # expert_ffn
    seq_len: int | None = None
    batch: int | None = None

    def attn(self, inner: int) -> list[tuple[int, int]]:
        """The valid (tp, cp) of a pipeline stage of ``inner`` ranks (dp = the rest)."""
        out = []
        for tp in divisors(inner):
            if (self.tp is not None and tp not in self.tp) or any(n % tp for n in self.tp_divides):
                continue
            for cp in divisors(inner // tp):
                split = 2 * cp * tp if cp > 1 else tp  # meshfold.parallel.batch.local_positions
                if ((self.cp is None or cp in self.cp) and (self.seq_len is None or self.seq_len % split == 0)
                        and (self.batch is None or self.batch % (inner // (tp * cp)) == 0)):
                    out.append((tp, cp))
        return out

    def moe(self, inner: int) -> list[tuple[int, int]]:
        """The valid (etp, ep) of a pipeline stage of ``inner`` ranks (edp = the rest)."""
        return [(etp, ep) for etp in divisors(inner)
                if (self.etp is None or etp in self.etp) and not any(n % etp for n in self.etp_divides)
                for ep in divisors(inner // etp)
                if (self.ep is None or ep in self.ep) and not any(n % ep for n in self.ep_divides)]

    @functools.lru_cache(maxsize=None)
    def stages(self, world_size: int) -> tuple[tuple[int, tuple, tuple], ...]:
        """(pp, valid attn (tp, cp), valid moe (etp, ep)) for every pp that leaves both non-empty."""
        out = []
        for p in divisors(world_size):
            if self.pp is None or p in self.pp:
                attn, moe = self.attn(world_size // p), self.moe(world_size // p)
                if attn and moe:
                    out.append((p, tuple(attn), tuple(moe)))
        return tuple(out)


def _allowed(name: str, values: Sequence[int] | None) -> tuple[int, ...] | None:
    if values is None:
        return None
    out = tuple(values)
    if not out or not all(isinstance(v, int) and v >= 1 for v in out):
        raise ValueError(f"fold_specs({name}={values!r}): give the allowed sizes, positive integers (e.g. [1, 2])")
    return out


def _size(name: str, n: int | None) -> int | None:
    if n is not None and not (isinstance(n, int) and n >= 1):
        raise ValueError(f"fold_specs({name}={n!r}): a model or batch size is a positive integer")
    return n


def _sizes(**named: int | None) -> tuple[int, ...]:
    return tuple(n for name, n in named.items() if _size(name, n) is not None)


def fold_specs(world_sizes: Sequence[int] | None = None, max_world_size: int = 256,
               pp: Sequence[int] | None = None, *, tp: Sequence[int] | None = None,
               cp: Sequence[int] | None = None, ep: Sequence[int] | None = None,
               etp: Sequence[int] | None = None, heads: int | None = None, kv_heads: int | None = None,
               ffn: int | None = None, shared_ffn: int | None = None, experts: int | None = None,
               expert_ffn: int | None = None, seq_len: int | None = None,
               batch: int | None = None) -> st.SearchStrategy[FoldSpec]:
    """Valid FoldSpecs that also fit a model and a batch, valid by construction (no draw is
    discarded): the world size from ``world_sizes`` (or 1..max_world_size), then ``pp``, then
    (tp, cp) and (etp, ep) among the pairs that fit, so every fitting factorization of both views
    can appear; shrinking goes towards the smallest sizes, each step again a valid fold.

    Constraints (None: any):

    * ``pp``, ``tp``, ``cp``, ``ep``, ``etp``: the allowed sizes of that dim (``tp=[1, 2]``: at
      most 2);
    * ``heads``, ``kv_heads``, ``ffn`` (the dense MLP), ``shared_ffn``: tp divides each;
      ``experts``: ep divides it; ``expert_ffn``: etp divides it;
    * ``seq_len``: each rank's share of a sequence is whole, as
      :func:`meshfold.parallel.batch.local_positions` cuts it (``seq_len`` divisible by
      ``2 * cp * tp`` with cp > 1, by ``tp`` without); ``batch``: dp divides it.

    ``ValueError`` if no world size admits a fold under the constraints.

    Multi-rank properties: run each example on a long-lived world (``worlds(n)`` in tests,
    :class:`meshfold.runtime.launch.World` elsewhere) and build its fold with
    :func:`meshfold.testing.worlds.cached_fold`. A World whose ranks all *finish* a failing
    example (return, or raise after their last collective) stays up, so hypothesis shrinks the
    example on the same ranks and their process groups: one ``run`` per shrink step, no restart.
    So have each rank return what it computed and assert in the test process, or raise only
    after its last collective; a rank that raises while its peers still wait in a collective
    leaves the group out of step, and the world is torn down and restarted for the next step.
    Constraints keep shrink steps from reaching folds the model cannot take.

    Example::

        @settings(max_examples=4)
        @given(fold_specs(world_sizes=[4], pp=[1], heads=4, kv_heads=2, experts=4, seq_len=8, batch=2))
        def check(spec):
            diffs = worlds(4).run(compare_with_one_device, spec)   # each rank returns its differences
            assert max(diffs) < 1e-12
    """
    limits = _Limits(pp=_allowed("pp", pp), tp=_allowed("tp", tp), cp=_allowed("cp", cp), ep=_allowed("ep", ep),
                     etp=_allowed("etp", etp), tp_divides=_sizes(heads=heads, kv_heads=kv_heads, ffn=ffn,
                                                                  shared_ffn=shared_ffn),
                     ep_divides=_sizes(experts=experts), etp_divides=_sizes(expert_ffn=expert_ffn),
                     seq_len=_size("seq_len", seq_len), batch=_size("batch", batch))
    candidates = list(world_sizes) if world_sizes else range(1, max_world_size + 1)
    sizes = [W for W in candidates if limits.stages(W)]
    if not sizes:
        raise ValueError(f"fold_specs: no fold of {list(candidates)} ranks fits {limits}")
    return _fold_specs(sizes, limits)


@st.composite
def _fold_specs(draw, sizes: list[int], limits: _Limits) -> FoldSpec:
    # one choice per view, among its valid (tp, cp) / (etp, ep) in increasing order: a fixed
    # number of choices, so hypothesis shrinks towards the smallest sizes (it prefers fewer
    # choices over smaller ones, which per-dim choices of varying count would steer)
    W = draw(st.sampled_from(sizes))
    p, attn, moe = draw(st.sampled_from(limits.stages(W)))
    tp, cp = draw(st.sampled_from(attn))
    etp, ep = draw(st.sampled_from(moe))
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
