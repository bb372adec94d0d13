"""A router and experts of the user's own in meshfold's MoE layer, on folded layouts.

``MoELayer(cfg, router=..., experts=...)`` with a hash router that reads token ids (an extra
router input, sharded like the tokens) and squared-ReLU experts of other weight names computes
what one device computes (fp64); under bf16 compute every parameter of the router module keeps
the router's dtype.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from meshfold.kernels import grouped_mm
from meshfold.mesh import FoldSpec
from meshfold.models import MoEConfig, MoELayer
from meshfold.models.router import topk_routing
from meshfold.parallel import MOE_LAYOUT, batch_rows, local_positions, parallelize_moe
from meshfold.testing.strategies import fold_specs
from meshfold.testing.worlds import cached_fold

pytestmark = pytest.mark.multirank

R = Replicate()
f64 = torch.float64
E, H, FFN, K = 4, 6, 4, 2  # experts, hidden, expert ffn, top-k
B, S, VOCAB = 2, 8, 50


class HashRouter(nn.Module):
    """Hash routing: token id t goes to experts ``(h(t) + j) % E`` for j < k, weighted by a
    softmax over those experts' learnable gates. No scores, so no balancing losses."""

    def __init__(self, num_experts: int, topk: int):
        super().__init__()
        self.num_experts, self.topk = num_experts, topk
        self.gate = nn.Parameter(torch.randn(num_experts, dtype=f64))

    def forward(self, x_TH, local, token_ids):
        first_T = (token_ids * 7919 + 13) % self.num_experts
        experts_TK = (first_T[:, None] + torch.arange(self.topk, device=x_TH.device)) % self.num_experts
        probs_TK = torch.softmax(local("router.gate", self.gate)[experts_TK], dim=-1)
        return probs_TK, experts_TK, None


class SquaredReLUExperts(nn.Module):
    """``down(relu(up x)^2)`` per expert, weights ``w_in`` [E, H, F] and ``w_out`` [E, F, H]."""

    def __init__(self, num_experts: int, hidden: int, ffn: int):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(num_experts, hidden, ffn, dtype=f64) * hidden ** -0.5)
        self.w_out = nn.Parameter(torch.randn(num_experts, ffn, hidden, dtype=f64) * ffn ** -0.5)

    def forward(self, x_MH, offsets_E, local, local_mask):
        h_MF = grouped_mm(x_MH, local("experts.w_in", self.w_in), offsets_E)
        return grouped_mm(F.relu(h_MF).square(), local("experts.w_out", self.w_out), offsets_E)


HASH_CFG = MoEConfig(hidden=H, ffn=FFN, num_experts=E, topk=K, router_dtype=f64)
HASH_LAYOUT = {"router.gate": ("attn", (R, R, R)),  # every rank routes its own tokens
               "experts.w_in": ("moe", (R, Shard(0), Shard(2))),  # experts over ep, ffn over etp
               "experts.w_out": ("moe", (R, Shard(0), Shard(1)))}


def _hash_layer():
    return MoELayer(HASH_CFG, router=HashRouter(E, K), experts=SquaredReLUExperts(E, H, FFN))


