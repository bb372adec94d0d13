"""Ring attention over cp (meshfold.parallel.ring_attention) equals causal attention on one device,
in the kernels, the attention function and the whole folded model (GQA, and MLA ringing its
latent), and allocates nothing of S/cp x S elements."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from meshfold.mesh import FoldSpec
from meshfold.parallel import ring_attention as ring
from meshfold.testing.worlds import cached_fold

TOL = dict(rtol=1e-9, atol=1e-11)


# ---- block kernels ---------------------------------------------------------------------------
@settings(max_examples=30)
@given(st.integers(1, 2), st.sampled_from([(2, 2), (4, 2), (4, 1)]), st.integers(1, 6), st.integers(1, 6),
       st.sampled_from([4, 8]), st.sampled_from([0, -2, 2]), st.booleans(), st.integers(0, 10**6))
def test_fused_block_kernel_equals_plain_reference(B, heads, m, n, d, dv_minus_d, causal, seed):
    """Per block, the CPU flash kernel and the torch reference give the same output, log-sum-exp
    and gradients (GQA included, and values narrower or wider than the keys, as MLA's), and the
    output is SDPA's."""
    if causal:
        n = m  # diagonal blocks are square
    h, g = heads
    gen = torch.Generator().manual_seed(seed)
    dv = d + dv_minus_d
    q, k = (torch.randn(B, heads, rows, d, dtype=torch.float64, generator=gen) for heads, rows in ((h, m), (g, n)))
    v, do = (torch.randn(B, heads, rows, dv, dtype=torch.float64, generator=gen) for heads, rows in ((g, n), (h, m)))
    (ffwd, fbwd), (pfwd, pbwd) = ring.KERNELS["fused"], ring.KERNELS["plain"]
    fo, flse = ffwd(q, k, v, causal)
    po, plse = pfwd(q, k, v, causal)
    torch.testing.assert_close(fo, po, **TOL)
    torch.testing.assert_close(flse, plse, **TOL)
    torch.testing.assert_close(fo, F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=h != g), **TOL)
    for got, want in zip(fbwd(do, q, k, v, fo, flse, causal), pbwd(do, q, k, v, po, plse, causal)):
        torch.testing.assert_close(got, want, **TOL)


def test_on_cuda_the_ring_takes_the_kernel_sdpa_would_and_plain_only_without_one(monkeypatch):
    """On CUDA a block runs the fused kernel SDPA itself would pick for its shapes (flash, else
    memory-efficient), the plain kernels only where neither applies; on the CPU its flash kernel;
    elsewhere plain. (CUDA's numerics are compared with SDPA by benchmarks/gpu_check.sh.)"""
    import torch.backends.cuda as cuda_backends

    from meshfold.testing.references import OffCPU

    seen = []
    for flash, efficient, want in [(True, True, "flash"), (False, True, "efficient"), (False, False, "plain")]:
        monkeypatch.setattr(cuda_backends, "can_use_flash_attention",
                            lambda p, debug=False, f=flash: seen.append(("flash", p.key.shape[1], p.enable_gqa)) or f)
        monkeypatch.setattr(cuda_backends, "can_use_efficient_attention",
                            lambda p, debug=False, e=efficient: seen.append(("efficient", p.key.shape[1])) or e)
        choose = ring._cuda_block_kernels.__wrapped__  # the CUDA choice, on CPU stand-ins
        assert choose(torch.device("cpu"), torch.bfloat16, 4, 2, 64, 64) == want
    # flash is asked with the 2 grouped K/V heads, efficient with K/V repeated to the 4 query heads
    assert ("flash", 2, True) in seen and ("efficient", 4) in seen
    q = torch.zeros(1, 4, 2, 8)
    assert ring.block_kernels(q, q, q) == "fused" and ring.block_kernels(OffCPU(q), q, q) == "plain"


class _OneRank:
    """A one-rank cp mesh: what ring_attention reads of a mesh (no collective runs with cp = 1)."""
    mesh_dim_names = ("cp",)

    def size(self, dim=0):
        return 1

    def get_local_rank(self, dim):
        return 0


@pytest.mark.parametrize("kernels, dtype, dv", [("flash", torch.bfloat16, 64), ("flash", torch.bfloat16, 48),
                                                 ("efficient", torch.float32, 64), ("efficient", torch.float32, 48)])
