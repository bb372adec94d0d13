"""Weighted mixtures of token folders: each step's batch draws its rows from several sources.

``data.paths = ["web/", "code/"]`` with ``data.weights = [0.7, 0.3]`` trains on two folders
written by ``meshfold tokenize``: each row of a global batch comes from source ``s`` with
probability ``w_s / sum(w)`` (the form of Megatron-Core's ``--data-path 0.7 A 0.3 B``). Which
source and which window each row reads is drawn from ``(seed, step)`` alone, like a single
corpus's batches (:mod:`meshfold.data.corpus`), so a resumed run reads exactly the batches an
uninterrupted one would, and a dp rank reading only its own rows reads the same windows.

Each source keeps its own validation split (its last ``val_fraction`` of tokens), so its
validation loss can be reported apart; the mixture's validation batches are drawn from those
splits in the same proportions.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from meshfold.data.corpus import ByteCorpus, load_corpus, split_point
from meshfold.data.tokens import TOKENIZER, read_index

__all__ = ["Mixture", "check_mixture", "load_mixture"]


def _vocabulary(folder: Path, index: dict):
    """What must agree between sources: the id count, end-of-text id and the tokenizer's model."""
    try:
        model = json.loads((folder / TOKENIZER).read_text()).get("model")
    except (OSError, ValueError):
        model = None
    return index["vocab_size"], index.get("eos_id"), model


def check_mixture(paths: list, weights: list, val_fraction: float, seq: int, model_vocab: int | None = None) -> list:
    """The indexes of a mixture's sources, after checking what would otherwise fail in the ranks:
    one non-negative weight per source, not all zero; each source a token folder whose vocabulary
    is the others' (and fits ``model_vocab``), with more than ``seq + 1`` tokens in each split."""
    if len(weights) != len(paths):
        raise ValueError(f"data.weights has {len(weights)} weights for {len(paths)} data.paths; give one per path")
    bad = [w for w in weights if not w >= 0]
    if bad:
        raise ValueError(f"data.weights {weights}: {bad[0]!r} is negative; valid: numbers >= 0, not all 0")
    if not sum(weights) > 0:
        raise ValueError(f"data.weights {weights} are all 0; valid: numbers >= 0, not all 0")
    indexes, first = [], None
    for path in map(Path, paths):
        if not (path / "index.json").is_file():
            raise ValueError(f"data.paths {path}: a mixture's sources are token folders (meshfold tokenize "
                             f"--out {path} ...), and {path} has no index.json")
        index = read_index(path)
        vocab = _vocabulary(path, index)
        if first is None:
            first = (path, vocab)
        elif vocab != first[1]:
            raise ValueError(f"data.paths {path}: its vocabulary ({vocab[0]:,} ids, end-of-text {vocab[1]}) is not "
                             f"{first[0]}'s ({first[1][0]:,} ids, end-of-text {first[1][1]}"
                             f"{', another tokenizer' if vocab[:2] == first[1][:2] else ''}); tokenize every "
                             f"source with one tokenizer")
        if model_vocab is not None and index["vocab_size"] > model_vocab:
            raise ValueError(f"data {path}: its tokenizer has {index['vocab_size']:,} ids but model.vocab = "
                             f"{model_vocab:,}; set --set model.vocab={index['vocab_size']}")
        cut = split_point(index["tokens"], val_fraction)
        for split, n in (("training", cut), ("validation", index["tokens"] - cut)):
            if n <= seq + 1:
                raise ValueError(f"data {path}: its {split} split would have {n:,} tokens (data.val_fraction = "
                                 f"{val_fraction:g}), not more than train.seq + 1 = {seq + 1}")
        indexes.append(index)
    return indexes


class Mixture:
    """Token sources drawn in proportion to weights; answers ``batch`` like a :class:`ByteCorpus`.

    ``parts`` maps each source's name to its own corpus, for per-source validation loss."""

    def __init__(self, parts: dict[str, ByteCorpus], weights: list[float]):
        self.parts = parts
        self.p = np.asarray(weights, dtype=np.float64) / float(sum(weights))

    def sources(self, split: str, step: int, batch: int, seed: int) -> np.ndarray:
        """[batch] the source index each row of ``step``'s batch reads."""
        return self._draw(split, step, batch, seed)[0]

    def rows_by_source(self, step: int, batch: int, seed: int) -> list[int]:
        """How many rows of training ``step``'s batch each source gave (recorded per step)."""
        return np.bincount(self.sources("train", step, batch, seed), minlength=len(self.parts)).tolist()

    def _draw(self, split: str, step: int, batch: int, seed: int):
        rng = np.random.default_rng([seed, step, 2 if split == "train" else 3])
        return rng.choice(len(self.p), size=batch, p=self.p), rng.random(batch)

    def batch(self, split: str, step: int, batch: int, seq: int, seed: int,
              rows: range | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens, targets)``, both [batch, seq] int64, as :meth:`ByteCorpus.batch`: row ``r``
        is a window of source ``sources(...)[r]``; rows outside ``rows`` are left 0."""
        src, u = self._draw(split, step, batch, seed)
        streams = [part.train if split == "train" else part.val for part in self.parts.values()]
        out = np.zeros((batch, seq + 1), dtype=np.int64)
        for r in range(batch) if rows is None else rows:
            data = streams[src[r]]
            start = int(u[r] * (len(data) - seq - 1))
            out[r] = data[start:start + seq + 1]
        t = torch.from_numpy(out)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def load_mixture(paths: list, weights: list, val_fraction: float = 0.05) -> Mixture:
    """The token folders ``paths`` as one :class:`Mixture` with ``weights``."""
    return Mixture({str(p): load_corpus([p], val_fraction) for p in paths}, list(weights))
