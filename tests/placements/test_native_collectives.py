"""Even splits take the native all-gather / reduce-scatter, ragged ones the all-to-all, and both
compute the same (forward and backward), on real gloo ranks.

Each check runs a collective under every path (:func:`set_collective_path` ``"auto"``,
``"native"``, ``"a2a"``) on the same inputs and compares them with a single-process reference
and with each other; a call counter (wrapping ``torch.distributed``'s entry points for the call)
shows which primitive really ran.
"""

import contextlib
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st

from meshfold.runtime import compat
from meshfold.mesh import FoldSpec
from meshfold.placements import all_gather_v, reduce_scatter_v
from meshfold.placements import collectives
from meshfold.placements.collectives import set_collective_path
from meshfold.testing.strategies import split_sizes
from meshfold.testing.worlds import cached_fold

pytestmark = pytest.mark.multirank

HALF = (torch.bfloat16, torch.float16)
PRIMITIVES = ("all_gather_single", "reduce_scatter_single", "all_to_all_single")


def _home(name):  # the native gather / scatter go through meshfold.runtime.compat (older torch: older names)
    return dist if name == "all_to_all_single" else compat


@contextlib.contextmanager
def counting():
    """Count calls of the torch.distributed primitives the collectives use (this process)."""
    calls = Counter()
    saved = {name: getattr(_home(name), name) for name in PRIMITIVES}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return counted

    for name, fn in saved.items():
        setattr(_home(name), name, wrap(name, fn))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(_home(name), name, fn)


@contextlib.contextmanager
def path(p):
    previous = set_collective_path(p)
    try:
        yield
    finally:
        set_collective_path(previous)


def _inputs(seed, G, kind, sizes, F, dtype, integral):
    """Every group member's input and output weight, identical on every rank. ``integral``:
    small integers, whose sums are exact in any order (so every path must agree bitwise)."""
    g = torch.Generator().manual_seed(seed)

    def draw(shape):
        if integral:
            return torch.randint(-8, 9, shape, generator=g).to(dtype)
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)

    rows = sizes if kind == "gather" else [sum(sizes)] * G
    xs = [draw((n, F)) for n in rows]
    out_rows = [sum(sizes)] * G if kind == "gather" else sizes
    ws = [draw((n, F)) for n in out_rows]
    return xs, ws


def _reference(kind, xs, sizes, me):
    if kind == "gather":
        return torch.cat(xs)
    start = sum(sizes[:me])
    parts = torch.stack([x[start:start + sizes[me]].double() for x in xs])
    return parts.sum(0).to(xs[0].dtype)


def _run_paths(rank, world_size, spec, dim, kind, sizes, F, dtype, integral, seed):
    fm = cached_fold(spec)
    mesh = fm.attn if dim in ("dp", "cp", "tp") else fm.moe
    group = spec.group_of(rank, "attn" if mesh is fm.attn else "moe", dim)
    G, me = len(group), group.index(rank)
    xs, ws = _inputs(seed, G, kind, sizes, F, dtype, integral)
    fn = all_gather_v if kind == "gather" else reduce_scatter_v
    results = {}
    for p in ("auto", "native", "a2a"):
        x = xs[me].clone().requires_grad_(True)
        with path(p), counting() as calls:
            out = fn(x, sizes, mesh, dim)
            (out.double() * ws[me].double()).sum().backward()
        results[p] = (out.detach(), x.grad, dict(calls))
    want = _reference(kind, xs, sizes, me)
    # d/dx of sum_k <out_k, w_k>: the gather's gradient is my slice of sum_k w_k; the scatter's is
    # every rank's weight in its own rows (an all-gather of the weights)
    if kind == "gather":
        start = sum(sizes[:me])
        grad_want = sum(w.double() for w in ws)[start:start + sizes[me]]
    else:
        grad_want = torch.cat([w.double() for w in ws])
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    for p, (out, grad, _) in results.items():
        torch.testing.assert_close(out, want, rtol=tol, atol=tol, msg=lambda m: f"{p} forward: {m}")
        torch.testing.assert_close(grad.double(), grad_want.to(grad.dtype).double(), rtol=tol * 10,
                                   atol=tol * 10, msg=lambda m: f"{p} backward: {m}")
    if integral:  # exact sums: every path bitwise equal
        for p in ("native", "a2a"):
            assert torch.equal(results[p][0], results["auto"][0]), p
            assert torch.equal(results[p][1], results["auto"][1]), p
    return {p: c for p, (_, _, c) in results.items()}


