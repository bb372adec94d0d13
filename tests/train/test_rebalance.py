"""Balanced expert placement in training: its settings, and checkpoints kept in expert order."""

import pytest
import torch

from meshfold.mesh import FoldSpec
from meshfold.models import MoEConfig
from meshfold.models.transformer import MoETransformer, TransformerConfig
from meshfold.parallel.batch import shard_batch
from meshfold.parallel.data_parallel import reduce_gradients
from meshfold.parallel.expert_placement import expert_order, expert_params, folded_moe_layers, replace_experts
from meshfold.parallel.transformer import parallelize, single_device_name
from meshfold.testing.worlds import cached_fold
from meshfold.train import checkpoint
from meshfold.train.config import TrainConfig

CFG = TransformerConfig(vocab=32, hidden=16, layers=1, heads=4, kv_heads=2, ffn=8, first_k_dense=0,
                        moe=MoEConfig(hidden=16, ffn=4, num_experts=8, topk=2))
PLACEMENT = (5, 2, 7, 0, 1, 6, 3, 4)  # every expert leaves its static rank under ep 2 and ep 4


def _state_in_expert_order(model, opt) -> dict:
    """{name: full tensor} of weights and AdamW moments, expert weights in expert order."""
    slots = {id(p): layer.comm.slots for layer in folded_moe_layers(model) for p in expert_params(layer).values()}
    out = {}
    for name, p in model.named_parameters():
        name = single_device_name(name)
        for key, t in (("model", p.detach()), ("exp_avg", opt.state[p]["exp_avg"]),
                       ("exp_avg_sq", opt.state[p]["exp_avg_sq"])):
            out[f"{key}.{name}"] = expert_order(t.full_tensor(), slots.get(id(p)))
    return out


def _save_replaced_load_static(rank, world_size, folder, saved_on, loaded_on, data_parallel):
    torch.manual_seed(0)
    model = parallelize(MoETransformer(CFG), cached_fold(saved_on), data_parallel=data_parallel)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, CFG.vocab, (4, 8), generator=torch.Generator().manual_seed(1))
    local, pos = shard_batch(tokens, saved_on, rank)
    model.loss(local, shard_batch(tokens.roll(1, 1), saved_on, rank)[0], pos).backward()
    reduce_gradients(model)
    opt.step()
    opt.zero_grad(set_to_none=True)
    for layer in folded_moe_layers(model):
        replace_experts(layer, PLACEMENT, opt)
    saved = _state_in_expert_order(model, opt)
    checkpoint.save(folder, 1, model, opt, {"step": 1})
    placed_after_save = [layer.comm.slots for layer in folded_moe_layers(model)]

    torch.manual_seed(1)  # other initial weights: the load must replace them all
    static = parallelize(MoETransformer(CFG), cached_fold(loaded_on), data_parallel=data_parallel)
    static_opt = torch.optim.AdamW(static.parameters(), lr=1e-2)
    checkpoint.load(folder / "step_000001", static, static_opt, restore_rng=False)
    loaded = _state_in_expert_order(static, static_opt)
    differ = [n for n in saved if not torch.equal(saved[n], loaded[n])]
    return differ, placed_after_save, saved if rank == 0 else None


@pytest.mark.multirank
@pytest.mark.parametrize("saved_on, loaded_on, data_parallel", [
    (FoldSpec(4, tp=2, ep=4), FoldSpec(4, tp=2, ep=2, etp=2), "fsdp"),
    (FoldSpec(4, dp=4, ep=2), FoldSpec(4, tp=2, ep=4), "allreduce"),   # edp 2
])
def test_checkpoint_of_replaced_experts_is_in_expert_order(worlds, tmp_path, saved_on, loaded_on, data_parallel):
    """Saved under a non-identity placement, a checkpoint loads bit for bit under the static
    placement on another fold and into the single-device model; the saving run keeps its placement."""
    results = worlds(4).run(_save_replaced_load_static, tmp_path, saved_on, loaded_on, data_parallel)
    assert [r[0] for r in results] == [[]] * 4
    assert all(r[1] == [PLACEMENT] for r in results)
    saved = results[0][2]
    one = MoETransformer(CFG)
    opt = torch.optim.AdamW(one.parameters(), lr=1e-2)
    checkpoint.load(tmp_path / "step_000001", one, opt, restore_rng=False)
    for name, p in one.named_parameters():
        assert torch.equal(p.detach(), saved[f"model.{name}"]), name
        assert torch.equal(opt.state[p]["exp_avg"], saved[f"exp_avg.{name}"]), name


