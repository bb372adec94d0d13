"""Load-balancing losses of the router, on the routing map that dispatch uses.

Shapes: T = tokens on this rank, E = experts, k = top-k, B = sequences, S = sequence length.

Definitions follow Megatron-Core (``megatron/core/transformer/moe/moe_utils.py``):

* ``aux``: :func:`switch_aux_loss` (``switch_load_balancing_loss_func``,
  ``E / (k * N^2) * sum_e count_e * sum_t p_te``, 1 for a perfectly balanced router) over each DP
  rank's micro-batch (its tokens, summed over cp x tp), averaged over DP ranks: Megatron-Core's
  ``aux_loss``. Hugging Face's ``load_balancing_loss_func`` is the same quantity times k.
* ``global_aux``: the Switch loss over the tokens of every DP rank (counts summed over
  dp x cp x tp), equal to the single-device loss on the whole batch. Counts are summed rather
  than per-rank losses averaged, so there is no 1/DP shrinkage (Megatron-LM#3672).
* ``seq_aux``: the Switch loss per sequence (counts summed over cp x tp), averaged over sequences.
* ``z``: :func:`z_loss` (``z_loss_func``), the mean over all tokens of ``logsumexp(logits)^2``.

Every loss here is linear in the router probabilities once the token counts are fixed
(:mod:`meshfold.models.token_stats`). So each rank attaches only its share of every loss (its
tokens' probabilities times the global counts): the shares of all ranks sum to the loss and so
do their gradients, and a DP gradient sum gives exactly the single-device gradient with no
extra collective. The losses join the backward through :func:`attach_loss` on the routing
probabilities, without changing the forward output.
"""

from __future__ import annotations

import torch

from meshfold.models.config import MoEConfig
from meshfold.models.token_stats import TokenStats

__all__ = ["aux_scores", "switch_aux_loss", "z_loss", "attach_loss", "balancing_loss_shares"]


def aux_scores(logits_TE: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """Per-expert probabilities the balancing losses use: softmax over all E, or for sigmoid the
    sigmoid scores normalised to sum to 1 (Megatron-Core's choice)."""
    if cfg.score_function == "softmax":
        return torch.softmax(logits_TE, dim=-1)
    s = torch.sigmoid(logits_TE)
    return s / (s.sum(-1, keepdim=True) + 1e-20)


def switch_aux_loss(scores_TE, counts_E, num_tokens, cfg: MoEConfig):
    """Switch load-balancing loss ``E / (k N^2) sum_e count_e sum_t p_te``.

    ``counts_E`` and ``num_tokens`` describe the whole balancing group (already summed over its
    ranks); ``scores_TE`` may be only this rank's tokens, giving this rank's share of the loss.
    """
    E, k = cfg.num_experts, cfg.topk
    n = torch.as_tensor(num_tokens, dtype=torch.float64)  # a tensor stays on device: no sync
    return (scores_TE.sum(0) * counts_E).sum() * (E / (k * n * n))


def z_loss(logits_TE, num_tokens):
    """``sum_t logsumexp(logits_t)^2 / num_tokens`` (the mean when num_tokens = T)."""
    n = torch.as_tensor(num_tokens, dtype=torch.float64)
    return torch.logsumexp(logits_TE, dim=-1).square().sum() / n


def balancing_loss_shares(logits_TE: torch.Tensor, st: TokenStats, B: int, S: int, dp: int,
                          cfg: MoEConfig) -> dict[str, torch.Tensor]:
    """This rank's share of every configured loss (coefficient-weighted), by name."""
    losses = {}
    if cfg.any_aux_loss:
        scores_TE = aux_scores(logits_TE, cfg)
    if cfg.aux_loss_coeff:
        losses["aux"] = cfg.aux_loss_coeff * switch_aux_loss(scores_TE, st.routed_seq, st.T_seq, cfg) / dp
    if cfg.global_aux_loss_coeff:
        losses["global_aux"] = cfg.global_aux_loss_coeff * switch_aux_loss(scores_TE, st.routed_all, st.T_all, cfg)
    if cfg.seq_aux_loss_coeff:
        # the Switch loss of each sequence (its S tokens' scores, its counts), summed over B
        share = switch_aux_loss(scores_TE.reshape(B, S, -1).transpose(0, 1), st.seq_BE, st.S_seq, cfg)
        losses["seq_aux"] = cfg.seq_aux_loss_coeff * share / st.B_all
    if cfg.z_loss_coeff:
        losses["z"] = cfg.z_loss_coeff * z_loss(logits_TE, st.T_all)
    return losses


class _AttachLoss(torch.autograd.Function):
    """Return ``x`` unchanged; in backward, give ``loss`` the gradient 1, so the loss joins the
    backward pass as if added to the final loss, without changing the forward output."""

    @staticmethod
    def forward(ctx, x, loss):
        ctx.save_for_backward(loss)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


def attach_loss(x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``x``, with ``loss`` added to whatever loss the backward starts from."""
    return _AttachLoss.apply(x, loss)
