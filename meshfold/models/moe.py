"""The MoE layer: route, dispatch, experts, combine, plus shared experts and balancing losses.

Legend: B = sequences, S = sequence length (this rank's slice), T = B*S tokens on this rank,
H = hidden, E = experts, k = top-k, N = routed rows.

Written as single-device code. ``MoELayer(cfg)`` runs on one device; ``MoELayer(cfg, mesh=fm)``
(or :func:`~meshfold.models.moe_parallel.parallelize_moe`) runs folded: each rank passes its own
tokens (batch over dp, sequence over cp and, with sequence parallelism, over tp) and gets them
back in the same layout. The only difference is the ``comm`` object the layer asks for
collectives (see :mod:`meshfold.models.moe_parallel`).

Losses, on the routing map that dispatch uses (Megatron-LM#2767 computed them on another one):

* ``aux``: Switch loss over each DP rank's micro-batch (its tokens, summed over cp x tp), averaged
  over DP ranks: Megatron-Core's ``aux_loss``.
* ``global_aux``: Switch loss over the tokens of every DP rank (counts summed over dp x cp x tp),
  equal to the single-device loss on the whole batch. Counts are summed rather than per-rank
  losses averaged, so there is no 1/DP shrinkage (Megatron-LM#3672).
* ``seq_aux``: Switch loss per sequence (counts summed over cp x tp), averaged over sequences.
* ``z``: mean over all tokens of ``logsumexp(logits)^2``.

Each rank attaches only its share of every loss (its tokens' probabilities times the global
counts), so the shares of all ranks sum to the loss and so do their gradients: a DP gradient sum
gives exactly the single-device gradient. ``last_losses`` holds the full values (weighted by
their coefficients) and ``last_metrics`` tokens per expert, dropped fraction and load imbalance.
All token statistics of one forward travel in two fused vectors (over (cp, tp), then dp): three
small all-reduces per layer on a folded mesh, besides the dispatch's own count exchange.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshfold.models.config import MoEConfig
from meshfold.models.dispatcher import capacity, keep_mask, permute, unpermute
from meshfold.models.experts import Experts, SharedExpert, shared_expert_ffn
from meshfold.models.moe_parallel import LocalComm, parallelize_moe
from meshfold.models.router import Router, attach_loss, aux_scores, switch_aux_loss, z_loss

__all__ = ["MoELayer"]


class MoELayer(nn.Module):
    """One MoE block: ``forward(x [B, S, H] or [T, H]) -> same shape``.

    With ``mesh`` (a :class:`~meshfold.mesh.FoldedMesh`) the parameters become DTensors laid out
    as ``moe_parallel.MOE_LAYOUT`` and the layer runs folded; every rank must construct the layer
    with identical initial weights (e.g. the same ``torch.manual_seed``).
    """

    def __init__(self, cfg: MoEConfig, mesh=None, dtype: torch.dtype | None = None):
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg)
        self.experts = Experts(cfg.num_experts, cfg.hidden, cfg.ffn, cfg.expert_kind, dtype)
        self.shared = SharedExpert(cfg.hidden, cfg.shared_ffn, cfg.shared_kind, dtype) if cfg.shared_ffn else None
        if cfg.expert_sparsity is not None:
            self._add_tile_masks(cfg.expert_sparsity, mesh)
        self.comm = LocalComm()
        self._loss_shares: dict[str, torch.Tensor] = {}
        self._loss_totals: dict[str, torch.Tensor] | None = {}
        self.last_metrics: dict[str, torch.Tensor] = {}
        self._bias_counts = None
        if mesh is not None:
            parallelize_moe(self, mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg, comm = self.cfg, self.comm
        shape = x.shape
        B, S = (shape[0], shape[1]) if x.dim() == 3 else (1, shape[0])
        x_TH = x.reshape(-1, shape[-1])
        T = x_TH.shape[0]
        probs_TK, experts_TK, logits_TE = self.router(x_TH, comm.local)

        keep_TK, pad_to = self._drop(experts_TK, probs_TK, T)
        stats = self._token_stats(experts_TK, keep_TK, B, S, T)
        probs_TK = self._attach_losses(probs_TK, logits_TE, stats, B, S, T)

        perm = permute(x_TH, experts_TK, probs_TK, cfg.num_experts, keep_TK, pad_to)
        x_MH, offsets, handle = comm.dispatch(perm.x_NH, perm.counts_E, cfg.num_experts)
        masks = (None, None)
        if cfg.expert_sparsity is not None:
            m1 = comm.local_mask("experts.mask_gate_up", self.experts.mask_gate_up)
            masks = (m1.reshape(m1.shape[0], m1.shape[1], -1),
                     comm.local_mask("experts.mask_down", self.experts.mask_down))
        y_MH = self.experts(x_MH, offsets, comm.local, masks)
        y_NH = comm.combine(y_MH, handle)
        y_TH = unpermute(y_NH, perm, T)

        if self.shared is not None:
            y_TH = y_TH + self._shared(x_TH)
        self._metrics(stats)
        return y_TH.reshape(shape)

    # ---- tile-sparse experts ---------------------------------------------------------------
    def _add_tile_masks(self, sp, mesh) -> None:
        """Per-expert tile masks: gate_up [E, H/bk, 2, F/bn] (gate and up tiles kept apart, so an
        ETP shard of F takes matching tiles of both) and down [E, F/bk, H/bn]."""
        cfg = self.cfg
        etp = mesh.spec.etp if mesh is not None else 1
        E, H, Fn = cfg.num_experts, cfg.hidden, cfg.ffn
        two = 2 if cfg.expert_kind == "swiglu" else 1
        gate_up = sp.new_mask(E, H, Fn, etp=etp, etp_dim="N")  # checks tiles vs. F and its shards
        self.experts.register_buffer(
            "mask_gate_up", gate_up.unsqueeze(2).expand(-1, -1, two, -1).contiguous())
        self.experts.register_buffer("mask_down", sp.new_mask(E, Fn, H, etp=etp, etp_dim="K"))

    def sparse_layers(self) -> dict:
        """``{name: (weight parameter, mask [E, Kt, Nt])}`` for ``meshfold.sparsity.TilePruner``:
        ``w_down`` [E, F, H]; ``w_gate_up`` [E, H, 2, F], which the pruner reads as [E, H, 2F]
        (gate columns, then up), with its mask [E, H/bk, 2, F/bn] viewed the same way. Single
        device: under ETP each rank would prune its shard with its own threshold."""
        if self.cfg.expert_sparsity is None:
            raise ValueError("sparse_layers needs MoEConfig(expert_sparsity=ExpertSparsity(...))")
        ex = self.experts
        m = ex.mask_gate_up
        return {"w_gate_up": (ex.w_gate_up, m.view(m.shape[0], m.shape[1], -1)),
                "w_down": (ex.w_down, ex.mask_down)}

    # ---- pieces -----------------------------------------------------------------------------
    def _shared(self, x_TH):
        comm, sh = self.comm, self.shared
        x_full = comm.shared_in(x_TH)
        y = comm.shared_out(shared_expert_ffn(x_full, comm.local("shared.w_gate_up", sh.w_gate_up),
                                              comm.local("shared.w_down", sh.w_down)))
        if sh.gate is not None:
            y = y * torch.sigmoid(F.linear(x_TH, comm.local("shared.gate", sh.gate)))
        return y

    def _drop(self, experts_TK, probs_TK, T):
        cfg, comm = self.cfg, self.comm
        if cfg.capacity_factor is None:
            return None, None
        if cfg.drop_scope == "sub_sequence":
            cap = capacity(T, cfg.topk, cfg.num_experts, cfg.capacity_factor)
            keep = keep_mask(experts_TK, probs_TK, cfg.num_experts, cap, cfg.drop_policy)
        else:  # decide over the DP rank's tokens, gathered over attn (cp, tp)
            both = torch.cat([experts_TK.to(probs_TK.dtype), probs_TK.detach()], dim=1)
            group, offset = comm.gather_tokens(both, ("cp", "tp"))
            k = cfg.topk
            g_experts, g_probs = group[:, :k].long(), group[:, k:]
            cap = capacity(group.shape[0], k, cfg.num_experts, cfg.capacity_factor)
            keep = keep_mask(g_experts, g_probs, cfg.num_experts, cap, cfg.drop_policy)[offset:offset + T]
        return keep, (cap if cfg.pad_to_capacity else None)

    @torch.no_grad()
    def _token_stats(self, experts_TK, keep_TK, B, S, T) -> dict:
        """Every token statistic the losses and metrics need, summed over the right attention
        dims in one fused vector per stage: (cp, tp) first (one sequence's ranks), then dp.
        Counts are of the routing map before dropping (Megatron-LM#2767: losses must see the
        map dispatch uses); ``kept`` after dropping. Three small all-reduces per layer at most."""
        cfg, comm, E = self.cfg, self.comm, self.cfg.num_experts
        dev = experts_TK.device
        e = experts_TK.reshape(-1)
        routed_E = torch.zeros(E, dtype=torch.int64, device=dev).scatter_add_(0, e, torch.ones_like(e))
        kept_E = routed_E if keep_TK is None else torch.zeros_like(routed_E).scatter_add_(
            0, e, keep_TK.reshape(-1).to(torch.int64))
        parts = [routed_E, kept_E, torch.tensor([T, S], device=dev)]
        if cfg.seq_aux_loss_coeff:
            seq_of = torch.arange(T, device=dev).div(S, rounding_mode="floor").repeat_interleave(cfg.topk)
            seq_BE = torch.zeros(B, E, dtype=torch.int64, device=dev).index_put_(
                (seq_of, e), torch.ones_like(e), accumulate=True)
            parts.append(seq_BE.reshape(-1))
        seq_part = comm.sum(torch.cat(parts), ("cp", "tp"))  # one sequence group's totals
        routed_seq, kept_seq, (T_seq, S_seq) = seq_part[:E], seq_part[E:2 * E], seq_part[2 * E:2 * E + 2]
        every = comm.sum(torch.cat([routed_seq, kept_seq, T_seq.reshape(1),
                                    torch.tensor([B], device=dev)]), ("dp",))
        return {"routed_seq": routed_seq, "T_seq": T_seq.double(), "S_seq": S_seq.double(),
                "seq_BE": seq_part[2 * E + 2:].reshape(B, E) if cfg.seq_aux_loss_coeff else None,
                "routed_all": every[:E], "kept_all": every[E:2 * E],
                "T_all": every[2 * E].double(), "B_all": every[2 * E + 1].double()}

    def _attach_losses(self, probs_TK, logits_TE, st, B, S, T):
        cfg, comm = self.cfg, self.comm
        losses = {}
        if cfg.any_aux_loss:
            scores_TE = aux_scores(logits_TE, cfg)
        if cfg.aux_loss_coeff:
            losses["aux"] = cfg.aux_loss_coeff * switch_aux_loss(
                scores_TE, st["routed_seq"], st["T_seq"], cfg) / comm.dp
        if cfg.global_aux_loss_coeff:
            losses["global_aux"] = cfg.global_aux_loss_coeff * switch_aux_loss(
                scores_TE, st["routed_all"], st["T_all"], cfg)
        if cfg.seq_aux_loss_coeff:
            # the Switch loss of each sequence (its S tokens' scores, its counts), summed over B
            share = switch_aux_loss(scores_TE.reshape(B, S, -1).transpose(0, 1), st["seq_BE"], st["S_seq"], cfg)
            losses["seq_aux"] = cfg.seq_aux_loss_coeff * share / st["B_all"]
        if cfg.z_loss_coeff:
            losses["z"] = cfg.z_loss_coeff * z_loss(logits_TE, st["T_all"])
        for value in losses.values():
            probs_TK = attach_loss(probs_TK, value)
        self._loss_shares = {name: v.detach() for name, v in losses.items()}
        self._loss_totals = None
        return probs_TK

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
    def _metrics(self, st) -> None:
        total_E, kept_E = st["routed_all"], st["kept_all"]
        self.last_metrics = {
            "tokens_per_expert": total_E,
            "dropped_fraction": 1.0 - kept_E.sum() / total_E.sum().clamp(min=1),
            "load_imbalance": total_E.max() / total_E.float().mean().clamp(min=1e-9),
        }
        if self.training:  # evaluation forwards do not steer the aux-loss-free bias
            self._bias_counts = total_E if self._bias_counts is None else self._bias_counts + total_E

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
