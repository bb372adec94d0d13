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

With ``R`` redundant slots (:func:`replicated`) every ep rank also holds ``R // ep`` *copy
slots*: ``copies[i]`` is the expert copied into copy slot ``i`` of ep rank ``i // (R // ep)``.
An expert with ``c`` instances (its slot and its copies) has its rows split evenly over them, so
an expert hotter than a rank's mean share can be spread over several ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["balanced", "check_placement", "check_copies", "check_replicas", "dispatch_instances", "max_over_mean",
           "rank_loads", "replica_rank_loads", "replicated", "split_counts", "static"]


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


def check_copies(copies: Sequence[int], num_experts: int, ep: int) -> tuple[int, ...]:
    """``copies`` as a tuple if it fits ``ep`` ranks (as many copy slots on each) and names only
    experts of ``range(num_experts)``, at most ``num_experts`` copy slots; else a ValueError."""
    copies = tuple(copies)
    if ep < 2 or len(copies) % ep or len(copies) > num_experts:
        raise ValueError(f"{len(copies)} copy slots over ep = {ep} for {num_experts} experts; valid: a multiple "
                         f"of ep (ep >= 2), at most {num_experts}")
    wrong = sorted(e for e in set(copies) if not 0 <= e < num_experts)
    if wrong:
        raise ValueError(f"copies {list(copies)} name experts {wrong}; valid: 0 .. {num_experts - 1}")
    return copies


def _instances(copies: Sequence[int], num_experts: int) -> list[int]:
    """Per expert, how many slots hold it: 1 (its own) + its copies."""
    count = [1] * num_experts
    for e in copies:
        count[e] += 1
    return count


def replica_rank_loads(load_E: Sequence[float], slots: Sequence[int], copies: Sequence[int], ep: int) -> list[float]:
    """Per ep rank, the load it computes under ``slots`` and ``copies``: each expert's load split
    evenly over its instances (the split rule balances every source rank to within one row)."""
    n = _experts_per_rank(len(load_E), ep)
    slots = check_placement(slots, len(load_E), ep)
    copies = check_copies(copies, len(load_E), ep) if copies else ()
    count = _instances(copies, len(load_E))
    r = len(copies) // ep
    return [sum(load_E[e] / count[e] for e in (*slots[k * n:(k + 1) * n], *copies[k * r:(k + 1) * r]))
            for k in range(ep)]


def replicated(load_E: Sequence[float], ep: int, redundant: int,
               current: tuple[Sequence[int], Sequence[int]] | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(slots, copies)``: a placement and ``redundant`` copies whose busiest rank carries as
    little load as a greedy fill allows.

    Copies first: ``redundant`` times, the expert with the largest load per instance (ties to the
    lower id) among those with fewer than ``ep`` instances gets one more. Then every instance, of
    load ``load / instances``, largest first (ties: lower expert, then its own slot before its
    copies), goes to the least-loaded rank (ties to the lower rank) with a free slot of its kind
    (the expert's own slot, or a copy slot) not yet holding that expert; if every such rank
    already holds it, to the least-loaded with a free slot of the kind. Each rank's experts and
    copies are listed in increasing id. With ``current`` (slots, copies) given, it is kept unless
    the new one lowers the largest rank load (measurement noise moves no weights)."""
    num_experts = len(load_E)
    n = _experts_per_rank(num_experts, ep)
    if any(x < 0 for x in load_E):
        raise ValueError(f"expert loads {list(load_E)}; valid: every load >= 0")
    if redundant:
        check_copies([0] * redundant, num_experts, ep)
    count = [1] * num_experts
    for _ in range(redundant):
        e = max((e for e in range(num_experts) if count[e] < ep), key=lambda e: (load_E[e] / count[e], -e))
        count[e] += 1
    room = [[n, redundant // ep] for _ in range(ep)]  # free own slots, free copy slots
    held: list[list[list[int]]] = [[[], []] for _ in range(ep)]
    totals = [0.0] * ep
    pieces = sorted(((e, c) for e in range(num_experts) for c in range(count[e])),
                    key=lambda p: (-load_E[p[0]] / count[p[0]], p[0], p[1]))
    for e, c in pieces:
        kind = 0 if c == 0 else 1
        free = [r for r in range(ep) if room[r][kind]]
        apart = [r for r in free if e not in held[r][0] and e not in held[r][1]]
        r = min(apart or free, key=lambda r: (totals[r], r))
        room[r][kind] -= 1
        held[r][kind].append(e)
        totals[r] += load_E[e] / count[e]
    slots = tuple(e for r in range(ep) for e in sorted(held[r][0]))
    copies = tuple(e for r in range(ep) for e in sorted(held[r][1]))
    if current is not None and len(current[1]) == redundant:
        old = check_placement(current[0], num_experts, ep), tuple(current[1])
        if max(replica_rank_loads(load_E, slots, copies, ep)) >= max(replica_rank_loads(load_E, *old, ep)):
            return old
    return slots, copies


def check_replicas(redundant: int, num_experts: int, ep: int, pp: int = 1) -> str:
    """Why ``redundant`` copy slots cannot run with ``num_experts`` experts on ep ``ep`` and pp
    ``pp`` (empty when they can): the rules ``train.redundant_experts`` is validated by."""
    if redundant < 1:
        return f"{redundant} copy slots (valid: at least 1)"
    if ep < 2:
        return f"ep = {ep}: one ep rank holds every expert (valid: ep >= 2)"
    if pp > 1:
        return f"pp = {pp}: copies run without pipeline stages (valid: pp = 1)"
    if redundant % ep:
        return f"ep = {ep}: {redundant} copy slots are not a multiple of it (valid: {ep}, {2 * ep}, ..)"
    if redundant > num_experts:
        return f"{num_experts} experts: more copy slots than experts (valid: at most {num_experts})"
    return ""


def dispatch_instances(slots: Sequence[int], copies: Sequence[int], ep: int) -> list[list[int]]:
    """Per expert, the dispatch slots of its instances: its own slot first, then its copies in
    rank order. With copies the dispatch routes to ``E + R`` slots, ``E / ep + R / ep`` per ep
    rank: own slot ``s`` is dispatch slot ``(s // n) (n + r) + s % n`` and copy slot ``i`` is
    ``(i // r) (n + r) + n + i % r`` (n = E / ep, r = R / ep)."""
    E = len(slots)
    n = _experts_per_rank(E, ep)
    r = len(copies) // ep
    out: list[list[int]] = [[] for _ in range(E)]
    for s, e in enumerate(slots):
        out[e].append((s // n) * (n + r) + s % n)
    for i, e in enumerate(copies):
        out[e].append((i // r) * (n + r) + n + i % r)
    return out


def split_counts(count_E: Sequence[int], slots: Sequence[int], copies: Sequence[int], ep: int,
                 source: int) -> list[int]:
    """The rows ep rank ``source`` sends to each of the ``E + R`` dispatch slots when it routes
    ``count_E[e]`` pairs to expert ``e``, by the split rule of the training dispatch: its ``j``-th
    pair to an expert with ``c`` instances goes to instance ``(j + source) mod c``, so instance
    ``t`` gets ``count // c`` rows, one more when ``(t - source) mod c < count mod c``."""
    inst = dispatch_instances(slots, copies, ep)
    out = [0] * (len(slots) + len(copies))
    for e, x in enumerate(count_E):
        c = len(inst[e])
        for t, slot in enumerate(inst[e]):
            out[slot] = x // c + (1 if (t - source) % c < x % c else 0)
    return out
