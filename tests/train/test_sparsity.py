"""Tile-wise pruning (meshfold.train.sparsity): schedule, global threshold, no regrowth, moments, masks.

Group used below: an expert weight [E=4, K=16, N=16] and a TileSparseLinear [K=16, N=32], tiles
8 x 8, so 4*2*2 + 2*4 = 24 tiles and every stage of (0.25, 0.5, 0.75) is a whole number of tiles.
"""

import pytest
import torch

from meshfold.kernels import expand_tile_mask, grouped_mm
from meshfold.mesh import FoldSpec
from meshfold.train.sparsity import ExpertSparsity, TilePruner, TileSparseLinear, global_prune, mask_weight_
from meshfold.kernels import check_etp_alignment
from meshfold.testing.worlds import cached_fold

TILE = (8, 8)


def make_group(config, seed=0):
    """(experts weight, experts mask, linear layer, pruner, optimizer, loss function)."""
    torch.manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(4, 16, 16, dtype=torch.float64) / 4)  # [E, K, N]
    mask = config.new_mask(4, 16, 16)
    linear = TileSparseLinear(16, 32, tile=config.tile, dtype=torch.float64)
    opt = torch.optim.AdamW([w, *linear.parameters()], lr=1e-2, weight_decay=0.1)
    pruner = TilePruner({"experts": (w, mask), "linear": (linear.weight, linear.tile_mask)}, config, opt)
    x = torch.randn(12, 16, dtype=torch.float64)
    offsets = torch.tensor([3, 3, 9, 12], dtype=torch.int32)

    def loss_fn():
        h = grouped_mm(x, w, offsets, tile_mask=mask)  # [12, 16]
        return linear(h).pow(2).mean()

    return w, mask, linear, pruner, opt, loss_fn


def train_step(pruner, opt, loss_fn, step):
    opt.zero_grad()
    loss_fn().backward()
    pruner.accumulate()
    pruned = pruner.step(step)
    opt.step()
    return pruned


def test_schedule_reaches_each_stage_sparsity_and_trains_in_between():
    config = ExpertSparsity(tile=TILE, schedule=(0.25, 0.5, 0.75), start_step=2, steps_per_stage=3)
    *_, pruner, opt, loss_fn = make_group(config)
    seen = {}
    for step in range(10):
        if train_step(pruner, opt, loss_fn, step):
            seen[step] = pruner.sparsity()
    assert seen == {2: 0.25, 5: 0.5, 8: 0.75}
    assert [config.target_at(s) for s in (0, 1, 2, 4, 5, 8, 100)] == [0.0, 0.0, 0.25, 0.25, 0.5, 0.75, 0.75]


def test_pruned_tiles_never_regrow_even_when_their_weights_return():
    config = ExpertSparsity(tile=TILE, score="magnitude")
    w, mask, linear, pruner, *_ = make_group(config)
    pruner.prune_to(0.5)
    before = {"experts": mask.clone(), "linear": linear.tile_mask.clone()}
    with torch.no_grad():  # make every pruned weight the largest in the group
        w.add_(100 * ~expand_tile_mask(mask, 16, 16))
    pruner.prune_to(0.75)
    assert not torch.any(mask & ~before["experts"])
    assert not torch.any(linear.tile_mask & ~before["linear"])
    assert pruner.sparsity() == 0.75


def test_optimizer_moments_of_newly_pruned_tiles_are_zeroed():
    config = ExpertSparsity(tile=TILE, start_step=3, schedule=(0.5,))
    w, mask, _, pruner, opt, loss_fn = make_group(config)
    for step in range(4):
        train_step(pruner, opt, loss_fn, step)
    keep = expand_tile_mask(mask, 16, 16)
    state = opt.state[w]
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.all(state[key][~keep] == 0), key
        assert torch.all(state[key][keep] != 0), key


