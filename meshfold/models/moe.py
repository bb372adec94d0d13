"""The MoE layer: route, dispatch, experts, combine, plus shared experts and balancing losses.

Legend: B = sequences, S = sequence length (this rank's slice), T = B*S tokens on this rank,
H = hidden, E = experts, k = top-k, N = routed rows, M = rows this rank's experts receive.

Written as single-device code: ``MoELayer(cfg)`` runs on one device. Laid out from outside by
:func:`meshfold.parallel.moe.parallelize_moe`, it runs folded: each rank passes its own tokens
(batch over dp, sequence over cp and, with sequence parallelism, over tp) and gets them back in
the same layout. The only difference is the ``comm`` object the layer asks for what depends on
the ranks (:class:`~meshfold.models.comm.MoEComm`: :class:`~meshfold.models.comm.LocalComm` here,
:class:`~meshfold.parallel.moe.FoldedComm` once laid out).

The pieces, one file each: :mod:`.router` (top-k routing), :mod:`.dispatcher` (dropping,
permute / unpermute), :mod:`.experts`, :mod:`.token_stats` (the counts and their reductions over
the attention dims) and :mod:`.balancing` (the losses, attached as each rank's share, so a DP
gradient sum gives the single-device gradient). ``last_losses`` holds the full loss values
(weighted by their coefficients), ``last_metrics`` tokens per expert, dropped fraction and load
imbalance, of the last forward; :meth:`MoELayer.step_metrics` the same over every training forward
since :meth:`MoELayer.reset_step` (all micro-batches of a step).

Micro-batches. The balancing losses are defined per forward, on that forward's tokens (one
micro-batch). A step of ``m`` micro-batches sets ``balancing_scale = 1 / m`` (gradient
accumulation, a pipeline schedule), so each micro-batch's losses enter the backward scaled by
``1 / m`` and the step's balancing gradient is the mean over its micro-batches, as Megatron-Core
scales them (``MoEAuxLossAutoScaler.set_loss_scale`` with ``1 / num_microbatches``): its size
does not grow with the micro-batch count. Losses that average over tokens or sequences (z, seq_aux)
then give the gradients of the whole batch exactly, for any ``m``.
"""

from __future__ import annotations

import torch
from torch import nn

from meshfold.models.balancing import attach_loss, balancing_loss_shares
from meshfold.models.comm import LocalComm, MoEComm
from meshfold.models.config import MoEConfig
from meshfold.models.dispatcher import drop_pairs, permute, unpermute
from meshfold.models.experts import Experts, SharedExpert
from meshfold.models.router import Router
from meshfold.models.token_stats import routing_metrics, token_stats

__all__ = ["MoELayer", "add_step_entries"]


def add_step_entries(total: tuple | None, entry: tuple) -> tuple:
    """``total + entry`` of two (loss shares {name: tensor}, routed [E], kept [E]) tuples, as a
    new tuple (``total`` None: ``entry``)."""
    if total is None:
        return entry
    shares = {name: v + entry[0][name] for name, v in total[0].items()}
    return shares, total[1] + entry[1], total[2] + entry[2]


