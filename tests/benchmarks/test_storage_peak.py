"""The benchmarks' StoragePeak (benchmarks/storage_peak.py) splits a step's bytes into activations
and model state: activations do not depend on how the weights are held (FSDP2 or one device),
and a weight FSDP2 frees by shrinking its storage counts as freed."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from storage_peak import StoragePeak  # noqa: E402

from meshfold.mesh import FoldSpec  # noqa: E402
from meshfold.testing.worlds import cached_fold  # noqa: E402

H, N = 64, 48  # hidden, tokens per rank


def _model():
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(H, 4 * H), nn.Tanh(), nn.Linear(4 * H, H), nn.Tanh(), nn.Linear(H, H))
    for p in model.parameters():
        p.data = torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.1
    return model


def _step(model, x):
    """(activation peak, step peak, model-state bytes alive when the forward returns) of one
    forward and backward, after a warm-up step (the gradients exist, as in training)."""
    model(x).square().sum().backward()
    with StoragePeak(model) as tracked:
        loss = model(x).square().sum()
        _, state_after_forward = tracked.split(tracked.snapshot())
        loss.backward()
        del loss
    return tracked.activation_peak(), tracked.peak, state_after_forward


def _fsdp_and_one_device(rank, world_size):
    from torch.distributed.fsdp import fully_shard

    x = torch.randn(N, H, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    one_device = _step(_model(), x)
    model = _model()
    mesh = cached_fold(FoldSpec(world_size)).stage("attn")["dp"]
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root holds no weights of its own
    layers = [sum(p.numel() * 8 for p in layer.parameters()) for layer in _model()]
    return one_device, _step(model, x), sum(layers), max(layers)


@pytest.mark.multirank
def test_activation_peak_under_fsdp2_equals_one_device_and_resharded_weights_count_as_freed(worlds):
    """On 2 ranks the FSDP2 model's activation peak is the one-device model's on the same tokens
    (model state is counted apart); when the forward returns, every layer has resharded, so no
    gathered weight is alive (a tracker blind to FSDP2's storage resize kept them all); and the
    step peak holds less model state than the whole unsharded model and its gradients.

    "No gathered weight": at most one layer's all-gather output, which gloo's finished work
    object may still hold for a moment when the forward returns (seen in 4 of 8 runs: the last
    layer's 33280 bytes); a tracker blind to the resize keeps every layer's (297984 bytes)."""
    for (one_act, one_peak, _), (act, peak, state_after_forward), weights, layer in worlds(2).run(_fsdp_and_one_device):
        assert act == one_act, (act, one_act)
        assert state_after_forward <= layer < weights / 2, (state_after_forward, layer, weights)
        assert act <= peak < act + 2 * weights, (act, peak, weights)


def test_on_one_device_the_new_weight_gradients_and_nothing_else_are_model_state():
    """A step after the first makes one new gradient per weight (accumulated in place into
    ``.grad``, a view the tracker must not count again): exactly those bytes are model state."""
    model = _model()
    x = torch.randn(N, H, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    model(x).square().sum().backward()
    with StoragePeak(model) as tracked:
        model(x).square().sum().backward()
    activations, state = tracked.allocated()
    assert state == sum(p.numel() * 8 for p in model.parameters()), state
    assert activations > 0
