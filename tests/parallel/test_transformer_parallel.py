"""The whole MoE transformer on folded layouts: loss and every gradient equal one device (fp64)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshfold.mesh import FoldSpec
from meshfold.models import MoEConfig
from meshfold.models.transformer import MoETransformer, TransformerConfig
from meshfold.parallel.moe import local_slices
from meshfold.parallel.transformer import full_state_dict, single_device_name, param_layouts, parallelize
from meshfold.parallel.data_parallel import grad_norm, reduce_gradients
from meshfold.parallel.batch import local_positions, shard_batch
from meshfold.testing.strategies import fold_specs
from meshfold.testing.worlds import cached_fold
from meshfold.testing.references import checkpoint_reads, reference_transformer

pytestmark = pytest.mark.multirank

TOL = dict(rtol=1e-9, atol=1e-11)


def _config(spec, qkv_bias, qk_norm, tie, aux):
    moe = MoEConfig(hidden=16, ffn=2 * spec.etp, num_experts=8, topk=2, router_dtype=torch.float64,
                    shared_ffn=2 * spec.tp if qkv_bias else 0, seq_aux_loss_coeff=aux,
                    global_aux_loss_coeff=aux)
    return TransformerConfig(vocab=32, hidden=16, layers=2, heads=8, kv_heads=4, ffn=2 * spec.tp,
                             moe=moe, first_k_dense=1, qkv_bias=qkv_bias, qk_norm=qk_norm,
                             tie_embeddings=tie)


def _run(rank, world_size, case, data_parallel="fsdp"):
    spec, B, S, seed, qkv_bias, qk_norm, tie, aux = case
    cfg = _config(spec, qkv_bias, qk_norm, tie, aux)
    ref, tokens, targets = reference_transformer(cfg, seed, B, S)

    model = MoETransformer(cfg, dtype=torch.float64)
    model.load_state_dict(ref.state_dict())
    parallelize(model, cached_fold(spec), data_parallel=data_parallel)

    # the single-device loss: mean cross-entropy + the attached balancing losses
    ref_loss = ref.loss(tokens, targets)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    local_tokens, pos = shard_batch(tokens, spec, rank)
    local_targets, _ = shard_batch(targets, spec, rank)
    loss = model.loss(local_tokens, local_targets, pos)
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), **TOL)  # balancing losses: in the grads
    reduce_gradients(model)
    got = {}
    for name, p in model.named_parameters():
        got[single_device_name(name)] = p.grad.full_tensor()
    assert set(got) == set(ref_grads)
    for name, grad in got.items():
        torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=lambda m: f"{name}: {m}")
    norm = grad_norm(model)
    ref_norm = torch.sqrt(sum(g_.double().square().sum() for g_ in ref_grads.values()))
    torch.testing.assert_close(norm, ref_norm, **TOL)
    full = full_state_dict(model)
    for name, t in ref.state_dict().items():
        torch.testing.assert_close(full[name], t, rtol=0, atol=0)
    with torch.no_grad():  # the forward's DTensor holds the global logits
        logits = model(local_tokens, pos)
        assert logits.device_mesh is model.folded.stage("attn")
        torch.testing.assert_close(logits.full_tensor(), ref(tokens), **TOL)
    return True


@st.composite
def cases(draw, world_size):
    spec = draw(fold_specs(world_sizes=[world_size], pp=[1]).filter(lambda s: 4 % s.tp == 0))
    B = spec.dp * draw(st.integers(1, 2))
    split = 2 * spec.cp * spec.tp if spec.cp > 1 else spec.tp
    S = split * draw(st.integers(1, 2))
    return (spec, B, S, draw(st.integers(0, 10**6)), draw(st.booleans()), draw(st.booleans()),
            draw(st.booleans()), draw(st.sampled_from([0.0, 0.01])))


DATA_PARALLEL = st.sampled_from(["fsdp", "allreduce"])


@pytest.mark.parametrize("world_size", [4, 8])
def test_transformer_loss_and_grads_equal_single_device(worlds, world_size):
    world = worlds(world_size)

    @settings(max_examples=8 if world_size == 4 else 6)
    @given(cases(world_size), DATA_PARALLEL)
    def check(case, data_parallel):
        world.run(_run, case, data_parallel)

    check()


@pytest.mark.parametrize("spec", [
    FoldSpec(4, tp=2, ep=4),            # tp2 x dp2 | ep4
    FoldSpec(4, cp=2, tp=2, ep=2, etp=2),  # cp2 x tp2 | ep2 x etp2
    FoldSpec(8, dp=2, cp=2, tp=2, ep=8),   # every attention dim at once | ep8
    FoldSpec(8, tp=2, ep=4),               # one local expert over edp2: FSDP2 shards its hidden dim
])
def test_named_layouts(worlds, spec):
    assert all(worlds(spec.world_size).run(_run, (spec, 2 * spec.dp, 4 * spec.cp * spec.tp, 7, True, True, False, 0.01)))


def _run_small_buckets(rank, world_size, case):
    from meshfold.parallel import data_parallel

    default = data_parallel.REDUCE_BUCKET_BYTES
    data_parallel.REDUCE_BUCKET_BYTES = 200  # a few parameters per bucket, large ones alone
    try:
        return _run(rank, world_size, case, data_parallel="allreduce")
    finally:  # the world's processes serve later tests too
        data_parallel.REDUCE_BUCKET_BYTES = default


def test_gradients_reduced_in_small_buckets_equal_single_device(worlds):
    """reduce_gradients cuts the gradients into many buckets and copies the sums back in place;
    the gradients still equal one device's (the other tests fit every gradient in one bucket)."""
    spec = FoldSpec(4, cp=2, dp=2, ep=2, etp=2)
    assert all(worlds(4).run(_run_small_buckets, (spec, 2 * spec.dp, 4 * spec.cp, 5, True, True, True, 0.01)))


