"""The MoE layer's plug points on one device: what it refuses from a router of the user's own."""

import pytest
import torch
from torch import nn

from meshfold.models import MoEConfig, MoELayer
from meshfold.models.experts import Experts
from meshfold.train.sparsity import ExpertSparsity

CFG = MoEConfig(hidden=4, ffn=4, num_experts=4, topk=2)


class FixedRouter(nn.Module):
    """Returns the routing it was given, whatever the tokens (per-token inputs are accepted)."""

    def __init__(self, probs, experts, logits):
        super().__init__()
        self.out = (probs, experts, logits)

    def forward(self, x_TH, local, **route_inputs):
        return self.out


def _route(probs, experts, logits, cfg=CFG, **route_inputs):
    MoELayer(cfg, router=FixedRouter(probs, experts, logits))(torch.randn(2, 3, cfg.hidden), **route_inputs)


def test_routing_the_dispatch_cannot_take_is_an_error_naming_it():
    T, k, E = 6, CFG.topk, CFG.num_experts
    probs, experts, logits = torch.full((T, k), 0.5), torch.zeros(T, k, dtype=torch.int64), torch.zeros(T, E)
    _route(probs, experts, logits)  # valid: runs
    _route(probs, experts, None)  # no scores: fine without balancing losses
    with pytest.raises(ValueError, match=r"fixed top-k: \[T, k\] = \[6, 2\] torch.int64"):
        _route(probs[:, :1], experts[:, :1], logits)  # k = 1 under topk = 2
    with pytest.raises(ValueError, match=r"experts_TK \(6, 2\) torch.int32"):
        _route(probs, experts.int(), logits)
    with pytest.raises(ValueError, match=r"probs_TK \(6, 2\) torch.int64; valid: \[T, k\] = \[6, 2\], floating"):
        _route(experts, experts, logits)
    with pytest.raises(ValueError, match=r"logits_TE \(6, 3\); valid: \[T, E\] = \[6, 4\] or None"):
        _route(probs, experts, logits[:, :3])
    aux = MoEConfig(hidden=4, ffn=4, num_experts=4, topk=2, aux_loss_coeff=0.01)
    with pytest.raises(ValueError, match=r"returned no logits_TE \(None\), .* \(aux / seq_aux / global_aux / z"):
        _route(probs, experts, None, cfg=aux)
    with pytest.raises(ValueError, match=r"router input 'token_ids' has shape \(2, 4\); .* \(2, 3\)"):
        _route(probs, experts, logits, token_ids=torch.zeros(2, 4, dtype=torch.int64))


def test_plugs_that_are_not_modules_or_lose_the_tile_masks_are_refused():
    with pytest.raises(TypeError, match=r"MoELayer\(router=...\) takes an nn.Module .* got function"):
        MoELayer(CFG, router=lambda x_TH, local: None)
    sparse = MoEConfig(hidden=32, ffn=32, num_experts=2, topk=1, expert_sparsity=ExpertSparsity(tile=(16, 16)))
    with pytest.raises(ValueError, match="expert_sparsity adds tile masks to meshfold's Experts"):
        MoELayer(sparse, experts=Experts(2, 32, 32))