def test_cuda_block_kernels_take_the_aten_calls_shapes_on_the_meta_device(kernels, dtype, dv):
    """The CUDA kernels' calls (arguments, returned log-sum-exp layout, GQA and MLA's narrower
    values) run through torch's meta implementations of those ops, forward and backward."""
    B, h, g, S, d = 2, 4, 2, 80, 64
    q = torch.empty(B, h, S, d, dtype=dtype, device="meta", requires_grad=True)
    k = torch.empty(B, g, S, d, dtype=dtype, device="meta", requires_grad=True)
    v = torch.empty(B, g, S, dv, dtype=dtype, device="meta", requires_grad=True)
    out = ring.ring_attention(q, k, v, _OneRank(), "cp", kernels)
    assert out.shape == (B, h, S, dv) and out.dtype == dtype
    dq, dk, dvv = torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
    assert (dq.shape, dk.shape, dvv.shape) == (q.shape, k.shape, v.shape)


def test_block_plan_skips_future_and_marks_the_diagonal():
    # cp = 4: rank 1 holds chunks (1, 6); rank 0's chunks (0, 7) arrive, then rank 3's (3, 4)
    assert ring.block_plan((1, 6), (1, 6)) == [(0, 0, True), (1, 0, False), (1, 1, True)]
    assert ring.block_plan((1, 6), (0, 7)) == [(0, 0, False), (1, 0, False)]
    assert ring.block_plan((1, 6), (3, 4)) == [(1, 0, False), (1, 1, False)]


@pytest.mark.parametrize("off_cpu", [False, True], ids=["cpu", "off-cpu"])
def test_load_balanced_accepts_exactly_the_ring_layout_on_every_device(off_cpu):
    """The ring runs only on this rank's two chunks (each sequence up to an offset), on the CPU
    and off it alike (off it the check used to trust any even length): other layouts take the
    generic path; a tensor changed in place is checked anew."""
    from meshfold.testing.references import OffCPU

    cp, n = 4, 3

    def positions(rows):
        t = torch.tensor(rows)
        return OffCPU(t) if off_cpu else t

    chunks = [list(range(c * n, (c + 1) * n)) for c in range(2 * cp)]
    layout = positions(chunks[1] + chunks[6])  # rank 1 holds chunks 1 and 6
    assert ring.load_balanced(layout, 1, cp)
    assert ring.load_balanced(positions([[p + 10 for p in chunks[1] + chunks[6]]] * 2), 1, cp)  # an offset
    for other in (chunks[1] + chunks[2], list(range(2 * n)), chunks[6] + chunks[1], chunks[0] + chunks[7]):
        assert not ring.load_balanced(positions(other), 1, cp), other
    assert not ring.load_balanced(positions(chunks[1] + chunks[6][:-1]), 1, cp)  # odd length
    assert not ring.load_balanced(layout.neg_(), 1, cp)  # changed in place: checked again


def test_a_context_hook_given_no_positions_names_them_before_any_collective():
    with pytest.raises(ValueError, match=r"hook got positions None on a fold with cp > 1.*must pass the positions"):
        ring.ring_applies(None, mesh=None)


# ---- the attention function on a cp mesh -----------------------------------------------------
def _chunk_positions(spec, rank, n):
    c = cached_fold(spec).stage("attn").get_local_rank("cp")
    return torch.cat([torch.arange(i * n, (i + 1) * n) for i in ring.rank_chunks(c, spec.cp)])


def _one_device(B, h, g, S, d, seed):
    gen = torch.Generator().manual_seed(seed)
    q, w = (torch.randn(B, h, S, d, dtype=torch.float64, generator=gen) for _ in range(2))
    k, v = (torch.randn(B, g, S, d, dtype=torch.float64, generator=gen) for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=h != g)
    (o * w).sum().backward()
    return q, k, v, w, o


def _check_local(attn, q, k, v, w, o, pos):
    """``attn(q, k, v)`` on this rank's tokens ``pos`` equals the one-device output and
    gradients there."""
    lq, lk, lv = (t.detach()[:, :, pos].clone().requires_grad_() for t in (q, k, v))
    lo = attn(lq, lk, lv)
    (lo * w[:, :, pos]).sum().backward()
    torch.testing.assert_close(lo, o.detach()[:, :, pos], **TOL)
    for name, got, full in (("dq", lq, q), ("dk", lk, k), ("dv", lv, v)):
        torch.testing.assert_close(got.grad, full.grad[:, :, pos], **TOL, msg=lambda m: f"{name}: {m}")


