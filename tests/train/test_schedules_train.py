"""``meshfold train`` with the zero-bubble schedules and ``train.a2a_overlap``: the losses of 1F1B
(and of the same run without overlap), and the settings they cannot run with refused before any
rank starts."""

import json

import pytest

from meshfold.runtime.overlap import IN_FLIGHT

from tests.run_here import meshfold_here
from tests.train.test_train import SMALL, losses, meshfold_before_spawning

# 4 ranks pp2 x dp2 | pp2 x ep2, 4 layers (one a chunk in a V), 4 micro-batches (dualpipev: >= 2 pp)
PP2 = [*SMALL, "--set", "train.dtype=\"float64\"", "--set", "model.layers=4", "--set", "fold.pp=2",
       "--set", "fold.tp=1", "--set", "fold.ep=2", "--set", "train.batch=8", "--set", "train.microbatches=4",
       "--set", "train.eval_every=2"]

pytestmark = pytest.mark.multirank


@pytest.mark.slow
def test_zero_bubble_schedules_train_the_losses_of_1f1b(tmp_path):
    """Three steps (and an evaluation) of each: the same losses as 1F1B up to summation order;
    the steps change the model, so the optimizer saw the same gradients."""
    runs = {}
    for schedule, virtual in (("1f1b", 1), ("zbv", 2), ("dualpipev", 2)):
        out = tmp_path / schedule
        proc = meshfold_here("train", "--steps", "3", "--out-dir", out, *PP2, "--set", f"train.schedule=\"{schedule}\"",
                             "--set", f"train.virtual={virtual}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = losses(out)
        runs[schedule] = [rows[s]["loss"] for s in (1, 2, 3)] + [rows[2]["val_loss"]]
    for schedule in ("zbv", "dualpipev"):
        assert runs[schedule] == pytest.approx(runs["1f1b"], rel=1e-9, abs=0), schedule
    assert runs["1f1b"][2] != runs["1f1b"][0]


@pytest.mark.slow
def test_a2a_overlap_trains_the_losses_without_it(tmp_path):
    """Three steps with and without ``train.a2a_overlap``: dualpipev and 1F1B (run as combined
    1F1B) on pp 2, and the default fold
    (tp2 x dp2 | ep4) accumulating 2 micro-batches; each step's metrics count the all-to-alls
    that travelled while the other micro-batch computed."""
    pp1 = [*SMALL, "--set", "train.dtype=\"float64\"", "--set", "train.microbatches=2", "--set", "train.batch=8"]
    dualpipev = [*PP2, "--set", "train.schedule=\"dualpipev\"", "--set", "train.virtual=2"]
    for name, args in (("pp1", pp1), ("dualpipev", dualpipev), ("combined 1f1b", PP2)):
        runs = {}
        for overlap in ("false", "true"):
            out = tmp_path / f"{name}_{overlap}"
            proc = meshfold_here("train", "--steps", "3", "--out-dir", out, *args, "--set", f"train.a2a_overlap={overlap}")
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs[overlap] = losses(out)
        assert [runs["true"][s]["loss"] for s in (1, 2, 3)] == pytest.approx(
            [runs["false"][s]["loss"] for s in (1, 2, 3)], rel=1e-9, abs=0), name
        turns = runs["true"][3]["a2a_overlap"]
        assert 0 < turns["crossed"] <= turns["waited"] and "a2a_overlap" not in runs["false"][3], (name, turns)


def test_a2a_overlap_shows_on_the_profiler_timeline(tmp_path):
    """The trace of a step (train.profile_steps) shows the overlap: each all-to-all that travelled
    while the other micro-batch computed (the step's a2a_overlap.crossed) is a
    meshfold.a2a_in_flight range on its thread holding the other thread's ops; and gloo moves
    rows on its own threads while a micro-batch thread computes."""
    import glob

    out = tmp_path / "run"
    proc = meshfold_here("train", "--steps", "2", "--out-dir", out, *SMALL, "--set", "fold.world_size=2",
                         "--set", "fold.ep=2", "--set", "train.microbatches=2", "--set", "train.a2a_overlap=true",
                         "--set", "train.profile_steps=[2, 2]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    crossed = losses(out)[2]["a2a_overlap"]["crossed"]
    (trace,) = glob.glob(str(out / "profile" / "*.json"))
    events = [e for e in json.load(open(trace))["traceEvents"] if e.get("ph") == "X"]
    ranges = [e for e in events if e["name"] == IN_FLIGHT]
    turn_threads = {e["tid"] for e in ranges}
    assert len(turn_threads) == 2, turn_threads
    ops = [e for e in events if e["tid"] in turn_threads and e["name"].startswith("aten::")]

    def inside(e, window):
        return window["ts"] <= e["ts"] and e["ts"] + e["dur"] <= window["ts"] + window["dur"]

    holding = [r for r in ranges if any(o["tid"] != r["tid"] and inside(o, r) for o in ops)]
    assert len(holding) == crossed > 0
    moving = [e for e in events if e["name"] == "gloo:all_to_all"]
    assert any(o["ts"] < m["ts"] + m["dur"] and m["ts"] < o["ts"] + o["dur"] for m in moving for o in ops)


@pytest.mark.parametrize("overrides, message", [
    (["train.schedule=\"zbv\""], "the V schedules hold exactly 2 chunks per rank"),
    (["train.schedule=\"dualpipev\"", "train.virtual=2", "train.microbatches=2"], "microbatches = 2 < 2 pp = 4"),
    (["train.schedule=\"zbv\"", "train.virtual=2", "train.compile=true"], "train.schedule = 'zbv' with train.compile"),
    (["train.a2a_overlap=true", "train.schedule=\"interleaved-1f1b\"", "train.virtual=2", "train.microbatches=4"],
     "train.a2a_overlap with fold.pp = 2 and schedule 'interleaved-1f1b'"),
    (["train.a2a_overlap=true", "fold.pp=1", "train.microbatches=2", "train.compile=true"],
     "train.a2a_overlap with train.compile"),
    (["train.a2a_overlap=true", "fold.pp=1", "fold.ep=1"], "train.a2a_overlap with fold.ep = 1"),
])
def test_schedule_settings_it_cannot_run_with_fail_before_spawning(tmp_path, monkeypatch, capsys, overrides, message):
    sets = [a for o in ["fold.pp=2", "fold.tp=1", "fold.ep=2", "model.layers=4", *overrides] for a in ("--set", o)]
    rc, _, err = meshfold_before_spawning(monkeypatch, capsys, "train", *sets, "--out-dir", str(tmp_path))
    assert rc == 2 and message in err and "Traceback" not in err, err


def test_recompute_under_a_zero_bubble_schedule_is_warned_of_with_its_cost():
    from types import SimpleNamespace

    from meshfold.train.preflight import check_schedule

    (line,) = check_schedule(SimpleNamespace(schedule="zbv", recompute="selective"), pp=2)
    assert line.startswith("warning: train.recompute = 'selective' with train.schedule = 'zbv'") and "3.7x" in line
    assert check_schedule(SimpleNamespace(schedule="1f1b", recompute="selective"), pp=2) == []
    assert check_schedule(SimpleNamespace(schedule="zbv", recompute="none"), pp=2) == []
