"""Your own MoE model, laid out on folds by a plan, checked against one device.

A model meshfold does not ship, with its own module classes and parameter names:

* **hash routing** (Roller et al., "Hash Layers For Large Sparse Models", NeurIPS 2021): each
  token id is sent to ``k`` experts by a fixed table (a buffer built with its values), and a
  learned gate weighs the chosen experts, so the router still learns;
* **squared-ReLU experts** (So et al., "Primer", NeurIPS 2021): ``down(relu(up(x))^2)``;
* **a parallel block** (Wang and Komatsuzaki's GPT-J; Chowdhery et al., PaLM, section 2):
  attention and the MoE layer both read one shared norm of the residual, and both outputs are
  added to it, ``x + attn(norm(x)) + moe(norm(x))``.

It is single-device PyTorch with torch's own layers (``nn.Linear``, ``nn.Embedding``,
``nn.LayerNorm``, ``nn.RMSNorm``), whose initialization meshfold reproduces on the meta device
(``docs/models.md``, "The init protocol"). ``PLAN`` says, as data, how each parameter and module
is laid out; ``parallelize(model, folded, PLAN)`` applies it. Run::

    python examples/your_own_model.py

On 4 CPU ranks, for each fold of ``FOLDS`` (together: context parallelism, expert tensor
parallelism, FSDP2, full recomputation, bf16 compute over fp32 masters, a pp2 pipeline whose
stages hash-route with the token ids ``Plan.token_ids`` hands them), the loss and every
gradient of the laid-out model equal those of the model on one device (fp64: to 1e-9; bf16
compute: to a bf16 tolerance). Prints one line per fold and exits non-zero on a mismatch.

Legend: B = sequences, S = sequence length (this rank's tokens), T = B*S tokens, H = hidden,
V = vocab, E = experts, k = experts per token, F = expert ffn, h = heads, d = head dim.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from meshfold import FoldSpec
from meshfold.kernels import grouped_mm
from meshfold.models import MoEConfig, MoELayer
from meshfold.models import init
from meshfold.models.attention import apply_rope, attend
from meshfold.models.transformer import cross_entropy_sum
from meshfold.parallel.plan import Plan, SequenceParallel
from meshfold.runtime.launch import RankError, World
from meshfold.testing import assert_matches_one_device
from meshfold.testing.worlds import cached_fold


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    hidden: int = 16
    layers: int = 2
    heads: int = 4
    head_dim: int = 4
    experts: int = 4
    topk: int = 2
    ffn: int = 8  # per expert
    rope_theta: float = 10000.0
    hash_seed: int = 1234  # the token -> experts table: fixed, the same on every rank


# ---------------------------------------------------------------- the model, single-device code
class HashRouter(nn.Module):
    """``router(x_TH, local, token_ids) -> (probs_TK, experts_TK, logits_TE)``.

    Token id ``t`` goes to the experts ``expert_of_token[t]`` [k] (distinct, drawn once from
    ``hash_seed``); their weights are ``sigmoid`` of a learned gate's scores for them. ``local``
    gives this rank's view of a parameter (on one device, the parameter). The gate is a
    parameter of this module, read inside its ``forward``: when the router is an FSDP2 group of
    its own (its dtype kept under mixed precision), FSDP2 gathers it around this call."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.gate = init.normal_(nn.Parameter(torch.empty(cfg.experts, cfg.hidden)), std=cfg.hidden ** -0.5)  # [E, H]
        g = torch.Generator().manual_seed(cfg.hash_seed)
        # built with its values (device="cpu", even inside a meta build): copied to every rank
        table = [torch.randperm(cfg.experts, generator=g, device="cpu")[:cfg.topk] for _ in range(cfg.vocab)]
        self.register_buffer("expert_of_token", torch.stack(table), persistent=False)  # [V, k]

    def forward(self, x_TH, local, token_ids):
        gate_EH = local("router.gate", self.gate)
        logits_TE = F.linear(x_TH.to(gate_EH.dtype), gate_EH)
        experts_TK = self.expert_of_token.to(token_ids.device)[token_ids.reshape(-1)]
        probs_TK = torch.sigmoid(logits_TE.gather(1, experts_TK))
        return probs_TK, experts_TK, logits_TE