def _ring_function(rank, world_size, case):
    spec, B, (h, g), n, d, seed, kernels = case
    q, k, v, w, o = _one_device(B, h, g, 2 * spec.cp * n, d, seed)
    mesh = cached_fold(spec).stage("attn")
    _check_local(lambda a, b, c: ring.ring_attention(a, b, c, mesh, "cp", kernels), q, k, v, w, o,
                 _chunk_positions(spec, rank, n))
    return True


@pytest.mark.multirank
def test_ring_attention_equals_one_device(worlds):
    """cp = 2 and 4 (with dp or tp beside cp), GQA, both block kernels: this rank's output and
    its dQ, dK, dV equal causal attention over the whole sequence (fp64)."""
    world = worlds(4)

    @settings(max_examples=10)
    @given(st.tuples(st.sampled_from([FoldSpec(4, cp=4), FoldSpec(4, cp=2, tp=2), FoldSpec(4, cp=2)]),
                     st.integers(1, 2), st.sampled_from([(2, 2), (4, 2), (4, 1)]), st.integers(1, 5),
                     st.sampled_from([4, 8]), st.integers(0, 10**6), st.sampled_from(["fused", "plain"])))
    def check(case):
        world.run(_ring_function, case)

    check()


def _ring_expanding(rank, world_size, case):
    """MLA's case: what travels is a latent and a shared rope key, expanded per block by
    ``MLA.expand`` with a weight of this rank's."""
    from meshfold.models.mla import MLA, MLAConfig

    spec, B, h, n, seed, kernels = case
    cfg = MLAConfig(kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=3)
    expand = MLA(8, h, cfg, 10000.0, dtype=torch.float64).expand
    S, gen = 2 * spec.cp * n, torch.Generator().manual_seed(seed)
    full = [torch.randn(*shape, dtype=torch.float64, generator=gen).requires_grad_()
            for shape in ((B, h, S, 6), (B, 1, S, 6), (B, 1, S, 2), (6, h * 7))]  # q, latent, rope key, wkv_b
    w = torch.randn(B, h, S, 3, dtype=torch.float64, generator=gen)
    q, c, pe, wkv_b = full
    o = F.scaled_dot_product_attention(q, *expand(c, pe, wkv_b), is_causal=True)
    (o * w).sum().backward()
    pos = _chunk_positions(spec, rank, n)
    local = [t.detach()[:, :, pos].clone().requires_grad_() for t in (q, c, pe)]
    local.append(wkv_b.detach().clone().requires_grad_())
    mesh = cached_fold(spec).stage("attn")
    lo = ring.ring_attention(*local[:3], mesh, "cp", kernels, expand=expand, weights=(local[3],))
    (lo * w[:, :, pos]).sum().backward()
    torch.testing.assert_close(lo, o.detach()[:, :, pos], **TOL)
    dw = local[3].grad.clone()
    torch.distributed.all_reduce(dw, group=mesh.get_group("cp"))  # each cp rank holds its queries' share
    for name, got, want in (("dq", local[0].grad, q.grad[:, :, pos]), ("dlatent", local[1].grad, c.grad[:, :, pos]),
                            ("drope_key", local[2].grad, pe.grad[:, :, pos]), ("dwkv_b", dw, wkv_b.grad)):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{name}: {m}")
    return True


@pytest.mark.multirank
def test_ring_attention_with_expand_equals_one_device(worlds):
    """cp = 2 and 4, both block kernels, MLA's expansion (values narrower than keys): this rank's
    output and the gradients of q, of what travelled (sent home around the ring) and of the
    expanding weight (summed over cp) equal one device (fp64)."""
    world = worlds(4)

    @settings(max_examples=6)
    @given(st.tuples(st.sampled_from([FoldSpec(4, cp=4), FoldSpec(4, cp=2, tp=2)]), st.integers(1, 2),
                     st.sampled_from([1, 2]), st.integers(1, 4), st.integers(0, 10**6),
                     st.sampled_from(["fused", "plain"])))
    def check(case):
        world.run(_ring_expanding, case)

    check()


