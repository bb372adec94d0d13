"""Expert-parallel load of a step: the rows each ep rank received per MoE layer, and max / mean.

Every ep rank waits for the busiest one in each MoE layer (its expert GEMMs, and the all-to-all
that returns its rows), so the step's metrics record, per MoE layer, the rows of each ep rank and
the busiest one's over the mean (``ep_max_over_mean``; 1.0 is balanced).

The rows of ep rank ``r`` are the (token, expert) pairs routed to the experts it holds under the
layer's current placement (:mod:`meshfold.plan.placement`: ``slots``, one tuple per MoE layer;
the static placement holds experts ``r E / ep .. (r + 1) E / ep - 1``), counted before dropping,
over every micro-batch of the step. They come from the layer's ``tokens_per_expert``, which is
summed over the whole batch: with edp > 1 there are edp ep groups, and ``ep_rank_rows[l][r]`` is
the rows of ep index ``r`` summed over them (every group's ep rank ``r`` holds the same experts).
With edp = 1 that is exactly what ep rank ``r`` received; with edp > 1 a single rank of one group
may carry more than the groups' mean when they route differently. With etp > 1 each of the ep
rank's etp ranks computes all of its rows (over a slice of the expert's ffn). With hot-expert
copies an expert's rows count split over its instances by the split rule's cuts (to within a
row per source rank and instance), rounded to whole rows.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshfold.plan.placement import even_cuts, max_over_mean, replica_rank_loads

__all__ = ["copy_ranks", "describe_copies", "ep_load_metrics"]


def ep_load_metrics(tokens_per_expert_LE: Sequence[Sequence[int]], slots_L: Sequence[Sequence[int]],
                    ep: int, copies_L: Sequence[Sequence[int]] | None = None,
                    cuts_L: Sequence | None = None) -> dict[str, list]:
    """``{"ep_rank_rows": [L][ep], "ep_max_over_mean": [L]}`` from each MoE layer's rows per
    expert (single-device order), its placement ``slots_L[l]``, its copies ``copies_L[l]``
    (None: none) and their split's cuts ``cuts_L[l]`` (:func:`meshfold.plan.placement.split_cuts`;
    None: even)."""
    copies_L = copies_L or [()] * len(slots_L)
    cuts_L = cuts_L or [None] * len(slots_L)
    if not len(tokens_per_expert_LE) == len(slots_L) == len(copies_L):
        raise ValueError(f"{len(tokens_per_expert_LE)} MoE layers of tokens_per_expert but {len(slots_L)} "
                         f"placements and {len(copies_L)} copies; valid: one of each per MoE layer")
    rows = [[round(x) for x in replica_rank_loads(load_E, slots, copies, ep,
                                                  cuts or (even_cuts(slots, copies, ep) if copies else None))]
            for load_E, slots, copies, cuts in zip(tokens_per_expert_LE, slots_L, copies_L, cuts_L)]
    return {"ep_rank_rows": rows, "ep_max_over_mean": [max_over_mean(r) for r in rows]}


def copy_ranks(copies: Sequence[int], ep: int) -> dict[int, list[int]]:
    """``{expert: [ep ranks holding a copy of it]}`` (experts and ranks increasing) of a layer's
    ``copies``: copy slot ``i`` is on ep rank ``i // (R / ep)`` (``R = len(copies)``)."""
    per_rank = len(copies) // ep if ep else 0
    out: dict[int, list[int]] = {}
    for i, e in enumerate(copies):
        out.setdefault(int(e), []).append(i // per_rank)
    return {e: sorted(out[e]) for e in sorted(out)}


def describe_copies(copies: Sequence[int], ep: int) -> str:
    """One line of where a layer's copies are: ``expert 0 on ep ranks 1, 2, 3; expert 5 on ep rank 0``."""
    where = copy_ranks(copies, ep)
    return "; ".join(f"expert {e} on ep rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}" for e, r in where.items())