class SquaredReLUExperts(nn.Module):
    """``experts(x_MH, offsets_E, local, local_mask) -> y_MH``: expert ``e`` computes
    ``relu(x @ w_up[e])^2 @ w_down[e]`` on its rows (``offsets_E``: cumulative rows per expert).
    An ffn summed over slices of F, so expert tensor parallelism may split F."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.w_up = init.normal_(nn.Parameter(torch.empty(cfg.experts, cfg.hidden, cfg.ffn)), std=cfg.hidden ** -0.5)
        self.w_down = init.normal_(nn.Parameter(torch.empty(cfg.experts, cfg.ffn, cfg.hidden)), std=cfg.ffn ** -0.5)

    def forward(self, x_MH, offsets_E, local, local_mask=None):
        h_MF = grouped_mm(x_MH, local("experts.w_up", self.w_up), offsets_E)
        return grouped_mm(F.relu(h_MF).square(), local("experts.w_down", self.w_down), offsets_E)


class OwnAttention(nn.Module):
    """Causal self-attention with RoPE: ``forward(x [B, S, H], positions [S]) -> [B, S, H]``.

    The head count is read from the projections' outputs, so a layout may split the heads.
    ``context`` (None on one device) is the hook context parallelism sets: ``context(q, k, v,
    positions) -> o``, causal attention over every cp rank's keys. The RoPE frequencies are a
    buffer that ``reset_buffers`` computes (recomputed on each rank after a meta build)."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.head_dim, self.theta = cfg.head_dim, cfg.rope_theta
        inner = cfg.heads * cfg.head_dim
        self.q = nn.Linear(cfg.hidden, inner, bias=False)  # weight [h*d, H]
        self.k = nn.Linear(cfg.hidden, inner, bias=False)
        self.v = nn.Linear(cfg.hidden, inner, bias=False)
        self.o = nn.Linear(inner, cfg.hidden, bias=False)  # weight [H, h*d]
        self.register_buffer("inv_freq", torch.empty(cfg.head_dim // 2), persistent=False)  # [d/2]
        self.reset_buffers()
        self.context = None

    def reset_buffers(self):
        d = self.head_dim
        i = torch.arange(0, d, 2, dtype=torch.float64, device=self.inv_freq.device)
        self.inv_freq.copy_(self.theta ** (-i / d))

    def forward(self, x, positions, rope=None):
        B, S, _ = x.shape
        q, k, v = (proj(x).view(B, S, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        angles = positions.to(self.inv_freq.dtype)[..., None] * self.inv_freq  # [S, d/2]
        cos, sin = (f(torch.cat((angles, angles), -1)).to(x.dtype) for f in (torch.cos, torch.sin))  # [S, d]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # [B, h, S, d]
        o = self.context(q, k, v, positions) if self.context is not None else attend(q, k, v)
        return self.o(o.transpose(1, 2).reshape(B, S, -1))


class ParallelBlock(nn.Module):
    """``x + attn(norm(x)) + moe(norm(x))``: attention and MoE side by side from one norm."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden)
        self.attn = OwnAttention(cfg)
        moe = MoEConfig(hidden=cfg.hidden, ffn=cfg.ffn, num_experts=cfg.experts, topk=cfg.topk,
                        router_dtype=torch.get_default_dtype())
        self.moe = MoELayer(moe, router=HashRouter(cfg), experts=SquaredReLUExperts(cfg))

    def forward(self, x, positions, token_ids):
        h = self.norm(x)
        return x + self.attn(h, positions) + self.moe(h, token_ids=token_ids)


class OwnModel(nn.Module):
    """``forward(tokens [B, S], positions [S] | None) -> logits [B, S, V]``; ``loss`` the mean
    cross-entropy. ``positions`` are the absolute positions of the tokens this call sees
    (default ``0..S-1``; on a fold, a rank's slice of each sequence)."""

    # set by parallelize (one device: None): a rank's (cross-entropy sum, token count) -> the
    # global batch's mean loss
    reduce_loss = None

    def __init__(self, cfg: Config):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)  # weight [V, H]
        self.blocks = nn.ModuleList(ParallelBlock(cfg) for _ in range(cfg.layers))
        self.final_norm = nn.RMSNorm(cfg.hidden)
        self.unembed = nn.Linear(cfg.hidden, cfg.vocab, bias=False)  # weight [V, H]

    def forward(self, tokens, positions=None):
        positions = torch.arange(tokens.shape[1], device=tokens.device) if positions is None else positions
        x = self.tok(tokens)  # [B, S, H]
        for block in self.blocks:
            x = block(x, positions, token_ids=tokens)
        return self.unembed(self.final_norm(x))  # [B, S, V]

    def loss(self, tokens, targets, positions=None):
        total, count = self.loss_terms(self(tokens, positions), targets)
        return total / count if self.reduce_loss is None else self.reduce_loss(total, count)

    def loss_terms(self, logits, targets):
        """(loss summed over the tokens, token count): what ``loss`` reduces, and what a pipeline's
        last stage computes from its logits (with pp > 1 ``loss`` itself never runs)."""
        return cross_entropy_sum(logits, targets)


def build(cfg: Config, seed: int, dtype: torch.dtype, device) -> OwnModel:
    """The model in ``dtype`` on ``device`` ("meta": nothing allocated, each rank materializes
    its shards when laid out), its values drawn from ``seed`` alone (meshfold.models.init)."""

    def make():
        before = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # torch's layers take their dtype from it
        try:
            return OwnModel(cfg)
        finally:
            torch.set_default_dtype(before)

    return init.build(make, seed=seed, device=device)


# ---------------------------------------------------------------- its layout, as data
R = Replicate()
REPLICATED = (R, R, R)
# the MoE layer's parameters (names within the layer) -> (view, placements over its 3 dims)
MOE_TABLE = {
    "router.gate": ("attn", REPLICATED),  # every rank routes its own tokens
    "experts.w_up": ("moe", (R, Shard(0), Shard(2))),  # (edp, ep, etp): experts over ep, F over etp
    "experts.w_down": ("moe", (R, Shard(0), Shard(1))),
}
PLAN = Plan(
    params={  # placements over attn (dp, cp, tp); FSDP2 shards further over dp x cp
        "tok.weight": REPLICATED,
        "blocks.*.norm.*": REPLICATED,
        "blocks.*.attn.[qkv].weight": (R, R, Shard(0)),  # column-parallel: output features = heads
        "blocks.*.attn.o.weight": (R, R, Shard(1)),  # row-parallel: input features = heads
        "final_norm.weight": REPLICATED,
        "unembed.weight": REPLICATED,
    },
    tp={"blocks.*.attn": SequenceParallel(positions=True)},  # all-gather tokens over tp, reduce-scatter after
    context={"blocks.*.attn": "ring"},  # cp > 1: attn.context = ring attention over cp
    moe={"blocks.*.moe": MOE_TABLE},
    fsdp=("blocks.*.moe.experts", "blocks.*"),  # FSDP2 groups: each layer's experts (on the moe mesh,
    # sharded over edp), each block (attn mesh, over dp x cp); the root holds the rest
    tp_summed=("blocks.*.norm",),  # replicated over tp, its gradient a sum of tp shares
    recompute=("blocks.*",),  # what recompute="full" checkpoints
    keep_dtype={"blocks.*.moe.router.gate": None},  # the gate computes in its own (master) dtype
    # pp > 1 (Pipeline): the blocks cut into stages, the modules before and after them, and the
    # keyword under which each block gets its tokens' ids (the hash router's input)
    blocks="blocks", before=("tok",), after=("final_norm", "unembed"), token_ids="token_ids",
)


# ---------------------------------------------------------------- the check, on 4 ranks
CFG = Config()
B, S = 4, 8  # divisible by every dp, and S by 2 * cp * tp
# (fold, data parallelism, compute dtype, recompute), together covering cp, etp, FSDP2, full
# recompute and bf16 compute over fp32 masters
FOLDS = [
    (FoldSpec(4, cp=2, tp=2, ep=2, etp=2), "fsdp", None, "full"),
    (FoldSpec(4, tp=2, ep=4), "allreduce", None, "none"),
    (FoldSpec(4, cp=2, etp=2), "fsdp", torch.bfloat16, "full"),
    (FoldSpec(4, pp=2, tp=2, ep=2), "fsdp", None, "none"),  # a pipeline: each stage's blocks hash-route
]


def check(rank, world_size, spec, data_parallel, compute_dtype, recompute):
    """On this rank: the model laid out on ``spec`` against one device; max |differences|."""
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    masters = torch.float32 if compute_dtype is not None else torch.float64
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CFG.vocab, (B, S), generator=g)
    tol = dict(rtol=5e-2, atol=5e-3) if compute_dtype is not None else dict(rtol=1e-9, atol=1e-11)
    return assert_matches_one_device(lambda device: build(CFG, 0, masters, device), PLAN, cached_fold(spec),
                                     (tokens, tokens.roll(-1, 1)), data_parallel=data_parallel,
                                     compute_dtype=compute_dtype, recompute=recompute, on_meta=True, **tol)


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    world, ok = World(4, timeout=120.0), True
    print(f"your own model ({CFG.layers} parallel blocks, hash routing E={CFG.experts} k={CFG.topk}, "
          f"squared-ReLU experts) on 4 ranks vs one device:")
    try:
        for spec, data_parallel, compute_dtype, recompute in FOLDS:
            what = (f"attn tp{spec.tp} cp{spec.cp} dp{spec.dp} | moe etp{spec.etp} ep{spec.ep} edp{spec.edp}, "
                    f"{data_parallel}, {str(compute_dtype or torch.float64).removeprefix('torch.')} compute, "
                    f"recompute {recompute}")
            try:
                diffs = world.run(check, spec, data_parallel, compute_dtype, recompute)
            except RankError as err:
                ok = False
                print(f"  {what}: MISMATCH\n{err}")
                continue
            print(f"  {what}: max|dloss| {max(d['loss'] for d in diffs):.1e}  "
                  f"max|dgrad| {max(d['grad'] for d in diffs):.1e}")
    finally:
        world.close()
    print(f"{'all folds match one device' if ok else 'FAILED'} ({len(FOLDS)} folds)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
