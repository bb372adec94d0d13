"""Training text: byte-level tokens (vocab 256) from files every machine has, or from ``--data``.

The default corpus is the running Python's own standard-library sources: real text, present on
every machine that can run meshfold, no download. Files are read in sorted order, concatenated
with a newline between them, and split into a training part and a held-out validation part (the
last ``val_fraction`` of the bytes), so validation text is never trained on.

Batches are drawn deterministically from ``(seed, step)``: resuming at step n reproduces exactly
the batches an uninterrupted run would have seen, with no data-loader state to save.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from meshfold.data.files import corpus_files, default_corpus_paths
from meshfold.data.records import is_records_file
from meshfold.data.tokens import TokenStream, is_token_folder

__all__ = ["ByteCorpus", "load_corpus", "split_point", "split_sizes", "corpus_description", "text_only"]


def split_point(total: int, val_fraction: float) -> int:
    """Where a stream of ``total`` tokens splits: train ``[0, cut)``, validation ``[cut, total)``."""
    return int(total * (1 - val_fraction))


def text_only(files: list[Path]) -> None:
    """Byte-level training reads text files whole; records (JSON Lines, Parquet, a saved dataset)
    would be trained on as their JSON or binary bytes, so they are refused, naming the way in."""
    for f in files:
        if f.is_dir() or is_records_file(f):
            raise ValueError(f"--data {f} holds records, which byte-level training does not read; tokenize them "
                             f"(data.tokenizer, or meshfold tokenize --tokenizer T --out DIR {f})")


def split_sizes(files: list[Path], val_fraction: float) -> tuple[int, int]:
    """(train, validation) bytes :func:`load_corpus` will make of ``files``, from their sizes
    (for records, the size of their sources: what ``data.tokenizer`` is checked against first)."""
    try:
        total = sum(f.stat().st_size for f in files) + max(0, len(files) - 1)  # joined by newlines
    except OSError as err:
        raise ValueError(f"--data: cannot read {err.filename}: {err.strerror}") from None
    cut = split_point(total, val_fraction)
    return cut, total - cut


class _Window:
    """Positions ``[lo, hi)`` of a token stream (a numpy array or a memory-mapped TokenStream)."""

    def __init__(self, stream, lo: int, hi: int):
        self.stream, self.lo, self.hi = stream, lo, hi

    def __len__(self) -> int:
        return self.hi - self.lo

    def __getitem__(self, window: slice) -> np.ndarray:
        a, b, _ = window.indices(len(self))
        return np.asarray(self.stream[self.lo + a:self.lo + b])


@dataclass
class ByteCorpus:
    """Train and validation token streams: byte-level text (uint8 arrays), or the memory-mapped
    shards of a pre-tokenized folder (:mod:`meshfold.data.tokens`)."""

    train: np.ndarray | _Window
    val: np.ndarray | _Window

    def batch(self, split: str, step: int, batch: int, seq: int, seed: int,
              rows: range | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens, targets)``, both [batch, seq] int64, for one global step (same on all ranks).

        ``rows``: read only these rows of the global batch (a dp rank's own); the others are left
        0 and must not be used. The windows drawn do not depend on ``rows``."""
        data = self.train if split == "train" else self.val
        if len(data) <= seq + 1:
            raise ValueError(f"{split} text has {len(data)} tokens, fewer than seq + 1 = {seq + 1}")
        rng = np.random.default_rng([seed, step, 0 if split == "train" else 1])
        starts = rng.integers(0, len(data) - seq - 1, size=batch)
        out = np.zeros((batch, seq + 1), dtype=np.int64)
        for r in range(batch) if rows is None else rows:
            out[r] = data[starts[r]:starts[r] + seq + 1]
        t = torch.from_numpy(out)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def load_corpus(paths: list[str | Path] | None = None, val_fraction: float = 0.05) -> ByteCorpus:
    """Read ``paths`` (files or folders; default: the standard library) into a ByteCorpus; a single
    folder holding a token index (``meshfold tokenize``) is memory-mapped instead."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if paths and is_token_folder(paths):
        stream = TokenStream(paths[0])
        cut = split_point(len(stream), val_fraction)
        return ByteCorpus(_Window(stream, 0, cut), _Window(stream, cut, len(stream)))
    files = default_corpus_paths() if not paths else corpus_files(paths)
    text_only(files)
    chunks = []
    for f in files:
        try:
            chunks.append(f.read_bytes())
        except OSError as err:
            raise OSError(f"cannot read {f}: {err}") from err
    data = np.frombuffer(b"\n".join(chunks), dtype=np.uint8)
    cut = split_point(len(data), val_fraction)
    return ByteCorpus(data[:cut].copy(), data[cut:].copy())


def corpus_description(paths) -> str:
    """How a run's header names its text: the standard library, or the ``--data`` paths."""
    return "Python standard library sources" if not paths else ", ".join(map(os.fspath, paths))
