"""Gradient accumulation without pipeline parallelism: micro-batches 1, 2 and 4 of the same batch
give the same loss and every gradient (fp64), balancing losses included, on one device and on
hypothesis-drawn folds, with FSDP2 and all-reduce."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshfold.models import MoEConfig
from meshfold.models.transformer import MoETransformer, TransformerConfig
from meshfold.parallel.transformer import parallelize, single_device_name
from meshfold.testing.strategies import fold_specs
from meshfold.testing.worlds import cached_fold
from meshfold.parallel.pipeline import Pipeline, accumulate
from meshfold.train.loop import _global_loss

TOL = dict(rtol=1e-10, atol=1e-12)
# losses that average over the batch's tokens or sequences: their micro-batch means are the batch's
PER_TOKEN_LOSSES = dict(seq_aux_loss_coeff=0.05, z_loss_coeff=0.01)


def _single_device_grads(tokens, targets, microbatches, **losses):
    moe = MoEConfig(hidden=16, ffn=8, num_experts=8, topk=2, router_dtype=torch.float64, **losses)
    torch.manual_seed(0)
    model = MoETransformer(TransformerConfig(vocab=32, hidden=16, layers=2, heads=4, kv_heads=2, ffn=8, moe=moe),
                           dtype=torch.float64)
    counts = [float((t != -100).sum()) for t in targets.chunk(microbatches)]
    accumulate(model, tokens, targets, None, counts, backward=True)
    per_layer = [m.step_metrics() for m in model.moe_layers()]
    balancing = {k: float(sum(layer["losses"][k] for layer in per_layer)) for k in per_layer[0]["losses"]}
    assert len(balancing) == len(losses), balancing  # every configured loss was recorded
    balancing["tokens_per_expert"] = [layer["tokens_per_expert"].tolist() for layer in per_layer]
    return {n: p.grad for n, p in model.named_parameters()}, balancing


def test_balancing_gradients_do_not_grow_with_the_microbatch_count():
    """Each micro-batch's balancing losses enter the backward scaled by 1 / micro-batches (as in
    Megatron-Core): the gradients of micro-batches 1, 2 and 4 agree, with every balancing loss on.
    The batch is 4 copies of one sequence, so every micro-batch routes as the whole batch and the
    per-micro-batch Switch losses (aux, global_aux) equal the batch's; the step's recorded losses
    and tokens per expert (over all its micro-batches) are the batch's too."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32, (1, 12), generator=g).expand(4, -1)
    targets = torch.randint(0, 32, (1, 12), generator=g).expand(4, -1)
    losses = dict(aux_loss_coeff=0.1, global_aux_loss_coeff=0.1, **PER_TOKEN_LOSSES)
    ref, ref_losses = _single_device_grads(tokens, targets, 1, **losses)
    for m in (2, 4):
        got, got_losses = _single_device_grads(tokens, targets, m, **losses)
        for name, grad in got.items():
            torch.testing.assert_close(grad, ref[name], **TOL, msg=lambda msg: f"microbatches={m} {name}: {msg}")
        assert got_losses.pop("tokens_per_expert") == ref_losses["tokens_per_expert"], m
        assert got_losses == pytest.approx({k: v for k, v in ref_losses.items() if k != "tokens_per_expert"},
                                           rel=1e-12), (m, got_losses, ref_losses)


def _grads(rank, spec, seed, tokens, targets, microbatches, data_parallel):
    moe = MoEConfig(hidden=16, ffn=2 * spec.etp, num_experts=8, topk=2, router_dtype=torch.float64,
                    **PER_TOKEN_LOSSES)
    cfg = TransformerConfig(vocab=32, hidden=16, layers=2, heads=8, kv_heads=4, ffn=2 * spec.tp, moe=moe,
                            first_k_dense=1)
    torch.manual_seed(seed)
    model = MoETransformer(cfg, dtype=torch.float64)
    pipe = Pipeline(model, cached_fold(spec), microbatches, data_parallel=data_parallel)  # pp = 1: accumulation
    loss = _global_loss(pipe, tokens, targets, spec, rank, backward=True)
    pipe.reduce_gradients()
    return loss, {single_device_name(n): p.grad.full_tensor() for n, p in model.named_parameters()}


def _run(rank, world_size, case):
    spec, seed, data_parallel, ignore = case
    g = torch.Generator().manual_seed(seed)
    split = 2 * spec.cp * spec.tp if spec.cp > 1 else spec.tp
    B, S = 4 * spec.dp, 2 * split
    tokens = torch.randint(0, 32, (B, S), generator=g)
    targets = torch.randint(0, 32, (B, S), generator=g)
    if ignore:  # uneven counted tokens per micro-batch: the weighting must use the counts
        targets[torch.rand(B, S, generator=g) < 0.3] = -100
    whole, ref = _grads(rank, spec, seed, tokens, targets, 1, data_parallel)
    for m in (2, 4):
        loss, got = _grads(rank, spec, seed, tokens, targets, m, data_parallel)
        assert abs(loss - whole) <= 1e-12 * abs(whole), (m, loss, whole)
        for name, grad in got.items():
            torch.testing.assert_close(grad, ref[name], **TOL, msg=lambda msg: f"microbatches={m} {name}: {msg}")
    return True


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_microbatches_give_the_whole_batch_loss_and_gradients(worlds, world_size):
    world = worlds(world_size)

    @settings(max_examples=3)
    @given(fold_specs(world_sizes=[world_size], pp=[1]).filter(lambda s: 4 % s.tp == 0),
           st.integers(0, 10**6), st.sampled_from(["fsdp", "allreduce"]), st.booleans())
    def check(spec, seed, data_parallel, ignore):
        assert all(world.run(_run, (spec, seed, data_parallel, ignore)))

    check()
