"""Routing loads: which share of the routed (token, expert) pairs each expert gets.

Every ep rank waits for the busiest one in each MoE layer, so the planner charges that rank's
expert GEMMs, all-to-all bytes and activations (:mod:`meshfold.plan.cost`); the dry run routes
its fake tokens by the same shares (:mod:`meshfold.dryrun.routing`). One definition here serves
both:

* ``balanced``: every expert ``1 / E`` of the pairs;
* ``zipf:S``: expert ``e`` gets a share proportional to ``(e + 1) ** -S`` (:func:`zipf_weights`),
  in the same popularity order on every rank (expert 0 most popular, so under the static
  placement ep rank 0 receives the most); ``S = 0`` is balanced;
* ``replay:RUN_DIR``: the loads a run measured, read from its ``metrics.jsonl``
  (``tokens_per_expert``, per MoE layer, summed over its steps): each MoE layer of the plan is
  charged the mean over the measured layers of what its busiest rank gets.

Every source rank is taken to route the same shares (so an ep rank receives its experts' share
of each peer's pairs); the placement (:func:`parse_placement`: ``static``, ``balanced`` or
``replicated:R``, :mod:`meshfold.plan.placement`) says which experts each ep rank holds and,
with ``R`` copy slots, which hot experts have copies there. Pure Python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from meshfold.plan.placement import balanced, replica_rank_loads, replicated, split_shares, static

__all__ = ["PLACEMENTS", "Routing", "busiest_rank_fetches", "busiest_rank_shares", "copy_slots", "largest_remainder", "parse_placement",
           "parse_routing_load", "placed", "replay_loads", "zipf_weights"]

PLACEMENTS = ("static", "balanced", "replicated:R")


def parse_placement(text: str) -> str:
    """``"static"``, ``"balanced"`` or ``"replicated:R"`` (``R >= 1`` copy slots over the ep
    ranks, as ``train.redundant_experts = R`` with ``expert_placement = "balanced"``), checked."""
    if text in ("static", "balanced"):
        return text
    if text.startswith("replicated:") and text[11:].isdigit() and int(text[11:]) >= 1:
        return f"replicated:{int(text[11:])}"
    raise ValueError(f"placement {text!r}; valid: 'static', 'balanced' or 'replicated:R' with R >= 1 copy "
                     f"slots (e.g. replicated:8)")


def copy_slots(placement: str) -> int:
    """``R`` of ``replicated:R``; 0 for ``static`` and ``balanced``."""
    placement = parse_placement(placement)
    return int(placement[11:]) if placement.startswith("replicated:") else 0


def placed(shares_E, placement: str, ep: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(slots, copies)`` of ``placement`` for one layer's expert shares (or loads) on ``ep``
    ranks: the static placement, :func:`~meshfold.plan.placement.balanced` or
    :func:`~meshfold.plan.placement.replicated` of them."""
    R = copy_slots(placement)
    if R:
        return replicated(shares_E, ep, R)
    return (static(len(shares_E), ep) if placement == "static" else balanced(shares_E, ep)), ()


def zipf_weights(num_experts: int, s: float) -> list[float]:
    """Unnormalized Zipf popularity of each expert: ``(e + 1) ** -s`` (expert 0 the most popular)."""
    if not s >= 0:
        raise ValueError(f"zipf exponent s = {s}; valid: s >= 0 (0 is balanced)")
    return [(e + 1) ** -s for e in range(num_experts)]


def largest_remainder(total: int, weights: list[float]) -> list[int]:
    """Non-negative ints proportional to ``weights`` summing to ``total`` (ties to lower index)."""
    s = sum(weights)
    exact = [total * w / s for w in weights]
    out = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda e: (-(exact[e] - out[e]), e))
    for e in order[:total - sum(out)]:
        out[e] += 1
    return out


@dataclass(frozen=True)
class Routing:
    """A routing load: ``kind`` ``"balanced"``, ``"zipf"`` (exponent ``s``) or ``"replay"``
    (``measured_LE``: per measured MoE layer, rows per expert; ``source``: the run folder)."""

    kind: str = "balanced"
    s: float = 0.0
    measured_LE: tuple[tuple[float, ...], ...] = ()
    source: str = ""

    def __post_init__(self):
        if self.kind not in ("balanced", "zipf", "replay"):
            raise ValueError(f"routing kind {self.kind!r}; valid: 'balanced', 'zipf', 'replay'")
        if self.kind == "zipf":
            zipf_weights(1, self.s)  # the exponent's check
        if self.kind == "replay" and not self.measured_LE:
            raise ValueError(f"replay routing from {self.source!r} has no measured loads")

    def shares_LE(self, num_experts: int) -> list[list[float]]:
        """Per MoE layer (one for balanced and zipf), each expert's share of the routed pairs."""
        if self.kind == "balanced":
            return [[1 / num_experts] * num_experts]
        if self.kind == "zipf":
            w = zipf_weights(num_experts, self.s)
            return [[x / sum(w) for x in w]]
        if len(self.measured_LE[0]) != num_experts:
            raise ValueError(f"replay:{self.source} measured {len(self.measured_LE[0])} experts per layer but the "
                             f"planned model has {num_experts}; valid: a run of a model with {num_experts} experts")
        return [[x / (sum(load) or 1) for x in load] for load in self.measured_LE]

    def describe(self) -> str:
        return {"balanced": "balanced", "zipf": f"zipf:{self.s:g}", "replay": f"replay:{self.source}"}[self.kind]


