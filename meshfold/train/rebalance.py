"""Balanced expert placement during training (``train.expert_placement = "balanced"``).

Every ep rank waits for the busiest one, so every ``train.rebalance_every`` steps each MoE
layer's experts are re-assigned to ep ranks from the rows routed to them since the last
re-assignment (:func:`meshfold.plan.placement.balanced`, which keeps the current placement
unless the new one lowers the busiest rank's load), and moved there with their AdamW state
(:func:`meshfold.parallel.expert_placement.replace_experts`). The loads are the step metrics'
``tokens_per_expert``, already summed over every rank, so every rank takes the same decision
without exchanging anything more. The math is unchanged: routing stays in single-device expert
ids, and checkpoints are written in single-device expert order.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from meshfold.parallel.expert_placement import folded_moe_layers, placement_of, replace_experts
from meshfold.plan.placement import balanced, max_over_mean, rank_loads

__all__ = ["Rebalancer"]


class Rebalancer:
    """Re-places the experts of ``model``'s MoE layers every ``every`` steps from their loads.

    :meth:`after_step` is called on every rank after each optimizer step with the step's
    ``tokens_per_expert`` (per MoE layer, in layer order, the same on every rank)."""

    def __init__(self, model, every: int, ep: int):
        self.layers = folded_moe_layers(model)
        self.every, self.ep = every, ep
        self.loads: list[list[float]] | None = None  # per layer [E], since the last re-placement

    def after_step(self, n: int, tokens_per_expert: list[list[float]], optimizer) -> dict | None:
        """Add step ``n``'s loads; on a re-placement step, re-place and return what it did:
        ``moved_bytes`` (all ranks), ``seconds``, the busiest ep rank's load over the mean before
        and after (worst layer, on the loads it was decided from) and the ``placements``."""
        if len(tokens_per_expert) != len(self.layers):
            raise ValueError(f"{len(tokens_per_expert)} layers of tokens_per_expert for {len(self.layers)} "
                             f"MoE layers")
        if self.loads is None:
            self.loads = [list(map(float, x)) for x in tokens_per_expert]
        else:
            self.loads = [[a + b for a, b in zip(old, x)] for old, x in zip(self.loads, tokens_per_expert)]
        if n % self.every:
            return None
        t0 = time.perf_counter()
        before, after, sent = [], [], 0
        for layer, load in zip(self.layers, self.loads):
            current = placement_of(layer)
            slots = balanced(load, self.ep, current)
            before.append(max_over_mean(rank_loads(load, current, self.ep)))
            after.append(max_over_mean(rank_loads(load, slots, self.ep)))
            sent += replace_experts(layer, slots, optimizer)
        moved = torch.tensor(float(sent), dtype=torch.float64, device=self.layers[0].comm.moe.device_type)
        if dist.is_initialized():
            dist.all_reduce(moved)
        self.loads = None
        return {"moved_bytes": int(moved.item()), "seconds": time.perf_counter() - t0,
                "max_over_mean_before": max(before), "max_over_mean_after": max(after),
                "placements": self.placements()}

    def placements(self) -> list[list[int]]:
        """Each MoE layer's placement (slot -> expert), in layer order."""
        return [list(placement_of(layer)) for layer in self.layers]

    def restore(self, placements: list[list[int]], optimizer) -> None:
        """Re-apply placements saved with a checkpoint (after loading it, which is in expert order)."""
        if len(placements) != len(self.layers):
            raise ValueError(f"{len(placements)} saved expert placements for {len(self.layers)} MoE layers")
        for layer, slots in zip(self.layers, placements):
            replace_experts(layer, slots, optimizer)
