"""Records as documents: JSON Lines (plain and gzip), JSON arrays, Parquet and save_to_disk
folders tokenize to the ids a per-document encode gives, with the end-of-text id between them;
bad records are named before anything is written; progress is drawn only on a terminal."""

import gzip
import io
import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meshfold.data.progress import Progress, format_line
from meshfold.data.records import Reader, documents
from meshfold.data.tokens import TokenStream, load_tokenizer, tokenize, write_shards

DOCS = ["def add(a, b):\n    return a + b\n", "MoE layers fold attention and experts apart. ",
        "naïve café — ünïcode\nacross lines", "", "x = [1, 2, 3]\n" * 7, "the last document"]


def _write(kind: str, folder, docs=DOCS, field="text"):
    """``docs`` as a source of ``kind``, with an extra field beside the text (that must be ignored)."""
    rows = [{field: d, "id": i} for i, d in enumerate(docs)]
    if kind == "jsonl":
        path = folder / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "jsonl.gz":
        path = folder / "d.jsonl.gz"
        path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    elif kind == "json":
        path = folder / "d.json"
        path.write_text(json.dumps(rows))
    elif kind == "parquet":
        path = folder / "d.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=2)  # several row groups
    else:
        import datasets

        path = folder / "saved"
        train = datasets.Dataset.from_list(rows)
        datasets.DatasetDict({"train": train, "validation": train.select([0])}).save_to_disk(str(path))
    return path


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    (root / "t.txt").write_text("\n".join(DOCS) * 20)
    tokenize([str(root / "t.txt")], root / "out", train_vocab=300)
    return root / "out" / "tokenizer.json"


def _expected(tok, docs):
    eos, ids = tok.token_to_id("<|endoftext|>"), []
    for d in docs:
        ids += ([eos] if ids else []) + tok.encode(d).ids
    return ids


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "json", "parquet", "saved"])
def test_each_format_tokenizes_its_records_as_documents_with_eos_between(kind, tok_file, tmp_path):
    src = _write(kind, tmp_path)
    index = tokenize([str(src)], tmp_path / "out", tokenizer=str(tok_file), shard_tokens=20)
    tok = load_tokenizer(tok_file)
    stream = TokenStream(tmp_path / "out")
    assert stream[0:len(stream)].tolist() == _expected(tok, DOCS)
    assert index["documents"] == len(DOCS) and len(index["shards"]) > 1


def test_the_text_field_and_the_split_choose_what_is_read(tok_file, tmp_path):
    parquet = _write("parquet", tmp_path, field="content")
    index = tokenize([str(parquet)], tmp_path / "p", tokenizer=str(tok_file), reader=Reader("content"))
    assert index["reader"] == {"text_field": "content", "split": "train"} and index["documents"] == len(DOCS)
    saved = _write("saved", tmp_path)
    tokenize([str(saved)], tmp_path / "v", tokenizer=str(tok_file), reader=Reader(split="validation"))
    stream = TokenStream(tmp_path / "v")
    assert stream[0:len(stream)].tolist() == _expected(load_tokenizer(tok_file), DOCS[:1])


def test_a_folder_mixing_text_and_records_reads_each_as_its_kind(tok_file, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _write("parquet", src)
    (src / "z.txt").write_text("plain text file\n{\"text\": \"not a record\"}\n")
    got = [text for text, _ in documents([src / "d.parquet", src / "z.txt"])]
    assert got == DOCS + [(src / "z.txt").read_text()]


def test_readers_stream_records_one_at_a_time(tmp_path):
    """A bad record far into a file is met only after the documents before it were handed on."""
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(2000)) + '{"txt": 1}\n')
    docs = documents([path])
    assert [next(docs)[0] for _ in range(3)] == ["doc 0", "doc 1", "doc 2"]
    with pytest.raises(ValueError, match=r"big.jsonl line 2001: no field 'text' \(fields: txt\)"):
        list(docs)


