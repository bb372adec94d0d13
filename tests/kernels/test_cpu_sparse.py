"""The compacted tile-sparse CPU GEMMs (meshfold.kernels.cpu_sparse) against the masked reference.

Shapes: x [M, K] expert-major, w [E, K, N], offsets [E] int32 cumulative end rows, tile_mask
[E, K // bk, N // bn]. ``execution("compact")`` forces the compacted GEMMs where the measured rule
would pick the dense masked one for shapes this small.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshfold.kernels import cpu_sparse, expand_tile_mask, grouped_mm, grouped_mm_reference


def grads(fn, x, w, dy):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fn(x, w)
    return (y, *torch.autograd.grad(y, (x, w), dy))


def compact(x, w, offsets, mask, dy, mode="compact"):
    with cpu_sparse.execution(mode):
        return grads(lambda a, b: grouped_mm(a, b, offsets, tile_mask=mask), x, w, dy)


def reference(x, w, offsets, mask, dy):
    return grads(lambda a, b: grouped_mm_reference(a, b, offsets, mask), x, w, dy)


def tile_mask(E, kt, nt, density, stripe_tiles, g):
    """Random keep-mask [E, kt, nt]; ``stripe_tiles`` > 1 draws it per TW stripe of that many
    N tiles (every tile of a stripe keeps the same K tiles), 1 per tile."""
    per_stripe = torch.rand(E, kt, nt // stripe_tiles, generator=g) < density
    return per_stripe.repeat_interleave(stripe_tiles, dim=2)


@st.composite
def cases(draw):
    """A grouped GEMM as one rank of a fold sees it: all experts, an etp cut of the weight (its
    N columns, as fc1, or its K rows, as fc2, with the matching slice of x), or an ep / edp cut
    (a range of experts, with their rows); shapes, densities, tiles and TW stripes drawn."""
    E = draw(st.integers(1, 4))
    bk, bn = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([1, 2, 4]))
    kt, nt = draw(st.integers(1, 4)) * 2, draw(st.integers(1, 3)) * 2
    pattern = draw(st.sampled_from(["tile", "tw"]))
    stripe_tiles = draw(st.sampled_from([d for d in (1, 2, nt) if nt % d == 0])) if pattern == "tw" else 1
    density = draw(st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]))
    counts = draw(st.lists(st.integers(0, 9), min_size=E, max_size=E))  # zero-token experts included
    tail = draw(st.integers(0, 2))
    cut = draw(st.sampled_from(["none", "etp N", "etp K", "experts"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    K, N = kt * bk, nt * bn
    x = torch.randn(sum(counts) + tail, K, generator=g, dtype=torch.float64)
    w = torch.randn(E, K, N, generator=g, dtype=torch.float64)
    mask = tile_mask(E, kt, nt, density, stripe_tiles, g)
    q = draw(st.integers(0, 1))  # which of two etp ranks
    if cut == "etp N":  # the rank's columns: views, as the layer's local_mask / local shard are
        w, mask = w[:, :, q * N // 2:(q + 1) * N // 2], mask[:, :, q * nt // 2:(q + 1) * nt // 2]
    elif cut == "etp K":
        x, w, mask = x[:, q * K // 2:(q + 1) * K // 2], w[:, q * K // 2:(q + 1) * K // 2], mask[:, q * kt // 2:(q + 1) * kt // 2]
    elif cut == "experts" and E > 1:
        e0, e1 = q, q + E // 2
        start = sum(counts[:e0])
        x = x[start:start + sum(counts[e0:e1])]
        w, mask, counts = w[e0:e1], mask[e0:e1], counts[e0:e1]
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    dy = torch.randn(x.shape[0], w.shape[2], generator=g, dtype=torch.float64)
    return x, w, offsets, mask, dy


@settings(max_examples=60)
@given(case=cases())
def test_compacted_forward_dx_dw_equal_the_masked_reference_in_fp64(case):
    """Forward, dX and dW of the compacted GEMMs (and of whatever the rule picks) equal the plain
    masked reference in fp64; pruned entries of dW are exactly zero."""
    x, w, offsets, mask, dy = case
    want = reference(x, w, offsets, mask, dy)
    for mode in ("compact", "auto"):
        got = compact(x, w, offsets, mask, dy, mode)
        for name, a, b in zip(("y", "dx", "dw"), got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"{mode} {name}: {m}")
        pruned = ~expand_tile_mask(mask, w.shape[1], w.shape[2])
        assert torch.all(got[2][pruned] == 0)


def test_bf16_compacted_gemms_round_once_from_fp32_and_are_deterministic():
    """bf16: each output element is one GEMM accumulating in fp32, rounded once (within one bf16
    ulp of the fp32 reference rounded), and the same call twice is bitwise equal (each element
    has one writer of a fixed shape, whichever worker runs it)."""
    g = torch.Generator().manual_seed(0)
    E, K, N, bk, bn = 3, 64, 96, 16, 16
    counts = [40, 0, 70]
    x = torch.randn(sum(counts) + 3, K, generator=g).bfloat16()
    w = torch.randn(E, K, N, generator=g).bfloat16()
    dy = torch.randn(x.shape[0], N, generator=g).bfloat16()
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    mask = tile_mask(E, K // bk, N // bn, 0.5, 1, g)
    got, again = compact(x, w, offsets, mask, dy), compact(x, w, offsets, mask, dy)
    want = reference(x.float(), w.float(), offsets, mask, dy.float())
    for name, a, b, c in zip(("y", "dx", "dw"), got, again, want):
        assert torch.equal(a, b), name
        assert ((a.float() - c).abs() <= c.abs() * 2 ** -8 + 1e-6).all(), name


def test_a_plan_is_built_once_per_mask_and_never_reused_after_a_prune(monkeypatch):
    """Steps with an unchanged mask reuse its plans (one for the forward and dW, one for dX's
    transposed mask); pruning the mask in place gives new plans whose results match the
    reference (a stale plan would keep the old tiles)."""
    built = []

    class Counted(cpu_sparse.Plan):
        def __init__(self, *args):
            built.append(args)
            super().__init__(*args)

    monkeypatch.setattr(cpu_sparse, "Plan", Counted)
    monkeypatch.setattr(cpu_sparse, "_plans", type(cpu_sparse._plans)())
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(20, 8, generator=g, dtype=torch.float64), torch.randn(2, 8, 12, generator=g, dtype=torch.float64)
    dy, offsets = torch.randn(20, 12, generator=g, dtype=torch.float64), torch.tensor([9, 20], dtype=torch.int32)
    mask = tile_mask(2, 4, 3, 0.6, 1, g)
    for _ in range(3):
        compact(x, w, offsets, mask, dy)
    assert len(built) == 2
    mask[0, 1, :] = False  # a prune, in place
    mask[1, :, 2] = False
    for _ in range(2):
        got = compact(x, w, offsets, mask, dy)
    assert len(built) == 4
    for a, b in zip(got, reference(x, w, offsets, mask, dy)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_tw_mask_plans_one_gemm_per_stripe_over_its_kept_rows():
    """Tiles of a TW stripe keep the same K rows, so the plan runs each stripe of G columns as
    one GEMM over its kept rows (gathered by index), whatever the tile width bn."""
    g = torch.Generator().manual_seed(1)
    E, K, N, bk, bn, G = 2, 32, 64, 4, 8, 32
    mask = tile_mask(E, K // bk, N // bn, 0.5, G // bn, g)
    mask[:, :, 4:] = ~mask[:, :, :4]  # the two stripes differ, so they cannot merge
    p = cpu_sparse.plan(mask, K, N)
    for e in range(E):
        assert [(s.c0, s.c1) for s in p.stripes[e]] == [(0, G), (G, N)]
        for s in p.stripes[e]:
            rows = torch.cat([torch.arange(t * bk, (t + 1) * bk) for t in s.kept.tolist()])
            assert s.rows == rows.numel() and torch.equal(expand_tile_mask(mask, K, N)[e, :, s.c0].nonzero().flatten(), rows)


@pytest.mark.parametrize("density, tile, rows, want", [
    (1.0, (64, 64), 2048, "dense"),    # nothing pruned: the unmasked GEMM, no mask pass
    (0.25, (64, 64), 2048, "compact"),
    (0.75, (64, 64), 2048, "masked"),  # too little pruned to pay for the gathers
    (0.5, (64, 64), 2048, "compact"),
    (0.25, (1, 1), 2048, "masked"),    # unstructured: stripes one column wide
    (0.25, (64, 8), 2048, "masked"),   # stripes 8 columns wide
    (0.25, (64, 64), 64, "compact"),   # 8 rows per expert
    (0.25, (64, 64), 32, "masked"),    # 4 rows per expert
])
def test_choice_follows_the_measured_rule(density, tile, rows, want):
    E, K, N = 8, 256, 512
    mask = torch.rand(E, K // tile[0], N // tile[1], generator=torch.Generator().manual_seed(0)) < density
    if density == 1.0:
        mask[:] = True
    assert cpu_sparse.choose(cpu_sparse.plan(mask, K, N), rows, E) == want


def test_unknown_execution_raises_naming_it():
    with pytest.raises(ValueError, match="execution='fast'; valid: auto, compact, masked"):
        with cpu_sparse.execution("fast"):
            pass


def test_a_cached_plan_owns_its_mask_so_pruning_the_layers_buffer_in_place_cannot_change_it():
    """A plan made by a masked call (its stripes not built yet) and found again later by a mask
    with the same values must compact those values, not what the first mask's buffer was pruned
    to in the meantime."""
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(24, 8, generator=g, dtype=torch.float64), torch.randn(2, 8, 12, generator=g, dtype=torch.float64)
    dy, offsets = torch.randn(24, 12, generator=g, dtype=torch.float64), torch.tensor([10, 24], dtype=torch.int32)
    buffer = tile_mask(2, 4, 3, 0.7, 1, g)
    values = buffer.clone()
    compact(x, w, offsets, buffer, dy, mode="masked")  # plans the mask, runs the dense masked GEMMs
    buffer[:, :, 0] = False  # the pruner writes the layer's buffer in place
    got = compact(x, w, offsets, values, dy)  # a mask with the original values
    for a, b in zip(got, reference(x, w, offsets, values, dy)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
