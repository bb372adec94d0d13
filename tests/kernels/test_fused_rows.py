"""The compiled one-pass row loops of the dropless MoE layer (``fused=True``, ``train.compile``)
against the eager passes and the plain references: the combine (forward, and its gradients for
the expert rows and the routing weights) and the permute's backward (each token's k rows summed).

Slow: each dtype and shape is an inductor compile (a C++ build, seconds each on two cores)."""

import pytest
import torch

from meshfold.kernels.combine import combine_grads, combine_reference, sum_topk_rows
from meshfold.models import MoEConfig, MoELayer
from meshfold.models.dispatcher import permute, unpermute, unpermute_reference

pytestmark = pytest.mark.slow

F64 = torch.float64


def _routed(T, k, E, H, dtype, fused, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=F64).to(dtype).requires_grad_()
    probs, experts = torch.randn(T, E, generator=g).softmax(-1).topk(k, dim=-1)
    probs = probs.requires_grad_()
    perm = permute(x, experts, probs, E, fused=fused)
    y = torch.randn(T * k, H, generator=g, dtype=F64).to(dtype)
    return x, probs, perm, y


@pytest.mark.parametrize("dtype, tol", [(F64, 1e-12), (torch.bfloat16, 2e-2)])
def test_fused_permute_and_combine_equal_the_plain_ones(dtype, tol):
    """out = combine(f(permute(x))) and the gradients of x and the routing weights: the fused
    loops equal the plain index_add combine and the plain gather backward (fp64: to the order of
    a sum; bf16: to bf16 rounding of the eager path's own error)."""
    T, k, E, H = 41, 3, 6, 24
    dout = torch.randn(T, H, generator=torch.Generator().manual_seed(1), dtype=F64).to(dtype)
    results = {}
    for fused in (False, True):
        x, probs, perm, y0 = _routed(T, k, E, H, dtype, fused)
        assert perm.fused is fused and perm.pair_N is not None
        y = perm.x_NH * y0  # expert rows that depend on x (so the gather's backward runs)
        out = unpermute(y, perm, T) if fused else unpermute_reference(y, perm, T)
        results[fused] = (out, *torch.autograd.grad(out, (x, probs), dout))
    for name, want, got in zip(("out", "dx", "dprobs"), results[False], results[True]):
        err = (got.double() - want.double()).norm() / want.double().norm()
        assert err <= tol, (name, dtype, err.item())


def test_fused_loops_are_their_plain_definitions():
    """sum_topk_rows and combine_grads, compiled, equal their own plain-torch definitions and
    the reference combine's gradients written by hand (fp64)."""
    T, k, N, H = 13, 4, 13 * 4, 8
    g = torch.Generator().manual_seed(2)
    y = torch.randn(N, H, generator=g, dtype=F64)
    row_TK = torch.randperm(N, generator=g).view(T, k)
    w = torch.rand(T, k, generator=g, dtype=F64)
    want = torch.stack([(w[t, :, None] * y[row_TK[t]]).sum(0) for t in range(T)])
    for fn in (sum_topk_rows, torch.compile(sum_topk_rows, dynamic=False)):
        torch.testing.assert_close(fn(y, row_TK, w), want, rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(fn(y, row_TK), torch.stack([y[row_TK[t]].sum(0) for t in range(T)]),
                                   rtol=1e-13, atol=1e-13)
    token_N = torch.empty(N, dtype=torch.int64)
    token_N[row_TK.reshape(-1)] = torch.arange(T).repeat_interleave(k)
    p_N, dout = torch.rand(N, generator=g, dtype=F64), torch.randn(T, H, generator=g, dtype=F64)
    yr, pr = y.clone().requires_grad_(), p_N.clone().requires_grad_()
    want_dy, want_dp = torch.autograd.grad(combine_reference(yr, token_N, pr, T), (yr, pr), dout)
    dy, dp = torch.compile(combine_grads, dynamic=False)(dout, token_N, y, p_N)
    torch.testing.assert_close(dy, want_dy, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(dp, want_dp, rtol=1e-13, atol=1e-13)


def test_moe_layer_with_fused_rows_equals_the_eager_layer():
    """A whole MoE layer (router, balancing loss, experts) with fused_rows computes the eager
    layer's output and every parameter gradient (fp64, to 1e-12)."""
    cfg = MoEConfig(hidden=16, ffn=8, num_experts=4, topk=2, aux_loss_coeff=1e-2, router_dtype=F64)
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(3), dtype=F64)
    runs = []
    for fused in (False, True):
        torch.manual_seed(0)
        layer = MoELayer(cfg, dtype=F64)
        layer.fused_rows = fused
        xi = x.clone().requires_grad_()
        out = layer(xi)
        (out.square().sum() + sum(layer.last_losses.values())).backward()
        runs.append((out, xi.grad, {n: p.grad for n, p in layer.named_parameters()}))
    (o0, dx0, g0), (o1, dx1, g1) = runs
    torch.testing.assert_close(o1, o0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx1, dx0, rtol=1e-12, atol=1e-12)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-12, atol=1e-12, msg=name)
