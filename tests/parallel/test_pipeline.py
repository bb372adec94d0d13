"""Pipeline parallelism: loss and every gradient equal one device (fp64) with gradient
accumulation over the same microbatches, for every schedule, over hypothesis-chosen folds."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshfold.mesh import FoldSpec
from meshfold.models import MoEConfig
from meshfold.parallel.pipeline import Pipeline, chunk_layers
from meshfold.models.transformer import MoETransformer, TransformerConfig
from meshfold.parallel.transformer import single_device_name
from meshfold.parallel.batch import shard_batch
from meshfold.testing.strategies import fold_specs
from meshfold.testing.worlds import cached_fold

TOL = dict(rtol=1e-9, atol=1e-11)


def _config(spec, aux, layers=4):
    moe = MoEConfig(hidden=16, ffn=2 * spec.etp, num_experts=8, topk=2, router_dtype=torch.float64,
                    shared_ffn=2 * spec.tp, seq_aux_loss_coeff=aux, global_aux_loss_coeff=aux)
    return TransformerConfig(vocab=32, hidden=16, layers=layers, heads=8, kv_heads=4, ffn=2 * spec.tp,
                             moe=moe, first_k_dense=1, qkv_bias=True)


def _reference(cfg, seed, tokens, targets, spec, microbatches):
    """One device, gradient accumulation: microbatch j is every dp rank's j-th slice of its rows,
    its balancing losses scaled by 1 / microbatches (test_accumulation: the gradients then do not
    depend on the microbatch count)."""
    torch.manual_seed(seed)
    ref = MoETransformer(cfg, dtype=torch.float64)
    for layer in ref.moe_layers():
        layer.balancing_scale = 1 / microbatches
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    B = tokens.shape[0]
    b = B // spec.dp
    mb = b // microbatches
    total = 0.0
    for j in range(microbatches):
        rows = torch.cat([torch.arange(d * b + j * mb, d * b + (j + 1) * mb) for d in range(spec.dp)])
        loss = ref.loss(tokens[rows], targets[rows]) * (rows.numel() / B)
        loss.backward()
        total += loss.item()
    return state, {n: p.grad for n, p in ref.named_parameters()}, total


def _run(rank, world_size, case, recompute="none", layers=4, evaluate=False, a2a_overlap=False, first_k_dense=1):
    """Checks the step against one device; returns what its turns saw (Pipeline.overlap_stats)."""
    spec, B, S, seed, schedule, virtual, microbatches, data_parallel, aux = case
    cfg = dataclasses.replace(_config(spec, aux, layers), first_k_dense=first_k_dense)
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, cfg.vocab, (B, S), generator=g)
    targets = torch.randint(0, cfg.vocab, (B, S), generator=g)
    state, ref_grads, ref_loss = _reference(cfg, seed, tokens, targets, spec, microbatches)

    model = MoETransformer(cfg, dtype=torch.float64)
    model.load_state_dict(state)
    pipe = Pipeline(model, cached_fold(spec), microbatches, schedule, virtual, data_parallel, recompute=recompute,
                    a2a_overlap=a2a_overlap)
    local_tokens, pos = shard_batch(tokens, spec, rank)
    local_targets, _ = shard_batch(targets, spec, rank)
    loss = pipe.step(local_tokens, local_targets, pos)
    torch.testing.assert_close(loss.item(), ref_loss, **TOL)

    if data_parallel == "allreduce":
        from meshfold.parallel.data_parallel import reduce_gradients

        for chunk in pipe.chunks:
            reduce_gradients(chunk)
    names = set()
    for name, p in pipe.named_parameters():
        name = single_device_name(name)
        names.add(name)
        torch.testing.assert_close(p.grad.full_tensor(), ref_grads[name], **TOL, msg=lambda m: f"{name}: {m}")
    # this rank holds exactly its chunks' layers
    layers = chunk_layers(cfg.layers, spec.pp * virtual)
    mine = {i for s in pipe.stage_ids for i in layers[s]}
    assert {int(n.split(".")[1]) for n in names if n.startswith("layers.")} == mine
    stats = pipe.overlap_stats()
    if evaluate:  # the same batch forward only: the same loss
        pipe.eval()
        torch.testing.assert_close(pipe.step(local_tokens, local_targets, pos, backward=False).item(), ref_loss, **TOL)
    return stats


@st.composite
def cases(draw, world_size):
    spec = draw(fold_specs(world_sizes=[world_size], pp=[2]).filter(lambda s: 4 % s.tp == 0))
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]))
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    microbatches = draw(st.sampled_from([2, 4]))
    B = spec.dp * microbatches
    split = 2 * spec.cp * spec.tp if spec.cp > 1 else spec.tp
    S = split * draw(st.integers(1, 2))
    return (spec, B, S, draw(st.integers(0, 10**6)), schedule, virtual, microbatches,
            draw(st.sampled_from(["fsdp", "allreduce"])), draw(st.sampled_from([0.0, 0.01])))


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [4, 8])
def test_pipeline_loss_and_grads_equal_single_device(worlds, world_size):
    world = worlds(world_size)

    @settings(max_examples=10 if world_size == 4 else 6, deadline=None)
    @given(cases(world_size))
    def check(case):
        world.run(_run, case)

    check()


@pytest.mark.multirank
@pytest.mark.parametrize("case", [
    (FoldSpec(4, pp=2, tp=2, ep=2), "1f1b", 1),                  # pp2 x tp2 | ep2 x edp1
    (FoldSpec(8, pp=2, dp=2, cp=2, ep=4), "interleaved-1f1b", 2),  # pp2 x dp2 x cp2 | ep4
])
def test_named_pipeline_layouts(worlds, case):
    spec, schedule, virtual = case
    S = 4 * spec.cp * spec.tp
    assert all(worlds(spec.world_size).run(_run, (spec, 2 * spec.dp, S, 3, schedule, virtual, 2, "fsdp", 0.01)))



@pytest.mark.multirank
@pytest.mark.parametrize("schedule, virtual", [("zbv", 2), ("dualpipev", 2), ("interleaved-zb", 2)])
@pytest.mark.parametrize("spec, microbatches, recompute", [
    (FoldSpec(4, pp=2, ep=2), 4, "full"),                    # pp2 x dp2 | pp2 x ep2, FSDP2
    (FoldSpec(4, pp=4, ep=1), 8, "selective"),               # pp4
])
def test_zero_bubble_schedules_equal_one_device(worlds, schedule, virtual, spec, microbatches, recompute):
    """The zero-bubble schedules (their backward split into input and weight gradients) give the
    single-device loss and gradients, which 1F1B gives too (test_named_pipeline_layouts): with
    MoE layers, FSDP2 and recomputation, on pp2 and pp4, in fp64; and their evaluation (a V
    layout's runs its own forward-only order) gives the same batch's loss."""
    S = 4 * spec.cp * spec.tp
    case = (spec, microbatches * spec.dp, S, 7, schedule, virtual, microbatches, "fsdp", 0.01)
    layers = 2 * spec.pp  # one block a chunk
    assert all(worlds(spec.world_size).run(_run, case, recompute, layers, True))


def _bias_counts_run(rank, world_size, spec, schedule, virtual):
    """Expert-bias counts of a train step, an evaluation, and a second train step, against the
    single-device counts of the same microbatches: each token counted once per training forward
    (torch.distributed.pipelining runs every stage once more to infer shapes at the first step
    and whenever it switches between train and eval; those runs must not count), and so are the
    step's routing metrics (``step_metrics``, over both microbatches of the step)."""
    cfg = _config(spec, 0.0)
    cfg.moe.expert_bias = True
    g = torch.Generator().manual_seed(5)
    B, S = 2 * spec.dp, 2 * spec.tp * (2 * spec.cp if spec.cp > 1 else 1)
    tokens = torch.randint(0, cfg.vocab, (B, S), generator=g)
    ref = MoETransformer(cfg, dtype=torch.float64, seed=3)
    ref.loss(tokens, tokens)  # the counts do not depend on how the batch is microbatched
    want = {i: b.mlp._bias_counts for i, b in ref.moe_blocks()}
    pipe = Pipeline(MoETransformer(cfg, dtype=torch.float64, device="meta", seed=3), cached_fold(spec), 2,
                    schedule, virtual)
    local, pos = shard_batch(tokens, spec, rank)
    pipe.step(local, local, pos)
    first = {i: b.mlp._bias_counts.clone() for i, b in pipe.moe_blocks()}
    steps = [{i: b.mlp.step_metrics()["tokens_per_expert"] for i, b in pipe.moe_blocks()}]
    pipe.eval()
    pipe.step(local, local, pos, backward=False)
    pipe.train()
    for layer in pipe.moe_layers():
        layer.reset_step()
    pipe.step(local, local, pos)
    steps.append({i: b.mlp.step_metrics()["tokens_per_expert"] for i, b in pipe.moe_blocks()})
    for i, b in pipe.moe_blocks():
        assert torch.equal(first[i], want[i]), f"layer {i}, step 1: {first[i].tolist()} != {want[i].tolist()}"
        for n, step in enumerate(steps, 1):
            assert torch.equal(step[i], want[i]), f"layer {i}, step {n}'s metrics: {step[i].tolist()}"
        assert torch.equal(b.mlp._bias_counts, 2 * want[i]), \
            f"layer {i}, after eval and step 2: {b.mlp._bias_counts.tolist()} != {(2 * want[i]).tolist()}"
    return True


@pytest.mark.multirank
@pytest.mark.parametrize("case", [
    (FoldSpec(4, pp=2, ep=2), "1f1b", 1),
    (FoldSpec(4, pp=2, tp=2, ep=2), "gpipe", 1),
    (FoldSpec(4, pp=2, ep=2), "interleaved-1f1b", 2),
    (FoldSpec(4, pp=2, ep=2), "zbv", 2),
])
def test_expert_bias_counts_each_training_forward_once(worlds, case):
    spec, schedule, virtual = case
    assert all(worlds(spec.world_size).run(_bias_counts_run, spec, schedule, virtual))


def test_chunks_are_contiguous_and_balanced():
    assert chunk_layers(5, 2) == [[0, 1], [2, 3, 4]]
    assert chunk_layers(4, 4) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="3 pipeline chunks .* only 2 layers"):
        chunk_layers(2, 3)