def _mask_sharded_weight(rank, world_size, optimizer_name):
    """An expert weight [E=4, K=4, N=6] sharded over ep = 2, with a pending gradient and the
    optimizer's state; each rank masks its shard. Returns the full tensors afterwards."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    moe = cached_fold(FoldSpec(world_size, ep=2)).moe
    torch.manual_seed(0)  # the same full tensors on every rank
    full = torch.randn(4, 4, 6, dtype=torch.float64)
    keep_full = torch.rand(4, 4, 6) > 0.5
    placements = [Shard(0) if d == "ep" else Replicate() for d in moe.mesh_dim_names]
    w = torch.nn.Parameter(distribute_tensor(full, moe, placements))
    opt = (torch.optim.SGD([w], lr=0.1, momentum=0.9) if optimizer_name == "sgd"
           else torch.optim.AdamW([w], lr=0.1, amsgrad=True))
    w.grad = distribute_tensor(torch.ones_like(full), moe, placements)
    opt.step()  # creates the state: momentum_buffer, or exp_avg / exp_avg_sq / max_exp_avg_sq
    w.grad = distribute_tensor(torch.ones_like(full), moe, placements)
    e0 = moe.get_local_rank("ep") * 2
    mask_weight_(w, keep_full[e0:e0 + 2], opt)
    state = {k: v.full_tensor() for k, v in opt.state[w].items() if k != "step"}
    return keep_full, w.full_tensor().detach(), w.grad.full_tensor(), state


@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw_amsgrad"])
def test_masking_a_sharded_weight_zeroes_every_shard_its_gradient_and_all_optimizer_state(worlds, optimizer_name):
    keep, w, g, state = worlds(2).run(_mask_sharded_weight, optimizer_name)[0]
    assert set(state) == ({"momentum_buffer"} if optimizer_name == "sgd"
                          else {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
    for name, t in {"weight": w, "grad": g, **state}.items():
        assert torch.all(t[~keep] == 0), name
        assert torch.all(t[keep] != 0), name


def test_masks_are_respected_after_many_optimizer_steps():
    config = ExpertSparsity(tile=TILE, start_step=0, schedule=(0.5,))
    w, mask, linear, pruner, opt, loss_fn = make_group(config)
    for step in range(6):
        train_step(pruner, opt, loss_fn, step)
    for weight, m in ((w, mask), (linear.weight, linear.tile_mask)):
        pruned = ~expand_tile_mask(m, 16, weight.shape[-1]).reshape(weight.shape)
        assert torch.all(weight[pruned] == 0) and torch.all(weight.grad[pruned] == 0)
        assert torch.all(weight[~pruned] != 0)


def test_one_global_threshold_spans_the_layers_of_a_group():
    scores = {"small": torch.full((1, 2, 2), 0.1), "large": torch.full((1, 2, 2), 5.0)}
    kept = {n: torch.ones(1, 2, 2, dtype=torch.bool) for n in scores}
    new = global_prune(scores, kept, 0.5)
    assert not new["small"].any() and new["large"].all()


def test_taylor_score_accumulates_grad_times_weight_squared_over_steps():
    config = ExpertSparsity(tile=TILE, score="taylor")
    w, _, _, pruner, _, loss_fn = make_group(config)
    expected = torch.zeros_like(w)
    for _ in range(2):
        w.grad = None
        loss_fn().backward()
        pruner.accumulate()
        expected += (w.grad * w).pow(2)
    torch.testing.assert_close(pruner.taylor["experts"].double(), expected, rtol=1e-6, atol=0)


def test_tw_pattern_drops_k_rows_per_stripe_shared_by_the_stripe_tiles():
    # stripes of G = 16 columns = two 8-wide tiles; K-rows pruned in groups of bk = 8
    config = ExpertSparsity(tile=TILE, score="magnitude", pattern="tw", stripe=16)
    w, mask, linear, pruner, *_ = make_group(config)
    pruner.prune_to(0.5)
    for m in (mask, linear.tile_mask):
        stripes = m.reshape(m.shape[0], m.shape[1], -1, 2)  # [E, Kt, stripes, tiles per stripe]
        assert torch.equal(stripes[..., 0], stripes[..., 1])
    assert pruner.sparsity() == 0.5


def test_tw_pattern_with_single_rows_runs_on_the_torch_path():
    """tile (1, G): the paper's exact pattern, whole K-rows of one stripe."""
    config = ExpertSparsity(tile=(1, 16), score="magnitude", pattern="tw", stripe=16)
    linear = TileSparseLinear(16, 32, tile=config.tile, dtype=torch.float64)
    pruner = TilePruner({"linear": (linear.weight, linear.tile_mask)}, config)
    pruner.prune_to(0.25)
    x = torch.randn(5, 16, dtype=torch.float64)
    keep = expand_tile_mask(linear.tile_mask, 16, 32)[0]
    torch.testing.assert_close(linear(x), x @ (linear.weight * keep) + linear.bias)
    assert int((~linear.tile_mask).sum()) == 8  # 25% of 16 rows x 2 stripes


def test_tile_sparse_linear_equals_masked_dense_linear_on_any_leading_shape():
    layer = TileSparseLinear(16, 24, tile=TILE, dtype=torch.float64)
    layer.tile_mask[0, 1, 2] = False
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    keep = expand_tile_mask(layer.tile_mask, 16, 24)[0]
    torch.testing.assert_close(layer(x), x @ (layer.weight * keep) + layer.bias)


def test_etp_shard_boundary_inside_a_tile_raises_naming_the_numbers():
    with pytest.raises(ValueError, match=r"N = 96 / etp 2 = 48 is not a multiple of the tile's N-size 32"):
        check_etp_alignment(64, 96, (16, 32), etp=2, etp_dim="N")
    with pytest.raises(ValueError, match=r"K = 64 / etp 4 = 16 is not a multiple of the tile's K-size 32"):
        ExpertSparsity(tile=(32, 16)).new_mask(2, 64, 64, etp=4, etp_dim="K")
    check_etp_alignment(64, 96, (16, 16), etp=2, etp_dim="N")  # 48 = 3 tiles per shard: fine


