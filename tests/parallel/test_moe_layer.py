"""The MoE layer on folded layouts computes what one device computes (fp64).

Every rank builds the single-device reference itself (same seed, same weights, the whole batch),
then runs the folded layer on its own tokens and compares: its output slice, its input gradient,
the full parameter gradients (``param.grad.full_tensor()`` sums the Partial replicas), and the
loss values. The balancing losses of the reference come from their definitions (the hand-written
references of tests/models/test_router.py), not from meshfold.
"""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from meshfold.kernels import expand_tile_mask
from meshfold.mesh import FoldSpec
from meshfold.models import MoEConfig, MoELayer
from meshfold.parallel.moe import parallelize_moe
from meshfold.train.sparsity import ExpertSparsity
from meshfold.testing.strategies import divisors, fold_specs
from meshfold.testing.worlds import cached_fold
from tests.models.test_router import ref_seq_loss, ref_switch_loss, ref_z_loss_torch

pytestmark = pytest.mark.multirank

TOL = dict(rtol=1e-9, atol=1e-10)


def _token_slice(spec, rank, B, S):
    """This rank's tokens under the attention layout: batch over dp, sequence over (cp, tp)."""
    c = spec.coords(rank)["attn"]
    b = B // spec.dp
    s = S // (spec.cp * spec.tp)
    seq_part = c["cp"] * spec.tp + c["tp"]
    return slice(c["dp"] * b, (c["dp"] + 1) * b), slice(seq_part * s, (seq_part + 1) * s)


def _flat_index(spec, rank, B, S):
    """Row indices (into the [B*S] token list) of this rank's tokens, in its local order."""
    bs, ss = _token_slice(spec, rank, B, S)
    return (torch.arange(B)[bs, None] * S + torch.arange(S)[None, ss]).reshape(-1)


def _reference_losses(logits_TE, experts_TK, cfg, B, S, dp):
    """Megatron-Core's definitions (the hand-written references of tests/models/test_router.py) over the
    whole batch (T = B * S tokens)."""
    E, k = cfg.num_experts, cfg.topk
    scores = torch.softmax(logits_TE, -1) if cfg.score_function == "softmax" else (
        torch.sigmoid(logits_TE) / torch.sigmoid(logits_TE).sum(-1, keepdim=True))
    out = {}
    if cfg.aux_loss_coeff:  # per DP rank's micro-batch, averaged over DP
        n = B // dp * S
        out["aux"] = cfg.aux_loss_coeff * sum(
            ref_switch_loss(scores[g * n:(g + 1) * n], experts_TK[g * n:(g + 1) * n], E, k)
            for g in range(dp)) / dp
    if cfg.global_aux_loss_coeff:
        out["global_aux"] = cfg.global_aux_loss_coeff * ref_switch_loss(scores, experts_TK, E, k)
    if cfg.seq_aux_loss_coeff:
        out["seq_aux"] = cfg.seq_aux_loss_coeff * ref_seq_loss(scores, experts_TK, B, S, E, k)
    if cfg.z_loss_coeff:
        out["z"] = cfg.z_loss_coeff * ref_z_loss_torch(logits_TE)
    return out


