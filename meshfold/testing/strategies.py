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

from contextlib import contextmanager
from typing import Sequence

import torch
from hypothesis import strategies as st

from meshfold.mesh import FoldSpec

__all__ = ["cached_fold", "checkpoint_reads", "divisors", "fold_specs", "invalid_fold_kwargs", "placements",
           "ragged_shards", "split_sizes", "LiveTensors", "simulated_process_group", "simulated_world", "rank_values", "reference_transformer"]


_FOLDS: dict = {}


def cached_fold(spec: FoldSpec, device_type: str = "cpu"):
    """``meshfold.fold(spec)``, built once per process and spec: property tests that run many
    examples on one long-lived world (``meshfold.runtime.launch.World``) would otherwise create new
    process groups for every example. Every rank must call it for the same specs in the same
    order, as with ``fold``."""
    from meshfold.mesh import fold

    key = (spec, device_type)
    if key not in _FOLDS:
        _FOLDS[key] = fold(spec, device_type)
    return _FOLDS[key]


@contextmanager
def checkpoint_reads():
    """Inside the block, every slice read from a Hugging Face checkpoint by
    :mod:`meshfold.interop.hf` appends its element count to the yielded list (to check that a
    folded load reads only a rank's own shards)."""
    from meshfold.interop import hf

    read: list[int] = []
    original = hf._Checkpoint.slice

    class Counting:
        def __init__(self, sl):
            self.sl = sl

        def get_shape(self):
            return self.sl.get_shape()

        def __getitem__(self, idx):
            t = self.sl[idx]
            read.append(t.numel())
            return t

    hf._Checkpoint.slice = lambda self, key, param: Counting(original(self, key, param))
    try:
        yield read
    finally:
        hf._Checkpoint.slice = original


def reference_transformer(cfg, seed: int, B: int, S: int):
    """``(model, tokens, targets)``: a single-device fp64 MoETransformer of ``cfg`` drawn from
    ``seed``, its norms and q/k/v biases moved off their initial values (so their gradients are
    checked too), and a global [B, S] batch of tokens and targets from ``seed + 1``: what the
    folded equality tests compare against."""
    from meshfold.models.transformer import MoETransformer

    torch.manual_seed(seed)
    model = MoETransformer(cfg, dtype=torch.float64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith((".bq", ".bk", ".bv")):
                p.add_(0.1 * torch.randn_like(p))
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, cfg.vocab, (B, S), generator=g)
    targets = torch.randint(0, cfg.vocab, (B, S), generator=g)
    return model, tokens, targets


@contextmanager
def simulated_process_group(world_size: int):
    """A fake default process group of ``world_size`` ranks (this process is rank 0 of it), for
    torch's ``LocalTensorMode`` to simulate them (:func:`simulated_world`, or one mode per
    pipeline stage over that stage's ranks: modes over different rank sets do not nest). Torch
    runs single-threaded inside: meshfold's CPU kernel pool would otherwise run LocalTensor ops
    on threads outside the mode. The process must have no process group of its own."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("simulated_process_group: this process already has a default process group")
    threads = torch.get_num_threads()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        dist.destroy_process_group()


@contextmanager
def simulated_world(world_size: int):
    """``world_size`` ranks simulated in this one process (:mod:`meshfold.runtime.simulated`): a
    :func:`simulated_process_group` and torch's ``LocalTensorMode`` over every rank, which it
    yields; inside, :func:`meshfold.mesh.fold` and everything built on it runs all ranks at once
    (``mode.rank_map(lambda r: ...)`` makes per-rank inputs, tensors made inside are
    LocalTensors). Reaches folds that spawned processes cannot on a small machine; FSDP2 and
    meshfold's Pipeline excepted (tests/parallel/test_large_folds.py says why)."""
    from torch.distributed._local_tensor import LocalTensorMode

    with simulated_process_group(world_size), LocalTensorMode(world_size) as mode:
        yield mode


def rank_values(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """``{rank: that simulated rank's value}`` of a LocalTensor made in :func:`simulated_world`."""
    local = getattr(t, "_local_tensors", None)
    if local is None:
        raise TypeError(f"rank_values: a {type(t).__name__} holds no per-rank values (valid: a LocalTensor)")
    return dict(sorted(local.items()))


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


class LiveTensors:
    """Context: every tensor an op creates while it is active, held weakly; ``bytes()`` is the
    storage bytes of those still alive (each storage counted once; FSDP2's freed unsharded
    weights count 0). Within a forward, the growth is what the forward keeps for backward;
    after a whole step, it is what the step leaks. Works on any device (a dispatch mode).
    ``exclude``: tensors whose storages are not counted (a model's parameters and buffers, which
    views made during the forward share)."""

    def __init__(self, exclude=()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        refs = self._refs = []

        class _Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                refs.extend(weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
                return out

        self._mode = _Record()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)

    def bytes(self) -> int:
        self._refs[:] = [r for r in self._refs if r() is not None]
        storages = {}
        for r in self._refs:
            t = r()
            t = getattr(t, "_local_tensor", t)  # a DTensor: its shard's storage
            if t is not None and not t.is_meta and type(t) in (torch.Tensor, torch.nn.Parameter):
                s = t.untyped_storage()
                if s.data_ptr() in self._exclude:
                    continue
                storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
        return sum(storages.values())
