"""Per-token inputs other than the token ids (here a segment id per token, read by every block and
by its router) reach the blocks on every fold: ``Plan.per_token`` names them, the caller shards
them like the tokens, and under a pipeline each stage's blocks get their microbatch's slice. The
model is test_own_model_folds' with a segment embedding in each block and a per-segment router
bias; it equals one device in fp64 on pp2 and on cp2.

Legend: B = sequences, S = tokens, T = B*S, H = hidden, E = experts, G = segments."""

import dataclasses
import functools
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from meshfold.mesh import FoldSpec
from meshfold.models import MoEConfig, MoELayer, init
from meshfold.parallel.pipeline import Pipeline
from meshfold.testing import assert_matches_one_device
from tests.parallel.test_own_model_folds import (BATCH, E, F_, H, K, PLAN, R, Sandwich, SerialBlock, SoftmaxTop2,
                                                 TanhExperts, build_fp64)

G = 3  # segments


class SegmentRouter(SoftmaxTop2):
    """SoftmaxTop2 whose logits add a learned bias per (segment, expert):
    ``router(x_TH, local, segment) -> ...``, ``segment`` [T] flattened by the MoE layer."""

    def __init__(self):
        super().__init__()
        self.bias = init.normal_(nn.Parameter(torch.empty(G, E)), std=1.0)  # [G, E]

    def forward(self, x_TH, local, segment):
        logits_TE = x_TH @ local("router.proj", self.proj).T + local("router.bias", self.bias)[segment]
        top_TK, experts_TK = logits_TE.softmax(-1).topk(K, dim=-1)
        return top_TK / top_TK.sum(-1, keepdim=True), experts_TK, logits_TE


class SegmentBlock(SerialBlock):
    """``block(x [B, S, H], positions, segment [B, S])``: a learned embedding of each token's
    segment added before the mixer; the router reads the segment too."""

    def __init__(self):
        super().__init__()
        self.segment_embed = nn.Embedding(G, H)
        self.ffn = MoELayer(MoEConfig(hidden=H, ffn=F_, num_experts=E, topk=K, router_dtype=torch.float64),
                            router=SegmentRouter(), experts=TanhExperts())

    def forward(self, x, positions, segment):
        x = x + self.segment_embed(segment)
        x = x + self.mix(self.pre(x), positions)
        return x + self.ffn(self.post(x), segment=segment)


class Segmented(Sandwich):
    def __init__(self):
        super().__init__()
        self.trunk = nn.ModuleList(SegmentBlock() for _ in range(2))

    def loss(self, tokens, targets, positions=None, segment=None):
        x = self.wte(tokens)
        pos = torch.arange(tokens.shape[1]) if positions is None else positions
        for block in self.trunk:
            x = block(x, pos, segment)
        total, count = self.loss_terms(self.readout(self.ln_f(x)), targets)
        return total / count if self.reduce_loss is None else self.reduce_loss(total, count)


MOE = {**PLAN.moe["trunk.*.ffn"], "router.bias": ("attn", (R, R, R))}
SEGMENTED = dataclasses.replace(PLAN, moe={"trunk.*.ffn": MOE}, per_token=("segment",))
SEGMENTS = torch.randint(0, G, BATCH[0].shape, generator=torch.Generator().manual_seed(7))  # [B, S]


_build = functools.partial(build_fp64, Segmented, 3)


def _check(rank, world_size, spec):
    return assert_matches_one_device(_build, SEGMENTED, spec, (*BATCH, {"segment": SEGMENTS}))


@pytest.mark.multirank
@pytest.mark.parametrize("spec", [FoldSpec(2, pp=2), FoldSpec(2, cp=2)], ids=["pp2", "cp2"])
def test_a_per_token_input_other_than_token_ids_reaches_the_blocks_and_matches_one_device(worlds, spec):
    for diff in worlds(2).run(_check, spec):
        assert diff["loss"] < 1e-10 and diff["grad"] < 1e-9


def test_a_pipeline_step_refuses_per_token_inputs_the_plan_does_not_name():
    pipe = Pipeline.laid_out(Segmented(), SimpleNamespace(spec=FoldSpec(1)), plan=SEGMENTED)  # checked before any mesh
    tokens = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"per-token inputs \[\] but the plan's per_token names \['segment'\]"):
        pipe.step(tokens, tokens, torch.arange(4))
    with pytest.raises(ValueError, match=r"per-token inputs \['lang', 'segment'\] .* names \['segment'\]"):
        pipe.step(tokens, tokens, torch.arange(4), segment=tokens, lang=tokens)
    with pytest.raises(ValueError, match=r"per-token input 'segment' is \(2, 3\); valid: .* \(2, 4\)"):
        pipe.step(tokens, tokens, torch.arange(4), segment=tokens[:, :3])


def test_plan_per_token_names_keywords_other_than_positions_and_token_ids():
    with pytest.raises(ValueError, match=r"Plan.per_token names 'positions'"):
        dataclasses.replace(PLAN, per_token=("positions",))
    with pytest.raises(ValueError, match=r"Plan.per_token names 'ids'.*Plan.token_ids \('ids'\)"):
        dataclasses.replace(PLAN, token_ids="ids", per_token=("ids",))
