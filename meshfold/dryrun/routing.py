"""Routing models of a dry run: where the tokens of a fake forward go.

A fake tensor has no values, so a dry run cannot route; yet the dispatch's all-to-all sizes and
the experts' row counts depend on the routing. meshfold reads token counts on the host exactly
once per MoE layer forward (:func:`meshfold.placements.token_dispatch.block_counts`: the
per-expert counts of every rank of the ``(ep, etp)`` block, ``C[q][i][e]``), so a routing model
answers that one read with host ints and everything downstream is sized from them, exactly as
a real run is sized from its read.

* :class:`Balanced` (the default): every rank sends its ``pairs`` = tokens x top-k as evenly as
  integers allow, ``pairs // E`` to each expert and one more to ``pairs % E`` of them: rank s of
  the block takes the ``pairs % E`` experts that follow rank s - 1's around the ring of experts,
  so the block's extra rows cover the experts evenly (any two experts receive within one row of
  each other over the block, any two ep ranks within E / ep rows).
* :class:`Zipf` (``s`` > 0): expert ``e`` gets a share proportional to ``(e + 1) ** -s`` on
  every rank (the same popularity order everywhere, expert 0 most popular, so ep rank 0 receives
  the most rows), rounded by largest remainder so each rank's counts still sum to its pairs: the
  shares of :mod:`meshfold.plan.routing`, which the planner's ``--routing zipf:S`` charges.
  ``s = 0`` is balanced; ``s = 1`` gives expert 0 of 8 about 37% of the pairs.
* :class:`Placed`: another model's counts under an expert placement (a permutation of the
  experts into ep-rank slots, :mod:`meshfold.plan.placement`): the dispatch counts rows per
  slot, so slot ``s`` gets the rows of expert ``slots[s]``; a re-balanced run is planned with it.
  With hot-expert ``copies`` the counts cover the ``E + R`` dispatch slots, each expert's rows
  split over its instances by the training dispatch's rule
  (:func:`meshfold.plan.placement.split_counts`), and the dry run's layers fetch the copies.
* :class:`Replay`: the counts a real run read, call by call (tests compare a dry run with the
  real run it replays).

Models dropless routing (``capacity_factor`` None, the configs' default): with dropping, the
counts would be clipped to the capacity per rank; the dry run refuses such configs instead of
guessing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshfold.plan.placement import split_counts
from meshfold.plan.routing import largest_remainder, zipf_weights

__all__ = ["Balanced", "Zipf", "Replay", "Placed", "parse_routing", "expert_rows"]


@dataclass(frozen=True)
class Balanced:
    """Every expert gets ``pairs // E`` rows of each rank, the remainder spread round-robin."""

    def counts(self, pairs: int, num_experts: int, source: int) -> list[int]:
        """Rows rank ``source`` (its position in the dispatch block) sends to each expert."""
        base, extra = divmod(pairs, num_experts)
        start = source * extra  # source s takes the next `extra` experts of the ring after s - 1
        return [base + (1 if (e - start) % num_experts < extra else 0) for e in range(num_experts)]

    def block(self, call: int, pairs: int, num_experts: int, n_ep: int, n_etp: int) -> list:
        """``C[q][i][e]``: counts of every rank (etp q, ep i) of the block, each sending ``pairs``."""
        return [[self.counts(pairs, num_experts, i * n_etp + q) for i in range(n_ep)] for q in range(n_etp)]

    def describe(self) -> str:
        return "balanced"


@dataclass(frozen=True)
class Zipf(Balanced):
    """Expert ``e`` gets a share proportional to ``(e + 1) ** -s`` of every rank's pairs."""

    s: float = 1.0

    def __post_init__(self):
        zipf_weights(1, self.s)  # the exponent's check

    def counts(self, pairs: int, num_experts: int, source: int) -> list[int]:
        return largest_remainder(pairs, zipf_weights(num_experts, self.s))

    def describe(self) -> str:
        return f"zipf:{self.s:g}"


@dataclass
class Replay:
    """The block counts a real rank read, in call order (``calls[n]`` is ``C`` of its n-th read)."""

    calls: list = field(default_factory=list)

    def block(self, call: int, pairs: int, num_experts: int, n_ep: int, n_etp: int) -> list:
        if call >= len(self.calls):
            raise ValueError(f"Replay: read {call + 1} asked for, but the recorded run read only "
                             f"{len(self.calls)} times")
        return self.calls[call]

    def describe(self) -> str:
        return "replay"


@dataclass(frozen=True)
class Placed:
    """``inner``'s counts in slot order under placement ``slots`` (slot ``s`` holds expert
    ``slots[s]``, slot ``s`` is on ep rank ``s // (E / ep)``) and, when given, ``copies`` (copy
    slot ``i`` of ep rank ``i // (R / ep)`` holds expert ``copies[i]``): then the counts are per
    dispatch slot (``E / ep + R / ep`` per ep rank), each expert's split over its instances as
    the training dispatch splits them by ``cuts`` (:func:`~meshfold.plan.placement.split_cuts`;
    None: evenly)."""

    inner: object
    slots: tuple
    copies: tuple = ()
    cuts: tuple | None = None

    def block(self, call: int, pairs: int, num_slots: int, n_ep: int, n_etp: int) -> list:
        E = len(self.slots)
        if num_slots != E + len(self.copies) or sorted(self.slots) != list(range(E)):
            raise ValueError(f"placement {list(self.slots)} with copies {list(self.copies)} does not fit the "
                             f"layer's {num_slots} dispatch slots (valid: a permutation of its experts, and its "
                             f"copy slots)")
        C = self.inner.block(call, pairs, E, n_ep, n_etp)
        if self.copies:
            return [[split_counts(row, self.slots, self.copies, n_ep, self.cuts) for row in q] for q in C]
        return [[[row[e] for e in self.slots] for row in q] for q in C]

    def describe(self) -> str:
        kind = (f"{len(self.copies)} copies {list(self.copies)}" if self.copies else
                "static" if list(self.slots) == sorted(self.slots) else "balanced")
        return f"{self.inner.describe()}, {kind} placement"


def expert_rows(routing, pairs: int, num_experts: int, n_ep: int, n_etp: int) -> list[int]:
    """Rows each expert (or slot, for a :class:`Placed` model) receives over one dispatch block
    whose every rank sends ``pairs`` rows: the first call's counts summed over the block."""
    C = routing.block(0, pairs, num_experts, n_ep, n_etp)
    return [sum(row[e] for q in C for row in q) for e in range(num_experts)]


def parse_routing(text: str):
    """``"balanced"`` or ``"zipf:S"`` (e.g. ``zipf:1.2``) -> a routing model."""
    if text == "balanced":
        return Balanced()
    if text.startswith("zipf:"):
        try:
            return Zipf(float(text[5:]))
        except ValueError:
            pass
    raise ValueError(f"routing {text!r}; valid: 'balanced' or 'zipf:S' with S >= 0 (e.g. zipf:1.0)")