def _steer(layer, mode, ep):
    """Force routing for edge cases via feature 0 (set to 1 on every token by the caller)."""
    if mode is None:
        return
    E = layer.cfg.num_experts
    w = layer.router.weight.data
    w[:, 0] = 0.0
    if mode == "one_expert":
        w[E - 1, 0] = 50.0
    elif mode == "first_ep_rank":  # every token to experts of ep rank 0; other ep ranks get none
        w[: E // ep, 0] = 50.0


def _run_case(rank, world_size, case):
    spec, cfg_kwargs, B, S, seed, steer, mode = case
    cfg = MoEConfig(**cfg_kwargs)
    H = cfg.hidden
    torch.manual_seed(seed)
    # The reference attaches no losses itself: they are added from the definitions below.
    no_losses = dataclasses.replace(cfg, aux_loss_coeff=0.0, seq_aux_loss_coeff=0.0,
                                    global_aux_loss_coeff=0.0, z_loss_coeff=0.0)
    ref = MoELayer(no_losses, dtype=torch.float64)
    _steer(ref, steer, spec.ep)
    if cfg.expert_sparsity is not None:  # prune a random half of the tiles, the same on every rank
        for mask in (ref.experts.mask_gate_up, ref.experts.mask_down):
            mask.copy_(torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed)) < 0.5)
    g = torch.Generator().manual_seed(seed + 1)
    X = torch.randn(B, S, H, generator=g, dtype=torch.float64)
    Wt = torch.randn(B, S, H, generator=g, dtype=torch.float64)
    if steer:
        X[..., 0] = 1.0
    bs, ss = _token_slice(spec, rank, B, S)

    folded = MoELayer(cfg, dtype=torch.float64)
    folded.load_state_dict(ref.state_dict())
    parallelize_moe(folded, cached_fold(spec))

    # ---- reference ----
    Xr = X.clone().requires_grad_(True)
    X_TH = Xr.reshape(-1, H)
    if mode == "dropless":
        Y = ref(Xr)
        _, experts_TK, logits_TE = ref.router(X_TH)
        losses = _reference_losses(logits_TE, experts_TK, cfg, B, S, spec.dp)
    else:
        # Dropping decides per token group: a rank's own tokens (sub_sequence) or the DP rank's
        # tokens in (cp, tp) rank order (full_sequence). Run the reference on each group.
        Y_TH = torch.zeros_like(X_TH)
        leaders = [r for r in range(world_size)
                   if mode == "sub_sequence" or spec.coords(r)["attn"]["cp"] + spec.coords(r)["attn"]["tp"] == 0]
        for r in leaders:
            members = [r] if mode == "sub_sequence" else spec.group_of(r, "attn", ("cp", "tp"))
            idx = torch.cat([_flat_index(spec, m, B, S) for m in members])
            Y_TH = Y_TH.index_copy(0, idx, ref(X_TH[idx]))
        Y = Y_TH.reshape(B, S, H)
        losses = {}
    total = (Y * Wt).sum() + sum(losses.values())
    total.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    # ---- folded ----
    x = X[bs, ss].clone().requires_grad_(True)
    y = folded(x)
    torch.testing.assert_close(y, Y[bs, ss].detach(), **TOL)
    (y * Wt[bs, ss]).sum().backward()
    torch.testing.assert_close(x.grad, Xr.grad[bs, ss], **TOL)
    for name, p in folded.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), ref_grads[name], **TOL, msg=lambda m: f"{name}: {m}")
    for name, value in losses.items():
        torch.testing.assert_close(folded.last_losses[name], value.detach(), **TOL)
    return folded.last_metrics["tokens_per_expert"].tolist()


@st.composite
def moe_cases(draw, world_size, mode="dropless"):
    spec = draw(fold_specs(world_sizes=[world_size], pp=[1]))
    E = spec.ep * draw(st.sampled_from([1, 2]))
    if E == 1:
        E = 2
    topk = draw(st.integers(1, min(E, 3)))
    cfg = dict(hidden=4, ffn=2 * spec.etp, num_experts=E, topk=topk, router_dtype=torch.float64,
               score_function=draw(st.sampled_from(["softmax", "sigmoid"])),
               pre_softmax=draw(st.booleans()))
    if mode == "dropless":
        cfg.update(aux_loss_coeff=draw(st.sampled_from([0.0, 0.1])),
                   seq_aux_loss_coeff=draw(st.sampled_from([0.0, 0.1])),
                   global_aux_loss_coeff=draw(st.sampled_from([0.0, 0.1])),
                   z_loss_coeff=draw(st.sampled_from([0.0, 0.01])))
    else:
        cfg.update(capacity_factor=draw(st.sampled_from([0.0, 0.5, 1.0, 1.5])),
                   drop_policy=draw(st.sampled_from(["probs", "position"])),
                   drop_scope=mode, pad_to_capacity=draw(st.booleans()))
    if mode == "dropless" and draw(st.integers(0, 3)) == 0:  # tile-sparse experts, some tiles pruned
        cfg.update(expert_sparsity=ExpertSparsity(tile=draw(st.sampled_from([(1, 1), (2, 1), (2, 2)])),
                                                  score="magnitude"))
    if draw(st.booleans()):
        cfg.update(shared_ffn=2 * spec.tp, shared_kind=draw(st.sampled_from(["qwen2", "deepseek"])))
    B = spec.dp * draw(st.integers(1, 2))
    S = spec.cp * spec.tp * draw(st.integers(1, 3))
    steer = draw(st.sampled_from([None, None, "one_expert", "first_ep_rank"]))
    return spec, cfg, B, S, draw(st.integers(0, 10**6)), steer, mode


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_folded_layer_equals_single_device_dropless(worlds, world_size):
    world = worlds(world_size)

    @settings(max_examples={1: 6, 2: 10, 4: 10, 8: 6}[world_size])
    @given(moe_cases(world_size))
    def check(case):
        world.run(_run_case, case)

    check()


