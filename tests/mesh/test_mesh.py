"""FoldSpec: the two views of one rank layout (pure Python, no process group)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshfold.mesh import ATTN_DIMS, MOE_DIMS, VIEWS, FoldSpec, valid_folds
from meshfold.testing.strategies import divisors, fold_specs, invalid_fold_kwargs

views = st.sampled_from(sorted(VIEWS))


def reference_groups(spec, view, dims):
    """Independent definition: arange(W).reshape(view shape), then the chosen axes to the end."""
    names = VIEWS[view]
    mesh = np.arange(spec.world_size).reshape(spec.shape(view))
    axes = [names.index(d) for d in dims]
    keep = [i for i in range(len(names)) if i not in axes]
    flat = mesh.transpose(keep + axes).reshape(-1, int(np.prod([mesh.shape[a] for a in axes])))
    return sorted(sorted(g.tolist()) for g in flat)


@settings(max_examples=25)
@given(fold_specs())
def test_groups_of_each_dim_partition_the_world(spec):
    for view, dims in VIEWS.items():
        for d in dims:
            groups = spec.groups(view, d)
            flat = [r for g in groups for r in g]
            assert sorted(flat) == list(range(spec.world_size))  # every rank exactly once
            assert all(len(g) == getattr(spec, d) for g in groups)


@settings(max_examples=25)
@given(fold_specs(), views, st.data())
def test_groups_match_megatron_order_reference(spec, view, data):
    dims = data.draw(st.lists(st.sampled_from(VIEWS[view]), min_size=1, max_size=4, unique=True))
    dims = tuple(d for d in VIEWS[view] if d in dims)  # layout order
    assert spec.groups(view, dims) == reference_groups(spec, view, dims)


@settings(max_examples=25)
@given(fold_specs(), views, st.data())
def test_tuple_groups_are_products_of_single_dim_groups(spec, view, data):
    a, b = data.draw(st.lists(st.sampled_from(VIEWS[view]), min_size=2, max_size=2, unique=True))
    rank = data.draw(st.integers(0, spec.world_size - 1))
    product = sorted({y for x in spec.group_of(rank, view, a) for y in spec.group_of(x, view, b)})
    assert spec.group_of(rank, view, (a, b)) == product


@settings(max_examples=25)
@given(fold_specs(), st.data())
def test_coords_round_trip(spec, data):
    rank = data.draw(st.integers(0, spec.world_size - 1))
    coords = spec.coords(rank)
    for view in VIEWS:
        assert spec.rank(view, **coords[view]) == rank
    c = coords["attn"]
    assert rank == ((c["pp"] * spec.dp + c["dp"]) * spec.cp + c["cp"]) * spec.tp + c["tp"]
    m = coords["moe"]
    assert rank == ((m["pp"] * spec.edp + m["edp"]) * spec.ep + m["ep"]) * spec.etp + m["etp"]


@settings(max_examples=25)
@given(fold_specs())
def test_pp_groups_identical_in_both_views(spec):
    assert spec.groups("attn", "pp") == spec.groups("moe", "pp")
    assert spec.groups("attn", ("dp", "cp", "tp")) == spec.groups("moe", ("edp", "ep", "etp"))


@settings(max_examples=25)
@given(fold_specs())
def test_derived_sizes_fill_the_world(spec):
    assert spec.pp * spec.dp * spec.cp * spec.tp == spec.world_size
    assert spec.pp * spec.edp * spec.ep * spec.etp == spec.world_size


@settings(max_examples=60)
@given(invalid_fold_kwargs())
def test_invalid_specs_raise_naming_the_numbers(case):
    world_size, kwargs = case
    with pytest.raises(ValueError) as err:
        FoldSpec(world_size, **kwargs)
    (name, value), = kwargs.items()
    msg = str(err.value)
    assert str(value) in msg and (name in msg or "world size" in msg)


@pytest.mark.parametrize("kwargs, expected", [
    (dict(tp=3), "attn tp*cp*pp = 3 does not divide world size 16"),
    (dict(tp=2, cp=2, dp=3), "attn tp*cp*pp*dp = 12 but world size is 16 (valid dp for tp=2, cp=2, pp=1: 4)"),
    (dict(ep=3), "moe etp*ep*pp = 3 does not divide world size 16"),
    (dict(ep=4, edp=2), "moe etp*ep*pp*edp = 8 but world size is 16 (valid edp for etp=1, ep=4, pp=1: 4)"),
    (dict(tp=0), "tp must be a positive integer, got 0"),
    (dict(cp=2.0), "cp must be a positive integer, got 2.0"),
    (dict(dp=-1), "dp must be a positive integer or None (derived), got -1"),
])
def test_invalid_spec_messages(kwargs, expected):
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        FoldSpec(16, **kwargs)


def test_pp_differing_between_views_raises():
    with pytest.raises(ValueError, match="pp differs between views: attn pp = 2, moe pp = 4"):
        FoldSpec.from_views(16, attn=dict(tp=2, pp=2), moe=dict(ep=4, pp=4))
    spec = FoldSpec.from_views(16, attn=dict(tp=2, pp=2), moe=dict(ep=4, pp=2))
    assert spec == FoldSpec(16, tp=2, pp=2, ep=4)


@pytest.mark.parametrize("W", [1, 6, 12, 16])
def test_valid_folds_enumerates_every_factorization(W):
    folds = valid_folds(W)
    assert len(set(folds)) == len(folds)
    # Count independently: ordered factorizations of W/pp into (dp, cp, tp) times into (edp, ep, etp).
    def triples(n):
        return sum(1 for a in divisors(n) for b in divisors(n // a))
    expected = sum(triples(W // p) ** 2 for p in divisors(W))
    assert len(folds) == expected


def test_describe_lists_both_views():
    text = FoldSpec(16, tp=2, cp=2, pp=2, ep=8).describe()
    assert "attn view (pp2 x dp2 x cp2 x tp2)" in text
    assert "moe view (pp2 x edp1 x ep8 x etp1)" in text
    assert "[0-7] [8-15]" in text  # the two ep groups


@settings(max_examples=40)
@given(fold_specs(max_world_size=96))
def test_describes_shortcuts_agree_with_the_enumerated_groups(spec):
    """``describe`` reads groups and process-group counts from strides (instant for any world
    size); the plain reference enumerates every rank's group."""
    seen, shared, unshared = set(), 0, 0
    for view, dims in VIEWS.items():
        for d in dims:
            groups = reference_groups(spec, view, [d])
            assert [list(g) for g in spec.first_groups(view, d, 5)] == groups[:5]
            part = tuple(map(tuple, groups))
            unshared += len(part)
            if part not in seen:
                seen.add(part)
                shared += len(part) if len(part) > 1 else 0
    assert spec.process_group_count() == (shared, unshared)


