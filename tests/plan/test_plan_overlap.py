"""The planner's model of ``train.a2a_overlap`` as a specification: where it runs, what it hides.

Two micro-batches of a rank take turns so that one's MoE dispatch and combine all-to-alls travel
while the other computes (meshfold.runtime.overlap). The planner refuses it where meshfold does,
and charges each paired micro-batch's all-to-all only for what the partner's compute phases cannot
cover (meshfold.plan.overlap).
"""

import dataclasses

import pytest

from meshfold.mesh import FoldSpec
from meshfold.plan import HARDWARE, MODELS, TIME_TERMS, Layout, check_layout, estimate, hardware

MIXTRAL = MODELS["mixtral-8x22b"]   # every layer MoE
SEQ = 4096
H100 = HARDWARE["h100"]
# all-to-alls far shorter than any compute phase, and far longer
FAST = hardware("h100", nvlink_gbps=1e9, internode_gbps=1e9, nvlink_latency_us=0.0, internode_latency_us=0.0)
SLOW = hardware("h100", nvlink_gbps=1e-3, internode_gbps=1e-3)
PAIRED = Layout(FoldSpec(16, tp=2, ep=8), a2a_overlap=True)   # dp 8: global batch 24 is m = 3 micro-batches
COMBINED = Layout(FoldSpec(32, tp=2, ep=8, pp=2), sharding="allreduce", a2a_overlap=True)   # 1F1B, combined
DUALPIPEV = Layout(FoldSpec(32, tp=2, ep=8, pp=2), vpp=2, schedule="dualpipev", sharding="allreduce",
                   a2a_overlap=True)


def _both(hw, layout, gbs, **knobs):
    """(estimate without a2a_overlap, with it) of ``layout`` with ``knobs`` replaced."""
    layout = dataclasses.replace(layout, **knobs)
    return tuple(estimate(MIXTRAL, hw, dataclasses.replace(layout, a2a_overlap=o), SEQ, gbs) for o in (False, True))


@pytest.mark.parametrize("layout, gbs, reason", [
    (Layout(FoldSpec(8, ep=1), a2a_overlap=True), 16, "ep=1: there is no expert all-to-all"),
    (Layout(FoldSpec(8, ep=8), a2a_overlap=True), 8, "pp=1 and micro-batches=1: a forward overlaps another micro-batch's backward"),
    (Layout(FoldSpec(16, ep=4, pp=2), vpp=2, schedule="interleaved-1f1b", a2a_overlap=True), 16,
     "schedule 'interleaved-1f1b': 1f1b (combined) and dualpipev"),
    (Layout(FoldSpec(16, ep=4, pp=2), sharding="zero1", a2a_overlap=True), 16, "Megatron-Core's"),
])
def test_the_planner_refuses_a2a_overlap_where_meshfold_does_naming_why(layout, gbs, reason):
    assert reason in check_layout(MIXTRAL, layout, SEQ, gbs)
    assert check_layout(MIXTRAL, dataclasses.replace(layout, a2a_overlap=False), SEQ, gbs) == ""


@pytest.mark.parametrize("layout", [Layout(FoldSpec(8, ep=8), a2a_overlap=True),
                                    Layout(FoldSpec(16, ep=4, pp=2), a2a_overlap=True),
                                    Layout(FoldSpec(16, ep=4, pp=2), vpp=2, schedule="dualpipev", a2a_overlap=True)])
def test_a2a_overlap_runs_on_accumulated_pairs_and_on_dualpipev(layout):
    assert check_layout(MIXTRAL, layout, SEQ, 64) == ""
    assert layout.train_overrides(MIXTRAL.name, SEQ, 64)[-1] == "train.a2a_overlap=true"
    assert layout.describe().endswith(" a2a-ovl")


@pytest.mark.parametrize("layout, gbs", [(PAIRED, 24), (PAIRED, 64), (DUALPIPEV, 64), (COMBINED, 64)],
                         ids=["pp1-m3", "pp1-m8", "dualpipev", "combined-1f1b"])
