"""Multi-token prediction on one device, against a plain reimplementation of DeepSeek-V3's section 2.2.

The reference below takes the whole token chunk ``t_0 .. t_S`` (the model sees ``t_0 .. t_{S-1}``
and next-token targets) and follows the paper's formulation: depth k runs on a sequence *one
shorter* than depth k - 1 (positions ``0 .. S-1-k``), reads ``t_{i+k}`` straight from the chunk
and the previous depth's normed output (depth 1: the main head's input), and predicts
``t_{i+k+1}``; norms, the 2H -> H projection, the head and the cross-entropy are
written out by hand. The model instead keeps every depth at length S and masks with -100
(:func:`meshfold.models.mtp.mtp_targets`); causal attention makes the two agree. Only the
transformer blocks themselves (tested elsewhere) are shared.
"""

import pytest
import torch

from meshfold.models.config import MoEConfig
from meshfold.models.mla import MLAConfig
from meshfold.models.mtp import depth_inputs, mtp_targets
from meshfold.models.transformer import MoETransformer, TransformerConfig
from meshfold.testing.equivalence import perturb_constants

V, H, S = 40, 16, 12


def _cfg(mla: bool, depth: int, **kw) -> TransformerConfig:
    moe = MoEConfig(hidden=H, ffn=8, num_experts=4, topk=2)
    extra = dict(mla=MLAConfig(q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                               v_head_dim=4)) if mla else {}
    return TransformerConfig(**{**dict(vocab=V, hidden=H, layers=2, heads=2, ffn=24, moe=moe, first_k_dense=1,
                                       mtp_depth=depth, mtp_loss_weight=0.25), **extra, **kw})


def _norm(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _ce(logits, targets):
    return -logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1).mean()


def reference(model: MoETransformer, chunk: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(main loss, [L_1 .. L_D]) of ``chunk`` [B, S + 1] by the paper's truncating formulation."""
    cfg, eps = model.cfg, model.cfg.norm_eps
    w_head = model.head.weight
    tokens = chunk[:, :-1]
    h = model.embed.weight[tokens]
    for block in model.layers:
        h = block(h, torch.arange(h.shape[1]))
    h = _norm(h, model.norm.weight, eps)
    main = _ce(h @ w_head.T, chunk[:, 1:])
    losses = []
    for k, depth in enumerate(model.mtp, start=1):
        n = S - k  # positions i = 0 .. S-1-k: t_{i+k+1} exists
        e = model.embed.weight[chunk[:, k:k + n]]  # Emb(t_{i+k})
        x = torch.cat([_norm(e, depth.emb_norm.weight, eps), _norm(h[:, :n], depth.hidden_norm.weight, eps)], -1)
        h = _norm(depth.block(x @ depth.proj.weight.T, torch.arange(n)), depth.head_norm.weight, eps)
        logits = h @ w_head.T
        losses.append(_ce(logits, chunk[:, k + 1:k + 1 + n]))
    return main, losses


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
def test_mtp_loss_and_gradients_equal_the_papers_formulation(mla):
    torch.manual_seed(0)
    model = MoETransformer(_cfg(mla, depth=2), dtype=torch.float64, seed=1)
    perturb_constants(model, seed=2)
    chunk = torch.randint(0, V, (3, S + 1))
    parts = model.loss_parts(chunk[:, :-1], chunk[:, 1:])
    grads = torch.autograd.grad(parts["loss"], list(model.parameters()), allow_unused=True)

    main, depth = reference(model, chunk)
    want = main + 0.25 * sum(depth) / len(depth)
    torch.testing.assert_close(parts["main"], main.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(parts["mtp_depths"], torch.stack(depth).detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(parts["loss"], want, rtol=1e-12, atol=1e-12)
    ref_grads = torch.autograd.grad(want, list(model.parameters()), allow_unused=True)
    for (name, _), g, r in zip(model.named_parameters(), grads, ref_grads):
        assert (g is None) == (r is None), name
        if g is not None:
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


def test_every_mtp_parameter_gets_a_gradient():
    model = MoETransformer(_cfg(False, depth=2), dtype=torch.float64, seed=1)
    chunk = torch.randint(0, V, (2, S + 1))
    model.loss(chunk[:, :-1], chunk[:, 1:]).backward()
    missing = [n for n, p in model.named_parameters() if n.startswith("mtp.") and p.grad is None]
    assert not missing and len(model.mtp) == 2


def test_depth_inputs_read_k_ahead_and_drop_unknown_tokens():
    """Depth k reads t_{i+k} = targets[i+k-1] and predicts targets[i+k]; past the end, or where the
    token it reads is masked (-100, unknown), it reads id 0 and its target is -100."""
    targets = torch.tensor([[11, 12, -100, 14, 15]])
    full = mtp_targets(targets, 2)
    assert full[..., 0].tolist() == [[11, 12, -100, 14, 15]]
    read, want = depth_inputs(full, 1)
    assert read.tolist() == [[11, 12, 0, 14, 15]] and want.tolist() == [[12, -100, -100, 15, -100]]
    read, want = depth_inputs(full, 2)
    assert read.tolist() == [[12, 0, 14, 15, 0]] and want.tolist() == [[-100, -100, 15, -100, -100]]


def test_mtp_leaves_the_main_logits_and_loss_unchanged():
    base = MoETransformer(_cfg(False, depth=0), dtype=torch.float64, seed=1)
    mtp = MoETransformer(_cfg(False, depth=1), dtype=torch.float64, seed=1)
    chunk = torch.randint(0, V, (2, S + 1))
    torch.testing.assert_close(mtp(chunk[:, :-1]), base(chunk[:, :-1]), rtol=0, atol=0)
    torch.testing.assert_close(mtp.loss_parts(chunk[:, :-1], chunk[:, 1:])["main"],
                               base.loss(chunk[:, :-1], chunk[:, 1:]).detach(), rtol=0, atol=0)


@pytest.mark.parametrize("field, value", [("mtp_depth", -1), ("mtp_depth", 1.5), ("mtp_loss_weight", -0.1)])
def test_bad_mtp_settings_are_named(field, value):
    with pytest.raises(ValueError, match=f"{field} .*{value}"):
        _cfg(False, depth=0, **{field: value})


def test_an_mtp_depth_costs_a_layer_a_projection_and_a_head_in_the_flop_count():
    import dataclasses

    from meshfold.train.flops import train_flops_per_step

    base = _cfg(False, depth=0)
    B, s = 4, 32
    one_more_layer = train_flops_per_step(dataclasses.replace(base, layers=3), B, s) - train_flops_per_step(base, B, s)
    extra = one_more_layer + 3 * (2 * B * s * (2 * H) * H + 2 * B * s * H * V)
    got = train_flops_per_step(_cfg(False, depth=1), B, s) - train_flops_per_step(base, B, s)
    assert got == extra