BAD = [
    ("missing.jsonl", '{"body": "x"}\n', r"missing.jsonl line 1: no field 'text' \(fields: body\); name the text "
                                         r"with --text-field"),
    ("number.jsonl", '{"text": "ok"}\n{"text": 7}\n', r"number.jsonl line 2: field 'text' is a int, not a string"),
    ("list.json", '[{"text": "ok"}, "bare"]', r"list.json record 1: a str, not an object"),
    ("broken.jsonl", '{"text": "ok"}\n{"text": \n', r"broken.jsonl line 2: not JSON"),
    ("empty.jsonl", "", r"empty.jsonl: no records \(an empty source\)"),
    ("table.csv", "text\nhello\n", r"table.csv: meshfold does not read .csv files; valid: .jsonl, .jsonl.gz, "
                                   r".json, .parquet, a folder written by datasets' save_to_disk"),
]


@pytest.mark.parametrize("name,content,message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_naming_the_file_and_record_and_leaves_out_as_it_was(
        name, content, message, tok_file, tmp_path, capsys):
    from meshfold.cli import main

    out = tmp_path / "out"
    tokenize([str(_write("jsonl", tmp_path))], out, tokenizer=str(tok_file))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (tmp_path / name).write_text(content)
    assert main(["tokenize", "--tokenizer", str(tok_file), "--out", str(out), "--force", str(tmp_path / "d.jsonl"),
                 str(tmp_path / name)]) == 2
    err = capsys.readouterr().err.strip()
    assert re.search(message, err) and "\n" not in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no staging left


def test_bad_columns_of_parquet_and_saved_datasets_are_named(tmp_path):
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    with pytest.raises(ValueError, match=r"ints.parquet: column 'text' is int64, not strings"):
        list(documents([tmp_path / "ints.parquet"]))
    with pytest.raises(ValueError, match=r"ints.parquet: no column 'body' \(columns: text\)"):
        list(documents([tmp_path / "ints.parquet"], Reader("body")))
    saved = _write("saved", tmp_path)
    with pytest.raises(ValueError, match=r"saved: no split 'test' \(splits: train, validation\); name one with "
                                         r"--split"):
        list(documents([saved], Reader(split="test")))


def test_a_dataset_name_is_not_fetched_and_the_error_says_how_to_save_one(tmp_path, capsys):
    from meshfold.cli import main

    assert main(["tokenize", "--train-tokenizer", "260", "--out", str(tmp_path / "o"), "HuggingFaceFW/fineweb"]) == 2
    err = capsys.readouterr().err
    assert "HuggingFaceFW/fineweb: no such file or folder" in err
    assert "load_dataset('HuggingFaceFW/fineweb').save_to_disk('data/fineweb')" in err
    assert "name the folder: data/fineweb" in err


def test_byte_level_training_refuses_records_and_data_tokenizer_takes_them(tok_file, tmp_path):
    from meshfold.data.corpus import load_corpus
    from meshfold.train import preflight
    from meshfold.train.config import load_config

    cfg = load_config(None, ["train.seq=16"])
    cfg.data.paths = [str(_write("jsonl", tmp_path, docs=DOCS * 20))]
    with pytest.raises(ValueError, match=r"d.jsonl holds records, which byte-level training does not read; "
                                         r"tokenize them \(data.tokenizer"):
        preflight.check_data(cfg)
    with pytest.raises(ValueError, match=r"d.jsonl holds records"):
        load_corpus(cfg.data.paths)
    cfg = load_config(None, ["train.seq=16", "model.vocab=300", f"data.tokenizer={json.dumps(str(tok_file))}"])
    cfg.data.paths = [str(tmp_path / "d.jsonl")]
    preflight.check_data(cfg)