def _expected_calls(kind, sizes, dtype, p):
    """What each path must have called on gloo for one forward + backward."""
    even = len(set(sizes)) == 1
    if sum(sizes) == 0:
        return {}
    native_gather = even and p != "a2a"
    native_scatter = even and p == "native"  # gloo: auto keeps the all-to-all for every dtype
    gather = "all_gather_single" if native_gather else "all_to_all_single"
    scatter = "reduce_scatter_single" if native_scatter else "all_to_all_single"
    return dict(Counter([gather, scatter]))


@st.composite
def cases(draw, world_size):
    spec = draw(st.sampled_from([FoldSpec(world_size, tp=world_size, ep=world_size),
                                 FoldSpec(world_size, tp=2, etp=world_size // 2, ep=2)]))
    dim = draw(st.sampled_from(["tp", "ep", "etp"]))
    G = getattr(spec, dim)
    kind = draw(st.sampled_from(["gather", "scatter"]))
    even = draw(st.booleans())
    sizes = [draw(st.integers(0, 4))] * G if even else draw(split_sizes(G, max_total=12))
    dtype = draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16]))
    F, integral, seed = draw(st.integers(1, 3)), draw(st.booleans()), draw(st.integers(0, 10**6))
    return spec, dim, kind, sizes, F, dtype, integral, seed


@pytest.mark.parametrize("world_size", [4, 8])
def test_native_and_all_to_all_paths_agree_and_match_reference(worlds, world_size):
    """Over even and ragged splits and every dtype: auto, native and all-to-all give the
    reference's output and gradient; with exactly summable (integer-valued) data, bitwise the
    same; and each path called the primitives the module docstring's table says."""
    world = worlds(world_size)

    @settings(max_examples=14 if world_size == 4 else 8)
    @given(cases(world_size))
    @example((FoldSpec(world_size, tp=world_size, ep=world_size), "tp", "gather", [3] * world_size, 2,
              torch.float64, True, 1))
    @example((FoldSpec(world_size, tp=world_size, ep=world_size), "tp", "scatter", [2] * world_size, 2,
              torch.bfloat16, True, 2))
    def check(case):
        spec, dim, kind, sizes, F, dtype, integral, seed = case
        G = getattr(spec, dim)
        per_rank = world.run(_run_paths, spec, dim, kind, sizes, F, dtype, integral, seed)
        if G == 1:
            return
        for calls in per_rank:
            for p in ("auto", "native", "a2a"):
                assert calls[p] == _expected_calls(kind, sizes, dtype, p), (p, calls[p])

    check()


def test_backend_dtype_policy(monkeypatch):
    """auto: even gathers always native; even reduce-scatters native only where NCCL serves the
    tensor's device, in fp32 / fp64 (gloo's is an all-reduce; half precision must sum in fp32 with
    half-precision bytes); ragged never; "native" and "a2a" force the path."""
    config = {"value": "cuda:nccl"}
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config["value"])
    even, ragged = [4, 4, 4], [4, 3, 5]
    assert collectives._native_gather(even) and not collectives._native_gather(ragged)
    assert collectives._native_scatter(even, torch.float32, None, "cuda")
    assert collectives._native_scatter(even, torch.float64, None, "cuda")
    assert not collectives._native_scatter(even, torch.bfloat16, None, "cuda")
    assert not collectives._native_scatter(ragged, torch.float32, None, "cuda")
    config["value"] = "cpu:gloo,cuda:nccl"  # one group, two libraries: the tensor's device decides
    assert collectives._native_scatter(even, torch.float32, None, "cuda")
    assert not collectives._native_scatter(even, torch.float32, None, "cpu")
    config["value"] = "cpu:gloo,cuda:gloo"
    assert not collectives._native_scatter(even, torch.float32, None, "cpu")
    with path("native"):
        assert collectives._native_scatter(even, torch.bfloat16, None, "cpu")
        assert not collectives._native_scatter(ragged, torch.bfloat16, None, "cpu")
    with path("a2a"):
        assert not collectives._native_gather(even)
        config["value"] = "cuda:nccl"
        assert not collectives._native_scatter(even, torch.float32, None, "cuda")
    with pytest.raises(ValueError, match="valid"):
        set_collective_path("ring")


def test_ranks_compute_where_the_group_runs_nccl(monkeypatch):
    """The device comes from which library serves each device type, not from the backend's name:
    torch's default group on a CUDA machine, ``cpu:gloo,cuda:nccl``, computes on the GPU (a name
    comparison with "nccl" put it on the CPU); gloo, which also takes CUDA tensors, on the CPU."""
    from meshfold.mesh import backend_device_type, collective_backend

    for config, device, cpu_backend in [("cuda:nccl", "cuda", None), ("cpu:gloo,cuda:nccl", "cuda", "gloo"),
                                        ("cpu:gloo,cuda:gloo", "cpu", "gloo"), ("cpu:fake,cuda:fake", "cpu", "fake")]:
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None, c=config: c)
        assert backend_device_type() == device, config
        assert collective_backend(None, "cpu") == cpu_backend, config


