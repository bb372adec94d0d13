"""Pre-tokenized data: text -> shards -> batches round trip, dp ranks read only their own rows,
resumed runs read the batches an uninterrupted one would, and bad inputs fail before spawning."""

import json
from pathlib import Path

import numpy as np
import pytest

from meshfold.data.corpus import load_corpus
from meshfold.data.tokens import tokenize
from meshfold.data.tokens import TokenStream, load_tokenizer

TEXTS = {"a.txt": "def add(a, b):\n    return a + b\n" * 60, "b.md": "# notes\nMoE layers fold. " * 80,
         "c.py": "import torch\nx = torch.ones(3)\n" * 50}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    for name, text in TEXTS.items():
        (root / name).write_text(text)
    out = root.parent / (root.name + "-tokens")
    index = tokenize([str(root)], out, train_vocab=300, shard_tokens=500)  # several shards
    return root, out, index


def test_shards_hold_every_document_with_eos_between(corpus):
    root, out, index = corpus
    tok = load_tokenizer(out / "tokenizer.json")
    eos = index["eos_id"]
    expected = []
    for name in sorted(TEXTS):
        expected += ([eos] if expected else []) + tok.encode(TEXTS[name]).ids
    stream = TokenStream(out)
    assert len(index["shards"]) > 1 and index["dtype"] == "uint16" and index["vocab_size"] == 300
    assert stream[0:len(stream)].tolist() == expected
    ends = np.cumsum([s["tokens"] for s in index["shards"]]).tolist()
    windows = [(0, 300), (ends[0] - 5, ends[0] + 5), (ends[0] - 5, ends[0]), (ends[0], ends[0] + 7),
               (ends[0] - 1, ends[1] + 1), (len(expected) - 3, len(expected))]  # across 1 and 3 shards
    assert len(ends) >= 3
    for lo, hi in windows:
        assert stream[lo:hi].tolist() == expected[lo:hi], (lo, hi)
    assert tok.decode(stream[0:len(tok.encode(TEXTS["a.txt"]).ids)].tolist()) == TEXTS["a.txt"]


def test_each_dp_rank_reads_only_its_own_rows_of_the_same_batch(corpus):
    _, out, _ = corpus
    data = load_corpus([out], val_fraction=0.1)
    full, full_t = data.batch("train", 7, 4, 16, seed=3)
    for rows in (range(0, 2), range(2, 4)):
        mine, mine_t = data.batch("train", 7, 4, 16, seed=3, rows=rows)
        assert (mine[rows.start:rows.stop] == full[rows.start:rows.stop]).all()
        assert (mine_t[rows.start:rows.stop] == full_t[rows.start:rows.stop]).all()
        others = [r for r in range(4) if r not in rows]
        assert (mine[others] == 0).all()  # never read
    assert not (full[0:2] == full[2:4]).all()
    again = load_corpus([out], val_fraction=0.1).batch("train", 7, 4, 16, seed=3)[0]
    assert (again == full).all()  # a function of (seed, step) alone: nothing to restore on resume
    val, _ = data.batch("val", 0, 4, 16, seed=3)
    n_train = len(data.train)
    assert val.max() < 300 and n_train == int(len(TokenStream(out)) * 0.9)


@pytest.mark.slow
@pytest.mark.multirank
def test_training_on_tokens_resumes_exactly(corpus, tmp_path):
    from tests.train.test_train import SMALL, losses, meshfold

    _, out, _ = corpus
    run = [*SMALL, "--data", str(out), "--set", "fold.world_size=2", "--set", "fold.tp=1", "--set", "fold.ep=2",
           "--set", "model.vocab=300", "--set", "train.ckpt_every=2", "--set", "train.seq=16"]  # dp2 | ep2
    assert meshfold("train", "--steps", "4", "--out-dir", str(tmp_path / "a"), *run).returncode == 0
    assert meshfold("train", "--steps", "4", "--out-dir", str(tmp_path / "b"), *run,
                    "--set", "train.stop_at=2").returncode == 0
    proc = meshfold("train", "--steps", "4", "--out-dir", str(tmp_path / "b"), *run)
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-2000:]
    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert la[1]["loss"] < 6.0 and [la[s]["loss"] for s in (3, 4)] == [lb[s]["loss"] for s in (3, 4)]


def _check(data, *overrides):
    from meshfold.train import preflight
    from meshfold.train.config import load_config

    cfg = load_config(None, ["model.vocab=300", "train.seq=16", *overrides])
    cfg.data.paths = [str(data)]
    preflight.check_data(cfg)


