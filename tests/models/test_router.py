"""Router and load-balancing losses against hand-written definitions.

Shapes: T = tokens, H = hidden, E = experts, k = top-k, B = sequences, S = sequence length.

Every expected value here comes from a plain per-token reference written in this file (Python
loops over tokens and experts), never from meshfold's own loss functions: Megatron-Core's
``topk_routing_with_score_function`` / ``switch_load_balancing_loss_func`` /
``sequence_load_balancing_loss_func`` / ``z_loss_func`` definitions, and Hugging Face's Mixtral
``load_balancing_loss_func`` as an outside implementation.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from meshfold.models import MoEConfig, MoELayer
from meshfold.models.router import topk_routing

f64 = torch.float64


# ----------------------------------------------------------------------------- references


def ref_routing(logits_TE, *, score="softmax", pre_softmax=True, renormalize=False, k=2,
                scaling=None, num_groups=None, group_topk=None, bias_E=None):
    """Per-token reference: (probs [T, k], experts [T, k]) sorted by expert id within a token.

    softmax + pre_softmax: softmax over all E, pick the k best (scores + bias), weights are the
    unbiased scores, optionally renormalised over the k. softmax without pre_softmax: pick on
    logits (+ bias), softmax over the k picked logits. sigmoid: pick on sigmoid (+ bias), weights
    normalised over the k when k > 1 and renormalize. Group-limited: a group scores the sum of its best
    k / group_topk selection scores; only experts of the group_topk best groups may be picked.
    """
    logits_TE = logits_TE.detach()
    T, E = logits_TE.shape
    rows_p, rows_e = [], []
    for t in range(T):
        z = [float(v) for v in logits_TE[t]]
        if score == "softmax":
            m = max(z)
            ex = [math.exp(v - m) for v in z]
            s = [v / sum(ex) for v in ex]
            sel_base = s if pre_softmax else z
        else:
            s = [1.0 / (1.0 + math.exp(-v)) for v in z]
            sel_base = s
        sel = [v + (0.0 if bias_E is None else float(bias_E[e])) for e, v in enumerate(sel_base)]
        allowed = list(range(E))
        if num_groups is not None:
            n = E // num_groups
            group_score = [sum(sorted(sel[g * n:(g + 1) * n], reverse=True)[:k // group_topk])
                           for g in range(num_groups)]
            best = sorted(range(num_groups), key=lambda g: -group_score[g])[:group_topk]
            allowed = [e for e in range(E) if e // n in best]
        chosen = sorted(allowed, key=lambda e: -sel[e])[:k]
        if score == "softmax" and not pre_softmax:
            m = max(z[e] for e in chosen)
            ex = {e: math.exp(z[e] - m) for e in chosen}
            w = {e: ex[e] / sum(ex.values()) for e in chosen}
        else:
            w = {e: s[e] for e in chosen}
            if renormalize and (score == "softmax" or k > 1):
                total = sum(w.values())
                w = {e: v / total for e, v in w.items()}
        if scaling is not None:
            w = {e: v * scaling for e, v in w.items()}
        chosen = sorted(chosen)
        rows_e.append(chosen)
        rows_p.append([w[e] for e in chosen])
    return torch.tensor(rows_p, dtype=f64), torch.tensor(rows_e, dtype=torch.int64)


def by_expert(probs_TK, experts_TK):
    """Sort each token's k pairs by expert id (meshfold returns them best-first)."""
    order = experts_TK.argsort(dim=1)
    return probs_TK.gather(1, order), experts_TK.gather(1, order)


def ref_softmax(logits_TE):
    out = []
    for row in logits_TE.tolist():
        m = max(row)
        ex = [math.exp(v - m) for v in row]
        out.append([v / sum(ex) for v in ex])
    return torch.tensor(out, dtype=f64)


def ref_switch_loss(p_TE, experts_TK, E, k):
    """Megatron's Switch loss: E / (k N^2) * sum_e count_e * sum_t p_te."""
    N = p_TE.shape[0]
    count = [0] * E
    for row in experts_TK.tolist():
        for e in row:
            count[e] += 1
    return E / (k * N * N) * sum(count[e] * p_TE[:, e].sum() for e in range(E))


def ref_seq_loss(p_TE, experts_TK, B, S, E, k):
    """Megatron's per-sequence loss: the Switch loss of each sequence, averaged over sequences."""
    return sum(ref_switch_loss(p_TE[b * S:(b + 1) * S], experts_TK[b * S:(b + 1) * S], E, k)
               for b in range(B)) / B


