"""``meshfold train`` with multi-token prediction: the MTP loss is recorded apart from the main
loss, and settings MTP cannot run with are refused before any rank starts."""

import math

import pytest

from tests.run_here import meshfold_here
from tests.train.test_train import SMALL, losses, meshfold_before_spawning

ONE = [*SMALL, "--set", "fold.world_size=1", "--set", "fold.tp=1", "--set", "fold.ep=1", "--set", "train.steps=1"]

pytestmark = pytest.mark.multirank


def test_metrics_carry_the_mtp_loss_apart_from_an_unchanged_main_loss(tmp_path):
    """Step 1's ``loss`` is the main head's cross-entropy before any update, so it equals that of
    the same run without MTP (the main weights are drawn by name, the same with or without the
    depths); ``mtp_loss`` is the mean of the per-depth ``mtp_losses``, near ln(256) at the start."""
    runs = {}
    for depth in (0, 2):
        out = tmp_path / f"d{depth}"
        proc = meshfold_here("train", *ONE, "--set", f"model.mtp_depth={depth}",
                             "--out-dir", out)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[depth] = losses(out)
    plain, mtp = runs[0][1], runs[2][1]
    assert "mtp_loss" not in plain
    assert mtp["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert len(mtp["mtp_losses"]) == 2 and mtp["mtp_loss"] == pytest.approx(sum(mtp["mtp_losses"]) / 2, rel=1e-6)
    assert all(abs(x - math.log(256)) < 1.0 for x in mtp["mtp_losses"])
    assert math.isfinite(mtp["val_loss"])


@pytest.mark.slow
def test_mtp_on_pipeline_stages_trains_the_losses_of_one_stage(tmp_path):
    """pp 2 (the depths on the last stage, the embeddings they read handed down the pipeline)
    against pp 1 on the same dp 2 and micro-batches, fp64, two steps: the same loss, MTP loss and
    per-depth losses."""
    fp64 = [*SMALL, "--set", "train.dtype=\"float64\"", "--set", "model.mtp_depth=2", "--set", "train.steps=2",
            "--set", "fold.tp=1", "--set", "fold.ep=2", "--set", "train.batch=8", "--set", "train.microbatches=2"]
    runs = {}
    for pp in (1, 2):
        out = tmp_path / f"pp{pp}"
        proc = meshfold_here("train", *fp64, "--set", f"fold.pp={pp}", "--set", f"fold.world_size={2 * pp}",
                             "--out-dir", out)  # dp 2 on both: the same micro-batches
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[pp] = [[r["loss"], r["mtp_loss"], *r["mtp_losses"]] for r in (losses(out)[s] for s in (1, 2))]
    for one, two in zip(runs[1], runs[2]):
        assert two == pytest.approx(one, rel=1e-9, abs=0)


@pytest.mark.parametrize("overrides, message", [
    (["model.mtp_depth=-1"], "mtp_depth must be an integer >= 0 (0: no multi-token prediction), got -1"),
    (["model.mtp_loss_weight=-0.5"], "mtp_loss_weight must be a number >= 0, got -0.5"),
    (["model.mtp_depth=1", "train.expert_placement=\"balanced\""],
     "train.expert_placement = 'balanced' with model.mtp_depth = 1"),
])
def test_mtp_settings_it_cannot_run_with_fail_before_spawning(tmp_path, monkeypatch, capsys, overrides, message):
    sets = [a for o in overrides for a in ("--set", o)]
    rc, _, err = meshfold_before_spawning(monkeypatch, capsys, "train", *sets, "--out-dir", str(tmp_path))
    assert rc == 2 and message in err and "Traceback" not in err, err
