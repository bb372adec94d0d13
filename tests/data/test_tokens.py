"""Pre-tokenized data: text -> shards -> batches round trip, dp ranks read only their own rows,
resumed runs read the batches an uninterrupted one would, and bad inputs fail before spawning."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from meshfold.data.corpus import load_corpus
from meshfold.data.tokens import TokenStream, load_tokenizer, tokenize

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


def _token_run_args(out):
    from tests.train.test_train import SMALL

    return [*SMALL, "--data", str(out), "--set", "fold.world_size=2", "--set", "fold.tp=1", "--set", "fold.ep=2",
            "--set", "model.vocab=300", "--set", "train.ckpt_every=2", "--set", "train.seq=16"]  # dp2 | ep2


@pytest.fixture(scope="module")
def token_run(corpus, tmp_path_factory):
    """One 4-step run on the corpus's tokens, shared by the tests that read a run."""
    from tests.run_here import meshfold_here as meshfold

    run = tmp_path_factory.mktemp("token-run")
    proc = meshfold("train", "--steps", "4", "--out-dir", str(run), *_token_run_args(corpus[1]))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run


@pytest.mark.multirank
@pytest.mark.slow
def test_training_on_tokens_resumes_exactly(corpus, token_run, tmp_path):
    from tests.run_here import meshfold_here as meshfold
    from tests.train.test_train import losses

    run = _token_run_args(corpus[1])
    assert meshfold("train", "--steps", "4", "--out-dir", str(tmp_path / "b"), *run,
                    "--set", "train.stop_at=2").returncode == 0
    proc = meshfold("train", "--steps", "4", "--out-dir", str(tmp_path / "b"), *run)
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-2000:]
    la, lb = losses(token_run), losses(tmp_path / "b")
    assert la[1]["loss"] < 6.0 and [la[s]["loss"] for s in (3, 4)] == [lb[s]["loss"] for s in (3, 4)]


@pytest.mark.multirank
@pytest.mark.slow
def test_generate_encodes_and_decodes_with_the_tokenizer_the_run_trained_with(corpus, token_run, capsys):
    """The run keeps its tokenizer; generate says it uses it, and writes exactly what that
    tokenizer decodes of the prompt's ids and the ids a plain sampling loop draws from the model."""
    import torch

    from meshfold.cli import main
    from meshfold.train.trained import load_trained

    _, out, _ = corpus
    assert (token_run / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
    assert main(["generate", str(token_run), "--prompt", "def add", "--tokens", "12", "--seed", "3"]) == 0
    printed = capsys.readouterr()
    assert f"{token_run / 'tokenizer.json'} (the run's tokenizer)" in printed.err
    tok = load_tokenizer(out / "tokenizer.json")
    model, _ = load_trained(str(token_run))
    ids, g = tok.encode("def add").ids, torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _ in range(12):  # top-20 at temperature 0.8, generate's defaults
            top = torch.topk(model(torch.tensor([ids]))[0, -1].float() / 0.8, 20)
            ids.append(int(top.indices[torch.multinomial(torch.softmax(top.values, -1), 1, generator=g)]))
    assert printed.out == tok.decode(ids) + "\n"
    assert max(ids) >= 256  # ids that bytes could not decode


def _check(data, *overrides):
    from meshfold.train import preflight
    from meshfold.train.config import load_config

    cfg = load_config(None, ["model.vocab=300", "train.seq=16", *overrides])
    cfg.data.paths = cfg.data.paths or [str(data)]
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
    assert main(["tokenize", "--train-tokenizer", "260", "--out", str(tmp_path / "o"), str(tmp_path / "t.txt")]) == 0
    assert Path(tmp_path / "o" / "index.json").exists()
    assert np.fromfile(tmp_path / "o" / "shard-00000.bin", dtype=np.uint16).size > 0


def test_tokenize_refuses_a_vocabulary_it_cannot_make_and_empty_text(tmp_path, capsys):
    from meshfold.cli import main

    (tmp_path / "t.txt").write_text(TEXTS["a.txt"])
    (tmp_path / "empty.txt").write_text("")
    out = ["--out", str(tmp_path / "o")]
    # out of range: refused before any file is read (this one does not exist)
    assert main(["tokenize", "--train-tokenizer", "0", *out, str(tmp_path / "missing")]) == 2
    assert "--train-tokenizer 0: valid: 258 " in capsys.readouterr().err
    # more ids than BPE finds pairs to merge in the text: refused naming what it gives, not capped
    assert main(["tokenize", "--train-tokenizer", "100000", *out, str(tmp_path / "t.txt")]) == 2
    assert re.search(r"--train-tokenizer 100,000: .*stops at \d+ ids", capsys.readouterr().err)
    assert main(["tokenize", "--train-tokenizer", "260", *out, str(tmp_path / "empty.txt")]) == 2
    assert "empty.txt: the files are empty (0 bytes)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt", "t.txt"]  # nothing written