def ref_z_loss(logits_TE):
    """mean_t logsumexp(logits_t)^2."""
    T = logits_TE.shape[0]
    lse = [max(r) + math.log(sum(math.exp(v - max(r)) for v in r)) for r in logits_TE.tolist()]
    return sum(v * v for v in lse) / T


def ref_z_loss_torch(logits_TE):
    """Same as :func:`ref_z_loss`, differentiable (for the gradient check)."""
    m = logits_TE.max(dim=1, keepdim=True).values.detach()
    lse = (logits_TE - m).exp().sum(1).log() + m.squeeze(1)
    return (lse * lse).mean()


def layer(**kw):
    """A small fp64 layer with an fp64 router, seeded."""
    torch.manual_seed(kw.pop("seed", 0))
    kw.setdefault("hidden", 16)
    kw.setdefault("ffn", 8)
    kw.setdefault("num_experts", 8)
    kw.setdefault("router_dtype", f64)
    return MoELayer(MoEConfig(**kw), dtype=f64)


# ----------------------------------------------------------------------------- routing


@st.composite
def routing_cases(draw):
    E = draw(st.sampled_from([4, 6, 8, 12, 16]))
    score = draw(st.sampled_from(["softmax", "sigmoid"]))
    pre = draw(st.booleans())
    grouped = draw(st.booleans())
    if grouped:
        G = draw(st.sampled_from([g for g in (2, 3, 4) if E % g == 0]))
        g = draw(st.integers(1, G))
        k = g * draw(st.integers(1, E // G))
    else:
        G = g = None
        k = draw(st.integers(1, E))
    kw = dict(score=score, pre_softmax=pre, renormalize=draw(st.booleans()), k=k,
              scaling=draw(st.sampled_from([None, 2.5])), num_groups=G, group_topk=g)
    T = draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**16))
    use_bias = draw(st.booleans())
    return E, T, seed, use_bias, kw


def cfg_for(E, kw, **extra):
    return MoEConfig(hidden=8, ffn=8, num_experts=E, topk=kw["k"], score_function=kw["score"],
                     pre_softmax=kw["pre_softmax"], renormalize=kw["renormalize"],
                     topk_scaling_factor=kw["scaling"], num_groups=kw["num_groups"],
                     group_topk=kw["group_topk"], router_dtype=f64, **extra)


@settings(max_examples=25)
@given(routing_cases())
def test_topk_routing_matches_the_per_token_reference(case):
    """Every score function / pre-softmax / renormalise / scaling / group-limited / bias
    combination picks the reference's experts with the reference's weights."""
    E, T, seed, use_bias, kw = case
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g, dtype=f64) * 2
    bias = torch.randn(E, generator=g, dtype=f64) * 0.3 if use_bias else None
    probs, experts = topk_routing(logits, cfg_for(E, kw), bias)
    ref_p, ref_e = ref_routing(logits, bias_E=bias, **kw)
    probs, experts = by_expert(probs, experts)
    assert torch.equal(experts, ref_e)
    torch.testing.assert_close(probs, ref_p, rtol=1e-12, atol=1e-14)


def test_pre_softmax_and_post_softmax_weights_differ_as_defined():
    """pre-softmax weights are a slice of the full softmax; post-softmax weights sum to 1."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]], dtype=f64)
    base = dict(hidden=8, ffn=8, num_experts=4, topk=2, renormalize=False, router_dtype=f64)
    p_pre, _ = topk_routing(logits, MoEConfig(pre_softmax=True, **base))
    p_post, _ = topk_routing(logits, MoEConfig(pre_softmax=False, **base))
    full = ref_softmax(logits)[0]
    torch.testing.assert_close(p_pre[0], full[:2], rtol=1e-14, atol=0)
    two = torch.tensor([math.exp(1.0), 1.0], dtype=f64) / (math.exp(1.0) + 1.0)
    torch.testing.assert_close(p_post[0], two, rtol=1e-14, atol=0)


def test_expert_bias_changes_selection_not_weights():
    """A large bias forces its expert into every token's top-k, with its unbiased weight."""
    lay = layer(num_experts=8, topk=2, expert_bias=True, renormalize=False)
    lay.router.expert_bias[5] = 10.0
    x = torch.randn(10, 16, dtype=f64)
    probs, experts, logits = lay.router(x)
    assert (experts == 5).any(dim=1).all()
    full = ref_softmax(logits)
    torch.testing.assert_close(probs, full.gather(1, experts), rtol=1e-14, atol=0)
    torch.testing.assert_close(logits, x @ lay.router.weight.T, rtol=1e-14, atol=0)


