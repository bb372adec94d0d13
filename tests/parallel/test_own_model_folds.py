"""A model of one's own, unlike meshfold's and the example's (serial pre-norm blocks, a learned
softmax top-2 router, tanh experts, a z-loss of its own on the logits, its own names), laid out by
a plan alone: ``assert_matches_one_device`` holds in fp64 on four folds, one of them a pipeline
(pp2), where the last stage computes the model's own loss terms.

Legend: B = sequences, S = tokens, T = B*S, H = hidden, V = vocab, E = experts, k = top-k,
F = expert ffn."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from meshfold.kernels import grouped_mm
from meshfold.mesh import FoldSpec
from meshfold.models import MoEConfig, MoELayer, init
from meshfold.models.attention import attend
from meshfold.models.transformer import cross_entropy_sum
from meshfold.parallel.plan import Plan, SequenceParallel
from meshfold.testing import assert_matches_one_device

pytestmark = pytest.mark.multirank

V, H, HEADS, E, K, F_ = 24, 8, 2, 4, 2, 6
Z = 1e-2  # the model's own z-loss coefficient


class SoftmaxTop2(nn.Module):
    """``router(x_TH, local) -> (probs_TK, experts_TK, logits_TE)``: softmax over every expert,
    the top 2 kept and renormalized."""

    def __init__(self):
        super().__init__()
        self.proj = init.normal_(nn.Parameter(torch.empty(E, H)), std=H ** -0.5)  # [E, H]

    def forward(self, x_TH, local):
        logits_TE = x_TH @ local("router.proj", self.proj).T
        top_TK, experts_TK = logits_TE.softmax(-1).topk(K, dim=-1)
        return top_TK / top_TK.sum(-1, keepdim=True), experts_TK, logits_TE


class TanhExperts(nn.Module):
    """``experts(x_MH, offsets_E, local) -> y_MH``: ``tanh(x @ a[e]) @ b[e]`` per expert."""

    def __init__(self):
        super().__init__()
        self.a = init.normal_(nn.Parameter(torch.empty(E, H, F_)), std=H ** -0.5)
        self.b = init.normal_(nn.Parameter(torch.empty(E, F_, H)), std=F_ ** -0.5)

    def forward(self, x_MH, offsets_E, local, local_mask=None):
        h_MF = torch.tanh(grouped_mm(x_MH, local("experts.a", self.a), offsets_E))
        return grouped_mm(h_MF, local("experts.b", self.b), offsets_E)


class Mixing(nn.Module):
    """Causal attention without RoPE: ``forward(x [B, S, H], positions) -> [B, S, H]``."""

    def __init__(self):
        super().__init__()
        self.query, self.key, self.value, self.out = (nn.Linear(H, H, bias=False) for _ in range(4))
        self.context = None  # the context-parallel hook

    def forward(self, x, positions):
        B, S, _ = x.shape
        q, k, v = (f(x).view(B, S, -1, H // HEADS).transpose(1, 2) for f in (self.query, self.key, self.value))
        o = attend(q, k, v) if self.context is None else self.context(q, k, v, positions)
        return self.out(o.transpose(1, 2).reshape(B, S, -1))


class SerialBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre, self.post = nn.LayerNorm(H), nn.LayerNorm(H)
        self.mix = Mixing()
        self.ffn = MoELayer(MoEConfig(hidden=H, ffn=F_, num_experts=E, topk=K, router_dtype=torch.float64),
                            router=SoftmaxTop2(), experts=TanhExperts())

    def forward(self, x, positions):
        x = x + self.mix(self.pre(x), positions)
        return x + self.ffn(self.post(x))


class Sandwich(nn.Module):
    reduce_loss = None  # set by parallelize

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, H)
        self.trunk = nn.ModuleList(SerialBlock() for _ in range(2))
        self.ln_f = nn.LayerNorm(H)
        self.readout = nn.Linear(H, V, bias=False)

    def loss(self, tokens, targets, positions=None):
        x = self.wte(tokens)
        pos = torch.arange(tokens.shape[1]) if positions is None else positions
        for block in self.trunk:
            x = block(x, pos)
        total, count = self.loss_terms(self.readout(self.ln_f(x)), targets)
        return total / count if self.reduce_loss is None else self.reduce_loss(total, count)

    def loss_terms(self, logits, targets):
        """Cross-entropy plus a z-loss (``Z * logsumexp(logits)^2``), each summed over the counted tokens."""
        total, count = cross_entropy_sum(logits, targets)
        z = logits.double().logsumexp(-1).square()[targets != -100].sum()
        return total + Z * z.to(total.dtype), count


R = Replicate()
PLAN = Plan(
    params={"trunk.*.mix.query.weight": (R, R, Shard(0)), "trunk.*.mix.key.weight": (R, R, Shard(0)),
            "trunk.*.mix.value.weight": (R, R, Shard(0)), "trunk.*.mix.out.weight": (R, R, Shard(1))},
    default=(R, R, R),
    tp={"trunk.*.mix": SequenceParallel(positions=True)},
    context={"trunk.*.mix": "ring"},
    moe={"trunk.*.ffn": {"router.proj": ("attn", (R, R, R)), "experts.a": ("moe", (R, Shard(0), Shard(2))),
                         "experts.b": ("moe", (R, Shard(0), Shard(1)))}},
    fsdp=("trunk.*.ffn.experts", "trunk.*"),
    tp_summed=("trunk.*.pre", "trunk.*.post"),
    blocks="trunk", before=("wte",), after=("ln_f", "readout"),
)

g = torch.Generator().manual_seed(5)
BATCH = (torch.randint(0, V, (4, 8), generator=g), torch.randint(0, V, (4, 8), generator=g))


def build_fp64(cls, seed: int, device):
    """``cls()`` built in fp64 by ``init.build`` (its declared initialization, from ``seed``)."""
    def make():
        before = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            return cls()
        finally:
            torch.set_default_dtype(before)

    return init.build(make, seed=seed, device=device)


_build = functools.partial(build_fp64, Sandwich, 2)


def _check(rank, world_size, spec, data_parallel):
    return assert_matches_one_device(_build, PLAN, spec, BATCH, data_parallel=data_parallel, on_meta=True)


@pytest.mark.parametrize("spec, data_parallel", [
    (FoldSpec(4, tp=2, dp=2, ep=2), "allreduce"),          # tp2 x dp2 | edp2 x ep2
    (FoldSpec(4, cp=2, tp=2, ep=4), "fsdp"),                # cp2 x tp2 | ep4
    (FoldSpec(4, dp=2, cp=2, ep=2, etp=2), "fsdp"),         # dp2 x cp2 | ep2 x etp2
    (FoldSpec(4, pp=2, tp=2, ep=2), "fsdp"),                # pp2 x tp2 | pp2 x ep2: the model's z-loss kept
], ids=["tp2dp2-edp2ep2", "cp2tp2-ep4", "dp2cp2-ep2etp2", "pp2tp2-pp2ep2"])
def test_a_model_of_ones_own_matches_one_device_on_four_folds(worlds, spec, data_parallel):
    for diff in worlds(4).run(_check, spec, data_parallel):
        assert diff["loss"] < 1e-10 and diff["grad"] < 1e-9
