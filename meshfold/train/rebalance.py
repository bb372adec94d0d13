"""Balanced expert placement during training (``train.expert_placement = "balanced"``).

Every ep rank waits for the busiest one, so every ``train.rebalance_every`` steps each MoE
layer's experts are re-assigned to ep ranks from the rows routed to them since the last
re-assignment (:func:`meshfold.plan.placement.balanced`, which keeps the current placement
unless the new one lowers the busiest rank's load), and moved there with their AdamW state
(:func:`meshfold.parallel.expert_placement.replace_experts`). The loads are the step metrics'
``tokens_per_expert``, already summed over every rank, so every rank takes the same decision
without exchanging anything more. The math is unchanged: routing stays in single-device expert
ids, and checkpoints are written in single-device expert order.

With ``redundant`` copy slots (``train.redundant_experts``) each re-placement also chooses which
experts get copies (:func:`meshfold.plan.placement.replicated`) and how each expert's rows are
split over its instances, in shares chosen from the same loads so the receiving ranks' rows are
as even as the instances allow (:func:`meshfold.plan.placement.split_cuts`, set with
:meth:`meshfold.parallel.moe.FoldedComm.set_copies`). The copies are fetched from their experts
each forward, so they move no weights or state of their own; the split is only routing.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from meshfold.parallel.expert_placement import expert_params, folded_moe_layers, placement_of, replace_experts
from meshfold.plan.placement import balanced, even_cuts, max_over_mean, replica_rank_loads, replicated, split_cuts

__all__ = ["Rebalancer"]


class Rebalancer:
    """Re-places the experts of ``model``'s MoE layers every ``every`` steps from their loads.

    :meth:`after_step` is called on every rank after each optimizer step with the step's
    ``tokens_per_expert`` (per MoE layer, in layer order, the same on every rank)."""

    def __init__(self, model, every: int, ep: int, redundant: int = 0):
        self.layers = folded_moe_layers(model)
        self.every, self.ep, self.redundant = every, ep, redundant
        self.loads: list[list[float]] | None = None  # per layer [E], since the last re-placement

    def after_step(self, n: int, tokens_per_expert: list[list[float]], optimizer) -> dict | None:
        """Add step ``n``'s loads; on a re-placement step, re-place and return what it did:
        ``moved_bytes`` (all ranks), ``seconds``, the busiest ep rank's load over the mean before
        (the placement, copies and split that ran) and after (worst layer, on the loads it was
        decided from), the ``placements`` and, with redundant slots, the ``copies`` and their
        split's ``cuts``."""
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
            current = placement_of(layer), layer.comm.copies or ()
            if self.redundant:
                slots, copies = replicated(load, self.ep, self.redundant, current)
            else:
                slots, copies = balanced(load, self.ep, current[0]), ()
            cuts = split_cuts(load, slots, copies, self.ep) if copies else None
            before.append(max_over_mean(replica_rank_loads(load, *current, self.ep, _cuts_of(layer))))
            after.append(max_over_mean(replica_rank_loads(load, slots, copies, self.ep, cuts)))
            sent += self._place(layer, slots, copies, optimizer, cuts)
        moved = torch.tensor(float(sent), dtype=torch.float64, device=self.layers[0].comm.moe.device_type)
        if dist.is_initialized():
            dist.all_reduce(moved)
        self.loads = None
        out = {"moved_bytes": int(moved.item()), "seconds": time.perf_counter() - t0,
               "max_over_mean_before": max(before), "max_over_mean_after": max(after),
               "placements": self.placements()}
        if self.redundant:
            out["copies"], out["cuts"] = self.copies(), self.cuts()
        return out

    @staticmethod
    def _place(layer, slots, copies, optimizer, cuts=None) -> int:
        sent = replace_experts(layer, slots, optimizer)
        layer.comm.set_copies(copies, layer.cfg.num_experts, expert_params(layer), cuts)
        return sent

    def placements(self) -> list[list[int]]:
        """Each MoE layer's placement (slot -> expert), in layer order."""
        return [list(placement_of(layer)) for layer in self.layers]

    def copies(self) -> list[list[int]]:
        """Each MoE layer's copies (copy slot -> expert; empty before the first re-placement)."""
        return [list(layer.comm.copies or ()) for layer in self.layers]

    def cuts(self) -> list[list[list[int]] | None]:
        """Each MoE layer's split of its experts' rows over their instances (per expert, the
        split rule's cuts; None: no copies)."""
        return [None if c is None else [list(k) for k in c] for c in map(_cuts_of, self.layers)]

    def restore(self, placements: list[list[int]], optimizer, copies: list[list[int]] | None = None,
                cuts: list | None = None) -> None:
        """Re-apply placements (and copies, split by their cuts) saved with a checkpoint (after
        loading it, which is in expert order). Copies are taken up only if they fit this run's
        redundant slots."""
        if len(placements) != len(self.layers):
            raise ValueError(f"{len(placements)} saved expert placements for {len(self.layers)} MoE layers")
        copies = copies or [[] for _ in placements]
        cuts = cuts or [None for _ in placements]
        for layer, slots, held, cut in zip(self.layers, placements, copies, cuts):
            fits = len(held) == self.redundant
            self._place(layer, slots, held if fits else (), optimizer, cut if fits else None)


def _cuts_of(layer):
    """The cuts the layer's copies split its experts' rows by (None: no copies)."""
    comm = layer.comm
    if comm.copies is None:
        return None
    return comm.cuts or even_cuts(placement_of(layer), comm.copies, comm.ep)