def test_aux_loss_counts_the_routing_map_dispatch_uses():
    """With an expert bias the balancing counts are those of the biased (dispatched) choice
    (Megatron-LM#2767 computed them on another map)."""
    lay = layer(num_experts=8, topk=2, expert_bias=True, aux_loss_coeff=1.0)
    lay.router.expert_bias[3] = 10.0
    x = torch.randn(12, 16, dtype=f64)
    lay(x)
    logits = x @ lay.router.weight.T
    _, chosen = ref_routing(logits, k=2, renormalize=True, bias_E=lay.router.expert_bias)
    assert lay.last_metrics["tokens_per_expert"][3] == 12
    expected = ref_switch_loss(ref_softmax(logits), chosen, 8, 2)
    torch.testing.assert_close(lay.last_losses["aux"], expected, rtol=1e-12, atol=0)


def test_input_jitter_applies_only_in_training():
    lay = layer(input_jitter=0.2)
    x = torch.randn(32, 16, dtype=f64)
    clean = x @ lay.router.weight.T
    lay.eval()
    assert torch.equal(lay.router(x)[2], clean)
    lay.train()
    noisy = lay.router(x)[2]
    assert not torch.allclose(noisy, clean)
    # multiplicative noise in [0.8, 1.2] per input element bounds each logit
    bound = (x.abs() * 0.2) @ lay.router.weight.T.abs()
    assert ((noisy - clean).abs() <= bound + 1e-12).all()


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float32, f64])
@pytest.mark.parametrize("router_dtype", [torch.float32, f64])
def test_router_runs_in_router_dtype_whatever_the_model_dtype(model_dtype, router_dtype):
    torch.manual_seed(0)
    lay = MoELayer(MoEConfig(hidden=16, ffn=16, num_experts=4, topk=2, router_dtype=router_dtype),
                   dtype=model_dtype)
    x = torch.randn(8, 16, dtype=model_dtype)
    probs, experts, logits = lay.router(x)
    assert lay.router.weight.dtype == router_dtype
    assert logits.dtype == probs.dtype == router_dtype
    assert lay(x).dtype == model_dtype
    expected = F.linear(x.to(router_dtype), lay.router.weight)
    assert torch.equal(logits, expected)


# ----------------------------------------------------------------------------- losses


def balanced_layer_input(E, reps):
    """Router = identity on H = E, token t = onehot(t % E) + 0.5 onehot((t+1) % E): top-2 picks
    experts t % E and (t+1) % E, every expert gets N k / E pairs and N / E probability mass."""
    lay = layer(hidden=E, num_experts=E, topk=2, aux_loss_coeff=1.0)
    with torch.no_grad():
        lay.router.weight.copy_(torch.eye(E, dtype=f64) * 3)
    x = torch.zeros(E * reps, E, dtype=f64)
    for t in range(E * reps):
        x[t, t % E] = 1.0
        x[t, (t + 1) % E] = 0.5
    return lay, x


def test_switch_aux_loss_of_a_perfectly_balanced_router_is_one():
    lay, x = balanced_layer_input(8, 3)
    lay(x)
    assert torch.equal(lay.last_metrics["tokens_per_expert"], torch.full((8,), 6))
    torch.testing.assert_close(lay.last_losses["aux"], torch.tensor(1.0, dtype=f64), rtol=1e-13, atol=0)


@settings(max_examples=25)
@given(st.integers(1, 4), st.integers(1, 12), st.sampled_from([(4, 1), (8, 2), (8, 3), (16, 4)]),
       st.integers(0, 2**16))