@pytest.mark.parametrize("kwargs, match", [
    (dict(score="random"), r"score='random'; valid: taylor, magnitude"),
    (dict(schedule=(0.5, 0.25)), r"schedule=\(0.5, 0.25\); valid: non-decreasing"),
    (dict(schedule=(1.0,)), r"in \[0, 1\)"),
    (dict(pattern="tw", stripe=12, tile=(8, 8)), r"stripe G a multiple of bn = 8, got stripe=12"),
])
def test_bad_config_raises_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ExpertSparsity(**kwargs)


def test_pruner_rejects_a_mask_of_the_wrong_shape():
    w = torch.nn.Parameter(torch.randn(2, 16, 16))
    with pytest.raises(ValueError, match=r"experts: mask torch.bool \(2, 4, 4\) does not match"):
        TilePruner({"experts": (w, torch.ones(2, 4, 4, dtype=torch.bool))}, ExpertSparsity(tile=TILE))


# ---- folded training on the compacted CPU path -------------------------------------------------
SPARSE_TRAINING_STEPS = 4  # prunes to 0.25 after step 2 and to 0.5 after step 3


def _sparse_training(rank, world_size, case):
    """4 steps of a tiny fp64 MoE transformer, tile-sparse experts (16 x 16 tiles, Taylor score,
    pruned after steps 2 and 3), laid out on ``spec`` with ``data_parallel``, as ``meshfold
    train`` steps it (global loss, gradient reduction, prune, AdamW), once on the masked GEMMs
    and once on the compacted ones. Returns each run's losses, full gradients per step (after
    the prune, as AdamW sees them) and this rank's count of compacted GEMMs."""
    from meshfold.kernels import cpu_sparse
    from meshfold.models import MoEConfig, MoETransformer, TransformerConfig
    from meshfold.parallel import parallelize, reduce_gradients, single_device_name
    from meshfold.parallel.pipeline import Pipeline
    from meshfold.testing.worlds import cached_fold
    from meshfold.train.loop import _global_loss
    from meshfold.train.pruning import FoldedPruner

    spec, data_parallel, pattern = case
    sp = ExpertSparsity(tile=(16, 16), schedule=(0.25, 0.5), pattern=pattern, stripe=32 if pattern == "tw" else None,
                        start_step=2, steps_per_stage=1)
    moe = MoEConfig(hidden=32, ffn=32 * spec.etp, num_experts=4, topk=2, router_dtype=torch.float64,
                    expert_sparsity=sp)
    cfg = TransformerConfig(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=32, moe=moe)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (SPARSE_TRAINING_STEPS, 2 * spec.dp, 16 * spec.tp), generator=g)
    targets = torch.randint(0, 64, tokens.shape, generator=g)
    runs = {}
    for mode in ("masked", "compact"):
        torch.manual_seed(1)
        model = parallelize(MoETransformer(cfg, dtype=torch.float64), cached_fold(spec), data_parallel=data_parallel)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), foreach=False)
        pruner = FoldedPruner(model, sp, opt)
        losses, grads = [], []
        cpu_sparse.executions()  # reset the counts
        with cpu_sparse.execution(mode):
            for n in range(1, SPARSE_TRAINING_STEPS + 1):
                losses.append(_global_loss(Pipeline.laid_out(model, cached_fold(spec)), tokens[n - 1], targets[n - 1],
                                           spec, rank, backward=True))
                reduce_gradients(model)
                pruner.accumulate()
                pruner.step(n)
                grads.append({single_device_name(k): p.grad.full_tensor() for k, p in model.named_parameters()})
                opt.step()
                opt.zero_grad(set_to_none=True)
        runs[mode] = (losses, grads, cpu_sparse.executions()["compact"], pruner.sparsity())
    return runs


@pytest.mark.multirank
@pytest.mark.parametrize("spec, data_parallel, pattern", [
    (FoldSpec(4, ep=2, etp=2), "allreduce", "tile"),  # moe ep2 x etp2: the masks' etp slices
    (FoldSpec(4, ep=2), "fsdp", "tw"),                 # moe edp2 x ep2: FSDP2 cuts the local experts
    (FoldSpec(4, tp=2, ep=4), "fsdp", "tile"),         # attn dp2 x tp2, moe ep4 (one local expert)
])
def test_folded_training_on_the_compacted_gemms_equals_the_masked_path_across_prunes(worlds, spec, data_parallel,
                                                                                   pattern):
    """Loss and every gradient of each step equal the masked path's in fp64 (across the prunes
    after steps 2 and 3), on every rank, and the compacted GEMMs really ran there."""
    for runs in worlds(4).run(_sparse_training, (spec, data_parallel, pattern), timeout=300):
        (losses, grads, masked_compact, sparsity), (c_losses, c_grads, compact, c_sparsity) = runs["masked"], runs["compact"]
        assert masked_compact == 0 and compact > 0
        assert sparsity == c_sparsity == 0.5
        torch.testing.assert_close(c_losses, losses, rtol=1e-12, atol=0)
        for step, (want, got) in enumerate(zip(grads, c_grads), 1):
            assert want.keys() == got.keys()
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-13,
                                           msg=lambda m: f"step {step} {name}: {m}")