def _context_hook(rank, world_size, spec, n, offset, permuted):
    """The parallelize hook: ring for the load-balanced layout (also shifted by an offset), the
    generic all-gather + mask path for any other positions; both equal one device."""
    from meshfold.models.attention import CausalMaskCache
    from meshfold.parallel.context import RingContext

    S = 2 * spec.cp * n
    q, k, v, w, o = _one_device(2, 4, 2, S, 8, seed=3)
    c = cached_fold(spec).stage("attn").get_local_rank("cp")
    if permuted:  # any split of the sequence: rank c gets 2n positions of a fixed permutation
        pos = torch.randperm(S, generator=torch.Generator().manual_seed(0))[c * 2 * n:(c + 1) * 2 * n]
    else:
        pos = _chunk_positions(spec, rank, n)
    hook = RingContext(cached_fold(spec).stage("attn"), spec.cp, CausalMaskCache())
    calls, real = [], ring.ring_attention
    ring.ring_attention = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        _check_local(lambda a, b, c_: hook(a, b, c_, pos + offset), q, k, v, w, o, pos)
    finally:
        ring.ring_attention = real
    return len(calls)


@pytest.mark.multirank
@pytest.mark.parametrize("spec", [FoldSpec(4, cp=4), FoldSpec(4, cp=2, dp=2)])
def test_context_hook_rings_the_layout_and_masks_other_positions(worlds, spec):
    assert worlds(4).run(_context_hook, spec, 3, 0, False) == [1] * 4
    assert worlds(4).run(_context_hook, spec, 3, 100, False) == [1] * 4  # same layout, offset positions
    assert worlds(4).run(_context_hook, spec, 3, 0, True) == [0] * 4  # arbitrary positions: generic path


def _one_rank_in_the_ring_layout(rank, world_size, spec, n):
    """cp rank 1 holds its chunks 1 and 2 (the ring's layout), rank 0 its chunks 3 and 0 in that
    order (not the ring's): each rank's own answer would differ."""
    from meshfold.models.attention import CausalMaskCache
    from meshfold.parallel.context import RingContext

    q, k, v, w, o = _one_device(2, 4, 2, 4 * n, 8, seed=5)
    c = cached_fold(spec).stage("attn").get_local_rank("cp")
    pos = torch.cat([torch.arange(i * n, (i + 1) * n) for i in ((1, 2) if c == 1 else (3, 0))])
    assert ring.load_balanced(pos, c, spec.cp) == (c == 1)
    hook = RingContext(cached_fold(spec).stage("attn"), spec.cp, CausalMaskCache())
    _check_local(lambda a, b, c_: hook(a, b, c_, pos), q, k, v, w, o, pos)
    return True


@pytest.mark.multirank
def test_the_cp_ranks_choose_ring_or_gather_together(worlds):
    """Ring or all-gather is one decision of all cp ranks: where only some ranks' positions are
    the ring's layout, every rank takes the generic path and equals one device (each rank
    deciding alone ran different collectives and waited until the time-out)."""
    assert worlds(2).run(_one_rank_in_the_ring_layout, FoldSpec(2, cp=2), 3, timeout=20) == [True, True]


def _kept_by_attention(rank, world_size, spec, n):
    """Bytes an Attention layer's forward keeps for backward (its output included) over this
    rank's 2n tokens: on one device (positions 0..2n-1, SDPA) and with the ring over cp."""
    from meshfold.models.attention import Attention, CausalMaskCache
    from meshfold.parallel.context import RingContext
    from meshfold.testing.references import LiveTensors

    gen = torch.Generator().manual_seed(0)
    attn = Attention(32, 4, 2, 8, 10000.0, qk_norm=True, dtype=torch.float64)
    for p in attn.parameters():
        p.data.normal_(generator=gen)
    x = torch.randn(1, 2 * n, 32, dtype=torch.float64, generator=gen, requires_grad=True)

    def kept(pos):
        with LiveTensors(exclude=[*attn.parameters()]) as live:
            y = attn(x, pos)  # [1, 2n, 32]
            nbytes = live.bytes()
        y.sum().backward()
        return nbytes

    one_device = kept(torch.arange(2 * n))
    attn.context = RingContext(cached_fold(spec).stage("attn"), spec.cp, CausalMaskCache())
    return one_device, kept(_chunk_positions(spec, rank, n))


@pytest.mark.multirank
@pytest.mark.parametrize("spec", [FoldSpec(2, cp=2), FoldSpec(4, cp=4)])
def test_ring_keeps_no_more_for_backward_than_one_device_on_as_many_tokens(worlds, spec):
    """Per rank, an attention layer under the ring keeps for backward no more bytes than the same
    layer on one device over the same number of tokens: the ring's output, laid out as SDPA's,
    is what the output projection saves (before, a transposed copy of it, [S/cp, h*d] per
    layer, was kept beside it, so activation memory per token was higher under cp)."""
    for one_device, ringed in worlds(spec.world_size).run(_kept_by_attention, spec, 16):
        assert ringed <= one_device, (ringed, one_device)


