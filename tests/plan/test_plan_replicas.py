"""The planner with hot-expert copies (``--placement replicated:R``): copies spread the hottest
expert's rows where no permutation can, and cost their fetch over ep and the weights kept for
backward; only the layouts ``meshfold train`` runs them on are proposed, with the settings that
run them. (Agreement with the dry run: tests/dryrun/test_replicas_dryrun.py.)"""

import argparse

import pytest

from meshfold.cli import plan as cli
from meshfold.mesh import FoldSpec
from meshfold.plan import MODELS, Layout, estimate, hardware
from meshfold.plan.routing import Routing, parse_placement
from meshfold.plan.search import plan
from meshfold.train.config import load_config

H100 = hardware("h100")
ZIPF = Routing("zipf", 1.2)
MIXTRAL = MODELS["mixtral-8x22b"]
EP8 = Layout(FoldSpec(128, tp=4, ep=8), mbs=8, recompute="full")


def test_copies_spread_the_hottest_expert_where_no_permutation_can():
    """ep8, one expert a rank: a re-placement leaves expert 0's 42.9% of the pairs on one rank;
    8 copies bring the busiest rank to within 15% of the mean share (1/8) and shorten the step."""
    moved = estimate(MIXTRAL, H100, EP8, 4096, 256, ZIPF, "balanced")
    copied = estimate(MIXTRAL, H100, EP8, 4096, 256, ZIPF, "replicated:8")
    w = [(e + 1) ** -1.2 for e in range(8)]
    assert moved.detail["busiest_share"] == pytest.approx(w[0] / sum(w))
    assert 1 / 8 <= copied.detail["busiest_share"] <= 1.15 / 8
    assert copied.time["compute"] < moved.time["compute"] and copied.step_time < moved.step_time


def test_copies_cost_their_fetch_over_ep_and_their_weights_in_memory():
    """Under balanced routing copies change no rows, so what differs from the re-placed layout is
    their cost alone: more bytes over ep (weights in, gradients back) and more memory, both
    growing with the copies (two copy slots a rank against one)."""
    lay = Layout(FoldSpec(128, tp=4, ep=4, etp=2), mbs=8, recompute="full")
    est = {p: estimate(MIXTRAL, H100, lay, 4096, 256, None, p) for p in ("balanced", "replicated:4", "replicated:8")}
    ep = {p: e.collectives[("all_to_all", "ep")] for p, e in est.items()}
    mem = {p: e.memory["activations"] for p, e in est.items()}
    assert ep["balanced"] < ep["replicated:4"] < ep["replicated:8"]
    assert mem["balanced"] < mem["replicated:4"] < mem["replicated:8"]
    assert est["replicated:8"].detail["copies_bytes"] > est["replicated:4"].detail["copies_bytes"] > 0


@pytest.mark.parametrize("layout, message", [
    (Layout(FoldSpec(128, tp=4, ep=8, pp=2)), "pp = 2: copies run without pipeline stages"),
    (Layout(FoldSpec(128, tp=4, ep=1), mbs=8, recompute="full"), "ep = 1: one ep rank holds every expert"),
    (Layout(FoldSpec(128, tp=4, ep=4), mbs=8, recompute="full"), "ep = 4: 2 copy slots are not a multiple of it"),
])
def test_a_layout_copies_cannot_run_on_is_refused_naming_why(layout, message):
    with pytest.raises(ValueError, match=f"with --placement replicated:2: {message}"):
        estimate(MIXTRAL, H100, layout, 4096, 256, ZIPF, "replicated:2")


@pytest.mark.parametrize("text", ["replicated:0", "replicated:x", "copies", "replicated"])
def test_bad_placements_name_the_valid_ones(text):
    with pytest.raises(ValueError, match="valid: 'static', 'balanced' or 'replicated:R'"):
        parse_placement(text)


def test_only_layouts_meshfold_train_runs_copies_on_are_proposed_with_their_settings(capsys):
    """Every proposed layout has pp = 1 and ep >= 2 dividing R, and the printed command's
    settings pass ``meshfold train``'s validation (which refuses copies anywhere else)."""
    found = plan("tiny-mixtral", 8, "h100", 256, 8, routing=ZIPF, placement="replicated:4")
    assert found and all(e.layout.spec.pp == 1 and e.layout.spec.ep in (2, 4) for e in found)
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    args = parser.parse_args(["--model", "tiny-mixtral", "--gpus", "8", "--seq", "256", "--gbs", "8", "--top", "2",
                              "--routing", "zipf:1.2", "--placement", "replicated:4"])
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "routing zipf:1.2, replicated:4 placement" in out
    command = next(line for line in out.splitlines() if line.startswith("run #1: meshfold train"))
    sets = command.split(" --set ")[1:]
    assert "train.expert_placement=balanced" in sets and "train.redundant_experts=4" in sets
    load_config(None, sets).validate()
