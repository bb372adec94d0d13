"""meshfold's MoELayer against Hugging Face transformers' sparse MoE blocks, same weights.

Shapes: B = sequences, S = sequence length, T = B*S tokens, H = hidden, E = experts,
I = expert ffn, Fs = shared-expert ffn.

transformers 5.x keeps experts fused: ``experts.gate_up_proj`` [E, 2I, H] (gate rows first, then
up rows; the eager forward does ``linear(x, gate_up_proj[e]).chunk(2)`` -> gate, up) and
``experts.down_proj`` [E, H, I]; the router is ``gate.weight`` [E, H]. meshfold keeps
``w_gate_up`` [E, H, 2, I] (0 = gate, 1 = up) and ``w_down`` [E, I, H]. These in-memory conversions of
fused tensors stay here on purpose, as a check independent of meshfold.interop.hf (which reads
per-expert checkpoint keys).

Both HF routers take softmax in fp32 (``logits.float()`` / ``softmax(dtype=float)``) even for an
fp64 model, so in fp64 the routing weights agree only to fp32 rounding (rtol 1e-6); the logits
themselves, both an fp64 ``F.linear``, agree to fp64 rounding.
"""

import pytest
import torch
from transformers import MixtralConfig, Qwen2MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

from meshfold.models import MoEConfig, MoELayer

H, I, FS, E, K = 32, 24, 40, 8, 2
TOL = {torch.float64: dict(rtol=1e-6, atol=1e-7), torch.float32: dict(rtol=2e-5, atol=2e-6)}


# ----------------------------------------------------------------------------- conversion


def experts_from_hf(gate_up_proj, down_proj):
    """HF fused experts -> meshfold: [E, 2I, H] -> w_gate_up [E, H, 2, I]; [E, H, I] -> w_down
    [E, I, H]."""
    n, two_i, h = gate_up_proj.shape
    w_gate_up = gate_up_proj.reshape(n, 2, two_i // 2, h).permute(0, 3, 1, 2)
    return w_gate_up, down_proj.transpose(1, 2)


def shared_from_hf(mlp, gate_linear):
    """HF Qwen2MoeMLP (gate/up/down nn.Linear) + shared_expert_gate -> meshfold SharedExpert
    tensors: w_gate_up [H, 2, Fs], w_down [Fs, H], gate [1, H]."""
    w_gate_up = torch.stack([mlp.gate_proj.weight.T, mlp.up_proj.weight.T], dim=1)
    return w_gate_up, mlp.down_proj.weight.T, gate_linear.weight


def load_from_hf(layer, block):
    with torch.no_grad():
        layer.router.weight.copy_(block.gate.weight)
        w1, w2 = experts_from_hf(block.experts.gate_up_proj, block.experts.down_proj)
        layer.experts.w_gate_up.copy_(w1)
        layer.experts.w_down.copy_(w2)
        if getattr(block, "shared_expert", None) is not None:
            s1, s2, g = shared_from_hf(block.shared_expert, block.shared_expert_gate)
            layer.shared.w_gate_up.copy_(s1)
            layer.shared.w_down.copy_(s2)
            layer.shared.gate.copy_(g)


def randomize(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * p.shape[-1] ** -0.5)


# ----------------------------------------------------------------------------- blocks


def mixtral(dtype, impl="eager"):
    cfg = MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K,
                        router_jitter_noise=0.0, experts_implementation=impl)
    block = MixtralSparseMoeBlock(cfg).to(dtype)
    randomize(block, 0)
    ours = MoELayer(MoEConfig(hidden=H, ffn=I, num_experts=E, topk=K, score_function="softmax",
                              pre_softmax=True, renormalize=True, router_dtype=dtype), dtype=dtype)
    load_from_hf(ours, block)
    return block, ours


def qwen2_moe(dtype, norm_topk_prob):
    cfg = Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=I, shared_expert_intermediate_size=FS,
                         num_experts=E, num_experts_per_tok=K, norm_topk_prob=norm_topk_prob,
                         experts_implementation="eager")
    block = Qwen2MoeSparseMoeBlock(cfg).to(dtype)
    randomize(block, 1)
    ours = MoELayer(MoEConfig(hidden=H, ffn=I, num_experts=E, topk=K, score_function="softmax",
                              pre_softmax=True, renormalize=norm_topk_prob, shared_ffn=FS,
                              shared_kind="qwen2", router_dtype=dtype), dtype=dtype)
    load_from_hf(ours, block)
    return block, ours


def tokens(dtype, B=3, S=10, seed=2):
    return torch.randn(B, S, H, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def assert_same_routing(block, ours, x):
    """Same logits, same chosen experts (as sets per token), same weights."""
    x_TH = x.reshape(-1, H)
    hf_logits, hf_w, hf_idx = block.gate(x_TH)
    probs, experts, logits = ours.router(x_TH)
    torch.testing.assert_close(logits, hf_logits, rtol=1e-12 if x.dtype == torch.float64 else 1e-6, atol=0)
    o_ours, o_hf = experts.argsort(1), hf_idx.argsort(1)
    assert torch.equal(experts.gather(1, o_ours), hf_idx.gather(1, o_hf))
    torch.testing.assert_close(probs.gather(1, o_ours), hf_w.to(probs.dtype).gather(1, o_hf), **TOL[x.dtype])


# HF's grouped_mm experts call F.grouped_mm, which has no fp64 kernel on CPU
@pytest.mark.parametrize("dtype, impl", [(torch.float64, "eager"), (torch.float32, "eager"),
                                         (torch.float32, "grouped_mm")])
def test_mixtral_block_and_moe_layer_agree(dtype, impl):
    block, ours = mixtral(dtype, impl)
    x = tokens(dtype)
    assert_same_routing(block, ours, x)
    torch.testing.assert_close(ours(x), block(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_qwen2_moe_block_with_gated_shared_expert_and_moe_layer_agree(dtype, norm_topk_prob):
    block, ours = qwen2_moe(dtype, norm_topk_prob)
    x = tokens(dtype)
    assert_same_routing(block, ours, x)
    torch.testing.assert_close(ours(x), block(x), **TOL[dtype])


def test_mixtral_gradients_agree_after_conversion():
    """Backward through both: input and weight gradients match once converted like the weights.

    HF's fp32 routing weights (relative error ~6e-8) enter every weight-gradient term, summed
    over 30 tokens, so the fp64 weight gradients agree to an absolute 1e-6."""
    grad_tol = dict(rtol=1e-6, atol=1e-6)
    block, ours = mixtral(torch.float64)
    x = tokens(torch.float64)
    dy = tokens(torch.float64, seed=3)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    block(xa).backward(dy)
    ours(xb).backward(dy)
    torch.testing.assert_close(xb.grad, xa.grad, **TOL[torch.float64])
    g1, g2 = experts_from_hf(block.experts.gate_up_proj.grad, block.experts.down_proj.grad)
    torch.testing.assert_close(ours.experts.w_gate_up.grad, g1, **grad_tol)
    torch.testing.assert_close(ours.experts.w_down.grad, g2, **grad_tol)
    torch.testing.assert_close(ours.router.weight.grad, block.gate.weight.grad, **grad_tol)