def test_attention_with_a_context_hook_accepts_positions_in_any_order():
    """Under cp a rank's positions need not increase (the generic path takes any); the module
    hands them to its ``context`` hook instead of rejecting them."""
    from meshfold.models.attention import Attention

    attn = Attention(16, 4, 2, 4, 10000.0, dtype=torch.float64)
    seen = []
    attn.context = lambda q, k, v, pos: seen.append(pos) or q
    x, pos = torch.randn(1, 4, 16, dtype=torch.float64), torch.tensor([5, 1, 7, 0])
    attn(x, pos)
    assert seen and seen[0] is pos
    attn.context = None
    with pytest.raises(ValueError, match="do not increase"):
        attn(x, pos)


# ---- the whole model -------------------------------------------------------------------------
def _model_counting_rings(rank, world_size, case, data_parallel):
    from tests.parallel.test_transformer_parallel import _run

    calls, real = [], ring.ring_attention
    ring.ring_attention = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        assert _run(rank, world_size, case, data_parallel)
    finally:
        ring.ring_attention = real
    return len(calls)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [4, 8])
def test_model_with_ring_attention_equals_one_device(worlds, world_size):
    """Hypothesis-drawn folds with cp = 2 or 4 (tp, dp, ep, etp drawn beside it; GQA 8 / 4 heads,
    qk-norm and biases drawn): loss, every gradient and the logits equal one device (fp64), and
    every attention layer ran the ring (2 layers x 2 forwards)."""
    from tests.parallel.test_transformer_parallel import DATA_PARALLEL, cases

    world = worlds(world_size)

    @settings(max_examples=5 if world_size == 4 else 3)
    @given(cases(world_size).filter(lambda c: c[0].cp > 1), DATA_PARALLEL)
    def check(case, data_parallel):
        assert world.run(_model_counting_rings, case, data_parallel) == [4] * world_size

    check()


@pytest.mark.multirank
@pytest.mark.parametrize("spec", [FoldSpec(4, cp=4, ep=4), FoldSpec(8, cp=4, tp=2, ep=4, etp=2)])
def test_named_cp4_layouts_with_tp_gqa_and_qk_norm_equal_one_device(worlds, spec):
    """cp = 4 with and without tp, GQA, qk-norm and biases on, whatever hypothesis draws above."""
    case = (spec, 2 * spec.dp, 2 * spec.cp * spec.tp, 11, True, True, False, 0.01)
    assert worlds(spec.world_size).run(_model_counting_rings, case, "fsdp") == [4] * spec.world_size


def _mla_counting_rings(rank, world_size, case):
    """tests.models.test_deepseek_v3's whole-model check (loss, every gradient, logits in fp64), with
    the ring calls counted by what travelled."""
    from tests.models.test_deepseek_v3 import _run_folded

    calls, real = [], ring.ring_attention
    ring.ring_attention = lambda q, k, v, *a, **kw: calls.append((k.shape[1:], v.shape[1:])) or real(q, k, v, *a, **kw)
    try:
        assert _run_folded(rank, world_size, case)
    finally:
        ring.ring_attention = real
    return calls


