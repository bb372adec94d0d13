"""Gradient accumulation without pipeline parallelism: micro-batches 1, 2 and 4 of the same batch
give the same loss and every gradient (fp64), balancing losses included, on one device and on
hypothesis-drawn folds, with FSDP2 and all-reduce, and with multi-token prediction's depths."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshfold.mesh import FoldSpec
from meshfold.models import MoEConfig
from meshfold.models.mtp import mtp_targets
from meshfold.models.transformer import MoETransformer, TransformerConfig
from meshfold.parallel.transformer import parallelize, single_device_name
from meshfold.testing.strategies import fold_specs
from meshfold.testing.worlds import cached_fold
from meshfold.parallel.pipeline import Pipeline, accumulate, local_microbatch_counts
from meshfold.train.loop import _global_loss, _global_loss_parts

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


def _mtp_step(tokens, targets_bsd, microbatches):
    """(loss, parts, gradients) of one accumulated step of an MTP model with D = targets' columns - 1."""
    moe = MoEConfig(hidden=16, ffn=8, num_experts=4, topk=2, router_dtype=torch.float64, **PER_TOKEN_LOSSES)
    cfg = TransformerConfig(vocab=32, hidden=16, layers=2, heads=4, kv_heads=2, ffn=8, moe=moe, moe_every=2,
                            mtp_depth=targets_bsd.shape[-1] - 1, mtp_loss_weight=0.3)
    model = MoETransformer(cfg, dtype=torch.float64, seed=1)
    counts = local_microbatch_counts(targets_bsd, microbatches).tolist()  # one device: nothing to all-reduce
    parts: dict = {}
    loss = accumulate(model, tokens, targets_bsd, None, counts, backward=True, parts=parts)
    return loss, parts, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("masked", [False, True], ids=["corpus", "masked"])
def test_microbatches_give_the_whole_batch_mtp_loss_and_gradients(depth, masked):
    """Micro-batches 2 and 4 give the whole batch's objective, its main and per-depth MTP parts and
    every gradient (fp64). Each micro-batch's term k is weighted by its share of the batch's
    term-k positions: in corpus batches (no -100) every row counts S - k depth-k positions, so
    that share is its share of main targets; with -100 targets the two differ (a depth-k position
    needs two known targets), and a micro-batch may hold no depth-2 position at all."""
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 32, (4, 12), generator=g)
    targets = torch.randint(0, 32, (4, 12), generator=g)
    if masked:
        targets[torch.rand(4, 12, generator=g) < 0.4] = -100
        targets[3, 1::2] = -100  # the last micro-batch of 4: no two known targets in a row
    targets_bsd = mtp_targets(targets, depth)
    whole, whole_parts, ref = _mtp_step(tokens, targets_bsd, 1)
    for m in (2, 4):
        loss, parts, got = _mtp_step(tokens, targets_bsd, m)
        assert loss == pytest.approx(whole, rel=1e-12), m
        for name in ("main", "mtp", "mtp_depths"):
            torch.testing.assert_close(parts[name], whole_parts[name], **TOL, msg=lambda msg: f"{m} {name}: {msg}")
        for name, grad in got.items():
            torch.testing.assert_close(grad, ref[name], **TOL, msg=lambda msg: f"microbatches={m} {name}: {msg}")


def _mtp_fold_step(rank, spec, tokens, targets, microbatches, data_parallel):
    moe = MoEConfig(hidden=16, ffn=4, num_experts=4, topk=2, router_dtype=torch.float64, **PER_TOKEN_LOSSES)
    cfg = TransformerConfig(vocab=32, hidden=16, layers=2, heads=4, kv_heads=2, ffn=8, moe=moe, moe_every=2,
                            mtp_depth=2, mtp_loss_weight=0.3)
    model = MoETransformer(cfg, dtype=torch.float64, seed=1)
    pipe = Pipeline(model, cached_fold(spec), microbatches, data_parallel=data_parallel)  # pp = 1: accumulation
    loss, parts = _global_loss_parts(pipe, tokens, targets, spec, rank, True, mtp_depth=2)
    pipe.reduce_gradients()
    return loss, parts, {single_device_name(n): p.grad.full_tensor() for n, p in model.named_parameters()}


def _run_mtp(rank, world_size, spec, data_parallel):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 32, (8, 8), generator=g)
    targets = torch.randint(0, 32, (8, 8), generator=g)
    targets[torch.rand(8, 8, generator=g) < 0.4] = -100
    whole, whole_parts, ref = _mtp_fold_step(rank, spec, tokens, targets, 1, data_parallel)
    for m in (2, 4):
        loss, parts, got = _mtp_fold_step(rank, spec, tokens, targets, m, data_parallel)
        assert loss == pytest.approx(whole, rel=1e-12), m
        for name, value in parts.items():  # the main loss, mtp_loss and the per-depth mtp_losses
            assert value == pytest.approx(whole_parts[name], rel=1e-12), (m, name, value, whole_parts[name])
        for name, grad in got.items():
            torch.testing.assert_close(grad, ref[name], **TOL, msg=lambda msg: f"microbatches={m} {name}: {msg}")
    return True


@pytest.mark.multirank
@pytest.mark.parametrize("spec, data_parallel", [(FoldSpec(4, dp=2, tp=2, ep=2), "fsdp"),
                                                 (FoldSpec(4, dp=2, cp=2, ep=4), "allreduce")],
                         ids=["dp2tp2-ep2-fsdp", "dp2cp2-ep4-allreduce"])
def test_microbatches_give_the_whole_batch_mtp_loss_and_gradients_on_folds(worlds, spec, data_parallel):
    """As above on a fold, through the training loop's step with masked targets: each micro-batch's
    per-term counts are summed over the ranks (one all-reduce) before any of its forwards."""
    assert all(worlds(4).run(_run_mtp, spec, data_parallel))
