"""Expert placement: which experts each expert-parallel rank holds.

With ``E`` experts over ``ep`` ranks, every ep rank holds ``E // ep`` of them in its *slots*: slot
``s = r * (E // ep) + j`` is local expert ``j`` of ep rank ``r``. A placement is the tuple
``slots`` of length ``E`` with ``slots[s]`` the (single-device) id of the expert in slot ``s``, so
it is a permutation of ``range(E)`` and every rank holds the same number of experts. The static
placement is the identity: rank ``r`` holds experts ``r * E / ep .. (r + 1) * E / ep - 1``.

A placement changes where an expert's rows are computed, never which rows it gets: routing and
the model's math are in single-device expert ids, and checkpoints are kept in single-device
order whatever the placement.

Every ep rank waits for the busiest one (its expert GEMMs and its share of the all-to-all), so
:func:`balanced` re-assigns experts to ranks from measured per-expert loads to lower the
largest per-rank load. It is pure Python: the planner, the dry run and training share it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["balanced", "check_placement", "max_over_mean", "rank_loads", "static"]


def _experts_per_rank(num_experts: int, ep: int) -> int:
    if ep < 1 or num_experts < 1 or num_experts % ep:
        raise ValueError(f"num_experts = {num_experts} over ep = {ep}; valid: ep >= 1 dividing num_experts")
    return num_experts // ep


def static(num_experts: int, ep: int) -> tuple[int, ...]:
    """The identity placement: ep rank ``r`` holds the contiguous block of experts ``r``."""
    _experts_per_rank(num_experts, ep)
    return tuple(range(num_experts))


def check_placement(slots: Sequence[int], num_experts: int, ep: int) -> tuple[int, ...]:
    """``slots`` as a tuple if it is a permutation of ``range(num_experts)`` (and ep divides it);
    otherwise a ValueError naming what is wrong."""
    _experts_per_rank(num_experts, ep)
    slots = tuple(slots)
    if len(slots) != num_experts:
        raise ValueError(f"placement has {len(slots)} slots for {num_experts} experts; valid: one slot per expert")
    if sorted(slots) != list(range(num_experts)):
        missing = sorted(set(range(num_experts)) - set(slots))
        seen, twice = set(), []
        for e in slots:
            if e in seen:
                twice.append(e)
            seen.add(e)
        raise ValueError(f"placement {list(slots)} is not a permutation of range({num_experts}): "
                         f"missing experts {missing}, repeated {sorted(set(twice))}, "
                         f"out of range {sorted(e for e in set(slots) if not 0 <= e < num_experts)}")
    return slots


def rank_loads(load_E: Sequence[float], slots: Sequence[int], ep: int) -> list[float]:
    """Per ep rank, the sum of the loads of the experts it holds under ``slots``.

    ``load_E[e]``: the load of expert ``e`` in single-device order (rows routed to it)."""
    n = _experts_per_rank(len(load_E), ep)
    slots = check_placement(slots, len(load_E), ep)
    return [sum(load_E[e] for e in slots[r * n:(r + 1) * n]) for r in range(ep)]


def max_over_mean(loads: Sequence[float]) -> float:
    """The busiest rank's load over the mean load (1.0 is balanced; 1.0 when there is no load)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def balanced(load_E: Sequence[float], ep: int, current: Sequence[int] | None = None) -> tuple[int, ...]:
    """A placement whose busiest ep rank carries as little load as a greedy fill allows.

    Longest processing time first under a cardinality limit: experts in order of decreasing load
    (ties to the lower id) each go to the least-loaded rank that still has a free slot (ties to the
    lower rank); each rank's experts are then listed in increasing id. Its largest rank load is
    within the largest single expert's load of the best possible. With ``current`` given, the
    current placement is kept unless the new one lowers the largest rank load, so measurement
    noise between equally good placements moves no weights."""
    num_experts = len(load_E)
    n = _experts_per_rank(num_experts, ep)
    if any(x < 0 for x in load_E):
        raise ValueError(f"expert loads {list(load_E)}; valid: every load >= 0")
    bins: list[list[int]] = [[] for _ in range(ep)]
    totals = [0.0] * ep
    for e in sorted(range(num_experts), key=lambda e: (-load_E[e], e)):
        r = min((r for r in range(ep) if len(bins[r]) < n), key=lambda r: (totals[r], r))
        bins[r].append(e)
        totals[r] += load_E[e]
    slots = tuple(e for b in bins for e in sorted(b))
    if current is not None:
        current = check_placement(current, num_experts, ep)
        if max(rank_loads(load_E, slots, ep)) >= max(rank_loads(load_E, current, ep)):
            return current
    return slots