def replay_loads(run_dir: str | Path) -> tuple[tuple[float, ...], ...]:
    """Per MoE layer, the rows each expert was routed over every step of the run in ``run_dir``
    (its ``metrics.jsonl``, ``tokens_per_expert``)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"replay:{run_dir}: no {path}; valid: the folder of a meshfold train run (train.out_dir)")
    total: list[list[float]] | None = None
    for line in path.read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if "tokens_per_expert" not in row:
            continue
        if total is None:
            total = [[0.0] * len(layer) for layer in row["tokens_per_expert"]]
        for acc, layer in zip(total, row["tokens_per_expert"]):
            for e, x in enumerate(layer):
                acc[e] += x
    if not total:
        raise ValueError(f"replay:{run_dir}: {path} has no tokens_per_expert (a MoE model's run records them)")
    return tuple(tuple(layer) for layer in total)


def parse_routing_load(text: str) -> Routing:
    """``"balanced"``, ``"zipf:S"`` (e.g. ``zipf:1.2``) or ``"replay:RUN_DIR"`` -> a :class:`Routing`."""
    if text == "balanced":
        return Routing()
    if text.startswith("zipf:"):
        try:
            return Routing("zipf", float(text[5:]))
        except ValueError:
            pass
    if text.startswith("replay:") and text[7:]:
        return Routing("replay", measured_LE=replay_loads(text[7:]), source=text[7:])
    raise ValueError(f"routing {text!r}; valid: 'balanced', 'zipf:S' with S >= 0 (e.g. zipf:1.2) or "
                     f"'replay:RUN_DIR' (a meshfold train run's folder)")


def _busiest(shares, placement: str, ep: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """(the busiest ep rank, slots, copies) of one layer's shares under ``placement``."""
    slots, copies = placed(shares, placement, ep)
    per_rank = replica_rank_loads(shares, slots, copies, ep)
    return max(range(ep), key=lambda i: (per_rank[i], -i)), slots, copies


@lru_cache(maxsize=4096)
def busiest_rank_shares(routing: Routing, placement: str, num_experts: int, ep: int) -> tuple[tuple[float, ...], ...]:
    """Per MoE layer of ``routing``, the shares (of all routed pairs) of the expert instances of
    the busiest ep rank under ``placement`` (:func:`placed` of that layer's shares): its
    ``E / ep`` experts and, under ``replicated:R``, its ``R / ep`` copies, each expert's share
    split over its instances as training splits it (:func:`~meshfold.plan.placement.split_shares`
    of these shares; the split rule's, to within a row per source). Balanced routing, static:
    each ``1 / E``."""
    n, r = num_experts // ep, copy_slots(placement) // ep
    out = []
    for shares in routing.shares_LE(num_experts):
        k, slots, copies = _busiest(shares, placement, ep)
        split = split_shares(shares, slots, copies, ep) if copies else [(1.0,)] * num_experts
        own = [(e, 0) for e in slots[k * n:(k + 1) * n]]  # (expert, its instance): its slot is instance 0
        copied = [(e, 1 + copies[:i].count(e)) for i, e in enumerate(copies) if i // r == k] if r else []
        out.append(tuple(shares[e] * split[e][t] for e, t in own + copied))
    return tuple(out)


@lru_cache(maxsize=4096)
def busiest_rank_fetches(routing: Routing, placement: str, num_experts: int, ep: int) -> tuple[float, float]:
    """Under ``replicated:R``, (expert weights the busiest ep rank sends for the copies of its
    experts, copies it receives) per MoE layer forward, the mean over ``routing``'s layers; (0, 0)
    without copies."""
    n, r = num_experts // ep, copy_slots(placement) // ep
    if not r:
        return 0.0, 0.0
    sent = 0
    layers = routing.shares_LE(num_experts)
    for shares in layers:
        k, slots, copies = _busiest(shares, placement, ep)
        mine = set(slots[k * n:(k + 1) * n])
        sent += sum(1 for e in copies if e in mine)  # its own share included, as an all-to-all's input
    return sent / len(layers), float(r)
