"""meshfold.testing.assert_matches_one_device: passes when a fold computes what one device does,
and fails, naming what differs, when it does not."""

import pytest
import torch

from meshfold.mesh import FoldSpec
from meshfold.models import MoEConfig
from meshfold.models.transformer import MoETransformer, TransformerConfig, cross_entropy_sum
from meshfold.testing import assert_matches_one_device

pytestmark = pytest.mark.multirank

CFG = TransformerConfig(vocab=32, hidden=16, layers=2, heads=4, kv_heads=2, ffn=4, first_k_dense=1,
                        qkv_bias=True, moe=MoEConfig(hidden=16, ffn=4, num_experts=4, topk=2,
                                                     router_dtype=torch.float64))
g = torch.Generator().manual_seed(0)
BATCH = (torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g))


def _transformer(device):
    return MoETransformer(CFG, dtype=torch.float64, device=device, seed=3)


def _local_mean(model, tokens, targets, positions):
    """A loss that forgets to reduce over the ranks: each rank's mean of its own tokens."""
    total, count = cross_entropy_sum(model.local_logits(tokens, positions), targets)
    return total / count


def _checks(rank, world_size, spec):
    whole = assert_matches_one_device(_transformer, None, spec, BATCH)  # a copy of the reference, perturbed
    meta = assert_matches_one_device(_transformer, None, spec, BATCH, on_meta=True, data_parallel="allreduce",
                                     recompute="full")
    with pytest.raises(AssertionError, match="the loss differs from one device"):
        assert_matches_one_device(_transformer, None, spec, BATCH, loss=_local_mean)
    return whole, meta


def test_a_fold_matches_one_device_and_a_wrong_loss_is_caught(worlds):
    for whole, meta in worlds(4).run(_checks, FoldSpec(4, cp=2, ep=2, etp=2)):
        assert whole["loss"] < 1e-12 and whole["grad"] < 1e-10 and meta["grad"] < 1e-10
