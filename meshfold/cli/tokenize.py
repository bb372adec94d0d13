"""``meshfold tokenize``: text files and records -> pre-tokenized shards that ``meshfold train --data DIR`` reads.

    meshfold tokenize --tokenizer path/to/tokenizer.json --out data/tok corpus/
    meshfold tokenize --train-tokenizer 8192 --out data/tok corpus/    # BPE trained here, offline
    meshfold tokenize --tokenizer tok.json --out data/tok shards/*.parquet --text-field content
"""

from __future__ import annotations

import argparse

__all__ = ["configure", "main"]


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
    parser.add_argument("--text-field", default="text", help="the field (JSON) or column (Parquet, saved "
                                                                "dataset) holding each record's text (default: text)")
    parser.add_argument("--split", default="train", help="the split of a saved DatasetDict folder (default: train)")
    parser.add_argument("files", nargs="+", help="text files or folders (hidden and binary files skipped), "
                                                 ".jsonl, .jsonl.gz, .json, .parquet, or a folder written by "
                                                 "datasets' save_to_disk; each record is one document")


def main(args: argparse.Namespace) -> int:
    from meshfold.data.records import Reader
    from meshfold.data.tokens import tokenize

    index = tokenize(args.files, args.out, args.tokenizer, args.train_tokenizer, args.shard_tokens, args.force,
                     Reader(args.text_field, args.split))
    print(f"wrote {index['tokens']:,} tokens (vocab {index['vocab_size']:,}, {index['dtype']}) in "
          f"{len(index['shards'])} shards to {args.out}/; train on them with meshfold train --data {args.out} "
          f"--set model.vocab={index['vocab_size']}")
    return 0
