"""The planner's model of ``train.a2a_overlap`` as a specification: where it runs, what it hides.

Two micro-batches of a rank take turns so that one's MoE dispatch and combine all-to-alls travel
while the other computes (meshfold.runtime.overlap). The planner refuses it where meshfold does,
and charges each paired micro-batch's all-to-all only for what the partner's compute phases cannot
cover (meshfold.plan.overlap).
"""

import dataclasses

import pytest

from meshfold.mesh import FoldSpec
from meshfold.plan import MODELS, Layout, check_layout

MIXTRAL = MODELS["mixtral-8x22b"]
SEQ = 4096


@pytest.mark.parametrize("layout, gbs, reason", [
    (Layout(FoldSpec(8, ep=1), a2a_overlap=True), 16, "ep=1: there is no expert all-to-all"),
    (Layout(FoldSpec(8, ep=8), a2a_overlap=True), 8, "pp=1 and micro-batches=1: micro-batches overlap in pairs"),
    (Layout(FoldSpec(16, ep=4, pp=2), a2a_overlap=True), 16, "schedule '1f1b': only dualpipev"),
    (Layout(FoldSpec(16, ep=4, pp=2), vpp=2, schedule="interleaved-1f1b", a2a_overlap=True), 16,
     "schedule 'interleaved-1f1b': only dualpipev"),
    (Layout(FoldSpec(16, ep=4, pp=2), sharding="zero1", a2a_overlap=True), 16, "Megatron-Core's"),
])
def test_the_planner_refuses_a2a_overlap_where_meshfold_does_naming_why(layout, gbs, reason):
    assert reason in check_layout(MIXTRAL, layout, SEQ, gbs)
    assert check_layout(MIXTRAL, dataclasses.replace(layout, a2a_overlap=False), SEQ, gbs) == ""


@pytest.mark.parametrize("layout", [Layout(FoldSpec(8, ep=8), a2a_overlap=True),
                                    Layout(FoldSpec(16, ep=4, pp=2), vpp=2, schedule="dualpipev", a2a_overlap=True)])
def test_a2a_overlap_runs_on_accumulated_pairs_and_on_dualpipev(layout):
    assert check_layout(MIXTRAL, layout, SEQ, 64) == ""
    assert layout.train_overrides(MIXTRAL.name, SEQ, 64)[-1] == "train.a2a_overlap=true"
    assert layout.describe().endswith(" a2a-ovl")