def test_bad_token_data_fails_before_spawning_naming_the_value(corpus, tmp_path):
    """What ``meshfold train`` checks before any rank starts (main() calls check_data first)."""
    _, out, _ = corpus
    _check(out)  # the good folder passes
    with pytest.raises(ValueError, match="its tokenizer has 300 ids but model.vocab = 256 .*set --set model.vocab=300"):
        _check(out, "model.vocab=256")
    with pytest.raises(ValueError, match="the validation text would have [0-9,]+ tokens"):
        _check(out, "train.seq=1024", "model.max_seq=2048")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "index.json").write_text((out / "index.json").read_text())
    for f in json.loads((out / "index.json").read_text())["shards"]:
        (bad / f["file"]).write_bytes((out / f["file"]).read_bytes())
    last = sorted(bad.glob("shard-*.bin"))[-1]
    last.write_bytes(last.read_bytes()[:-2])
    with pytest.raises(ValueError, match=f"{last.name} is [0-9,]+ bytes, not the .*rerun meshfold tokenize"):
        _check(bad)
    (bad / "index.json").write_text("{}")
    with pytest.raises(ValueError, match="is not a meshfold token index"):
        _check(bad)
    with pytest.raises(ValueError, match="data.tokenizer with --data .*tokenized already"):
        _check(out, f"data.tokenizer={json.dumps(str(out / 'tokenizer.json'))}")
    with pytest.raises(ValueError, match="has 300 ids but model.vocab = 256"):
        _check(out.parent / out.name.replace("-tokens", ""), "model.vocab=256",
               f"data.tokenizer={json.dumps(str(out / 'tokenizer.json'))}")


def test_tokenize_command_names_bad_inputs(tmp_path):
    from meshfold.cli import main

    (tmp_path / "t.txt").write_text("hello world " * 10)
    assert main(["tokenize", "--tokenizer", str(tmp_path / "none.json"), "--out", str(tmp_path / "o"),
                 str(tmp_path / "t.txt")]) == 2
    assert main(["tokenize", "--train-tokenizer", "100", "--out", str(tmp_path / "o"), str(tmp_path / "t.txt")]) == 2
    assert main(["tokenize", "--train-tokenizer", "280", "--out", str(tmp_path / "o"), str(tmp_path / "t.txt")]) == 0
    assert Path(tmp_path / "o" / "index.json").exists()
    assert np.fromfile(tmp_path / "o" / "shard-00000.bin", dtype=np.uint16).size > 0


@pytest.mark.slow
@pytest.mark.multirank
def test_data_tokenizer_tokenizes_text_for_the_run_and_reuses_it(corpus, tmp_path):
    from tests.train.test_train import SMALL2, losses, meshfold

    root, out, _ = corpus
    run = [*SMALL2, "--data", str(root), "--set", f"data.tokenizer={json.dumps(str(out / 'tokenizer.json'))}",
           "--set", "model.vocab=300", "--set", "train.seq=16", "--out-dir", str(tmp_path)]
    proc = meshfold("train", "--steps", "2", *run)
    assert proc.returncode == 0 and "tokenizing 3 files" in proc.stdout, proc.stderr[-2000:]
    assert TokenStream(tmp_path / "tokens")[0:50].tolist() == TokenStream(out)[0:50].tolist()
    proc = meshfold("train", "--steps", "3", *run)
    assert proc.returncode == 0 and "reusing the tokens" in proc.stdout and sorted(losses(tmp_path)) == [1, 2, 3]


def test_a_folder_written_as_the_format_documents_it_is_read(tmp_path):
    """meshfold.data.tokens' docstring is the format: a folder written from it by hand, with only the
    keys it lists, trains (its stream is the shards' ids in order, split as documented)."""
    a, b = np.arange(40, dtype=np.uint16), np.arange(100, 130, dtype=np.uint16)
    a.tofile(tmp_path / "shard-00000.bin")
    b.tofile(tmp_path / "shard-00001.bin")
    (tmp_path / "index.json").write_text(json.dumps({
        "format": "meshfold-tokens-1", "dtype": "uint16", "vocab_size": 300, "eos_id": 0, "tokenizer": "by hand",
        "tokens": 70, "shards": [{"file": "shard-00000.bin", "tokens": 40}, {"file": "shard-00001.bin", "tokens": 30}]}))
    corpus = load_corpus([str(tmp_path)], val_fraction=0.2)
    stream = np.concatenate([a, b])
    assert np.array_equal(corpus.train[0:56], stream[:56]) and np.array_equal(corpus.val[0:14], stream[56:])
