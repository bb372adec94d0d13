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
An expert with ``c`` instances (its slot and its copies) has its rows split over them by shares
(:func:`split_shares`) chosen from the measured loads so the receiving ranks' rows are as even as
the instances allow, so an expert hotter than a rank's mean share can be spread over several
ranks, and a copy on a lightly loaded rank can take more than an even share.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["SHARE_UNITS", "balanced", "check_placement", "check_copies", "check_cuts", "check_replicas",
           "dispatch_instances", "even_cuts", "max_over_mean", "rank_loads", "replica_rank_loads", "replicated",
           "split_counts", "split_cuts", "split_shares", "static"]


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


def _instance_ranks(slots: Sequence[int], copies: Sequence[int], ep: int) -> list[list[int]]:
    """Per expert, the ep rank of each of its instances: its own slot first, then its copies in
    copy-slot order (the order of :func:`dispatch_instances`)."""
    n = _experts_per_rank(len(slots), ep)
    r = len(copies) // ep
    out: list[list[int]] = [[] for _ in slots]
    for s, e in enumerate(slots):
        out[e].append(s // n)
    for i, e in enumerate(copies):
        out[e].append(i // r)
    return out


def _fill(base: dict[int, float], load: float) -> dict[int, float]:
    """Water-filling: the amounts of ``load`` each rank of ``base`` (rank -> its load without it)
    takes so that the ranks that take any end level and no rank ends below that level."""
    ranks = sorted(base, key=lambda k: (base[k], k))
    level = base[ranks[0]] + load
    for i in range(1, len(ranks) + 1):
        level = (load + sum(base[k] for k in ranks[:i])) / i
        if i == len(ranks) or level <= base[ranks[i]]:
            break
    return {k: max(0.0, level - base[k]) for k in base}


def _split(load_E: Sequence[float], at: list[list[int]], ep: int) -> list[dict[int, float]]:
    """Per expert, the load each ep rank holding an instance of it computes (rank -> rows), chosen
    so the ranks' totals are as even as the instances allow.

    The totals reachable by splitting each expert over its ranks form a base polytope, whose
    least-squares point also has the smallest maximum (Fujishige, *Lexicographically optimal base
    of a polymatroid*, 1980). Block coordinate descent reaches it: each sweep re-fills every
    split expert over its ranks given the others (:func:`_fill`), until a sweep moves less than
    1e-9 of the load. Starts from the even split over instances."""
    amount = [{k: load_E[e] * x.count(k) / len(x) for k in x} for e, x in enumerate(at)]
    totals = [0.0] * ep
    for a in amount:
        for k, v in a.items():
            totals[k] += v
    split = [e for e, a in enumerate(amount) if len(a) > 1 and load_E[e] > 0]
    for _ in range(1000):
        moved = 0.0
        for e in split:
            for k, v in amount[e].items():
                totals[k] -= v
            new = _fill({k: totals[k] for k in amount[e]}, load_E[e])
            moved += sum(abs(new[k] - amount[e][k]) for k in new)
            for k, v in new.items():
                totals[k] += v
            amount[e] = new
        if moved <= 1e-9 * sum(load_E):
            break
    return amount


SHARE_UNITS = 1 << 20  # the whole of an expert's rows in split_cuts: shares in units of 2**-20


def split_shares(load_E: Sequence[float], slots: Sequence[int], copies: Sequence[int],
                 ep: int) -> tuple[tuple[float, ...], ...]:
    """Per expert, the share of its rows each of its instances receives (instances in the order
    of :func:`dispatch_instances`; each expert's shares sum to 1), chosen from the loads
    ``load_E`` so the busiest ep rank computes as few rows as the instances allow (:func:`_split`).
    Instances of one expert on one rank share its rows there evenly; an expert without load is
    split evenly."""
    at = _instance_ranks(check_placement(slots, len(load_E), ep), check_copies(copies, len(load_E), ep)
                         if copies else (), ep)
    amount = _split(load_E, at, ep)
    return tuple(tuple(amount[e][k] / x.count(k) / load_E[e] if load_E[e] > 0 else 1 / len(x) for k in x)
                 for e, x in enumerate(at))


def even_cuts(slots: Sequence[int], copies: Sequence[int], ep: int) -> tuple[tuple[int, ...], ...]:
    """Per expert, the cuts of an even split over its instances: ``(1, 2, .., c)``."""
    return tuple(tuple(range(1, len(x) + 1)) for x in _instance_ranks(slots, copies, ep))


def split_cuts(load_E: Sequence[float], slots: Sequence[int], copies: Sequence[int],
               ep: int) -> tuple[tuple[int, ...], ...]:
    """:func:`split_shares` as the split rule's *cuts*: per expert, ``c`` increasing integers,
    the running sums of its instances' shares in units of :data:`SHARE_UNITS` (the last is
    ``SHARE_UNITS``). Integers, so every rank, the device and the dry run cut rows alike."""
    out = []
    for shares in split_shares(load_E, slots, copies, ep):
        run, cuts = 0.0, []
        for f in shares[:-1]:
            run += f
            cuts.append(min(SHARE_UNITS, round(run * SHARE_UNITS)))
        out.append((*cuts, SHARE_UNITS))
    return tuple(out)


def check_cuts(cuts, slots: Sequence[int], copies: Sequence[int], ep: int) -> tuple[tuple[int, ...], ...]:
    """``cuts`` as tuples if it gives every expert one non-decreasing integer >= 0 per instance,
    the last > 0; else a ValueError naming the first expert that does not."""
    at = _instance_ranks(slots, copies, ep)
    cuts = tuple(tuple(x) for x in cuts)
    if len(cuts) != len(at):
        raise ValueError(f"split cuts for {len(cuts)} experts; valid: one tuple per expert ({len(at)})")
    for e, (c, x) in enumerate(zip(cuts, at)):
        if (len(c) != len(x) or any(not isinstance(v, int) for v in c) or c[0] < 0 or c[-1] <= 0
                or any(b < a for a, b in zip(c, c[1:]))):
            raise ValueError(f"expert {e}'s split cuts {list(c)}; valid: {len(x)} non-decreasing integers >= 0 "
                             f"(one per instance), the last > 0")
    return cuts


def replica_rank_loads(load_E: Sequence[float], slots: Sequence[int], copies: Sequence[int], ep: int,
                       cuts=None) -> list[float]:
    """Per ep rank, the load it computes under ``slots`` and ``copies``: each expert's load split
    over its instances by the split rule's ``cuts`` (:func:`split_counts`; None:
    :func:`split_shares` of ``load_E``, the split a re-choice from these loads sets). The split
    rule follows the cuts to within a row per source rank and instance."""
    slots = check_placement(slots, len(load_E), ep)
    copies = check_copies(copies, len(load_E), ep) if copies else ()
    if cuts is None:
        shares = split_shares(load_E, slots, copies, ep)
    else:
        shares = [[(b - a) / c[-1] for a, b in zip((0, *c), c)] for c in check_cuts(cuts, slots, copies, ep)]
    out = [0.0] * ep
    for e, ranks in enumerate(_instance_ranks(slots, copies, ep)):
        for k, f in zip(ranks, shares[e]):
            out[k] += load_E[e] * f
    return out


def replicated(load_E: Sequence[float], ep: int, redundant: int,
               current: tuple[Sequence[int], Sequence[int]] | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(slots, copies)``: a placement and ``redundant`` copies whose busiest rank, with each
    expert's rows split by :func:`split_shares`, carries as little load as a greedy fill allows.

    The experts' own slots are :func:`balanced`'s. Then each copy slot in turn goes where it
    relieves the busiest rank: the busiest rank's largest piece of an expert (ties: the lower
    rank, then the lower expert) gets a copy on the least-loaded rank with a free copy slot that
    does not hold that expert and is less loaded than the busiest (ties to the lower rank), and
    the split is re-balanced; the next busiest rank is tried when none of its experts can move.
    A slot that relieves no rank takes the expert with the largest load per instance that its
    rank does not hold (ties to the lower id). An expert is
    never held twice on a rank. (Copying the hottest experts in turn, without looking at the
    ranks, gave two experts of half the rows each three instances on ep4 with R = 4: six equal
    pieces on four ranks, 4/3 of the mean, where one copy each on two other ranks gives 1.)
    Each rank's copies are listed in increasing id. With ``current`` (slots, copies) given, it
    is kept unless the new one lowers the largest rank load (measurement noise moves no weights)."""
    num_experts = len(load_E)
    n = _experts_per_rank(num_experts, ep)
    if any(x < 0 for x in load_E):
        raise ValueError(f"expert loads {list(load_E)}; valid: every load >= 0")
    if redundant:
        check_copies([0] * redundant, num_experts, ep)
    slots = balanced(load_E, ep)
    per = redundant // ep
    held = [[list(slots[k * n:(k + 1) * n]), []] for k in range(ep)]  # own experts, copies

    def rank_pieces():
        at = [[] for _ in range(num_experts)]
        for k, (own, cop) in enumerate(held):
            for e in (*own, *cop):
                at[e].append(k)
        amount = _split(load_E, at, ep)
        return [sum(a.get(k, 0.0) for a in amount) for k in range(ep)], amount

    for _ in range(redundant):
        totals, amount = rank_pieces()
        free = [k for k in range(ep) if len(held[k][1]) < per]
        move = None
        for b in sorted(range(ep), key=lambda k: (-totals[k], k)):
            for e in sorted({*held[b][0], *held[b][1]}, key=lambda e: (-amount[e].get(b, 0.0), e)):
                to = [k for k in free if totals[k] < totals[b] and e not in held[k][0] + held[k][1]]
                if to and amount[e].get(b, 0.0) > 0:
                    move = e, min(to, key=lambda k: (totals[k], k))
                    break
            if move:
                break
        if move is None:  # no rank to relieve: the first free slot takes the hottest expert per instance
            k = free[0]
            count = [sum(own.count(e) + cop.count(e) for own, cop in held) for e in range(num_experts)]
            move = max((e for e in range(num_experts) if e not in held[k][0] + held[k][1]),
                       key=lambda e: (load_E[e] / count[e], -e)), k
        held[move[1]][1].append(move[0])
    copies = tuple(e for k in range(ep) for e in sorted(held[k][1]))
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
                 cuts=None) -> list[int]:
    """The rows an ep rank sends to each of the ``E + R`` dispatch slots when it routes
    ``count_E[e]`` pairs to expert ``e``, by the split rule of the training dispatch: an
    expert's ``cuts`` (``c`` increasing integers, the last the whole ``U``; None:
    :func:`even_cuts`) give instance ``t`` the keys from ``cuts[t - 1]`` (0 for ``t = 0``) up to
    ``cuts[t]``, and the rank's ``j``-th pair of ``x`` to the expert (in token order) has the key
    ``((2 j + 1) U) // (2 x)``, the midpoint of its ``1 / x`` of the whole. So instance ``t`` gets
    its share of the ``x`` rows to within one row, and every source rank cuts its rows alike."""
    inst = dispatch_instances(slots, copies, ep)
    cuts = even_cuts(slots, copies, ep) if cuts is None else check_cuts(cuts, slots, copies, ep)
    out = [0] * (len(slots) + len(copies))
    for e, x in enumerate(count_E):
        U = cuts[e][-1]
        # pairs whose key is below the cut B: j < (2 x B - U) / (2 U), rounded up, within 0 .. x
        below = [0, *(min(x, max(0, -((U - 2 * x * B) // (2 * U)))) for B in cuts[e][:-1]), x]
        for t, slot in enumerate(inst[e]):
            out[slot] = below[t + 1] - below[t]
    return out