def test_data_tokenizer_reads_records_and_reuses_tokens_only_for_the_same_reader(tok_file, tmp_path):
    from meshfold.data.tokens import tokenize_for_run

    _write("parquet", tmp_path, field="content")
    said = io.StringIO()
    run = [[str(tmp_path / "d.parquet")], str(tok_file), tmp_path / "tokens"]
    tokenize_for_run(*run, stream=said, reader=Reader("content"))
    stream = TokenStream(tmp_path / "tokens")
    assert stream[0:len(stream)].tolist() == _expected(load_tokenizer(tok_file), DOCS)
    tokenize_for_run(*run, stream=said, reader=Reader("content"))
    assert "reusing the tokens" in said.getvalue().splitlines()[-1]
    with pytest.raises(ValueError, match="no column 'text'"):  # another field: read again, not reused
        tokenize_for_run(*run, stream=said, reader=Reader("text"))


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_is_drawn_on_a_terminal_only(tok_file, tmp_path):
    src = _write("jsonl", tmp_path)
    tok = load_tokenizer(tok_file)
    quiet, shown = io.StringIO(), _Terminal()
    write_shards(tok, [src], tmp_path / "a", "t", stream=quiet)
    index = write_shards(tok, [src], tmp_path / "b", "t", stream=shown)
    assert quiet.getvalue() == ""
    last = shown.getvalue().rstrip("\n").split("\r")[-1]
    size = src.stat().st_size
    assert last.startswith(f"{len(DOCS)} records  {size} B of {size} B (100%)  {index['tokens']:,} tokens  ")
    assert "/s  ETA " in last and shown.getvalue().endswith("\n")


def test_the_progress_line_states_rate_and_time_left():
    assert format_line(12_000, 250_000_000, 1_000_000_000, 3_456_789, 10.0) == \
        "12,000 records  250.0 MB of 1.0 GB (25%)  3,456,789 tokens  25.0 MB/s  ETA 0:30"
    assert format_line(1, 1, 10, 1, 0.0).endswith("ETA ?")
    ticks = iter([0.0, 0.1, 0.5])
    terminal = _Terminal()
    progress = Progress(terminal, 100, every=0.2, clock=lambda: next(ticks))
    progress.update(1, 10, 5)  # 0.1 s after the start: not redrawn yet
    assert terminal.getvalue() == ""
    progress.update(2, 50, 9)
    assert terminal.getvalue().startswith("\r2 records  50 B of 100 B (50%)  9 tokens  100 B/s  ETA 0:00")


def test_records_reach_the_shards_in_order_across_many_encode_batches(tok_file, tmp_path):
    docs = [f"record {i} " * (i % 5) for i in range(2500)]  # more than one encode_batch of 1024
    src = _write("jsonl", tmp_path, docs=docs)
    tokenize([str(src)], tmp_path / "out", tokenizer=str(tok_file))
    stream = TokenStream(tmp_path / "out")
    assert stream[0:len(stream)].tolist() == _expected(load_tokenizer(tok_file), docs)
    assert np.asarray(stream[0:5]).dtype == np.uint16


def write_examples(folder) -> None:
    """The small dataset docs/data.md's commands run on: DOCS repeated in every format."""
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for kind in ("jsonl", "jsonl.gz", "json", "parquet", "saved"):
        _write(kind, folder, docs=DOCS * 60)


def test_the_commands_docs_data_md_shows_run(tmp_path, monkeypatch):
    """The tokenize commands of docs/data.md's Records section, on the dataset its first line writes."""
    import shlex
    from pathlib import Path

    from meshfold.cli import main

    doc = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()
    block = doc.split("## Records")[1].split("```bash")[1].split("```")[0]
    lines = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert lines[0] == "python -m tests.data.test_records data/examples"
    monkeypatch.chdir(tmp_path)
    write_examples("data/examples")
    tokenizes = [shlex.split(line) for line in lines if line.startswith("meshfold tokenize")]
    assert len(tokenizes) == 5
    for argv in tokenizes:
        assert main(argv[1:]) == 0, argv
    sizes = {json.loads(p.read_text())["tokens"] for p in Path("data").glob("tok-*/index.json")}
    assert len(sizes) == 1  # every format holds the same documents


if __name__ == "__main__":
    import sys

    write_examples(sys.argv[1] if len(sys.argv) > 1 else "data/examples")