class MoELayer(nn.Module):
    """One MoE block: ``forward(x [B, S, H] or [T, H]) -> same shape``.

    :func:`meshfold.parallel.moe.parallelize_moe` lays it out on a folded mesh (its parameters
    become DTensors as ``meshfold.parallel.layouts.MOE_LAYOUT`` says and ``comm`` a
    :class:`~meshfold.parallel.moe.FoldedComm`); every rank must build the layer with identical
    initial weights (e.g. the same ``torch.manual_seed``).
    """

    def __init__(self, cfg: MoEConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg)
        self.experts = Experts(cfg.num_experts, cfg.hidden, cfg.ffn, cfg.expert_kind, dtype)
        self.shared = SharedExpert(cfg.hidden, cfg.shared_ffn, cfg.shared_kind, dtype) if cfg.shared_ffn else None
        if cfg.expert_sparsity is not None:
            self.experts.add_tile_masks(cfg.expert_sparsity)
        self.comm: MoEComm = LocalComm()
        self._loss_shares: dict[str, torch.Tensor] = {}
        self._loss_totals: dict[str, torch.Tensor] | None = {}
        self.last_metrics: dict[str, torch.Tensor] = {}
        self._bias_counts = None
        self.balancing_scale = 1.0  # 1 / micro-batches of the step (module docstring)
        # (scaled loss shares, routed [E], kept [E]) of the last training forward, and summed over
        # the training forwards since reset_step; replaced, never changed in place (recompute)
        self._step_entry: tuple | None = None
        self._step: tuple | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg, comm = self.cfg, self.comm
        shape = x.shape
        B, S = (shape[0], shape[1]) if x.dim() == 3 else (1, shape[0])
        x_TH = x.reshape(-1, shape[-1])
        T = x_TH.shape[0]
        probs_TK, experts_TK, logits_TE = self.router(x_TH, comm.local)

        keep_TK, pad_to = drop_pairs(experts_TK, probs_TK, cfg, comm)
        stats = token_stats(experts_TK, keep_TK, B, S, cfg.num_experts, bool(cfg.seq_aux_loss_coeff), comm)
        losses = balancing_loss_shares(logits_TE, stats, B, S, comm.dp, cfg)
        scale = self.balancing_scale
        for value in losses.values():
            probs_TK = attach_loss(probs_TK, value if scale == 1 else value * scale)
        self._loss_shares, self._loss_totals = {name: v.detach() for name, v in losses.items()}, None

        perm = permute(x_TH, experts_TK, probs_TK, cfg.num_experts, keep_TK, pad_to, rows=comm.rows_sent)
        in_flight = comm.dispatch_start(perm.x_NH, perm.counts_E)  # folded: the all-to-all travels...
        shared_TH = None if self.shared is None else self.shared(x_TH, comm)  # ...while this computes
        routed = in_flight.wait()  # folded: routed.tokens, a RaggedTensor on moe (ep, etp)
        y_MH = self.experts(routed.rows, routed.offsets_E, comm.local, comm.local_mask)
        y_NH = comm.combine(routed, y_MH)
        y_TH = unpermute(y_NH, perm, T)

        if shared_TH is not None:
            y_TH = y_TH + shared_TH
        self.last_metrics = routing_metrics(stats)
        if self.training:  # evaluation forwards do not steer the aux-loss-free bias, nor count in the step
            seen = self._bias_counts
            self._bias_counts = stats.routed_all if seen is None else seen + stats.routed_all
            shares = {name: v * scale for name, v in self._loss_shares.items()}
            self._step_entry = (shares, stats.routed_all, stats.kept_all)
            self._step = add_step_entries(self._step, self._step_entry)
        return y_TH.reshape(shape)

    def sparse_layers(self) -> dict:
        """The experts' ``{name: (weight, mask)}`` for ``meshfold.train.sparsity.TilePruner``
        (:meth:`Experts.sparse_layers`). Single device: under ETP each rank would prune its
        shard with its own threshold."""
        if self.cfg.expert_sparsity is None:
            raise ValueError("sparse_layers needs MoEConfig(expert_sparsity=ExpertSparsity(...))")
        return self.experts.sparse_layers()

    @property
    def last_losses(self) -> dict[str, torch.Tensor]:
        """The last forward's balancing losses (coefficient-weighted), summed over every rank's
        share. On a folded layer reading it is a collective (one fused all-reduce per attention
        dim, only the first time): every rank must read it."""
        if self._loss_totals is None:
            names = list(self._loss_shares)
            if names:
                total = self.comm.sum(torch.stack([self._loss_shares[n].double() for n in names]),
                                      ("dp", "cp", "tp"))
                self._loss_totals = dict(zip(names, total.unbind()))
            else:
                self._loss_totals = {}
        return self._loss_totals

    def reset_step(self) -> None:
        """Start a new step for :meth:`step_metrics` (forget the forwards counted so far)."""
        self._step = None

    @torch.no_grad()
    def step_metrics(self) -> dict:
        """The step's balancing losses and routing, over every training forward since
        :meth:`reset_step`: ``losses`` {name: the coefficient-weighted loss as it entered the
        gradient, i.e. the mean over micro-batches}, ``tokens_per_expert`` [E] (every routed pair
        of the step, before dropping) and ``dropped_fraction`` (of those pairs). A collective on
        a folded layer, like :attr:`last_losses`: every rank must call it."""
        if self._step is None:
            raise RuntimeError("step_metrics: no training forward since reset_step")
        shares, routed_E, kept_E = self._step
        losses = {}
        if shares:
            total = self.comm.sum(torch.stack([v.double() for v in shares.values()]), ("dp", "cp", "tp"))
            losses = dict(zip(shares, total.unbind()))
        return {"losses": losses, "tokens_per_expert": routed_E,
                "dropped_fraction": 1.0 - kept_E.sum() / routed_E.sum().clamp(min=1)}

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Aux-loss-free balancing: move the expert bias from the token counts of every forward
        since the last update (already summed over dp x cp x tp), then reset them."""
        if self._bias_counts is None:
            raise RuntimeError("update_expert_bias: no forward since the last update")
        self.router.update_expert_bias(self._bias_counts)
        self._bias_counts = None

    def discard_bias_counts(self) -> None:
        """Forget the token counts gathered since the last bias update (e.g. a skipped step)."""
        self._bias_counts = None
