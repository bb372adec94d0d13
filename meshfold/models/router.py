"""Router: gate logits and top-k selection (its balancing losses: :mod:`.balancing`).

Shapes: T = tokens on this rank, H = hidden, E = experts, k = top-k.

Definitions follow Megatron-Core (``megatron/core/transformer/moe/moe_utils.py``):

* :func:`topk_routing` is ``topk_routing_with_score_function``: softmax with ``pre_softmax``
  (softmax over all E, then top-k) or without (top-k on logits, softmax over the k), sigmoid
  (normalised over the k when k > 1 and ``renormalize``), group-limited top-k, a scaling factor, and an expert bias
  used for selection only. ``renormalize`` adds the Hugging Face behaviour: Mixtral always
  renormalises the pre-softmax top-k weights, Qwen2-MoE when ``norm_topk_prob`` is set.

The losses that balance this routing live beside it, in :mod:`meshfold.models.balancing`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshfold.kernels import serial_graph
from meshfold.models import init
from meshfold.models.config import MoEConfig

__all__ = ["Router", "topk_routing"]


def _group_limited_topk(scores_TE, k, num_groups, group_topk, group_score_topk=None):
    """Top-k inside the ``group_topk`` best groups; a group scores the sum of its best
    ``group_score_topk`` experts (None: ``k // group_topk``, Megatron ``group_limited_topk``;
    DeepSeek-V3's reference and Hugging Face code use 2, equal for its k = 8, group_topk = 4)."""
    T, E = scores_TE.shape
    per_group = scores_TE.view(T, num_groups, E // num_groups)
    n = k // group_topk if group_score_topk is None else group_score_topk
    group_score_TG = per_group.topk(n, dim=-1).values.sum(-1)
    best_groups = group_score_TG.topk(group_topk, dim=-1).indices
    group_mask = torch.zeros_like(group_score_TG, dtype=torch.bool).scatter_(1, best_groups, True)
    expert_mask_TE = group_mask.unsqueeze(-1).expand_as(per_group).reshape(T, E)
    masked = scores_TE.masked_fill(~expert_mask_TE, float("-inf"))
    return masked.topk(k, dim=-1)


def topk_routing(logits_TE: torch.Tensor, cfg: MoEConfig, expert_bias_E: torch.Tensor | None = None):
    """(probs_TK, experts_TK) from router logits, as Megatron-Core's score-function routing."""
    k = cfg.topk

    def topk(scores_TE):
        """(scores_TK, experts_TK): the experts are chosen on ``scores + expert_bias`` when a
        bias is given, but the scores returned are the unbiased ones at those experts."""
        biased_TE = scores_TE if expert_bias_E is None else scores_TE + expert_bias_E
        if cfg.num_groups is not None:
            top_TK, experts_TK = _group_limited_topk(biased_TE, k, cfg.num_groups, cfg.group_topk,
                                                         cfg.group_score_topk)
        else:
            top_TK, experts_TK = biased_TE.topk(k, dim=-1)
        if expert_bias_E is not None:
            top_TK = scores_TE.gather(1, experts_TK)
        return top_TK, experts_TK

    if cfg.score_function == "softmax":
        if cfg.pre_softmax:
            probs_TK, experts_TK = topk(torch.softmax(logits_TE, dim=-1))
            if cfg.renormalize:
                probs_TK = probs_TK / probs_TK.sum(-1, keepdim=True)
        else:
            top_logits_TK, experts_TK = topk(logits_TE)
            probs_TK = torch.softmax(top_logits_TK, dim=-1)
    else:
        probs_TK, experts_TK = topk(torch.sigmoid(logits_TE))
        if cfg.renormalize and k > 1:  # HF DeepSeek-V3's norm_topk_prob; Megatron always (k > 1)
            probs_TK = probs_TK / (probs_TK.sum(-1, keepdim=True) + 1e-20)
    if cfg.topk_scaling_factor is not None:
        probs_TK = probs_TK * cfg.topk_scaling_factor
    return probs_TK, experts_TK


class Router(nn.Module):
    """Linear gate (in ``router_dtype``, fp32 by default, whatever the model dtype) + top-k.

    ``forward(x_TH, local=None) -> (probs_TK, experts_TK, logits_TE)``; probs in ``router_dtype``.
    MoELayer's default router; one of the user's own follows the same
    :class:`~meshfold.models.interfaces.MoERouter` contract.
    The aux-loss-free ``expert_bias`` (buffer, [E]) only affects which experts are chosen.
    """

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden, dtype=cfg.router_dtype))
        init.normal_(self.weight, std=cfg.hidden ** -0.5)
        if cfg.expert_bias:
            self.register_buffer("expert_bias", init.zeros_(torch.empty(cfg.num_experts, dtype=torch.float32)))
        else:
            self.expert_bias = None

    def forward(self, x_TH: torch.Tensor, local=None):
        """``local(name, weight)``: this rank's view of the gate weight (the layer's comm); read
        here, inside the module call, so module hooks (FSDP2) see it."""
        cfg = self.cfg
        w = self.weight if local is None else local("router.weight", self.weight)
        x = x_TH.to(cfg.router_dtype)
        if self.training and cfg.input_jitter:
            eps = cfg.input_jitter
            x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
        logits_TE = F.linear(x, w.to(cfg.router_dtype))
        bias = None if self.expert_bias is None else self.expert_bias.to(logits_TE.dtype)
        # [T, E] softmax, top-k, renormalisation: small ops, on one thread (serial_graph)
        probs_TK, experts_TK = serial_graph(lambda l, b: topk_routing(l, cfg, b), logits_TE, bias)
        return probs_TK, experts_TK, logits_TE

    @torch.no_grad()
    def update_expert_bias(self, counts_E: torch.Tensor) -> None:
        """Aux-loss-free balancing step: ``bias += rate * sign(mean(count) - count)``.

        ``counts_E`` must be the token counts over every rank that routes with this router
        (summed over attn dp x cp x tp); call it between optimizer steps, not inside forward.
        """
        if self.expert_bias is None:
            raise ValueError("update_expert_bias needs MoEConfig(expert_bias=True)")
        c = counts_E.to(torch.float32)
        self.expert_bias += self.cfg.expert_bias_rate * torch.sign(c.mean() - c)