def _nccl_branches_under_gloo(rank, world_size):
    """The group reports NCCL for CPU tensors, so every branch meant for NCCL runs on gloo: the
    auto path's native fp32 reduce-scatter, the split exchange and the debug checks' metadata
    gather on the group's device."""
    spec = FoldSpec(world_size, tp=world_size, ep=world_size)
    mesh = cached_fold(spec).attn
    real = dist.get_backend_config
    dist.get_backend_config = lambda group=None: "cpu:nccl"
    collectives.set_debug_checks(True)
    try:
        assert collectives._native_scatter([2] * world_size, torch.float32, None, "cpu")
        x = torch.arange(2 * world_size * 3, dtype=torch.float32).reshape(2 * world_size, 3) * (rank + 1)
        with counting() as calls:
            out = reduce_scatter_v(x, [2] * world_size, mesh, "tp")
        received = collectives.exchange_splits([rank + j for j in range(world_size)], mesh, "tp")
    finally:
        dist.get_backend_config = real
        collectives.set_debug_checks(False)
    want = x[2 * rank:2 * rank + 2] / (rank + 1) * sum(range(1, world_size + 1))
    return torch.equal(out, want), dict(calls), received


def test_nccl_only_branches_run_under_gloo(worlds):
    results = worlds(4).run(_nccl_branches_under_gloo)
    for rank, (equal, calls, received) in enumerate(results):
        assert equal and calls.get("reduce_scatter_single") == 1, (rank, calls)
        assert received == [j + rank for j in range(4)]  # rank j sends me j + my rank


def _half_sum(rank, world_size, dtype):
    """Rank 0 holds 1, the others 2^-8 each: summed in half precision hop by hop, each 2^-8 is
    lost against the 1 (bf16 has 8 significant bits); summed in fp32 and rounded once, they are
    not."""
    fm = cached_fold(FoldSpec(world_size, tp=world_size))
    x = torch.full((world_size, 1), 1.0 if rank == 0 else 2.0 ** -8, dtype=dtype)
    out = {}
    for p in ("auto", "native", "a2a"):
        with path(p):
            out[p] = reduce_scatter_v(x, [1] * world_size, fm.attn, "tp").item()
    return out


@pytest.mark.parametrize("dtype", HALF)
def test_half_precision_reduce_scatter_sums_in_fp32_on_every_path(worlds, dtype):
    want = torch.tensor(1.0 + 3 * 2.0 ** -8).to(dtype).item()
    assert want != 1.0
    assert worlds(4).run(_half_sum, dtype) == [{"auto": want, "native": want, "a2a": want}] * 4


def _moe_layer_paths(rank, world_size):
    """A folded MoE layer (tp = 2 with a shared expert, ep = 2, etp = 2, pad-to-capacity) under
    auto and under the all-to-all path: the same output and gradients, and auto took the native
    all-gather for the shared expert's sequence-parallel entry and exit and the etp gather of the
    padded dispatch (equal counts on every etp rank)."""
    from meshfold.models import MoEConfig, MoELayer
    from meshfold.parallel.moe import parallelize_moe

    cfg = MoEConfig(hidden=4, ffn=4, num_experts=4, topk=2, router_dtype=torch.float64,
                    capacity_factor=1.0, pad_to_capacity=True, shared_ffn=4)
    spec = FoldSpec(world_size, tp=2, ep=2, etp=2)
    runs = {}
    for p in ("auto", "a2a"):
        torch.manual_seed(0)
        layer = MoELayer(cfg, dtype=torch.float64)
        parallelize_moe(layer, cached_fold(spec))
        x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
        x.requires_grad_(True)
        with path(p), counting() as calls:
            y = layer(x)
            (y * y).sum().backward()
        grads = [q.grad.to_local() for q in layer.parameters()]
        runs[p] = (y.detach(), x.grad, grads, dict(calls))
    (ya, gxa, ga, calls), (yb, gxb, gb, _) = runs["auto"], runs["a2a"]
    same = torch.equal(ya, yb) and torch.equal(gxa, gxb) and all(map(torch.equal, ga, gb))
    return same, calls.get("all_gather_single", 0)


def test_sequence_parallel_and_padded_etp_take_native_gathers(worlds):
    # forward: the shared expert's tp gather, the dispatch's etp gather; backward: the gathers
    # that are the backward of the shared expert's tp reduce-scatter and of the combine's etp one
    assert worlds(4).run(_moe_layer_paths) == [(True, 4)] * 4