def test_dims_constants():
    assert ATTN_DIMS == ("pp", "dp", "cp", "tp") and MOE_DIMS == ("pp", "edp", "ep", "etp")


# ---- fold_specs under a model's constraints ------------------------------------------------------
FIT = dict(heads=4, kv_heads=2, experts=4, expert_ffn=6, seq_len=12, batch=3)


def _fits(spec, heads, kv_heads, experts, expert_ffn, seq_len, batch, max_tp=None):
    """What a fold must satisfy to take the model and the batch (stated independently of the
    strategy): tp divides the heads, ep the experts, etp the expert ffn, dp the batch, and every
    rank holds whole load-balanced chunks of a sequence."""
    split = 2 * spec.cp * spec.tp if spec.cp > 1 else spec.tp
    return ((max_tp is None or spec.tp <= max_tp) and heads % spec.tp == 0 and kv_heads % spec.tp == 0
            and experts % spec.ep == 0 and expert_ffn % spec.etp == 0 and seq_len % split == 0
            and batch % spec.dp == 0)


@settings(max_examples=40)
@given(fold_specs(world_sizes=[6, 12], tp=[1, 2], **FIT))
def test_fold_specs_draw_only_folds_that_fit_the_constraints(spec):
    assert _fits(spec, max_tp=2, **FIT)


@pytest.mark.parametrize("W", [6, 12])
def test_fold_specs_can_draw_every_fold_that_fits(W):
    """The strategy's choices (pp, then (tp, cp) and (etp, ep)) enumerate exactly the fitting
    folds, so none is discarded and none is unreachable."""
    from meshfold.testing.strategies import _Limits

    limits = _Limits(tp_divides=(FIT["heads"], FIT["kv_heads"]), ep_divides=(FIT["experts"],),
                     etp_divides=(FIT["expert_ffn"],), seq_len=FIT["seq_len"], batch=FIT["batch"])
    reachable = {FoldSpec(W, tp=tp, cp=cp, pp=p, etp=etp, ep=ep)
                 for p, attn, moe in limits.stages(W) for tp, cp in attn for etp, ep in moe}
    assert reachable == {s for s in valid_folds(W) if _fits(s, **FIT)}


def test_fold_specs_refuse_constraints_no_fold_meets():
    with pytest.raises(ValueError, match="fold_specs: no fold of \\[3\\] ranks fits"):
        fold_specs(world_sizes=[3], pp=[1], heads=4, batch=2, seq_len=4)  # tp, dp or cp = 3: none fits
    with pytest.raises(ValueError, match=r"fold_specs\(tp=\[0, 2\]\): give the allowed sizes"):
        fold_specs(tp=[0, 2])
    with pytest.raises(ValueError, match=r"fold_specs\(heads=2.5\): a model or batch size is a positive integer"):
        fold_specs(heads=2.5)