@pytest.mark.multirank
@pytest.mark.parametrize("spec, q_latent, data_parallel", [
    (FoldSpec(4, cp=2, tp=2, ep=2, etp=2), False, "allreduce"),  # cp2 x tp2, a plain q projection
    (FoldSpec(4, cp=4, ep=4), True, "fsdp"),                      # cp4
    (FoldSpec(8, cp=4, tp=2, ep=4, etp=2), True, "fsdp"),         # cp4 x tp2
])
def test_mla_model_rings_its_latent_and_equals_one_device(worlds, spec, q_latent, data_parallel):
    """DeepSeek-V3 (MLA, YaRN): loss, every gradient (wkv_b's through the per-block expansion,
    wkv_a's and kv_norm's through the latent's gradient sent home around the ring) and the logits
    equal one device (fp64); every MLA layer ran the ring (2 layers x 2 forwards), and what
    travelled is the latent [1, S/cp, kv_lora_rank] and the rope key [1, S/cp, qk_rope_head_dim]."""
    B, S = 2 * spec.dp, 4 * spec.cp * spec.tp
    calls = worlds(spec.world_size).run(_mla_counting_rings, (spec, B, S, 7, data_parallel, 0.01, q_latent))
    latent = (torch.Size([1, S // spec.cp, 10]), torch.Size([1, S // spec.cp, 4]))  # _folded_config's rkv, dr
    assert calls == [[latent] * 4] * spec.world_size


def _model_any_positions(rank, world_size, spec):
    from meshfold.models.transformer import MoETransformer
    from meshfold.parallel.transformer import parallelize
    from tests.parallel.test_transformer_parallel import _config

    cfg = _config(spec, True, True, False, 0.0)
    torch.manual_seed(0)
    ref = MoETransformer(cfg, dtype=torch.float64)
    model = MoETransformer(cfg, dtype=torch.float64)
    model.load_state_dict(ref.state_dict())
    parallelize(model, cached_fold(spec))
    S = 4 * spec.cp * spec.tp
    tokens = torch.randint(0, cfg.vocab, (2, S), generator=torch.Generator().manual_seed(1))
    c = spec.coords(rank)["attn"]
    part = S // (spec.cp * spec.tp)  # a fixed permutation, cut over cp, then tp
    start = (c["cp"] * spec.tp + c["tp"]) * part
    pos = torch.randperm(S, generator=torch.Generator().manual_seed(2))[start:start + part]
    calls, real = [], ring.ring_attention
    ring.ring_attention = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        with torch.no_grad():
            got = model.local_logits(tokens[:, pos], pos)
    finally:
        ring.ring_attention = real
    torch.testing.assert_close(got, ref(tokens)[:, pos], **TOL)
    return len(calls)


@pytest.mark.multirank
@pytest.mark.parametrize("spec", [FoldSpec(4, cp=2, tp=2, ep=4), FoldSpec(4, cp=4, ep=2, etp=2)])
def test_model_with_positions_outside_the_layout_equals_one_device(worlds, spec):
    """Tokens at arbitrary positions (a permutation of the sequence cut over cp x tp): the model
    takes the generic all-gather + mask path, never the ring, and its logits equal one device."""
    assert worlds(4).run(_model_any_positions, spec) == [0] * 4


# ---- memory ----------------------------------------------------------------------------------
class _LargestOutput(TorchDispatchMode):
    """Records the largest number of elements of any op's output (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest[0]:
                self.largest = t.numel(), (str(func), tuple(t.shape))
        return out


def _largest_tensor(rank, world_size, spec, S, method, model):
    import dataclasses

    from meshfold.models.transformer import MoETransformer
    from meshfold.parallel.transformer import parallelize
    from meshfold.parallel.batch import shard_batch
    from tests.models.test_deepseek_v3 import _folded_config
    from tests.parallel.test_transformer_parallel import _config

    cfg = _config(spec, False, True, False, 0.0) if model == "gqa" else dataclasses.replace(_folded_config(), max_seq=S)
    torch.manual_seed(0)
    model = parallelize(MoETransformer(cfg, dtype=torch.float64), cached_fold(spec))
    for block in model.layers:
        attn = getattr(block.attn, "inner", block.attn)
        attn.context.method = method
    tokens = torch.randint(0, cfg.vocab, (1, S), generator=torch.Generator().manual_seed(1))
    local, pos = shard_batch(tokens, spec, rank)
    with _LargestOutput() as mode:
        model.loss(local, local, pos).backward()
    return mode.largest


@pytest.mark.multirank
@pytest.mark.parametrize("spec, model", [
    (FoldSpec(2, cp=2, ep=2), "gqa"), (FoldSpec(4, cp=4, ep=4), "gqa"), (FoldSpec(4, cp=2, tp=2, ep=4), "gqa"),
    (FoldSpec(2, cp=2, ep=2), "mla"), (FoldSpec(4, cp=2, tp=2, ep=4), "mla"),
])
def test_no_tensor_of_s_over_cp_by_s_elements(worlds, spec, model):
    """Forward and backward of the folded model with the ring allocate no tensor of S/cp x S
    elements on any rank; the old path (K/V, or MLA's latent, all-gathered, an [S/cp, S] mask)
    does, so the check can fail. S = 256 puts every legitimate tensor (logits 1 x S/cp x 32,
    K/V or one block's expanded MLA K/V, weights) below S^2/cp."""
    S = 256
    limit = S // spec.cp * S
    rings = worlds(spec.world_size).run(_largest_tensor, spec, S, "ring", model)
    assert all(n < limit for n, _ in rings), (limit, rings)
    gathers = worlds(spec.world_size).run(_largest_tensor, spec, S, "gather", model)
    assert all(n >= limit for n, _ in gathers), (limit, gathers)
