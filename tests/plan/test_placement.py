"""Expert placement: balanced() re-assigns experts to ep ranks as a permutation that lowers the
busiest rank's load; check_placement names what is wrong with a bad one."""

import itertools

import pytest
from hypothesis import given, settings, strategies as st

from meshfold.plan.placement import balanced, check_placement, max_over_mean, rank_loads, static


@st.composite
def loads_and_ep(draw, max_experts=6):
    ep = draw(st.sampled_from([1, 2, 3]))
    num_experts = ep * draw(st.integers(1, max_experts // ep))
    return draw(st.lists(st.integers(0, 1000), min_size=num_experts, max_size=num_experts)), ep


def best_possible(load_E, ep):
    """The lowest busiest-rank load over every placement (brute force; tiny E only)."""
    return min(max(rank_loads(load_E, p, ep)) for p in itertools.permutations(range(len(load_E))))


@settings(max_examples=60, deadline=None)
@given(loads_and_ep())
def test_balanced_is_a_permutation_with_equal_experts_per_rank(case):
    load_E, ep = case
    slots = balanced(load_E, ep)
    assert sorted(slots) == list(range(len(load_E)))
    n = len(load_E) // ep
    for r in range(ep):  # each rank's experts are listed in increasing id
        assert list(slots[r * n:(r + 1) * n]) == sorted(slots[r * n:(r + 1) * n])


@settings(max_examples=60, deadline=None)
@given(loads_and_ep())
def test_balanced_busiest_rank_within_one_expert_of_the_best_possible(case):
    load_E, ep = case
    busiest = max(rank_loads(load_E, balanced(load_E, ep), ep))
    assert busiest <= best_possible(load_E, ep) + max(load_E)
    assert busiest <= max(rank_loads(load_E, static(len(load_E), ep), ep)) + max(load_E)


@settings(max_examples=60, deadline=None)
@given(loads_and_ep(), st.randoms(use_true_random=False))
def test_balanced_keeps_the_current_placement_unless_it_lowers_the_busiest_rank(case, rnd):
    load_E, ep = case
    current = list(range(len(load_E)))
    rnd.shuffle(current)
    new = balanced(load_E, ep, current=current)
    before, after = max(rank_loads(load_E, current, ep)), max(rank_loads(load_E, new, ep))
    assert after <= before
    if after == before:
        assert new == tuple(current)


def test_balanced_pairs_hot_experts_with_cold_ones():
    # 8 experts on 4 ranks: static puts the two hottest together (max/mean 2.0); the best pairs
    # each hot expert with a cold one
    load_E = [100, 90, 80, 70, 10, 10, 10, 10]
    assert max_over_mean(rank_loads(load_E, static(8, 4), 4)) == pytest.approx(190 / 95)
    slots = balanced(load_E, 4)
    assert sorted(rank_loads(load_E, slots, 4)) == [80, 90, 100, 110]
    assert {frozenset(slots[i:i + 2]) for i in range(0, 8, 2)} == {
        frozenset({0, 7}), frozenset({1, 6}), frozenset({2, 5}), frozenset({3, 4})}


def test_bad_placements_are_errors_naming_them():
    with pytest.raises(ValueError, match=r"missing experts \[3\], repeated \[1\]"):
        check_placement([0, 1, 1, 2], 4, 2)
    with pytest.raises(ValueError, match="3 slots for 4 experts"):
        check_placement([0, 1, 2], 4, 2)
    with pytest.raises(ValueError, match="num_experts = 6 over ep = 4"):
        balanced([1] * 6, 4)
    with pytest.raises(ValueError, match="every load >= 0"):
        balanced([1, -1], 2)
