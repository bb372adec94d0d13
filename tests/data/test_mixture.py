"""Weighted mixtures of token folders: rows come from the sources in the stated proportions, each
row is a window of the source it was drawn from, batches are a function of (seed, step), each
source validates on its own split, and bad mixtures fail before any rank starts."""

import json

import numpy as np
import pytest

from meshfold.data.files import FORMAT
from meshfold.data.mixture import load_mixture

SIZE = 4000


def _folder(path, lo: int, vocab: int = 512, eos: int = 0):
    """A token folder whose ids all lie in [lo, lo + 100): which source a row came from shows in it."""
    path.mkdir()
    ids = (lo + np.arange(SIZE) % 100).astype(np.uint16)
    ids.tofile(path / "shard-00000.bin")
    (path / "index.json").write_text(json.dumps({"format": FORMAT, "dtype": "uint16", "vocab_size": vocab,
                                                 "eos_id": eos, "tokens": SIZE,
                                                 "shards": [{"file": "shard-00000.bin", "tokens": SIZE}]}))
    return path


@pytest.fixture
def sources(tmp_path):
    return [str(_folder(tmp_path / "a", 0)), str(_folder(tmp_path / "b", 100)), str(_folder(tmp_path / "c", 200))]


def _source_of(row) -> int:
    assert len(set(row.numpy() // 100)) == 1, row  # one source per row
    return int(row[0]) // 100


def test_rows_are_drawn_in_the_stated_proportions_and_recorded(sources):
    weights = [0.6, 0.3, 0.1]
    mix = load_mixture(sources, weights, val_fraction=0.1)
    steps, batch = 300, 8
    counts = np.sum([mix.rows_by_source(s, batch, seed=5) for s in range(steps)], axis=0)
    n = steps * batch
    for w, c in zip(weights, counts):  # within 5 binomial standard deviations
        assert abs(c - w * n) < 5 * np.sqrt(n * w * (1 - w)), (counts, weights)
    for step in (0, 17, 299):  # what is recorded is what the batch read
        tokens, _ = mix.batch("train", step, batch, 16, seed=5)
        got = np.bincount([_source_of(r) for r in tokens], minlength=3).tolist()
        assert got == mix.rows_by_source(step, batch, seed=5)


def test_a_zero_weight_source_gives_no_training_rows(sources):
    mix = load_mixture(sources, [1, 0, 3], val_fraction=0.1)
    drawn = np.sum([mix.rows_by_source(s, 8, seed=0) for s in range(100)], axis=0)
    assert drawn[1] == 0 and drawn[0] > 0 and drawn[2] > drawn[0]


def test_batches_are_a_function_of_seed_and_step_and_dp_ranks_read_their_own_rows(sources):
    mix = load_mixture(sources, [0.5, 0.25, 0.25], val_fraction=0.1)
    full, targets = mix.batch("train", 9, 8, 16, seed=1)
    again = load_mixture(sources, [0.5, 0.25, 0.25], val_fraction=0.1).batch("train", 9, 8, 16, seed=1)
    assert (again[0] == full).all() and (again[1] == targets).all()  # what a resumed run reads at step 9
    assert (full[:, 1:] == targets[:, :-1]).all()
    for rows in (range(0, 4), range(4, 8)):
        mine, _ = mix.batch("train", 9, 8, 16, seed=1, rows=rows)
        assert (mine[rows.start:rows.stop] == full[rows.start:rows.stop]).all()
    assert not (mix.batch("train", 10, 8, 16, seed=1)[0] == full).all()
    assert not (mix.batch("train", 9, 8, 16, seed=2)[0] == full).all()


def test_each_source_validates_on_its_own_held_out_split(sources):
    mix = load_mixture(sources, [0.5, 0.25, 0.25], val_fraction=0.1)
    cut = int(SIZE * 0.9)
    for k, (name, part) in enumerate(mix.parts.items()):
        assert name == sources[k] and len(part.val) == SIZE - cut
        tokens, _ = part.batch("val", 0, 4, 16, seed=0)
        assert {_source_of(r) for r in tokens} == {k}
    val, _ = mix.batch("val", 0, 64, 16, seed=0)
    train_ids = np.concatenate([np.asarray(p.train[0:len(p.train)]) for p in mix.parts.values()])
    assert {_source_of(r) for r in val} == {0, 1, 2} and len(train_ids) == 3 * cut


def _check(paths, weights, *overrides):
    from meshfold.train import preflight
    from meshfold.train.config import load_config

    cfg = load_config(None, ["model.vocab=512", "train.seq=16", f"data.weights={json.dumps(weights)}", *overrides])
    cfg.data.paths = paths
    preflight.check_data(cfg)


def test_bad_mixtures_fail_before_any_rank_starts_naming_the_source(sources, tmp_path):
    _check(sources, [1, 1, 2])  # a good one passes
    with pytest.raises(ValueError, match=r"data.weights \[1, -1, 2\]: -1 is negative; valid: numbers >= 0, not all 0"):
        _check(sources, [1, -1, 2])
    with pytest.raises(ValueError, match=r"data.weights \[0, 0, 0\] are all 0"):
        _check(sources, [0, 0, 0])
    with pytest.raises(ValueError, match="data.weights has 2 weights for 3 data.paths"):
        _check(sources, [1, 2])
    other = str(_folder(tmp_path / "other", 0, vocab=300))
    with pytest.raises(ValueError, match=r"data.paths .*other: its vocabulary \(300 ids, end-of-text 0\) is not "
                                         r".*a's \(512 ids"):
        _check(sources[:2] + [other], [1, 1, 1])
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "t.txt").write_text("x" * 100)
    with pytest.raises(ValueError, match=r"data.paths .*text: a mixture's sources are token folders"):
        _check(sources[:2] + [str(tmp_path / "text")], [1, 1, 1])
    with pytest.raises(ValueError, match=r"data .*a: its validation split would have 200 tokens"):
        _check(sources, [1, 1, 1], "train.seq=512")
    with pytest.raises(ValueError, match="its tokenizer has 512 ids but model.vocab = 256"):
        _check(sources, [1, 1, 1], "model.vocab=256")


@pytest.mark.multirank
@pytest.mark.slow
def test_a_mixed_run_records_rows_per_source_and_validation_loss_per_source(sources, tmp_path):
    from tests.run_here import meshfold_here as meshfold
    from tests.train.test_train import SMALL2, losses

    run = [*SMALL2, "--set", f"data.paths={json.dumps(sources)}", "--set", "data.weights=[0.5, 0.5, 0]",
           "--set", "model.vocab=512", "--set", "train.seq=16", "--set", "train.eval_every=2",
           "--set", "train.ckpt_every=2", "--set", "train.batch=8"]
    proc = meshfold("train", "--steps", "4", "--out-dir", str(tmp_path / "a"), *run)
    assert proc.returncode == 0, proc.stderr[-2000:]
    a = losses(tmp_path / "a")
    mix = load_mixture(sources, [0.5, 0.5, 0], val_fraction=0.05)
    assert [a[s]["data_rows"] for s in (1, 2, 3, 4)] == [mix.rows_by_source(s, 8, 0) for s in range(4)]
    assert sorted(a[2]["val_loss_by_source"]) == sorted(sources) and "val_loss_by_source" not in a[1]
    proc = meshfold("train", "--steps", "4", "--out-dir", str(tmp_path / "b"), *run, "--set", "train.stop_at=2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = meshfold("train", "--steps", "4", "--out-dir", str(tmp_path / "b"), *run)
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-2000:]
    b = losses(tmp_path / "b")
    assert [a[s]["loss"] for s in (3, 4)] == [b[s]["loss"] for s in (3, 4)]
    assert a[4]["val_loss_by_source"] == b[4]["val_loss_by_source"]