def test_tokenize_writes_only_into_a_new_folder_or_replaces_a_tokenization_whole(corpus, tmp_path):
    root, out, _ = corpus
    target = tmp_path / "tok"
    shutil.copytree(out, target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    with pytest.raises(ValueError, match="tok is not empty; .* or --force to replace"):
        tokenize([str(root / "a.txt")], target, tokenizer=str(out / "tokenizer.json"))
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    tokenize([str(root / "a.txt")], target, tokenizer=str(out / "tokenizer.json"), force=True)
    tok = load_tokenizer(target / "tokenizer.json")  # the folder carries its tokenizer
    assert TokenStream(target)[0:len(TokenStream(target))].tolist() == tok.encode(TEXTS["a.txt"]).ids
    assert sorted(p.name for p in target.iterdir()) == ["index.json", "shard-00000.bin", "tokenizer.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["tok"]  # no staging folder left behind
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="src holds files that are not a meshfold tokenization"):
        tokenize([str(root / "a.txt")], tmp_path / "src", tokenizer=str(out / "tokenizer.json"), force=True)
    assert (tmp_path / "src" / "keep.txt").read_text() == "mine"


def test_a_token_folder_is_never_read_as_text(corpus, tmp_path):
    """Without its index (a tokenization cut short, an index removed) a token folder's text would
    be tokenizer.json; beside other paths its index and tokenizer would be."""
    root, out, _ = corpus
    cut = tmp_path / "cut"
    shutil.copytree(out, cut)
    (cut / "index.json").unlink()
    with pytest.raises(ValueError, match="cut holds token shards .* but no index.json"):
        _check(cut)
    with pytest.raises(ValueError, match="is a token folder .*train on it alone"):
        _check(out, f"data.paths={json.dumps([str(out), str(root)])}")


@pytest.mark.slow
@pytest.mark.multirank
def test_data_tokenizer_tokenizes_text_for_the_run_and_reuses_it(corpus, tmp_path):
    from tests.run_here import meshfold_here as meshfold
    from tests.train.test_train import SMALL2, losses

    root, out, _ = corpus
    run = [*SMALL2, "--data", str(root), "--set", f"data.tokenizer={json.dumps(str(out / 'tokenizer.json'))}",
           "--set", "model.vocab=300", "--set", "train.seq=16", "--out-dir", str(tmp_path)]
    proc = meshfold("train", "--steps", "2", *run)
    assert proc.returncode == 0 and "tokenizing 3 files" in proc.stdout, proc.stderr[-2000:]
    assert TokenStream(tmp_path / "tokens")[0:50].tolist() == TokenStream(out)[0:50].tolist()
    proc = meshfold("train", "--steps", "3", *run)
    assert proc.returncode == 0 and "reusing the tokens" in proc.stdout and sorted(losses(tmp_path)) == [1, 2, 3]


def test_a_folder_written_as_the_format_documents_it_is_read(tmp_path):
    """docs/data.md's example index.json, with shards of the sizes it states, trains: its stream
    is the shards' ids in order, split as documented."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()
    index = json.loads(re.search(r"```json\n(.*?)```", doc, re.S).group(1))
    assert index["format"] == "meshfold-tokens-1" and index["dtype"] == "uint16"
    shards = [(np.arange(s["tokens"]) * (k + 1) % index["vocab_size"]).astype(np.uint16)
              for k, s in enumerate(index["shards"])]
    for ids, s in zip(shards, index["shards"]):
        ids.tofile(tmp_path / s["file"])
    (tmp_path / "index.json").write_text(json.dumps(index))
    _check(tmp_path)  # what train checks before any rank starts
    corpus = load_corpus([str(tmp_path)], val_fraction=0.2)
    stream, n_train = np.concatenate(shards), int(index["tokens"] * 0.8)
    assert np.array_equal(corpus.train[0:n_train], stream[:n_train])
    assert np.array_equal(corpus.val[0:len(stream) - n_train], stream[n_train:])