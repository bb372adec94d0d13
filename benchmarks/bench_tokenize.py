"""Tokenize throughput of each reader against the plain text path, on one generated corpus.

The same documents (generated words, a fixed seed) are written as text files (the plain path: one
file per document), JSON Lines, gzip JSON Lines, a JSON array, Parquet and a
``save_to_disk`` folder; each is tokenized by ``meshfold tokenize`` with one byte-level BPE
tokenizer trained beforehand. Rates are MB of document text (the same text in every format, so
the rates compare) per second of wall time and per second of CPU time (this process and the
tokenizer's threads: steadier than wall time on a shared machine), for the whole tokenize and for
the reader alone (iterating the documents, nothing encoded).

    python benchmarks/bench_tokenize.py --mb 64 --json benchmarks/results/tokenize.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import sys
import shutil
import signal
import tempfile
import time
from pathlib import Path

import numpy as np

from meshfold.data.files import corpus_files
from meshfold.data.records import documents, source_bytes
from meshfold.data.tokens import tokenize

def generate(mb: float, seed: int = 0) -> list[str]:
    """Documents of 50 to 2,000 words, about ``mb`` MB of text in all: words of 2 to 10 letters
    from a lexicon of 20,000, drawn with Zipf-like frequencies as in natural text."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    lexicon = np.array(["".join(rng.choice(letters, size=int(rng.integers(2, 11)), p=None)) for _ in range(20_000)])
    p = 1 / np.arange(1, len(lexicon) + 1)
    p /= p.sum()
    docs, total = [], 0
    while total < mb * 1e6:
        words = rng.choice(lexicon, size=int(rng.integers(50, 2000)), p=p)
        text = " ".join(words) + ".\n"
        docs.append(text)
        total += len(text)
    return docs


def write_formats(docs: list[str], root: Path) -> dict[str, Path]:
    """The corpus in each format the readers take, keyed by the name the table shows."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = {"text files": root / "text"}
    out["text files"].mkdir()
    for k, doc in enumerate(docs):
        (out["text files"] / f"{k:08d}.txt").write_text(doc)
    lines = "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs))
    out[".jsonl"] = root / "c.jsonl"
    out[".jsonl"].write_text(lines)
    out[".jsonl.gz"] = root / "c.jsonl.gz"
    out[".jsonl.gz"].write_bytes(gzip.compress(lines.encode(), compresslevel=1))
    out[".json"] = root / "c.json"
    out[".json"].write_text(json.dumps([{"text": d} for d in docs]))
    out[".parquet"] = root / "c.parquet"
    pq.write_table(pa.table({"text": docs}), out[".parquet"], row_group_size=4096)
    out["save_to_disk"] = root / "saved"
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(out["save_to_disk"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=64, help="MB of document text to generate")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--json", help="write the table here as JSON")
    args = parser.parse_args()
    docs = generate(args.mb)
    text_mb, n_docs = sum(len(d) for d in docs) / 1e6, len(docs)
    root = Path(tempfile.mkdtemp(prefix="bench-tokenize-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still deletes the generated corpus
    try:
        (root / "sample.txt").write_text("".join(docs[:400]))
        tokenize([str(root / "sample.txt")], root / "tok", train_vocab=args.vocab)
        tok = str(root / "tok" / "tokenizer.json")
        sources = write_formats(docs, root)
        del docs  # on disk in every format now; the memory goes back to the machine
        rows = []
        machine = platform.processor() or platform.machine()
        print(f"{n_docs:,} documents, {text_mb:.1f} MB of text, vocab {args.vocab}; {machine}")
        print(f"{'reader':<14}{'disk MB':>8}{'wall s':>8}{'CPU s':>8}{'MB/s':>7}{'MB/CPU s':>10}{'vs text':>9}"
              f"{'read only MB/s':>16}{'MB/CPU s':>10}", flush=True)
        for name, path in sources.items():
            files = corpus_files([str(path)])
            t0, c0 = time.perf_counter(), time.process_time()
            read = sum(len(text) for text, _ in documents(files))  # the reader alone
            read_s, read_cpu = time.perf_counter() - t0, time.process_time() - c0
            t0, c0 = time.perf_counter(), time.process_time()
            index = tokenize([str(path)], root / f"out-{len(rows)}", tokenizer=tok)
            s, cpu = time.perf_counter() - t0, time.process_time() - c0
            rows.append({"reader": name, "documents": index["documents"], "tokens": index["tokens"],
                         "disk_mb": source_bytes(path) / 1e6, "seconds": s, "cpu_seconds": cpu,
                         "text_mb_per_s": text_mb / s, "text_mb_per_cpu_s": text_mb / cpu,
                         "read_only_mb_per_s": read / 1e6 / read_s, "read_only_mb_per_cpu_s": read / 1e6 / read_cpu})
            shutil.rmtree(root / f"out-{len(rows) - 1}")  # the tokens are not needed again: disk stays bounded
            r, base = rows[-1], rows[0]["text_mb_per_cpu_s"]
            print(f"{r['reader']:<14}{r['disk_mb']:>8.1f}{r['seconds']:>8.2f}{r['cpu_seconds']:>8.2f}"
                  f"{r['text_mb_per_s']:>7.2f}{r['text_mb_per_cpu_s']:>10.2f}{r['text_mb_per_cpu_s'] / base:>9.2f}"
                  f"{r['read_only_mb_per_s']:>16.1f}{r['read_only_mb_per_cpu_s']:>10.1f}", flush=True)
        if len({(r["documents"], r["tokens"]) for r in rows}) != 1:  # the same documents, read by each
            raise SystemExit("the readers disagree on the corpus: " + json.dumps(rows))
        if args.json:
            Path(args.json).write_text(json.dumps({"text_mb": text_mb, "documents": n_docs, "rows": rows},
                                                  indent=1) + "\n")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    from meshfold.runtime.machine import print_machine

    print_machine()  # the CPU and its bf16 instructions: a timing means nothing without them
    main()