def test_switch_and_seq_aux_and_z_losses_match_megatron_definitions(B, S, Ek, seed):
    E, k = Ek
    lay = layer(num_experts=E, topk=k, seed=seed, aux_loss_coeff=0.5, seq_aux_loss_coeff=0.25,
                global_aux_loss_coeff=2.0, z_loss_coeff=0.125)
    x = torch.randn(B, S, 16, dtype=f64, generator=torch.Generator().manual_seed(seed))
    lay(x)
    logits = x.reshape(-1, 16) @ lay.router.weight.T
    _, chosen = ref_routing(logits, k=k, renormalize=True)
    p = ref_softmax(logits)
    got = lay.last_losses
    close = dict(rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(got["aux"], 0.5 * ref_switch_loss(p, chosen, E, k), **close)
    torch.testing.assert_close(got["global_aux"], 2.0 * ref_switch_loss(p, chosen, E, k), **close)
    torch.testing.assert_close(got["seq_aux"], 0.25 * ref_seq_loss(p, chosen, B, S, E, k), **close)
    torch.testing.assert_close(got["z"], torch.tensor(0.125 * ref_z_loss(logits), dtype=f64), **close)


def test_sigmoid_aux_loss_uses_scores_normalised_over_experts():
    lay = layer(num_experts=8, topk=2, score_function="sigmoid", aux_loss_coeff=1.0)
    x = torch.randn(20, 16, dtype=f64)
    lay(x)
    logits = x @ lay.router.weight.T
    _, chosen = ref_routing(logits, score="sigmoid", k=2)
    s = torch.sigmoid(logits)
    p = s / s.sum(1, keepdim=True)
    torch.testing.assert_close(lay.last_losses["aux"], ref_switch_loss(p, chosen, 8, 2), rtol=1e-12, atol=0)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_hf_mixtral_load_balancing_loss_is_ours_times_k(k):
    """transformers' ``load_balancing_loss_func((logits,), E, k)`` (one layer, no mask; it applies
    softmax to the logits itself, once) equals meshfold's Switch loss times k."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    lay = layer(num_experts=8, topk=k, aux_loss_coeff=1.0)
    x = torch.randn(64, 16, dtype=f64)
    lay(x)
    logits = x @ lay.router.weight.T
    hf = load_balancing_loss_func((logits,), num_experts=8, top_k=k)
    # HF accumulates in fp32
    torch.testing.assert_close(hf.to(f64), k * lay.last_losses["aux"], rtol=2e-6, atol=0)


def test_hf_mixtral_load_balancing_loss_of_a_balanced_router_is_k():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    lay, x = balanced_layer_input(8, 3)
    hf = load_balancing_loss_func((x @ lay.router.weight.T,), num_experts=8, top_k=2)
    assert abs(float(hf.detach()) - 2.0) < 1e-5


LOSS_COEFF = {"aux": "aux_loss_coeff", "seq_aux": "seq_aux_loss_coeff",
              "global_aux": "global_aux_loss_coeff", "z": "z_loss_coeff"}


@pytest.mark.parametrize("name", list(LOSS_COEFF))
def test_attached_loss_leaves_output_bitwise_and_adds_exactly_its_gradient(name):
    """With a loss coefficient the forward output is bitwise unchanged, the expert gradients are
    bitwise unchanged, and the router gradient grows by the loss's own gradient."""
    B, S, H, E, k, coeff = 2, 6, 16, 8, 2, 0.3
    plain = layer(hidden=H, num_experts=E, topk=k)
    lossy = layer(hidden=H, num_experts=E, topk=k, **{LOSS_COEFF[name]: coeff})
    lossy.load_state_dict(plain.state_dict())
    x = torch.randn(B, S, H, dtype=f64)
    dy = torch.randn(B, S, H, dtype=f64)
    y0, y1 = plain(x), lossy(x)
    assert torch.equal(y0, y1)
    y0.backward(dy)
    y1.backward(dy)
    for p0, p1 in zip(plain.experts.parameters(), lossy.experts.parameters()):
        assert torch.equal(p0.grad, p1.grad)

    w = plain.router.weight.detach().clone().requires_grad_()
    logits = x.reshape(-1, H) @ w.T
    _, chosen = ref_routing(logits.detach(), k=k, renormalize=True)
    p = torch.softmax(logits, dim=-1)
    if name in ("aux", "global_aux"):
        loss = ref_switch_loss(p, chosen, E, k)
    elif name == "seq_aux":
        loss = ref_seq_loss(p, chosen, B, S, E, k)
    else:
        loss = ref_z_loss_torch(logits)
    (coeff * loss).backward()
    torch.testing.assert_close(lossy.router.weight.grad - plain.router.weight.grad, w.grad,
                               rtol=1e-10, atol=1e-14)


# ----------------------------------------------------------------------------- config errors


def test_topk_above_num_experts_is_rejected_naming_both():
    with pytest.raises(ValueError, match=r"topk = 5 exceeds num_experts = 4"):
        MoEConfig(hidden=8, ffn=8, num_experts=4, topk=5)


def test_group_topk_above_num_groups_is_rejected_naming_both():
    with pytest.raises(ValueError, match=r"group_topk = 5 must be in 1\.\.num_groups = 4"):
        MoEConfig(hidden=8, ffn=8, num_experts=8, topk=5, num_groups=4, group_topk=5)


def test_num_groups_not_dividing_num_experts_is_rejected_naming_both():
    with pytest.raises(ValueError, match=r"num_groups = 3 must divide num_experts = 8"):
        MoEConfig(hidden=8, ffn=8, num_experts=8, topk=2, num_groups=3, group_topk=1)


def test_unknown_score_function_is_rejected_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"score_function = 'relu'; valid"):
        MoEConfig(hidden=8, ffn=8, num_experts=4, topk=2, score_function="relu")
