"""Tile-wise sparsity (Guo et al., SC 2020, arXiv 2008.13006) for expert and dense weights.

Legend: E = experts, K = input dim, N = output dim, (bk, bn) = tile, Kt = K // bk, Nt = N // bn.
Weights are stored K x N (the paper's B[K, N]); a mask is bool [E, Kt, Nt] in the layout
:func:`meshfold.kernels.grouped_mm` takes, so the kernel skips pruned tiles and their gradients
are exactly zero. A dense [K, N] weight is handled as E = 1.

The method, as in the paper:

* importance per weight: magnitude |w| or the Taylor score (dL/dW * W)^2 accumulated over the
  steps since the last prune; a unit's score is the L2 norm of its importances / its size;
* one global threshold over every layer of a group (layers compete for the same budget);
* a gradual schedule: prune to ``schedule[i]`` at step ``start_step + i * steps_per_stage`` and
  train in between; pruned units never regrow;
* optimizer moments (Adam/AdamW ``exp_avg``, ``exp_avg_sq``) of pruned units are zeroed, else
  momentum would move the weights again.

Units: ``pattern="tile"`` prunes single bk x bn tiles. ``pattern="tw"`` is the paper's own
pattern mapped onto the kernel: N is cut into stripes of G = ``stripe`` columns (a multiple of
bn) and each stripe drops its own K-rows, in groups of bk rows so that they are whole kernel tiles.
With ``tile=(1, G)`` this is exactly the paper's pattern (the torch path runs it; the Triton path
needs bk, bn multiples of 16). TW-2D and the "mix" variant are not implemented.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshfold.kernels import check_etp_alignment, dense_tile_mask, expand_tile_mask, grouped_mm, tile_grid

SCORES = ("taylor", "magnitude")
PATTERNS = ("tile", "tw")
MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")


@dataclass(frozen=True)
class ExpertSparsity:
    """Tile-sparsity settings a MoE config holds as ``expert_sparsity`` (or a dense layer uses).

    tile: (bk, bn) tile in K x N, the unit the kernels skip. schedule: sparsity after each stage.
    Stage i prunes at step ``start_step + i * steps_per_stage``. stripe: TW stripe width G.
    """

    tile: tuple[int, int] = (64, 64)
    schedule: tuple[float, ...] = (0.25, 0.5, 0.75)
    score: str = "taylor"
    pattern: str = "tile"
    stripe: int | None = None
    start_step: int = 1000
    steps_per_stage: int = 1000

    def __post_init__(self):
        if self.score not in SCORES:
            raise ValueError(f"score={self.score!r}; valid: {', '.join(SCORES)}")
        if self.pattern not in PATTERNS:
            raise ValueError(f"pattern={self.pattern!r}; valid: {', '.join(PATTERNS)}")
        if len(self.tile) != 2 or min(self.tile) < 1:
            raise ValueError(f"tile={self.tile}; valid: (bk, bn) with bk, bn >= 1")
        if any(not 0.0 <= s < 1.0 for s in self.schedule) or list(self.schedule) != sorted(self.schedule):
            raise ValueError(f"schedule={self.schedule}; valid: non-decreasing sparsities in [0, 1)")
        if self.steps_per_stage < 1 or self.start_step < 0:
            raise ValueError(f"start_step={self.start_step}, steps_per_stage={self.steps_per_stage}; "
                             f"valid: start_step >= 0, steps_per_stage >= 1")
        if self.pattern == "tw" and (self.stripe is None or self.stripe % self.tile[1]):
            raise ValueError(f"pattern='tw' needs stripe G a multiple of bn = {self.tile[1]}, got stripe={self.stripe}")

    @property
    def unit(self) -> tuple[int, int]:
        """(rows, cols) pruned together: a tile, or bk rows of one TW stripe."""
        return (self.tile[0], self.stripe) if self.pattern == "tw" else self.tile

    def prune_steps(self) -> list[int]:
        return [self.start_step + i * self.steps_per_stage for i in range(len(self.schedule))]

    def target_at(self, step: int) -> float:
        """Sparsity the schedule asks for once ``step`` has been reached (0 before the first stage)."""
        reached = [s for s, at in zip(self.schedule, self.prune_steps()) if step >= at]
        return reached[-1] if reached else 0.0

    def new_mask(self, E: int, K: int, N: int, *, etp: int = 1, etp_dim: str = "N", device=None) -> torch.Tensor:
        """All-kept mask [E, Kt, Nt] after checking the tiles against the weight and its ETP shards."""
        check_etp_alignment(K, N, self.unit, etp, etp_dim)
        return dense_tile_mask(E, K, N, self.tile, device=device)


# ----------------------------------------------------------------------------- scores


def _as_experts(t: torch.Tensor) -> torch.Tensor:
    """[K, N] -> [1, K, N]; [E, K, N] unchanged; [E, K, d1, d2, ...] -> [E, K, d1 * d2 * ...]
    (e.g. fused gate/up experts [E, H, 2, F] as [E, H, 2F]). A view in every case."""
    if t.dim() == 2:
        return t.unsqueeze(0)
    return t if t.dim() == 3 else t.view(t.shape[0], t.shape[1], -1)


def unit_scores(importance: torch.Tensor, unit: tuple[int, int]) -> torch.Tensor:
    """importance [E, K, N] (or [K, N]) -> [E, K // ur, N // uc]: L2 norm of each unit / its size."""
    imp = _as_experts(importance).float()
    E, K, N = imp.shape
    ur, uc = unit
    kt, nt = tile_grid(K, N, unit)
    blocks = imp.reshape(E, kt, ur, nt, uc)
    return blocks.pow(2).sum(dim=(2, 4)).sqrt() / (ur * uc)


def global_prune(scores: Mapping[str, torch.Tensor], kept: Mapping[str, torch.Tensor],
                 sparsity: float) -> dict[str, torch.Tensor]:
    """New keep-masks with ``round(sparsity * units)`` pruned over all layers together.

    scores / kept: per layer [E, Kt, Nt] (float / bool). Units pruned before stay pruned (no
    regrowth); the lowest-scoring kept units are pruned until the global count is reached, which
    is one threshold shared by every layer. Ties break by layer order, then position.
    """
    names = list(scores)
    flat_scores = torch.cat([scores[n].flatten() for n in names])
    flat_kept = torch.cat([kept[n].flatten() for n in names])
    target = round(sparsity * flat_kept.numel())
    to_prune = target - int((~flat_kept).sum())
    new_kept = flat_kept.clone()
    if to_prune > 0:
        candidates = torch.where(flat_kept, flat_scores, torch.inf)
        order = torch.sort(candidates, stable=True).indices
        new_kept[order[:to_prune]] = False
    out, start = {}, 0
    for n in names:
        size = kept[n].numel()
        out[n] = new_kept[start:start + size].reshape(kept[n].shape)
        start += size
    return out


def zero_pruned_moments(optimizer: torch.optim.Optimizer, weight: torch.Tensor, keep: torch.Tensor) -> None:
    """Multiply the optimizer state of ``weight`` (Adam/AdamW moments, SGD momentum) by ``keep``.

    keep: element mask broadcastable to weight (to its local shard when weight is a DTensor).
    Without this the stored momentum of a freshly pruned tile keeps updating it even though its
    gradient is zero.
    """
    state = optimizer.state.get(weight, {})
    for key in MOMENT_KEYS:
        if key in state:
            local_shard(state[key]).mul_(keep.to(state[key].dtype))


@torch.no_grad()
def mask_weight_(weight: torch.Tensor, keep: torch.Tensor, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Zero the pruned elements of ``weight``, of its pending gradient and of its optimizer state.

    keep: element mask broadcastable to weight, or to its local shard when weight is a DTensor
    (each rank then masks what it holds). The gradient matters when pruning runs between backward
    and ``optimizer.step()``: it was computed while the tile was alive, and Adam would turn it
    into fresh momentum.
    """
    local_shard(weight).mul_(keep.to(weight.dtype))
    if weight.grad is not None:
        local_shard(weight.grad).mul_(keep.to(weight.grad.dtype))
    if optimizer is not None:
        zero_pruned_moments(optimizer, weight, keep)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view: writing it writes the DTensor); t itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


# ----------------------------------------------------------------------------- pruner


class TilePruner:
    """Prunes a group of layers with one global threshold on the schedule of ``config``.

    layers: name -> (weight parameter [E, K, N] or [K, N], mask [E, Kt, Nt] bool); a weight with
    more dims, [E, K, d1, ...], is pruned as [E, K, d1 * ...] (:func:`_as_experts`). The masks are the
    buffers the layers pass to the kernel; they are updated in place, so the layers see each
    prune. Call :meth:`accumulate` after every backward (Taylor score) and :meth:`step` once per
    training step, between backward and ``optimizer.step()``.
    """

    def __init__(self, layers: Mapping[str, tuple[torch.Tensor, torch.Tensor]], config: ExpertSparsity,
                 optimizer: torch.optim.Optimizer | None = None):
        self.config = config
        self.optimizer = optimizer
        self.layers = dict(layers)
        for name, (w, mask) in self.layers.items():
            E, K, N = _as_experts(w).shape
            tile_grid(K, N, config.unit)  # a TW stripe must divide N too
            if mask.dtype != torch.bool or tuple(mask.shape) != (E, *tile_grid(K, N, config.tile)):
                raise ValueError(f"{name}: mask {mask.dtype} {tuple(mask.shape)} does not match weight "
                                 f"{tuple(w.shape)} with tile {config.tile} (valid: bool {(E, K // config.tile[0], N // config.tile[1])})")
        self.taylor = {name: torch.zeros_like(w, dtype=torch.float32) for name, (w, _) in self.layers.items()}

    @torch.no_grad()
    def accumulate(self) -> None:
        """Add (dL/dW * W)^2 of the current gradients to the Taylor scores."""
        for name, (w, _) in self.layers.items():
            g = w.grad
            if g is not None:
                self.taylor[name].add_((g.float() * w.float()).pow(2))

    def sparsity(self) -> float:
        """Fraction of pruned tiles over the whole group."""
        pruned = sum(int((~m).sum()) for _, m in self.layers.values())
        return pruned / sum(m.numel() for _, m in self.layers.values())

    def _units(self, mask: torch.Tensor) -> torch.Tensor:
        """Tile mask [E, Kt, Nt] -> unit mask (TW: one entry per stripe; all tiles of a stripe agree)."""
        if self.config.pattern == "tw":
            return mask[:, :, :: self.config.stripe // self.config.tile[1]]
        return mask

    def _tiles(self, units: torch.Tensor) -> torch.Tensor:
        if self.config.pattern == "tw":
            return units.repeat_interleave(self.config.stripe // self.config.tile[1], dim=2)
        return units

    @torch.no_grad()
    def prune_to(self, sparsity: float) -> None:
        """Prune the group to ``sparsity`` (fraction of units); never revives a pruned unit."""
        scores, kept = {}, {}
        for name, (w, mask) in self.layers.items():
            imp = self.taylor[name] if self.config.score == "taylor" else w.abs()
            scores[name] = unit_scores(imp, self.config.unit)
            kept[name] = self._units(mask)
        new_kept = global_prune(scores, kept, sparsity)
        for name, (w, mask) in self.layers.items():
            mask.copy_(self._tiles(new_kept[name]))
            self.taylor[name].zero_()  # the next stage scores the weights as they are trained from here
        self.apply_()

    @torch.no_grad()
    def apply_(self) -> None:
        """Zero pruned weights, their pending gradients and optimizer moments (idempotent;
        :func:`mask_weight_`)."""
        for w, mask in self.layers.values():
            w3 = _as_experts(w)
            mask_weight_(w, expand_tile_mask(mask, w3.shape[1], w3.shape[2]).reshape(w.shape), self.optimizer)

    def step(self, step: int) -> bool:
        """Prune when ``step`` is a stage boundary of the schedule; True if it pruned."""
        if step not in self.config.prune_steps():
            return False
        self.prune_to(self.config.target_at(step))
        return True


# ----------------------------------------------------------------------------- dense layer


class TileSparseLinear(nn.Module):
    """y [..., N] = x [..., K] @ (W * mask) + b, with W stored [K, N] and run by ``grouped_mm``, E = 1.

    The same kernel (and its tile skipping) as the experts, so dense layers can be tile-sparse too.
    ``tile_mask`` [1, K // bk, N // bn] is a buffer; hand ``(weight, tile_mask)`` to a TilePruner.
    """

    def __init__(self, in_features: int, out_features: int, tile: tuple[int, int] = (64, 64), bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(in_features, out_features, device=device, dtype=dtype))  # [K, N]
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.register_buffer("tile_mask", dense_tile_mask(1, in_features, out_features, tile, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's init: U(-1/sqrt(K), 1/sqrt(K)) for weight and bias
        bound = 1.0 / math.sqrt(self.in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_TK = x.reshape(-1, self.in_features)
        offsets = torch.full((1,), x_TK.shape[0], dtype=torch.int32, device=x.device)
        y_TN = grouped_mm(x_TK, self.weight.unsqueeze(0), offsets, tile_mask=self.tile_mask)
        if self.bias is not None:
            y_TN = y_TN + self.bias
        return y_TN.reshape(*x.shape[:-1], self.out_features)
