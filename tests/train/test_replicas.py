"""Hot-expert copies (``train.redundant_experts``): the planner, the split rule, exactness against
one device, and the settings refused before any rank starts."""

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshfold.mesh import FoldSpec
from meshfold.models import MoEConfig
from meshfold.models.transformer import MoETransformer, TransformerConfig
from meshfold.parallel.batch import shard_batch
from meshfold.parallel.data_parallel import reduce_gradients
from meshfold.parallel.recompute import apply_recompute
from meshfold.parallel.expert_placement import expert_order, expert_params, folded_moe_layers, replace_experts
from meshfold.parallel.transformer import parallelize, single_device_name
from meshfold.plan.placement import (balanced, max_over_mean, rank_loads, replica_rank_loads, replicated,
                                     split_counts, split_shares)
from meshfold.testing.references import reference_transformer
from meshfold.testing.worlds import cached_fold
from meshfold.train.config import TrainConfig

E = 8
TOL = dict(rtol=1e-10, atol=1e-12)


# ---- the planner ------------------------------------------------------------------------------

@st.composite
def loads_and_sizes(draw):
    ep = draw(st.sampled_from([2, 4]))
    E_ = ep * draw(st.integers(1, 4))
    R = ep * draw(st.integers(1, E_ // ep))
    load = draw(st.lists(st.integers(0, 1000), min_size=E_, max_size=E_))
    return [float(x) for x in load], ep, R


@settings(max_examples=60)
@given(loads_and_sizes())
def test_replicated_fills_every_copy_slot_and_never_does_worse_than_balanced(case):
    """A placement of every expert plus R / ep copies on each rank, no expert twice on a rank, and
    with the rows split by ``split_shares`` the busiest rank carries no more than ``balanced``'s
    without copies (which places the own slots the same way)."""
    load, ep, R = case
    slots, copies = replicated(load, ep, R)
    assert sorted(slots) == list(range(len(load))) and len(copies) == R
    n, r = len(load) // ep, R // ep
    for k in range(ep):
        held = [*slots[k * n:(k + 1) * n], *copies[k * r:(k + 1) * r]]
        assert len(set(held)) == len(held), (k, held)
    per_rank = replica_rank_loads(load, slots, copies, ep)
    assert sum(per_rank) == pytest.approx(sum(load))
    assert max(per_rank) <= max(rank_loads(load, balanced(load, ep), ep)) * (1 + 1e-9) + 1e-9


@settings(max_examples=60)
@given(loads_and_sizes())
def test_split_shares_leave_no_rank_above_what_moving_rows_between_instances_can_lower(case):
    """The split is optimal: every expert's shares sum to 1, and no expert with rows on a rank
    has an instance on a rank less loaded by more than a rounding (moving rows there would lower
    the max)."""
    load, ep, R = case
    slots, copies = replicated(load, ep, R)
    shares = split_shares(load, slots, copies, ep)
    per_rank = replica_rank_loads(load, slots, copies, ep)
    n, r = len(load) // ep, R // ep
    ranks = [[s // n] for s in sorted(range(len(load)), key=lambda s: slots[s])]
    for i, e in enumerate(copies):
        ranks[e].append(i // r)
    for e, (f, at) in enumerate(zip(shares, ranks)):
        assert sum(f) == pytest.approx(1)
        for k, x in zip(at, f):
            if x * load[e] > 1e-6 * sum(load):
                assert all(per_rank[k] <= per_rank[j] + 1e-6 * sum(load) for j in at), (e, at, per_rank)


def test_two_experts_of_half_the_rows_each_are_balanced_by_ep_copies():
    """ep4, R = 4, two experts with half the rows each (where a router without a balancing loss
    ends up): one copy of each on the two other ranks balances them exactly. Copying the hottest
    per instance in turn gave each three instances (six pieces of 1/6 on four ranks): 4/3."""
    load = [0.0] * 16
    load[2], load[9] = 50.0, 50.0
    slots, copies = replicated(load, 4, 4)
    assert max_over_mean(replica_rank_loads(load, slots, copies, 4)) == pytest.approx(1.0)


def test_uneven_shares_balance_what_an_even_split_cannot():
    """ep2: expert 0 (60 rows) on rank 0 with a copy on rank 1, which also holds expert 2 (20
    rows). Split evenly, rank 1 computes 30 + 20 = 50 against rank 0's 30 (1.25x the mean);
    split 40 / 20 by the shares, both compute 40."""
    load = [60.0, 0.0, 20.0, 0.0]
    slots, copies = (0, 1, 2, 3), (1, 0)  # rank 0: experts 0, 1 + a copy of 1; rank 1: 2, 3 + a copy of 0
    assert replica_rank_loads(load, slots, copies, 2, ((1, 2), (1, 2), (1,), (1,))) == [30.0, 50.0]
    assert replica_rank_loads(load, slots, copies, 2) == pytest.approx([40.0, 40.0])
    assert split_shares(load, slots, copies, 2)[0] == pytest.approx((2 / 3, 1 / 3))


# ---- exactness against one device -----------------------------------------------------------

def _config(spec):
    moe = MoEConfig(hidden=16, ffn=2 * spec.etp, num_experts=E, topk=2, router_dtype=torch.float64,
                    shared_ffn=2 * spec.tp, seq_aux_loss_coeff=0.01)
    return TransformerConfig(vocab=32, hidden=16, layers=2, heads=8, kv_heads=4, ffn=2 * spec.tp, moe=moe,
                             first_k_dense=0)


def _grads_in_expert_order(model) -> dict:
    slots = {id(p): layer.comm.slots for layer in folded_moe_layers(model) for p in expert_params(layer).values()}
    return {single_device_name(n): expert_order(p.grad.full_tensor(), slots.get(id(p)))
            for n, p in model.named_parameters()}


def _split_counts(comm, experts_TK) -> tuple[list[int], list[int]]:
    """(the rows each dispatch slot gets from ``experts_TK`` under the split rule, what
    ``split_counts`` says of the layer's placement, copies and cuts)."""
    got = comm.slot_ids(experts_TK).flatten().tolist()
    counts = [int((experts_TK == e).sum()) for e in range(E)]
    slots = comm.slots or tuple(range(E))
    return [got.count(s) for s in range(E + len(comm.copies))], split_counts(counts, slots, comm.copies, comm.ep,
                                                                              comm.cuts)


def _train_with_copies(rank, world_size, case):
    """Two AdamW steps of the fold with copies beside the single-device model: (differences
    beyond fp64 rounding, each expert's split counts on this rank)."""
    spec, data_parallel, seed, placements, recompute = case
    cfg = _config(spec)
    ref, _, _ = reference_transformer(cfg, seed, 1, 1)
    model = MoETransformer(cfg, dtype=torch.float64)
    model.load_state_dict(ref.state_dict())
    parallelize(model, cached_fold(spec), data_parallel=data_parallel)
    apply_recompute(model.layers, recompute)  # "full": the copies are fetched again in backward
    for layer, (slots, copies, cuts) in zip(folded_moe_layers(model), placements):
        replace_experts(layer, slots, None)
        layer.comm.set_copies(copies, E, expert_params(layer), cuts)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    B, S = 2 * spec.dp, 4 * spec.cp * spec.tp
    g = torch.Generator().manual_seed(seed + 1)
    diffs = []
    for step in range(2):
        tokens, targets = (torch.randint(0, cfg.vocab, (B, S), generator=g) for _ in range(2))
        ref_loss = ref.loss(tokens, targets)
        ref_loss.backward()
        lt, pos = shard_batch(tokens, spec, rank)
        loss = model.loss(lt, shard_batch(targets, spec, rank)[0], pos)
        loss.backward()
        reduce_gradients(model)
        if not torch.allclose(loss.detach(), ref_loss.detach(), **TOL):
            diffs.append(f"step {step + 1} loss {loss.item()} vs {ref_loss.item()}")
        got = _grads_in_expert_order(model)
        for name, p in ref.named_parameters():
            if not torch.allclose(got[name], p.grad, **TOL):
                diffs.append(f"step {step + 1} gradient {name}: {(got[name] - p.grad).abs().max().item():.3g}")
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    drawn = torch.randint(0, E, (64, 1), generator=torch.Generator().manual_seed(seed))
    return diffs, _split_counts(folded_moe_layers(model)[0].comm, drawn)


@st.composite
def any_cuts(draw, copies):
    """None (even) or, per expert of ``E``, ``1 + copies`` non-decreasing cuts of a whole in 1 .. 12."""
    if draw(st.booleans()):
        return None
    out = []
    for e in range(E):
        whole = draw(st.integers(1, 12))
        inner = draw(st.lists(st.integers(0, whole), min_size=copies.count(e), max_size=copies.count(e)))
        out.append((*sorted(inner), whole))
    return tuple(out)


@st.composite
def copy_cases(draw, specs):
    spec, data_parallel = draw(st.sampled_from(specs))
    placements = []
    for _ in range(2):  # one per MoE layer: any placement, any copies (an expert may be copied twice), any cuts
        R = spec.ep * draw(st.integers(1, 2))
        copies = tuple(draw(st.lists(st.integers(0, E - 1), min_size=R, max_size=R)))
        placements.append((tuple(draw(st.permutations(range(E)))), copies, draw(any_cuts(copies))))
    return spec, data_parallel, draw(st.integers(0, 10**6)), placements, draw(st.sampled_from(["none", "full"]))


def _check(world, case):
    results = world.run(_train_with_copies, case)
    assert [d for d, _ in results] == [[]] * len(results)
    for _, (got, want) in results:  # every source rank splits each expert's rows by its cuts
        assert got == want


@pytest.mark.slow  # 5-32 s; the quick tier's ep2 x etp2 and ep2 x edp2 cases below hold ep2 copies too
@pytest.mark.multirank
def test_copies_on_ep2_train_like_one_device(worlds):
    """ep2 (world 2): loss and every gradient equal one device (fp64) over two AdamW steps, with
    drawn placements and copies in both MoE layers, with and without full recomputation."""
    world = worlds(2)

    @settings(max_examples=4, deadline=None)
    @given(copy_cases([(FoldSpec(2, ep=2), "fsdp")]))
    def check(case):
        _check(world, case)

    check()


@pytest.mark.multirank
@pytest.mark.parametrize("spec, data_parallel", [
    (FoldSpec(4, tp=2, ep=4), "fsdp"), (FoldSpec(4, tp=2, ep=2, etp=2), "fsdp"),
    (FoldSpec(4, dp=4, ep=2), "fsdp"), (FoldSpec(4, dp=4, ep=2), "allreduce"),  # edp 2
])
def test_copies_on_ep4_etp2_and_edp2_train_like_one_device(worlds, spec, data_parallel):
    """ep4, ep2 x etp2 and ep2 x edp2 (FSDP2 and all-reduce): loss and every gradient equal one
    device (fp64) over two AdamW steps, with drawn placements and copies."""
    world = worlds(4)

    @settings(max_examples=2, deadline=None)
    @given(copy_cases([(spec, data_parallel)]))
    def check(case):
        _check(world, case)

    check()


def _syncs_with_copies(rank, world_size):
    from meshfold.models import MoELayer
    from meshfold.parallel.moe import parallelize_moe
    from tests.parallel.test_host_syncs import _layer_cfg, count_forward_syncs

    spec = FoldSpec(4, tp=2, ep=2, etp=2)
    torch.manual_seed(0)
    layer = MoELayer(_layer_cfg("dropless", spec.etp, spec.tp), dtype=torch.float64)
    parallelize_moe(layer, cached_fold(spec))
    layer.comm.set_copies((0, 0), 4, expert_params(layer))  # expert 0 on both ep ranks
    x = torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    return count_forward_syncs(layer, x)


@pytest.mark.multirank
def test_a_forward_with_copies_still_reads_the_host_once(worlds):
    """The split rule and the copies' fetch add no host read to the layer's one (the counts)."""
    for syncs in worlds(4).run(_syncs_with_copies):
        assert len(syncs) <= 1, syncs


# ---- settings ---------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, R, message", [
    ({"fold": {"world_size": 4, "tp": 2, "ep": 1}}, 2, "fold.ep = 1"),
    ({"fold": {"world_size": 4, "pp": 2, "ep": 2}}, 2, "fold.pp = 2"),
    ({"fold": {"world_size": 4, "ep": 4}, "moe": {"num_experts": 8}}, 2, "not a multiple of ep"),
    ({"fold": {"world_size": 4, "ep": 4}, "moe": {"num_experts": 8}}, 12, "more copy slots than experts"),
    ({"fold": {"world_size": 4, "ep": 4}, "moe": {"num_experts": 8, "capacity_factor": 1.0}}, 4, "dropless"),
    ({"model": {"name": "tiny-mixtral", "first_k_dense": 4}}, 4, "no MoE layers"),
])
def test_copies_that_cannot_run_are_refused_before_any_rank_starts(overrides, R, message):
    cfg = TrainConfig(**overrides)
    cfg.train.expert_placement = "balanced"
    cfg.train.redundant_experts = R
    with pytest.raises(ValueError, match=f"train.redundant_experts = {R} with .*{message}"):
        cfg.validate()


def test_copies_with_static_placement_are_refused():
    cfg = TrainConfig(fold={"world_size": 4, "ep": 4}, moe={"num_experts": 8})
    cfg.train.redundant_experts = 4
    with pytest.raises(ValueError, match="train.expert_placement = 'static'.*valid: 'balanced'"):
        cfg.validate()


# ---- meshfold train -----------------------------------------------------------------------------

def _train(out, *extra):
    from tests.run_here import meshfold_here
    from tests.train.test_train import SMALL, losses

    args = [*SMALL, "--set", "moe.num_experts=8", "--set", "train.dtype=\"float64\"", "--set", "train.ckpt_every=2"]
    proc = meshfold_here("train", "--steps", "4", "--out-dir", str(out), *args, *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, losses(out)


COPIES = ["--set", "train.expert_placement=\"balanced\"", "--set", "train.rebalance_every=2",
          "--set", "train.redundant_experts=4"]


def test_a_run_with_copies_trains_like_a_static_one_and_shows_its_copies(tmp_path):
    """``meshfold train`` with 4 copy slots on ep4 (8 experts, re-placed every 2 steps): the
    losses are a static run's to fp64 rounding (gradients are summed over an expert's instances
    in another order, so not bit for bit), the re-placement records its copies, and the next
    steps count each copied expert's rows split over its instances."""
    _, static = _train(tmp_path / "static")
    _, copied = _train(tmp_path / "copies", *COPIES)
    assert [copied[s]["loss"] for s in (1, 2, 3, 4)] == pytest.approx(
        [static[s]["loss"] for s in (1, 2, 3, 4)], rel=1e-12, abs=0)
    placed = copied[2]["expert_placement"]
    assert [len(c) for c in placed["copies"]] == [4] * len(placed["placements"])
    r = copied[3]
    for load, slots, copies, cuts, per_rank in zip(r["tokens_per_expert"], placed["placements"], placed["copies"],
                                                   placed["cuts"], r["ep_rank_rows"]):
        assert per_rank == [round(x) for x in replica_rank_loads(load, slots, copies, 4, cuts)]
        assert max_over_mean(per_rank) <= max_over_mean(rank_loads(load, tuple(range(8)), 4))


@pytest.mark.slow  # four runs, ~45 s on two cores
def test_a_run_with_copies_resumes_bit_exact_with_its_copies(tmp_path):
    """Stopped after its re-placement at step 2 and resumed, a run with copies takes up the saved
    placement and copies: steps 3 and 4 are the uninterrupted run's, bit for bit, and split the
    rows over the same copies. Its checkpoint also resumes without copies (static placement),
    with the same losses to fp64 rounding."""
    _, whole = _train(tmp_path / "whole", *COPIES)
    _train(tmp_path / "cut", *COPIES, "--set", "train.stop_at=2")
    shutil.copytree(tmp_path / "cut" / "checkpoints", tmp_path / "static" / "checkpoints")
    proc, static = _train(tmp_path / "static")
    assert "resumed from" in proc.stdout
    assert [static[s]["loss"] for s in (3, 4)] == pytest.approx([whole[s]["loss"] for s in (3, 4)], rel=1e-12, abs=0)
    proc, cut = _train(tmp_path / "cut", *COPIES)
    assert "resumed from" in proc.stdout
    assert [cut[s]["loss"] for s in (3, 4)] == [whole[s]["loss"] for s in (3, 4)]
    assert [cut[s]["ep_rank_rows"] for s in (3, 4)] == [whole[s]["ep_rank_rows"] for s in (3, 4)]  # the copies