def _own_router_and_experts(rank, world_size, spec, seed):
    """Largest |folded - single device| of the output, the input gradient and each parameter's
    gradient, with the token ids cut like the tokens (meshfold.parallel.batch)."""
    torch.manual_seed(seed)
    ref = _hash_layer()
    layer = _hash_layer()
    layer.load_state_dict(ref.state_dict())
    parallelize_moe(layer, cached_fold(spec), layout=HASH_LAYOUT)
    g = torch.Generator().manual_seed(seed + 1)
    X, W = (torch.randn(B, S, H, generator=g, dtype=f64) for _ in range(2))
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    Xr = X.clone().requires_grad_(True)
    Y = ref(Xr, token_ids=ids)
    (Y * W).sum().backward()
    Y = Y.detach()
    rows, pos = batch_rows(B, spec, rank), local_positions(S, spec, rank)

    def mine(t):
        return t[rows.start:rows.stop][:, pos]

    x = mine(X).clone().requires_grad_(True)
    y = layer(x, token_ids=mine(ids))
    (y * mine(W)).sum().backward()
    grads = {n: p.grad.full_tensor() for n, p in layer.named_parameters()}  # sums the Partial grads
    diffs = {"y": (y - mine(Y)).abs().max().item(), "x.grad": (x.grad - mine(Xr.grad)).abs().max().item()}
    diffs.update({n: (grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters()})
    return diffs


def test_own_router_with_token_ids_and_own_experts_equal_one_device(worlds):
    world = worlds(4)

    @settings(max_examples=4)
    @given(fold_specs(world_sizes=[4], pp=[1], experts=E, expert_ffn=FFN, seq_len=S, batch=B),
           st.integers(0, 10**6))
    def check(spec, seed):
        for diffs in world.run(_own_router_and_experts, spec, seed):
            assert set(diffs) == {"y", "x.grad", "router.gate", "experts.w_in", "experts.w_out"}
            assert max(diffs.values()) < 1e-12, (spec, diffs)

    check()


class LinearRouter(nn.Module):
    """A linear gate with a bias, as an ``nn.Linear`` (parameters ``gate.weight``, ``gate.bias``),
    then meshfold's top-k; computes in ``cfg.router_dtype``."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.hidden, cfg.num_experts, dtype=cfg.router_dtype)

    def forward(self, x_TH, local):
        w, b = local("router.gate.weight", self.gate.weight), local("router.gate.bias", self.gate.bias)
        logits_TE = F.linear(x_TH.to(self.cfg.router_dtype), w, b)
        probs_TK, experts_TK = topk_routing(logits_TE, self.cfg)
        return probs_TK, experts_TK, logits_TE


def _bf16_compute_with_a_router_of_two_parameters(rank, world_size):
    """bf16 compute over fp32 masters: the dtype each parameter is used in, the router's logits
    (and whether they equal the router's own on the same tokens), the output's and the
    gradients' dtypes; and the error for a keep_dtype that names no parameter."""
    cfg = MoEConfig(hidden=8, ffn=4, num_experts=4, topk=2, aux_loss_coeff=1e-2)  # router_dtype fp32
    torch.manual_seed(0)
    layer = MoELayer(cfg, dtype=torch.float32, router=LinearRouter(cfg))
    router = LinearRouter(cfg)
    router.load_state_dict(layer.router.state_dict())
    layout = {"router.gate.weight": ("attn", (R, R, R)), "router.gate.bias": ("attn", (R, R, R)),
              "experts.w_gate_up": MOE_LAYOUT["experts.w_gate_up"], "experts.w_down": MOE_LAYOUT["experts.w_down"]}
    parallelize_moe(layer, cached_fold(FoldSpec(world_size, ep=world_size)), layout=layout,
                    compute_dtype=torch.bfloat16)
    seen = {}
    layer.router.register_forward_hook(lambda module, args, out: seen.update(logits=out[2]))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(2, 3, cfg.hidden, generator=g).to(torch.bfloat16).requires_grad_(True)
    y = layer(x)
    y.float().square().sum().backward()
    want = router(x.detach().reshape(-1, cfg.hidden), lambda name, p: p)[2]
    try:  # a keep_dtype entry that names no parameter of the layer
        parallelize_moe(MoELayer(cfg, router=LinearRouter(cfg)), cached_fold(FoldSpec(world_size, ep=world_size)),
                        layout=layout, compute_dtype=torch.bfloat16, keep_dtype={"router.weight": None})
        unknown = None
    except ValueError as err:
        unknown = str(err)
    return {"unknown": unknown, "used": {n: layer.comm.local(n, p).dtype for n, p in layer.named_parameters()},
            "logits": seen["logits"].dtype, "logits_equal": torch.equal(seen["logits"], want),
            "y": y.dtype, "grads": {n: p.grad.dtype for n, p in layer.named_parameters()}}


def test_every_router_parameter_keeps_the_router_dtype_under_bf16_compute(worlds):
    for out in worlds(2).run(_bf16_compute_with_a_router_of_two_parameters):
        assert out["used"] == {"router.gate.weight": torch.float32, "router.gate.bias": torch.float32,
                               "experts.w_gate_up": torch.bfloat16, "experts.w_down": torch.bfloat16}
        assert out["logits"] == torch.float32 and out["logits_equal"]
        assert out["y"] == torch.bfloat16
        assert set(out["grads"].values()) == {torch.float32}  # gradients in the master dtype
        assert out["unknown"].startswith("keep_dtype names ['router.weight'], which are not parameters of the layer")


def _place_on_the_second_of_two_equal_folds(rank, world_size):
    """Two folds of one spec in one process, DTensor's op cache warmed on the first: whether
    ``place`` puts a parameter on the second fold's mesh object, and whether FSDP2 then shards
    it over that mesh."""
    from torch.distributed.tensor import distribute_tensor

    from meshfold.mesh import fold
    from meshfold.parallel import place
    from meshfold.runtime.compat import fully_shard_over

    spec, placements = FoldSpec(world_size), (R, R, R)
    first, second = fold(spec), fold(spec)
    w = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    nn.Parameter(distribute_tensor(w, first.stage("attn"), placements))  # caches the op for an equal mesh
    module = nn.Module()
    module.w = place(w, second.stage("attn"), placements)
    on_second = module.w.device_mesh is second.stage("attn")
    fully_shard_over(module, second.stage("attn"), ("dp", "cp"))
    sharded = tuple(module.w.to_local().shape)
    first.destroy()
    second.destroy()
    return on_second, sharded


def test_place_keeps_a_parameter_on_the_mesh_it_is_given_for_fsdp(worlds):
    assert worlds(2).run(_place_on_the_second_of_two_equal_folds) == [(True, (2, 4))] * 2
