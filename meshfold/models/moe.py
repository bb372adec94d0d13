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
imbalance.
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

__all__ = ["MoELayer"]


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
        for value in losses.values():
            probs_TK = attach_loss(probs_TK, value)
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
        if self.training:  # evaluation forwards do not steer the aux-loss-free bias
            seen = self._bias_counts
            self._bias_counts = stats.routed_all if seen is None else seen + stats.routed_all
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