@pytest.mark.parametrize("mode", ["sub_sequence", "full_sequence"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_folded_layer_equals_reference_with_token_dropping(worlds, world_size, mode):
    world = worlds(world_size)

    @settings(max_examples=8)
    @given(moe_cases(world_size, mode))
    def check(case):
        world.run(_run_case, case)

    check()


def _rank_routing(rank, E, k, H, seed, max_tokens=5):
    """Rank ``rank``'s tokens x [T, H], their experts [T, k] (distinct per token) and weights,
    the same on every rank that builds them; T in 0..max_tokens differs between ranks."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    T = int(torch.randint(0, max_tokens + 1, (1,), generator=g))
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    experts = torch.zeros(0, k, dtype=torch.long)
    if T:
        experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    probs = torch.rand(T, k, generator=g, dtype=torch.float64)
    return x, experts, probs


def _check_dispatch(rank, world_size, spec, E, k, seed):
    from meshfold.models.dispatcher import permute
    from meshfold.parallel.moe import FoldedComm

    comm = FoldedComm(cached_fold(spec))
    x, experts, probs = _rank_routing(rank, E, k, 3, seed)
    perm = permute(x, experts, probs, E)
    routed = comm.dispatch(perm.x_NH, perm.counts_E)
    got = routed.tokens.full_tensor()
    # single device: the tokens of this rank's ep x etp block, in the block's rank order
    me = spec.coords(rank)["moe"]
    block = [spec.rank("moe", **{**me, "ep": i, "etp": q}) for i in range(spec.ep) for q in range(spec.etp)]
    X, EXP, P = (torch.cat(parts) for parts in zip(*(_rank_routing(r, E, k, 3, seed) for r in block)))
    want = permute(X, EXP, P, E)
    assert torch.equal(got, want.x_NH)
    El = E // spec.ep
    mine = want.counts_E[me["ep"] * El:(me["ep"] + 1) * El]
    assert torch.equal(routed.offsets_E, mine.cumsum(0).to(torch.int32))
    # combine is dispatch's inverse: etp rank 0 returns the rows, the others a zero summand
    back = comm.combine(routed, routed.rows * (me["etp"] == 0))
    assert torch.equal(back, perm.x_NH)
    return True


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_dispatched_tokens_are_single_device_permute_rows_in_order(worlds, world_size):
    """For any fold, the dispatch's RaggedTensor on moe (ep, etp) is, as a global tensor, what
    single-device permute gives for the block's tokens, row for row; its offsets are the local
    experts' row counts, and combining the rows back returns each rank's permuted rows."""
    world = worlds(world_size)
    both = FoldSpec(world_size, ep=2, etp=world_size // 2)  # rows from several ep and etp ranks

    @settings(max_examples=10 if world_size < 8 else 6)
    @given(fold_specs(world_sizes=[world_size]), st.sampled_from([1, 2]), st.integers(1, 3), st.integers(0, 10**6))
    @example(both, 2, 2, 1)
    def check(spec, experts_per_rank, k, seed):
        E = spec.ep * experts_per_rank
        world.run(_check_dispatch, spec, E, min(k, E), seed)

    check()


def test_ep_rank_receiving_no_tokens(worlds):
    """Megatron-LM#1877 crashed when an EP rank received zero tokens."""
    spec = FoldSpec(4, tp=2, ep=4)
    cfg = dict(hidden=4, ffn=2, num_experts=8, topk=2, router_dtype=torch.float64)
    counts = worlds(4).run(_run_case, (spec, cfg, 2, 4, 3, "first_ep_rank", "dropless"))[0]
    assert sum(counts[2:]) == 0 and sum(counts[:2]) == 2 * 8  # experts 0-1 live on ep rank 0


def test_zero_tokens_and_all_dropped(worlds):
    spec = FoldSpec(2, ep=2)
    cfg = dict(hidden=4, ffn=2, num_experts=2, topk=2, capacity_factor=0.0, shared_ffn=2,
               router_dtype=torch.float64)
    worlds(2).run(_run_case, (spec, cfg, 2, 2, 5, None, "sub_sequence"))  # topk == E, all dropped
    worlds(2).run(_run_empty, spec)


def _run_empty(rank, world_size, spec):
    """A rank with zero tokens still takes part in the dispatch and gets a [0, H] output."""
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(hidden=4, ffn=2, num_experts=2, topk=1, shared_ffn=2), dtype=torch.float64)
    parallelize_moe(layer, cached_fold(spec))
    x = torch.randn(3 if rank else 0, 4, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert y.shape == x.shape and x.grad.shape == x.shape
    return True


def test_negative_capacity_factor_is_rejected():
    with pytest.raises(ValueError, match=r"capacity_factor must be >= 0"):
        MoEConfig(hidden=4, ffn=4, num_experts=4, topk=2, capacity_factor=-1.0)


def _indivisible(rank, world_size):
    layer = MoELayer(MoEConfig(hidden=4, ffn=4, num_experts=3, topk=1))
    try:
        parallelize_moe(layer, cached_fold(FoldSpec(world_size, ep=world_size)))
    except ValueError as err:
        return str(err)
    return None


def test_experts_not_divisible_by_ep_raise(worlds):
    assert worlds(2).run(_indivisible) == ["num_experts = 3 is not divisible by ep = 2 "
                                           "(valid ep: divisors of 3)"] * 2


def test_capacity_definition():
    from meshfold.models.dispatcher import capacity

    assert capacity(10, 2, 4, 1.0) == 5 and capacity(10, 2, 4, 1.25) == math.ceil(6.25)
    assert capacity(7, 1, 8, 0.0) == 0


def test_divisors_helper_used_by_strategies():
    assert divisors(12) == [1, 2, 3, 4, 6, 12]


def test_tile_sparse_experts_equal_dense_experts_with_masked_weights():
    """The masked fast path (apply_tile_mask's broadcast) against the plain reference: weights
    zeroed with the element mask (expand_tile_mask), dense kernel."""
    torch.manual_seed(0)
    sp = ExpertSparsity(tile=(2, 2), score="taylor")
    cfg = MoEConfig(hidden=8, ffn=4, num_experts=4, topk=2, expert_sparsity=sp, router_dtype=torch.float64)
    sparse = MoELayer(cfg, dtype=torch.float64)
    for mask in (sparse.experts.mask_gate_up, sparse.experts.mask_down):
        mask.copy_(torch.rand(mask.shape) < 0.5)
    dense = MoELayer(dataclasses.replace(cfg, expert_sparsity=None), dtype=torch.float64)
    dense.load_state_dict(sparse.state_dict(), strict=False)
    with torch.no_grad():
        for name, (w, mask) in sparse.sparse_layers().items():  # w [E, K, N] or [E, K, 2, F]
            keep = expand_tile_mask(mask, w.shape[1], w[0, 0].numel()).view(w.shape)
            getattr(dense.experts, name).mul_(keep)
    x = torch.randn(6, 8, dtype=torch.float64)
    ys, yd = sparse(x), dense(x)
    torch.testing.assert_close(ys, yd, **TOL)
    ys.square().sum().backward()
    for name, (w, mask) in sparse.sparse_layers().items():
        keep = expand_tile_mask(mask, w.shape[1], w[0, 0].numel()).view(w.shape)
        assert torch.all(w.grad[~keep] == 0)  # pruned tiles: zero gradient


def test_pruning_schedule_on_the_moe_layer_keeps_masks_after_steps():
    from meshfold.train.sparsity import TilePruner

    torch.manual_seed(0)
    sp = ExpertSparsity(tile=(2, 2), schedule=(0.25, 0.5), start_step=1, steps_per_stage=2)
    layer = MoELayer(MoEConfig(hidden=8, ffn=4, num_experts=4, topk=2, expert_sparsity=sp))
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    pruner = TilePruner(layer.sparse_layers(), sp, opt)
    reached = []
    for step in range(1, 6):
        layer(torch.randn(16, 8)).square().mean().backward()
        pruner.accumulate()
        pruner.step(step)
        opt.step()
        opt.zero_grad()
        reached.append(round(pruner.sparsity(), 2))
        for w, mask in layer.sparse_layers().values():  # w [E, K, N] or [E, K, 2, F]: as [E, K, N]
            keep = mask.repeat_interleave(2, 1).repeat_interleave(2, 2)
            assert torch.all(w.detach().reshape(keep.shape)[~keep] == 0)  # pruned weights stay zero
    assert reached[0] == 0.25 and reached[-1] == 0.5


# ---- local fast paths against their plain references ---------------------------------------


def _routed(T, k, E, H, dtype, seed=0):
    """x [T, H], a dropless Permuted of it (fp32 router probs) and its expert outputs y [T k, H]."""
    from meshfold.models.dispatcher import permute

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    logits = torch.randn(T, E, generator=g)
    probs, experts = logits.softmax(-1).topk(k, dim=-1)
    probs = probs.requires_grad_()
    perm = permute(x, experts, probs, E)
    y = torch.randn(T * k, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return x, probs, perm, y


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fast_combine_equals_reference_with_gradients(dtype, tol):
    """The dropless combine (token-major bmm in y's dtype) gives the plain weighted index_add's
    output and gradients for y and the router probabilities (bf16: to bf16 rounding)."""
    from meshfold.models.dispatcher import unpermute, unpermute_reference

    _, probs, perm, y = _routed(37, 3, 5, 16, dtype)
    assert perm.pair_N is not None
    dout = torch.randn(37, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    got = unpermute(y, perm, 37)
    want = unpermute_reference(y, perm, 37)
    g_got = torch.autograd.grad(got, (y, probs), dout)
    g_want = torch.autograd.grad(want, (y, probs), dout)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, atol=tol * 4, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_combine_in_parts_on_the_pool_equals_one_part(dtype, monkeypatch):
    """The combine's parts (tiny here, so many run on two pool workers) give bitwise the values
    and gradients of one part: every output element is written by one part with the same ops."""
    from meshfold.kernels import combine
    from meshfold.models import dispatcher

    _, probs, perm, y = _routed(101, 3, 5, 16, dtype)
    dout = torch.randn(101, 16, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(dtype)
    results = []
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for rows in (10**6, 7):
            monkeypatch.setattr(combine, "COMBINE_ROWS", rows)
            out = dispatcher.unpermute(y, perm, 101)
            results.append((out, *torch.autograd.grad(out, (y, probs), dout)))
    finally:
        torch.set_num_threads(before)
    for one, parts in zip(*results):
        assert torch.equal(one, parts)


def test_combine_of_no_tokens_off_the_cpu_gives_empty_output_and_gradients():
    """A rank (or an expert block) that receives no tokens: off the CPU the combine runs as one
    part, which must not be called with zero rows (its [0, k, H] view has no inferable size)."""
    from meshfold.kernels import combine_topk
    from meshfold.testing.references import OffCPU

    k, H = 2, 4
    y, probs = OffCPU(torch.zeros(0, H)).requires_grad_(), OffCPU(torch.zeros(0, k)).requires_grad_()
    empty = OffCPU(torch.zeros(0, dtype=torch.int64))
    with OffCPU.everywhere():
        out = combine_topk(y, probs, empty, empty)
        dy, dprobs = torch.autograd.grad(out, (y, probs), OffCPU(torch.zeros(0, H)))
    assert out.device.type != "cpu" and out.inner.shape == (0, H)
    assert dy.shape == (0, H) and dprobs.shape == (0, k)


def test_fast_permute_gradient_equals_plain_indexing():
    """gather_rows' backward (index_add) is autograd's x[token] backward, fp32-accumulated in
    bf16: equal to the fp64 sum rounded once."""
    from meshfold.kernels import gather_rows

    for dtype in (torch.float64, torch.bfloat16):
        x, _, perm, _ = _routed(29, 4, 6, 8, dtype)
        dy = torch.randn(29 * 4, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        (got,) = torch.autograd.grad(gather_rows(x, perm.token_N), x, dy.to(dtype))
        want = torch.zeros(29, 8, dtype=torch.float64).index_put_((perm.token_N,), dy.to(dtype).double(),
                                                                   accumulate=True)
        assert torch.equal(got, want.to(dtype))


@pytest.mark.parametrize("rows_per_part", [1, 5, 100])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_fast_swiglu_equals_reference_with_gradients(dtype, rows_per_part, monkeypatch):
    """Bitwise the plain definition, whether the rows run as one part or as parts on the pool
    (two intra-op threads, so the pool is used; 23 rows cut into 23, 5 or 1 parts)."""
    from meshfold.kernels import ffn
    from meshfold.kernels import swiglu, swiglu_reference

    monkeypatch.setattr(ffn, "PART_ELEMENTS", rows_per_part * 2 * 7)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        h = torch.randn(23, 2, 7, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dtype)
        h.requires_grad_()
        da = torch.randn(23, 7, dtype=torch.float64).to(dtype)
        got, want = swiglu(h), swiglu_reference(h)
        assert torch.equal(got, want)
        assert torch.equal(torch.autograd.grad(got, h, da)[0], torch.autograd.grad(want, h, da)[0])
        if dtype == torch.float64:
            assert torch.autograd.gradcheck(swiglu, (h.detach().requires_grad_(),))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("rows_per_part", [1, 5, 100])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_gelu_in_parts_equals_torch_gelu_with_gradients(dtype, rows_per_part, monkeypatch):
    """One ``F.gelu``'s values and gradient to a few ulps, whether run whole or in parts on the pool."""
    from meshfold.kernels import ffn

    monkeypatch.setattr(ffn, "PART_ELEMENTS", rows_per_part * 7)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        h = torch.randn(23, 7, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dtype)
        h.requires_grad_()
        da = torch.randn(23, 7, dtype=torch.float64).to(dtype)
        got, want = ffn.gelu(h), F.gelu(h)
        # a part's last elements may take ATen's scalar erf instead of the vector one: a few ulps
        # (bf16 computes in fp32, so at most one bf16 ulp after rounding)
        ulps = dict(rtol=(1 if dtype == torch.bfloat16 else 16) * torch.finfo(dtype).eps, atol=torch.finfo(dtype).tiny)
        torch.testing.assert_close(got, want, **ulps)
        torch.testing.assert_close(torch.autograd.grad(got, h, da)[0], torch.autograd.grad(want, h, da)[0], **ulps)
        if dtype == torch.float64:
            assert torch.autograd.gradcheck(ffn.gelu, (h.detach().requires_grad_(),))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
def test_pool_workers_follow_inference_mode_and_create_graph(kind, monkeypatch):
    """The CPU pool's workers run in the caller's grad and inference modes: on two threads a
    forward under ``torch.inference_mode`` and a backward with ``create_graph`` (a gradient
    penalty) give what ``no_grad`` and a plain backward give; GELU experts differentiate twice."""
    from meshfold.kernels import expert_ffn, ffn

    monkeypatch.setattr(ffn, "PART_ELEMENTS", 64)  # several activation parts, too
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        layer = MoELayer(MoEConfig(hidden=8, ffn=6, num_experts=4, topk=2, expert_kind=kind), dtype=torch.float64)
        x = torch.randn(24, 8, dtype=torch.float64)
        with torch.no_grad():
            want = layer(x)
        with torch.inference_mode():
            got = layer(x)
        assert torch.equal(got, want)
        x.requires_grad_()
        (plain,) = torch.autograd.grad(layer(x).square().sum(), x)
        (penalised,) = torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
        torch.testing.assert_close(penalised, plain, rtol=1e-13, atol=1e-13)
        if kind == "gelu":
            w1, w2 = layer.experts.w_gate_up.detach(), layer.experts.w_down.detach()
            offsets = torch.tensor([10, 20, 36, 48], dtype=torch.int32)
            rows = torch.randn(48, 8, dtype=torch.float64, requires_grad=True)
            assert torch.autograd.gradgradcheck(lambda r: expert_ffn(r, w1, w2, offsets, "gelu"), (rows,))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_single_threaded_scatter_rows_equals_index_add_on_all_threads(dtype):
    """gather_rows' backward on one pool thread gives bitwise the multi-threaded index_add
    (bf16: the fp64 sum rounded once); the caller's thread count is left as it was."""
    from meshfold.kernels import scatter_rows, scatter_rows_reference

    x, _, perm, _ = _routed(301, 3, 9, 40, dtype)
    g = torch.randn(301 * 3, 40, generator=torch.Generator().manual_seed(4), dtype=torch.float64).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = scatter_rows(g, perm.token_N, 301)
        assert torch.get_num_threads() == 2
        want = scatter_rows_reference(g, perm.token_N, 301)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, want)
    if dtype == torch.bfloat16:
        exact = torch.zeros(301, 40, dtype=torch.float64).index_add_(0, perm.token_N, g.double())
        assert torch.equal(got, exact.to(dtype))


def test_combine_keeps_autograd_of_the_caller():
    """The combine follows the caller's grad mode, though its parts run on pool threads (grad
    mode is thread-local)."""
    from meshfold.models.dispatcher import unpermute

    _, probs, perm, y = _routed(37, 3, 5, 16, torch.float32)
    with torch.no_grad():
        assert unpermute(y, perm, 37).grad_fn is None
    assert unpermute(y, perm, 37).grad_fn is not None


_ROUTINGS = [dict(), dict(pre_softmax=False), dict(score_function="sigmoid", num_groups=4, group_topk=2),
             dict(expert_bias=True, topk_scaling_factor=2.5)]


@pytest.mark.parametrize("routing", _ROUTINGS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_serial_graph_routing_equals_the_direct_call_with_gradients(dtype, routing):
    """The router's routing on one pool thread (serial_graph) gives bitwise what calling
    topk_routing on the caller's two threads gives: weights, experts and the logits' gradient;
    fn really runs with one intra-op thread, and the caller's count is left as it was."""
    from meshfold.kernels import serial_graph
    from meshfold.models.router import topk_routing

    cfg = MoEConfig(hidden=4, ffn=4, num_experts=8, topk=4, **routing)
    bias = torch.linspace(-0.1, 0.2, 8) if cfg.expert_bias else None
    logits = torch.randn(300, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(dtype)
    dprobs = torch.randn(300, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    seen = []

    def route(l_TE, b_E):
        seen.append(torch.get_num_threads())
        return topk_routing(l_TE, cfg, b_E)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        results = []
        for call in (lambda l: route(l, bias), lambda l: serial_graph(route, l, bias)):
            l_TE = logits.clone().requires_grad_()
            probs, experts = call(l_TE)
            results.append((probs, experts, torch.autograd.grad(probs, l_TE, dprobs)[0]))
        assert torch.get_num_threads() == 2 and seen == [2, 1]
    finally:
        torch.set_num_threads(before)
    (p0, e0, g0), (p1, e1, g1) = results
    assert torch.equal(p0, p1) and torch.equal(e0, e1) and torch.equal(g0, g1)
    assert not e1.requires_grad


def test_serial_graph_gradient_of_gradient_is_exact():
    """A backward with create_graph (a gradient penalty) through serial_graph is differentiable
    again: fp64 gradgradcheck of the router's softmax top-k and of a two-output function."""
    from meshfold.kernels import serial_graph
    from meshfold.models.router import topk_routing

    cfg = MoEConfig(hidden=4, ffn=4, num_experts=6, topk=2)
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda l: serial_graph(lambda x: topk_routing(x, cfg), l)[0], (logits,))
    a = torch.randn(7, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda x, y: serial_graph(lambda u, v: (u * v, u.exp()), x, y), (a, b))
