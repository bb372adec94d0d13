"""Tile-wise pruning of folded expert weights during ``meshfold train``.

The pruning method lives in :mod:`meshfold.sparsity` and works on whole weights. Under EP / ETP
each rank holds only a shard, yet the paper's threshold is global over the whole group of layers.
So at a prune step every rank gathers the full expert weights (and, for the Taylor score, the
full accumulated ``(dL/dW * W)^2``), runs the same :class:`~meshfold.sparsity.TilePruner` step
on them (identical input, identical masks everywhere; the masks are full-size buffers that each
layer slices for its shard), then zeroes its own shards of the weights, pending gradients and
optimizer moments under the new masks (:func:`~meshfold.sparsity.mask_weight_`). The cost:
with the Taylor score, full weights and gradients are gathered every step until the last stage
(and every rank keeps full fp32 scores), magnitude scoring gathers only at prune steps. That
suits the CPU-scale models ``meshfold train`` runs; scoring shards locally and reducing only
per-tile scores is the step to take for large models. Scores accumulated since the last stage
are not checkpointed, so a run resumed mid-stage scores from the resume on.
"""

from __future__ import annotations

import torch

from meshfold.kernels.reference import expand_tile_mask
from meshfold.sparsity import ExpertSparsity, TilePruner, local_shard, mask_weight_

__all__ = ["FoldedPruner"]


class FoldedPruner:
    """Prune every MoE layer of ``model`` together, on ``config``'s schedule."""

    def __init__(self, model, config: ExpertSparsity, optimizer):
        self.config, self.optimizer = config, optimizer
        self.layers = model.moe_layers()
        self.taylor: dict[str, torch.Tensor] = {}
        self.last_target: float | None = None  # sparsity of the last stage applied

    def _params(self):
        for i, layer in enumerate(self.layers):
            ex = layer.experts
            yield f"{i}.w_gate_up", layer, ex.w_gate_up, "experts.mask_gate_up", ex.mask_gate_up
            yield f"{i}.w_down", layer, ex.w_down, "experts.mask_down", ex.mask_down

    @staticmethod
    def _full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    @torch.no_grad()
    def accumulate(self) -> None:
        """Add this step's (dL/dW * W)^2 (full tensors; call after gradients are reduced)."""
        if self.config.score != "taylor" or self._done():
            return
        for name, _, p, _, _ in self._params():
            if p.grad is None:
                continue
            score = (self._full(p.grad).float() * self._full(p).float()).pow(2)
            self.taylor[name] = score if name not in self.taylor else self.taylor[name] + score

    @torch.no_grad()
    def step(self, step: int) -> bool:
        """Prune when ``step`` reaches a new stage (a boundary skipped for a non-finite loss is
        caught up at the next step); True if it pruned."""
        if self.last_target is None:  # first call, maybe after a resume: masks hold step - 1's stage
            self.last_target = self.config.target_at(step - 1)
        target = self.config.target_at(step)
        if target <= self.last_target:
            return False
        self.last_target = target
        group = {}
        for name, _, p, _, mask in self._params():
            w = self._full(p).detach().clone()
            E, K = w.shape[0], w.shape[1]
            group[name] = (w.reshape(E, K, -1), mask.view(E, mask.shape[1], -1))
        pruner = TilePruner(group, self.config)
        for name in group:
            if name in self.taylor:
                pruner.taylor[name] = self.taylor[name].reshape(group[name][0].shape)
        pruner.prune_to(target)  # updates the shared, full masks in place
        self.taylor.clear()
        for _, layer, p, mask_name, mask in self._params():
            local_mask = layer.comm.local_mask(mask_name, mask)
            local_shape = local_shard(p).shape
            E, K = local_shape[0], local_shape[1]
            flat_mask = local_mask.reshape(E, local_mask.shape[1], -1)
            keep = expand_tile_mask(flat_mask, K, local_shape[1:].numel() // K).reshape(local_shape)
            mask_weight_(p, keep, self.optimizer)
        return True

    def _done(self) -> bool:
        return self.last_target is not None and self.last_target >= max(self.config.schedule, default=0.0)

    def sparsity(self) -> float:
        masks = [m for *_, m in self._params()]
        return 1.0 - sum(int(m.sum()) for m in masks) / sum(m.numel() for m in masks)
