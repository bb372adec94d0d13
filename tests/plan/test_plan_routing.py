"""The planner under skewed routing: it charges the busiest ep rank (its expert GEMMs, all-to-all
bytes and activations), so layouts rank differently than under balanced routing; Zipf shares are
the dry run's; replay reads a run's measured loads; a balanced placement lowers the busiest share.
(Agreement with the dry run under Zipf: tests/dryrun/test_plan_vs_dryrun.py.)"""

import argparse
import json

import pytest

from meshfold.cli import plan as cli
from meshfold.dryrun.routing import Zipf
from meshfold.mesh import FoldSpec
from meshfold.plan import MODELS, Layout, estimate, hardware
from meshfold.plan.routing import Routing, busiest_rank_shares, largest_remainder, parse_routing_load

H200 = hardware("h200")
ZIPF = Routing("zipf", 1.2)
# the measured step of meshfold's default run: tokens_per_expert of its two MoE layers
MEASURED = [[56, 91, 991, 910], [41, 909, 939, 159]]


def test_under_zipf_a_larger_ep_loses_to_a_smaller_ep_with_more_edp():
    """Mixtral-8x7B on 64 H200s, attention tp2 x dp4 x pp8: experts over ep8 (one expert a rank,
    edp1) or ep2 (four experts a rank, edp4). Balanced, ep8 is faster (smaller expert shards, less
    gradient traffic); under Zipf 1.2 its rank 0 receives expert 0's 43% of the pairs against ep2's
    81% over 2 ranks, 3.4x the balanced rows against 1.6x: ep2 wins."""
    model = MODELS["mixtral-8x7b"]
    lay = {ep: Layout(FoldSpec(64, tp=2, pp=8, ep=ep), sharding="allreduce") for ep in (8, 2)}
    balanced = {ep: estimate(model, H200, lay[ep], 4096, 256) for ep in lay}
    skewed = {ep: estimate(model, H200, lay[ep], 4096, 256, ZIPF) for ep in lay}
    assert all(e.feasible for e in (*balanced.values(), *skewed.values()))
    assert balanced[8].mfu > balanced[2].mfu and skewed[2].mfu > skewed[8].mfu
    assert skewed[8].detail["busiest_share"] == pytest.approx(1 / sum((e + 1) ** -1.2 for e in range(8)))
    for ep in lay:  # what the skew charges: expert GEMMs and the ep all-to-all on the busiest rank
        assert skewed[ep].time["compute"] > balanced[ep].time["compute"]
        assert skewed[ep].time["ep"] > balanced[ep].time["ep"]
        assert skewed[ep].memory["activations"] > balanced[ep].memory["activations"]


def test_zipf_zero_costs_as_balanced_routing():
    model, lay = MODELS["qwen2-57b-a14b"], Layout(FoldSpec(64, tp=2, pp=4, ep=8), sharding="allreduce")
    a, b = estimate(model, H200, lay, 4096, 256), estimate(model, H200, lay, 4096, 256, Routing("zipf", 0.0))
    assert a.step_time == pytest.approx(b.step_time, rel=1e-12) and a.memory == pytest.approx(b.memory, rel=1e-12)


def test_zipf_shares_are_the_dry_runs():
    shares = Routing("zipf", 1.2).shares_LE(8)[0]
    pairs = 100_000
    assert Zipf(1.2).counts(pairs, 8, 0) == largest_remainder(pairs, shares)
    assert all(abs(c - pairs * x) < 1 for c, x in zip(Zipf(1.2).counts(pairs, 8, 3), shares))


def test_a_balanced_placement_lowers_the_busiest_share_and_the_step():
    """Qwen2-57B's 64 experts over ep8 under Zipf 1.2: static puts experts 0..7 on rank 0."""
    model, lay = MODELS["qwen2-57b-a14b"], Layout(FoldSpec(64, tp=2, pp=4, ep=8), sharding="allreduce")
    static = estimate(model, H200, lay, 4096, 256, ZIPF)
    moved = estimate(model, H200, lay, 4096, 256, ZIPF, placement="balanced")
    assert moved.detail["busiest_share"] < static.detail["busiest_share"]
    assert moved.step_time < static.step_time
    assert 1 / 8 <= moved.detail["busiest_share"]


def test_replay_reads_a_runs_measured_loads(tmp_path):
    rows = [{"step": 1, "loss": 5.0}, {"step": 2, "tokens_per_expert": MEASURED}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    replay = parse_routing_load(f"replay:{tmp_path}")
    # ep4, one expert a rank: layer 0's busiest holds 991, layer 1's 939, of 2048 each
    assert busiest_rank_shares(replay, "static", 4, 4) == ((991 / 2048,), (939 / 2048,))
    est = estimate(MODELS["tiny-mixtral"], H200, Layout(FoldSpec(4, ep=4)), 256, 8, replay)
    assert est.detail["busiest_share"] == pytest.approx((991 + 939) / 2 / 2048)
    assert est.detail["routing"] == f"replay:{tmp_path}"
    with pytest.raises(ValueError, match="measured 4 experts per layer but the planned model has 8"):
        estimate(MODELS["tiny-moe"], H200, Layout(FoldSpec(8, ep=8)), 256, 8, replay)


@pytest.mark.parametrize("text, message", [
    ("zipf:-1", "valid: 'balanced', 'zipf:S'"),
    ("uniform", "valid: 'balanced', 'zipf:S'"),
    ("replay:/nonexistent/run", "no /nonexistent/run/metrics.jsonl"),
])
def test_bad_routing_names_what_is_valid(text, message):
    with pytest.raises(ValueError, match=message):
        parse_routing_load(text)


def test_cli_plans_under_zipf_with_a_balanced_placement(capsys):
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    args = parser.parse_args(["--model", "tiny-mixtral", "--gpus", "4", "--seq", "256", "--gbs", "8", "--top", "2",
                              "--routing", "zipf:1.2", "--placement", "balanced"])
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "routing zipf:1.2, balanced placement" in out and "busiest ep" in out
    bad = parser.parse_args(["--model", "tiny-mixtral", "--gpus", "4", "--routing", "zipf"])
    assert cli.main(bad) == 2 and "routing 'zipf'; valid" in capsys.readouterr().err