def test_overlap_lowers_the_ep_term_by_the_hidden_seconds_and_nothing_else(layout, gbs):
    plain, overlapped = _both(H100, layout, gbs)
    hidden = overlapped.detail["a2a_hidden_s"]
    assert 0 < hidden <= overlapped.detail["a2a_s"] == plain.detail["a2a_s"]
    assert plain.detail["a2a_hidden_s"] == 0.0
    assert overlapped.detail["slowest_rank"] == plain.detail["slowest_rank"]
    assert plain.time["ep"] - overlapped.time["ep"] == pytest.approx(hidden, rel=1e-9)
    # FSDP2 without pp: every block stays gathered from its first forward, so it is gathered
    # once a step instead of twice a micro-batch (tests/plan/test_plan_collectives.py counts it)
    fewer_gathers = layout.spec.pp == 1 and layout.sharding == "fsdp"
    for term in TIME_TERMS:
        if term == "dp" and fewer_gathers:
            assert overlapped.time[term] < plain.time[term]
        elif term != "ep":
            assert overlapped.time[term] == pytest.approx(plain.time[term], rel=1e-12), term


@pytest.mark.parametrize("gbs, recompute, fraction", [(24, "none", 2 / 6), (64, "none", 7 / 16),
                                                      (24, "selective", 2 / 9)])
def test_short_all_to_alls_are_hidden_whole_on_every_paired_forward(gbs, recompute, fraction):
    """m = 3: two pairs (forward i + 1 beside backward i), each hiding one micro-batch's forward
    all-to-alls, of the 3 forwards' and 3 backwards'; the backward's are not counted (a GPU's
    autograd device thread takes no turn), nor recomputation's re-run ones (3 more)."""
    _, overlapped = _both(FAST, PAIRED, gbs, recompute=recompute)
    assert overlapped.detail["a2a_hidden_fraction"] == pytest.approx(fraction, rel=1e-9)


def test_long_all_to_alls_hide_at_most_the_partners_compute():
    """Far longer than the compute, each pair's forward hides per MoE layer at most its
    partner's backward phases (2 Ca + 2 Ce): two layer forwards, read off the compute term as
    the forward full recomputation adds; m = 3 gives two pairs."""
    gbs, m = 24, 3
    plain, overlapped = _both(SLOW, PAIRED, gbs)
    recomputed = estimate(MIXTRAL, SLOW, dataclasses.replace(PAIRED, recompute="full", a2a_overlap=False), SEQ, gbs)
    layer_forward = (recomputed.time["compute"] - plain.time["compute"]) / (m * MIXTRAL.layers)
    assert overlapped.detail["a2a_hidden_s"] == pytest.approx(2 * MIXTRAL.layers * 2 * layer_forward, rel=1e-9)
    assert overlapped.detail["a2a_hidden_fraction"] < 0.01


def test_under_dualpipev_each_rank_hides_on_its_overlapped_actions():
    """Short all-to-alls: of a rank's 2 m forward and backward passes per MoE layer, each of
    torch's 2 m - 2 pp - max(1, pp - 1 - r) overlapped actions hides a forward's over half the
    rank's layers (one chunk)."""
    pp, gbs = 2, 64
    m = gbs // DUALPIPEV.spec.dp
    plain, overlapped = _both(FAST, DUALPIPEV, gbs)
    r = overlapped.detail["slowest_rank"]
    assert overlapped.detail["a2a_hidden_fraction"] == pytest.approx((2 * m - 2 * pp - max(1, pp - 1 - r)) / (4 * m))
    for rank, (before, after) in enumerate(zip(plain.detail["stage_seconds"], overlapped.detail["stage_seconds"])):
        assert after < before, rank


def test_under_combined_1f1b_each_rank_hides_on_its_steady_pairs():
    """Short all-to-alls: of a rank's m forwards and m backwards per MoE layer, each of its
    m - min(pp - r, m) pairs hides one forward's over all its layers."""
    pp, gbs = 2, 64
    m = gbs // COMBINED.spec.dp
    _, overlapped = _both(FAST, COMBINED, gbs)
    r = overlapped.detail["slowest_rank"]
    assert overlapped.detail["a2a_hidden_fraction"] == pytest.approx((m - min(pp - r, m)) / (2 * m))


