"""``train.compile``: compiled training computes what eager training computes, on a folded layout,
and compiles each graph once (no graph breaks, no recompiles after the first step)."""

import pytest
import torch
from torch.distributed.tensor import DTensor

from meshfold.mesh import FoldSpec
from meshfold.models import MoEConfig
from meshfold.models.transformer import MoETransformer, TransformerConfig
from meshfold.parallel.compile import compile_model, compiled_hooks, swiglu_mlp, uncompile_model
from meshfold.parallel.pipeline import Pipeline
from meshfold.parallel.transformer import parallelize
from meshfold.models.experts import shared_expert_ffn
from meshfold.testing.worlds import cached_fold
from meshfold.train.loop import _global_loss

F64 = torch.float64
SPEC = FoldSpec(2, tp=2, ep=2)  # attn tp2 | moe ep2: the experts folded over the tp ranks


def _model(spec):
    """Two layers (a dense SwiGLU MLP, then an MoE layer) in fp64, FSDP2, with sequence parallelism:
    five RMSNorms of one shape, two RoPE calls, one dense MLP."""
    moe = MoEConfig(hidden=16, ffn=8, num_experts=4, topk=2)
    cfg = TransformerConfig(vocab=32, hidden=16, layers=2, heads=4, kv_heads=2, ffn=8 * spec.tp, moe=moe,
                            first_k_dense=1)
    torch.manual_seed(0)
    return parallelize(MoETransformer(cfg, dtype=F64), cached_fold(spec))


def _grads(model):
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            for n, p in model.named_parameters()}


def _train(rank, world_size):
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g))
               for _ in range(3)]
    runs = {}
    before = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    for compiled in (False, True):
        model = _model(SPEC)
        hooked = compile_model(model) if compiled else []
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, grads, graphs = [], [], []
        for tokens, targets in batches:
            losses.append(_global_loss(Pipeline.laid_out(model, cached_fold(SPEC)), tokens, targets, SPEC, rank,
                                       backward=True))
            grads.append(_grads(model))
            opt.step()
            opt.zero_grad(set_to_none=True)
            graphs.append((counters["stats"]["unique_graphs"] - before[0],
                           sum(counters["graph_break"].values()) - before[1]))
        runs[compiled] = losses, grads, graphs, hooked
    eager, compiled = runs[False], runs[True]
    for step in range(3):
        # fp64 throughout: compiled and eager differ only in the order of a few sums
        assert abs(eager[0][step] - compiled[0][step]) <= 1e-12 * abs(eager[0][step]), (step, eager[0], compiled[0])
        for name, want in eager[1][step].items():
            torch.testing.assert_close(compiled[1][step][name], want, rtol=1e-10, atol=1e-12,
                                       msg=lambda m: f"step {step + 1}, {name}: {m}")
    return compiled[3], compiled[2]


@pytest.mark.slow
@pytest.mark.multirank
def test_compiled_training_matches_eager_and_compiles_once(worlds):
    """Three AdamW steps on attn tp2 | moe ep2 (FSDP2, sequence parallelism): losses and every
    gradient equal eager training's to 1e-10 (fp64), and after the first step no graph is traced
    again; each kind of hook is one graph shared by all its modules (five norms, one graph)."""
    # inductor's first compile of three graphs (a cold cache, as on a fresh CI machine) takes over a
    # minute on two loaded cores: more than the session world's default 60 s for one run
    for hooked, graphs in worlds(2).run(_train, timeout=300):
        assert hooked == ["layers.0.attn_norm", "layers.0.attn", "layers.0.mlp_norm", "layers.0.mlp",
                          "layers.1.attn_norm", "layers.1.attn", "layers.1.mlp_norm", "layers.1.mlp", "norm"]
        first, *later = graphs
        assert all(g == first for g in later), graphs  # no recompile, no graph break after warm-up
        assert first[1] == 0, graphs  # no graph break at all
        # norm, RoPE, dense MLP, and the MoE layer's three row loops (weighted and plain row sums,
        # the combine's gradients): one graph each, not one per layer
        assert first[0] <= 6, graphs


def test_compile_hooks_are_set_from_outside_and_removed():
    """compile_model changes no parameter name or class, sets one shared function per kind, and
    uncompile_model restores the eager forward."""
    cfg = TransformerConfig(vocab=32, hidden=16, layers=2, heads=4, kv_heads=2, ffn=8,
                            moe=MoEConfig(hidden=16, ffn=8, num_experts=4, topk=2), first_k_dense=1)
    model = MoETransformer(cfg, dtype=F64, device="meta")
    names = [n for n, _ in model.named_parameters()]
    compile_model(model)
    assert [n for n, _ in model.named_parameters()] == names
    assert model.layers[0].attn_norm.norm is model.norm.norm  # one compiled function for all norms
    assert len(compiled_hooks(model)) == 9  # 8 compiled functions and the MoE layer's fused_rows
    assert model.layers[1].mlp.fused_rows and not type(model.layers[1].mlp).fused_rows
    uncompile_model(model)
    assert compiled_hooks(model) == [] and "norm" not in model.norm.__dict__
    assert not model.layers[1].mlp.fused_rows


def test_plain_swiglu_mlp_matches_the_eager_one():
    """The compiler's SwiGLU (plain torch ops) equals the eager MLP's (hand-written backward) in fp64."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, dtype=F64, generator=g, requires_grad=True)
    w1 = torch.randn(16, 2, 8, dtype=F64, generator=g, requires_grad=True)
    w2 = torch.randn(8, 16, dtype=F64, generator=g, requires_grad=True)
    outs = []
    for fn in (shared_expert_ffn, swiglu_mlp):
        y = fn(x, w1, w2)
        outs.append((y, *torch.autograd.grad(y.square().sum(), (x, w1, w2))))
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
