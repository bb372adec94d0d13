"""Tile-wise pruning of folded expert weights during ``meshfold train``.

The pruning method lives in :mod:`meshfold.train.sparsity` and works on whole weights. Under EP / ETP
each rank holds only a shard, yet the paper's threshold is global over the whole group of layers.
So at a prune step every rank gathers the full expert weights (and, for the Taylor score, the
full accumulated ``(dL/dW * W)^2``), runs the same :class:`~meshfold.train.sparsity.TilePruner` step
on them (identical input, identical masks everywhere; the masks are full-size buffers that each
layer slices for its shard), then zeroes its own shards of the weights, pending gradients and
optimizer moments under the new masks (:func:`~meshfold.train.sparsity.mask_weight_`). The cost:
with the Taylor score, full weights and gradients are gathered every step until the last stage
(and every rank keeps full fp32 scores), magnitude scoring gathers only at prune steps. That
suits the CPU-scale models ``meshfold train`` runs; scoring shards locally and reducing only
per-tile scores is the step to take for large models. Scores accumulated since the last stage
are not checkpointed, so a run resumed mid-stage scores from the resume on.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from meshfold.kernels.reference import expand_tile_mask
from meshfold.train.sparsity import ExpertSparsity, TilePruner, mask_weight_

__all__ = ["FoldedPruner", "shard_like"]


def shard_like(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``full`` (a tensor of ``p``'s whole shape) cut as ``p`` is cut.

    An expert weight is sharded over ep and etp by the fold and then over edp by FSDP2, on dim 0
    (a strided shard: FSDP2 cuts the ep-local experts) or on the hidden dim
    (:func:`~meshfold.parallel.data_parallel.expert_shard_placement`). Slicing by the fold's own
    ep / etp ranges misses the edp cut, so the piece is taken by DTensor's own placements,
    locally (``src_data_rank=None``: every rank holds ``full``, nothing is sent)."""
    if not isinstance(p, DTensor):
        return full
    return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()


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
            yield f"{i}.w_gate_up", ex.w_gate_up, ex.mask_gate_up
            yield f"{i}.w_down", ex.w_down, ex.mask_down

    @staticmethod
    def _full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    @torch.no_grad()
    def accumulate(self) -> None:
        """Add this step's (dL/dW * W)^2 (full tensors; call after gradients are reduced)."""
        if self.config.score != "taylor" or self._done():
            return
        for name, p, _ in self._params():
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
        for name, p, mask in self._params():
            w = self._full(p).detach().clone()
            E, K = w.shape[0], w.shape[1]
            group[name] = (w.reshape(E, K, -1), mask.view(E, mask.shape[1], -1))
        pruner = TilePruner(group, self.config)
        for name in group:
            if name in self.taylor:
                pruner.taylor[name] = self.taylor[name].reshape(group[name][0].shape)
        pruner.prune_to(target)  # updates the shared, full masks in place
        self.taylor.clear()
        for _, p, mask in self._params():
            E, K = p.shape[0], p.shape[1]  # the whole weight's shape, as the full mask's
            keep = expand_tile_mask(mask.reshape(E, mask.shape[1], -1), K, p.shape[1:].numel() // K)
            mask_weight_(p, shard_like(keep.reshape(p.shape), p), self.optimizer)
        return True

    def _done(self) -> bool:
        return self.last_target is not None and self.last_target >= max(self.config.schedule, default=0.0)

    def sparsity(self) -> float:
        masks = [m for *_, m in self._params()]
        return 1.0 - sum(int(m.sum()) for m in masks) / sum(m.numel() for m in masks)