def test_a_pair_in_turns_holds_two_micro_batches_activations_without_pp():
    from meshfold.plan.memory import in_flight

    assert in_flight(PAIRED, 3, 0) == 2.0
    assert in_flight(dataclasses.replace(PAIRED, a2a_overlap=False), 3, 0) == 1.0
    # combined 1F1B warms up with one forward more than 1F1B
    assert [in_flight(COMBINED, 8, r) for r in (0, 1)] == [3.0, 2.0]
    assert [in_flight(dataclasses.replace(COMBINED, a2a_overlap=False), 8, r) for r in (0, 1)] == [2.0, 1.0]


@pytest.mark.parametrize("sharding", ["allreduce", "fsdp"])
def test_overlap_without_pp_holds_the_second_micro_batchs_activations(sharding):
    """Under all-reduce the activations term doubles (the logits apart); under FSDP2 each phase
    from the loss backward on holds one more micro-batch's kept activations and every block's
    bf16 weights (gathered from their forward to the step's end), the gather phase of the first
    pair neither."""
    gbs = 16   # m = 2: one pair
    plain, overlapped = _both(H100, PAIRED, gbs, sharding=sharding)
    if sharding == "allreduce":
        logits = plain.memory["activations"] - (overlapped.memory["activations"] - plain.memory["activations"])
        assert 0 < logits < 0.1 * plain.memory["activations"]
        return
    stage = plain.detail["params_per_rank"][0]
    blocks = 2 * (stage.total - stage.ends)   # Mixtral has no gated shared expert
    before, after = plain.detail["step_phases"], overlapped.detail["step_phases"]
    assert after["gather"] == before["gather"]
    assert after["root"] - before["root"] == pytest.approx(blocks)
    one_more = after["backward"] - before["backward"] - blocks
    assert one_more > 0 and after["loss"] - before["loss"] == pytest.approx(blocks + one_more)


@pytest.mark.parametrize("name, gpus, seq, gbs", [("tiny-deepseek-v3", 8, 128, 16), ("tiny-mixtral", 4, 64, 8)])
def test_every_overlapped_layout_the_search_proposes_is_accepted_by_meshfold_train(name, gpus, seq, gbs):
    """plan(a2a_overlap=True) keeps both variants of each layout overlap runs on, and every
    overlapped one passes ``meshfold train``'s validation with the overrides it prints."""
    from meshfold.plan import plan
    from meshfold.train.config import load_config

    found = plan(name, gpus, "h100", seq, gbs, max_mbs=2, a2a_overlap=True)
    overlapped = [e.layout for e in found if e.layout.a2a_overlap]
    assert overlapped and all(dataclasses.replace(lay, a2a_overlap=False) in {e.layout for e in found}
                              for lay in overlapped)
    for lay in {tuple(lay.train_overrides(name, seq, gbs)): lay for lay in overlapped}.values():
        spec, _ = load_config(None, lay.train_overrides(name, seq, gbs)).validate()
        assert spec == lay.spec and lay.spec.ep > 1 and (lay.spec.pp == 1 or lay.schedule == "1f1b")
    assert not any(e.layout.a2a_overlap for e in plan(name, gpus, "h100", seq, gbs, max_mbs=2))


def test_the_cli_costs_overlap_when_asked_and_shows_the_share_hidden(capsys):
    import argparse

    from meshfold.cli import plan as cli

    parser = argparse.ArgumentParser()
    cli.configure(parser)
    args = parser.parse_args(["--model", "tiny-mixtral", "--gpus", "4", "--seq", "64", "--gbs", "8", "--top", "200",
                              "--a2a-overlap"])
    assert cli.main(args) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("#")]
    hidden = [row[-1] for row in rows]   # the last column: the share hidden, "-" on rows without overlap
    assert "-" in hidden and any(h.endswith("%") and 0 < float(h[:-1]) <= 100 for h in hidden)