@pytest.mark.parametrize("overrides, message", [
    ({"fold": {"world_size": 4, "tp": 2, "ep": 1}}, "fold.ep = 1"),
    ({"fold": {"world_size": 4, "pp": 2, "ep": 2}}, "fold.pp = 2"),
    ({"model": {"name": "tiny-mixtral", "first_k_dense": 4}}, "no MoE layers"),
])
def test_balanced_where_nothing_can_be_re_placed_is_an_error(overrides, message):
    cfg = TrainConfig(**overrides)
    cfg.train.expert_placement = "balanced"
    with pytest.raises(ValueError, match=message):
        cfg.validate()


def test_unknown_placement_names_the_valid_ones():
    cfg = TrainConfig()
    cfg.train.expert_placement = "greedy"
    with pytest.raises(ValueError, match="'greedy'; valid: static, balanced"):
        cfg.validate()


def _rebalance_every_two_steps(rank, world_size):
    from meshfold.train.rebalance import Rebalancer

    torch.manual_seed(0)
    model = parallelize(MoETransformer(CFG), cached_fold(FoldSpec(4, tp=2, ep=4)))
    rebalancer = Rebalancer(model, every=2, ep=4)
    first = rebalancer.after_step(1, [[60, 50, 1, 1, 1, 1, 1, 1]], None)
    placed = rebalancer.after_step(2, [[40, 30, 1, 1, 1, 1, 1, 1]], None)
    again = rebalancer.after_step(4, [[1, 1, 1, 1, 1, 1, 1, 1]], None)  # a fresh window: balanced loads
    return first, {k: v for k, v in placed.items() if k != "seconds"}, again["moved_bytes"], rebalancer.placements()


@pytest.mark.multirank
def test_rebalancer_re_places_from_the_loads_since_the_last_re_placement(worlds):
    """Every ``every`` steps, the same placement on every rank: balanced() of the summed loads;
    the next window starts afresh, and a placement that is no worse stays (nothing moves)."""
    from meshfold.plan.placement import balanced

    results = worlds(4).run(_rebalance_every_two_steps)
    want = list(balanced([100, 80, 2, 2, 2, 2, 2, 2], 4))
    for first, placed, moved_again, placements in results:
        assert first is None
        assert placed["placements"] == [want] == placements
        assert placed["moved_bytes"] == results[0][1]["moved_bytes"] > 0
        assert placed["max_over_mean_after"] < placed["max_over_mean_before"]
        assert moved_again == 0


def test_a_balanced_run_trains_like_a_static_one_and_reports_rows_under_its_placement(tmp_path):
    """``meshfold train`` with train.expert_placement = balanced (8 experts on ep4, re-placed every
    2 steps): the losses are a static run's, a re-placement is recorded, and each step's rows per
    ep rank are counted under the placement that step was routed with (after a re-placement, not
    the static blocks)."""
    from tests.run_here import meshfold_here
    from tests.train.test_train import SMALL, losses

    args = [*SMALL, "--set", "moe.num_experts=8", "--set", "train.dtype=\"float64\""]
    runs = {}
    for mode in ("static", "balanced"):
        out = tmp_path / mode
        proc = meshfold_here("train", "--steps", "4", "--out-dir", str(out), *args,
                             "--set", f"train.expert_placement=\"{mode}\"", "--set", "train.rebalance_every=2")
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[mode] = losses(out)
    assert [runs["balanced"][s]["loss"] for s in (1, 2, 3, 4)] == pytest.approx(
        [runs["static"][s]["loss"] for s in (1, 2, 3, 4)], rel=1e-12, abs=0)
    placed = runs["balanced"][2]["expert_placement"]["placements"]  # decided after step 2
    assert any(list(p) != list(range(8)) for p in placed), placed  # the fixture's routing is skewed
    for step, slots_L in ((1, [list(range(8))] * len(placed)), (3, placed)):
        r = runs["balanced"][step]
        for per_expert, per_rank, slots in zip(r["tokens_per_expert"], r["ep_rank_rows"], slots_L):
            assert per_rank == [sum(per_expert[e] for e in slots[i * 2:(i + 1) * 2]) for i in range(4)]