def _saved_masks(rank, world_size, spec, S):
    """(saved [S/cp, S] tensors, distinct storages among them) over one folded loss forward."""
    cfg = _config(spec, False, False, False, 0.0)
    torch.manual_seed(0)
    model = parallelize(MoETransformer(cfg, dtype=torch.float64), cached_fold(spec))
    for block in model.layers:  # the generic path (positions outside the load-balanced layout)
        getattr(block.attn, "inner", block.attn).context.method = "gather"
    tokens = torch.randint(0, cfg.vocab, (2, S), generator=torch.Generator().manual_seed(1))
    local_tokens, pos = shard_batch(tokens, spec, rank)
    ptrs = []

    def pack(t):
        if tuple(t.shape) == (S // spec.cp, S):  # the mask; S chosen to match no other dim
            ptrs.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss(local_tokens, local_tokens, pos)
    loss.backward()
    return len(ptrs), len(set(ptrs))


@pytest.mark.parametrize("spec", [FoldSpec(2, cp=2, ep=2), FoldSpec(4, cp=2, tp=2, ep=4)])
def test_context_parallel_layers_share_one_mask(worlds, spec):
    """On the generic cp path (K/V all-gathered, masked by position; the ring needs no mask) every
    layer's SDPA saves the [S/cp, S] causal mask for backward; the layers of a forward share one
    (16 MiB a layer at S = 2048, cp = 2, fp32 before). Under tp the layers share one tp gather of
    their positions, but each gathers its keys' positions over cp anew, so the mask is shared by
    value, not by tensor identity."""
    results = worlds(spec.world_size).run(_saved_masks, spec, 24)
    assert all(saved == 2 and distinct == 1 for saved, distinct in results), results


def test_cp_positions_are_load_balanced_mirrored_chunks():
    spec = FoldSpec(4, cp=2, tp=2)
    parts = [local_positions(16, spec, r).tolist() for r in range(4)]
    # cp rank 0 holds chunks 0 and 3 (of 4 chunks of 4), split over its two tp ranks
    assert parts[0] + parts[1] == [0, 1, 2, 3, 12, 13, 14, 15]
    assert parts[2] + parts[3] == [4, 5, 6, 7, 8, 9, 10, 11]
    assert sorted(p for part in parts for p in part) == list(range(16))


def _load_folded(rank, world_size, path, spec):
    from meshfold.interop.hf import from_pretrained

    with checkpoint_reads() as read:
        folded = from_pretrained(path, mesh=cached_fold(spec), dtype=torch.float64)
    single = from_pretrained(path, dtype=torch.float64)
    # this rank read exactly the elements of its own TP/EP shards, nothing more (FSDP2 then keeps
    # its dp part of them)
    shards = [local_slices(p.shape, mesh, placements)
              for (mesh, placements), p in zip(param_layouts(single, cached_fold(spec)).values(), single.parameters())]
    assert sum(read) == sum(math.prod(s.stop - s.start for s in sl) for sl in shards)
    tokens = torch.randint(0, single.cfg.vocab, (2 * spec.dp, 8 * spec.cp * spec.tp),
                           generator=torch.Generator().manual_seed(0))
    local, pos = shard_batch(tokens, spec, rank)
    c = spec.coords(rank)["attn"]
    b = tokens.shape[0] // spec.dp
    expected = single(tokens)[c["dp"] * b:(c["dp"] + 1) * b][:, pos]
    torch.testing.assert_close(folded.local_logits(local, pos), expected, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(folded(local, pos).full_tensor(), single(tokens), rtol=1e-9, atol=1e-9)
    # every parameter is a shard of the checkpoint's tensor: the full tensors equal it
    full = full_state_dict(folded)
    for name, t in single.state_dict().items():
        torch.testing.assert_close(full[name], t.to(full[name].dtype), rtol=0, atol=0)
    return True


@pytest.mark.parametrize("spec", [FoldSpec(4, tp=2, ep=4), FoldSpec(4, cp=2, ep=2, etp=2)])
def test_hf_checkpoint_loads_folded_from_slices(worlds, tmp_path, spec):
    from meshfold.models.configs import get_config
    from meshfold.interop.hf import save_pretrained

    torch.manual_seed(0)
    save_pretrained(MoETransformer(get_config("tiny-mixtral")), tmp_path)
    assert all(worlds(4).run(_load_folded, str(tmp_path), spec))


@pytest.mark.parametrize("name, moe_ffn, fold, message", [
    ("tiny-mixtral", None, dict(world_size=8, tp=8), "heads = 4 is not divisible by tp = 8"),
    ("tiny-mixtral", None, dict(world_size=8, ep=8), "num_experts = 4 is not divisible by ep = 8"),
    ("tiny-qwen2-moe", None, dict(world_size=8, tp=4), "kv_heads = 2 is not divisible by tp = 4"),
    ("tiny-qwen2-moe", 24, dict(world_size=16, etp=16), "ffn = 24 is not divisible by etp = 16"),
    ("tiny-qwen2-moe", None, dict(world_size=8, tp=2, etp=2, ep=2), None),
    ("tiny-qwen2-moe", 24, dict(world_size=8, ep=8, etp=1), None),
])
def test_check_fold_needs_no_mesh_and_names_the_size(name, moe_ffn, fold, message):
    """The divisibility checks parallelize runs, on a config and a FoldSpec alone (what meshfold
    train runs before spawning); a fold that divides passes."""
    import dataclasses

    from meshfold.models.configs import CONFIGS
    from meshfold.parallel.transformer_plan import check_fold

    cfg = CONFIGS[name]
    if moe_ffn is not None:
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, ffn=moe_ffn))
    if message is None:
        check_fold(cfg, FoldSpec(**fold))
    else:
        with pytest.raises(ValueError, match=message):
            check_fold(cfg, FoldSpec(**fold))