@pytest.mark.parametrize("kwargs, match", [
    (dict(microbatches=2, schedule="zero-bubble"), "schedule = 'zero-bubble'; valid"),
    (dict(microbatches=1, schedule="1f1b"), "microbatches = 1 < pp = 2"),
    (dict(microbatches=3, schedule="interleaved-1f1b", virtual=2), "not a multiple of pp = 2"),
    (dict(microbatches=2, schedule="1f1b", virtual=2), "interleaved schedules need virtual >= 2"),
    (dict(microbatches=2, schedule="interleaved-zb"), "interleaved schedules need virtual >= 2"),
    (dict(microbatches=2, schedule="zbv"), "V schedules hold exactly 2 chunks per rank"),
    (dict(microbatches=2, schedule="dualpipev", virtual=3), "V schedules hold exactly 2 chunks per rank"),
    (dict(microbatches=3, schedule="dualpipev", virtual=2), "microbatches = 3 < 2 pp = 4"),
    (dict(microbatches=2, tie=True), "tie_embeddings with pp > 1"),
])
def test_bad_pipeline_settings_raise_naming_the_value(kwargs, match):
    import types

    spec = FoldSpec(4, pp=2, tp=2, ep=2)
    cfg = _config(spec, 0.0)
    cfg.tie_embeddings = kwargs.pop("tie", False)
    with pytest.raises(ValueError, match=match):
        Pipeline(MoETransformer(cfg), types.SimpleNamespace(spec=spec), **kwargs)
