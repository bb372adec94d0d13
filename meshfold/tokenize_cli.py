"""``meshfold tokenize``: text files -> pre-tokenized shards that ``meshfold train --data DIR`` reads.

    meshfold tokenize --tokenizer path/to/tokenizer.json --out data/tok corpus/
    meshfold tokenize --train-tokenizer 8192 --out data/tok corpus/    # BPE trained here, offline
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

__all__ = ["configure", "main", "tokenize"]


def configure(parser: argparse.ArgumentParser) -> None:
    how = parser.add_mutually_exclusive_group(required=True)
    how.add_argument("--tokenizer", help="a Hugging Face tokenizers tokenizer.json, or a checkpoint folder with one")
    how.add_argument("--train-tokenizer", type=int, metavar="VOCAB",
                     help="train a byte-level BPE tokenizer of VOCAB ids on the files (saved to OUT)")
    parser.add_argument("--out", required=True, help="a new or empty folder for the shards, index.json and "
                                                     "tokenizer.json")
    parser.add_argument("--force", action="store_true", help="replace the tokenization OUT holds (only a "
                                                             "tokenization: a folder of other files is refused)")
    parser.add_argument("--shard-tokens", type=int, default=1 << 27, help="a shard closes after the document that reaches this many ids (default 2^27)")
    parser.add_argument("files", nargs="+", help="text files or folders (hidden and binary files skipped)")


def _check_out(out: Path, force: bool) -> None:
    """``--out`` is new or empty, or (``--force``) holds a tokenization that may be replaced."""
    from meshfold.tokens import INDEX, SHARD_GLOB

    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a new or empty folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not force:
        raise ValueError(f"--out {out} is not empty; give a new or empty folder, or --force to replace the "
                         f"tokenization it holds")
    if not (out / INDEX).is_file() and not any(out.glob(SHARD_GLOB)):
        raise ValueError(f"--out {out} holds files that are not a meshfold tokenization (no {INDEX}, no "
                         f"shards); --force replaces only a tokenization: give a new or empty folder")


def _move_into_place(stage: Path, out: Path) -> None:
    """``stage`` becomes ``out``; an earlier ``out`` is moved aside first and deleted only after,
    so the folder holds one whole tokenization at every moment a reader could look."""
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        os.rename(stage, out)
        return
    old = out.with_name(f".{out.name}.replaced-{os.getpid()}")
    os.rename(out, old)
    os.rename(stage, out)
    shutil.rmtree(old)


def tokenize(files: list[str], out: str | Path, tokenizer: str | None = None, train_vocab: int | None = None,
             shard_tokens: int = 1 << 27, force: bool = False) -> dict:
    """Tokenize ``files`` into ``out`` with a given tokenizer or one trained on them; the index.

    Everything about the request is checked before a file is read; the tokenization is written
    into a folder beside ``out`` and moved into place whole, so a failure or an interruption
    leaves ``out`` as it was."""
    from meshfold.data import corpus_files
    from meshfold.tokens import TOKENIZER, check_vocab, load_tokenizer, train_tokenizer, write_shards

    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens must be >= 1, got {shard_tokens}")
    if train_vocab is not None:
        check_vocab(train_vocab)
    out = Path(out)
    _check_out(out, force)
    paths = corpus_files(files)
    if not any(f.stat().st_size for f in paths):
        raise ValueError(f"{' '.join(map(str, files))}: the files are empty (0 bytes); nothing to tokenize")
    tok = None if train_vocab is not None else load_tokenizer(tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(stage, ignore_errors=True)
    try:
        if tok is None:
            tok, name = train_tokenizer(paths, train_vocab, stage), str(out / TOKENIZER)
        else:
            name = str(tokenizer)
        index = write_shards(tok, paths, stage, name, shard_tokens)
        if index["tokens"] == 0:
            raise ValueError(f"{' '.join(map(str, files))}: the tokenizer made no tokens of this text")
        _move_into_place(stage, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return index


def main(args: argparse.Namespace) -> int:
    index = tokenize(args.files, args.out, args.tokenizer, args.train_tokenizer, args.shard_tokens, args.force)
    print(f"wrote {index['tokens']:,} tokens (vocab {index['vocab_size']:,}, {index['dtype']}) in "
          f"{len(index['shards'])} shards to {args.out}/; train on them with meshfold train --data {args.out} "
          f"--set model.vocab={index['vocab_size']}")
    return 0
