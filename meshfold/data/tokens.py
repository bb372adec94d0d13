"""Pre-tokenized training data: ``meshfold tokenize`` writes it, ``meshfold train --data DIR`` reads it.

A token folder holds shards of flat token ids and one small JSON index::

    DIR/index.json          {"format": "meshfold-tokens-1", "dtype": "uint16", "vocab_size": V,
                             "eos_id": e, "tokenizer": "...", "tokens": N,
                             "shards": [{"file": ..., "tokens": n}, ...]}
    DIR/shard-00000.bin     ids as little-endian uint16 (vocab <= 65536) or uint32, EOS between
    DIR/shard-00001.bin     documents (a text file, or a record of a JSON Lines, JSON, Parquet
                            or saved-dataset source: :mod:`meshfold.data.records`)
    DIR/tokenizer.json      the tokenizer that made the ids (trained by --train-tokenizer, or a
                            copy of --tokenizer's): the folder decodes without anything else

The reader requires ``format``, ``dtype``, ``vocab_size``, ``shards`` and ``tokens``, the total
over the shards (a check that the shard list is the one written); ``eos_id`` and ``tokenizer``
say what made the ids; ``meshfold tokenize`` also records ``sources`` (what to reuse it for).

Why this layout: it is what numpy memory-maps without parsing (every rank maps the shards and
reads only the windows it trains on), it is the layout nanoGPT and Megatron-Core's indexed
datasets use in spirit (flat ids, an index beside them), and the index lets ``meshfold train``
check vocabulary, size and integrity before any rank starts.

The shards form one stream; its last ``data.val_fraction`` of tokens is held out for
validation, as for byte-level text. Batches are drawn from ``(seed, step)`` exactly as for bytes
(:mod:`meshfold.data.corpus`), so a resumed run reads the batches an uninterrupted one would: the
sampler's position is the step, which the checkpoint holds.

Tokenizers are Hugging Face ``tokenizers`` files (``pip install "meshfold[tokenize]"``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from meshfold.data.files import FORMAT, INDEX, SHARD_GLOB, corpus_files, default_corpus_paths, is_token_index
from meshfold.data.progress import Progress
from meshfold.data.records import Reader, documents, source_bytes

__all__ = ["TokenStream", "is_token_folder", "load_tokenizer", "read_index", "tokenize", "tokenizer_file",
           "train_tokenizer", "write_shards"]

TOKENIZER = "tokenizer.json"
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ValueError('tokenized data needs the tokenizers package: pip install "meshfold[tokenize]"') from None
    return tokenizers


def tokenizer_file(path: str | Path) -> Path:
    """The tokenizer.json that ``path`` names: itself, or the one in a checkpoint folder."""
    path = Path(path)
    return path / TOKENIZER if path.is_dir() else path


def load_tokenizer(path: str | Path):
    """A ``tokenizers.Tokenizer`` from a tokenizer.json, or a Hugging Face checkpoint folder with one."""
    path = Path(path)
    file = tokenizer_file(path)
    if not file.is_file():
        raise ValueError(f"tokenizer {path}: no tokenizer.json there")
    try:
        return _tokenizers().Tokenizer.from_file(str(file))
    except Exception as err:  # noqa: BLE001 - tokenizers raises its own exception types
        raise ValueError(f"tokenizer {file}: not a tokenizers file ({err})") from None


def eos_id(tok) -> int:
    """The id that separates documents: the tokenizer's end-of-text token."""
    for name in EOS_NAMES:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    raise ValueError(f"the tokenizer has none of the end-of-text tokens {list(EOS_NAMES)}")


MAX_VOCAB = 1 << 32  # ids are stored as uint32 at most


def check_vocab(vocab: int) -> None:
    """``--train-tokenizer VOCAB`` is a size a byte-level BPE can have (checked before any file is read)."""
    if not 257 + 1 <= vocab <= MAX_VOCAB:
        raise ValueError(f"--train-tokenizer {vocab}: valid: 258 (256 bytes + EOS + 1 merge) to {MAX_VOCAB:,} "
                         f"(uint32 ids)")


def train_tokenizer(files: list[Path], vocab: int, out: Path, reader: Reader | None = None):
    """Train a byte-level BPE tokenizer of exactly ``vocab`` ids on ``files`` (offline); saves and
    returns it. BPE stops when no pair of tokens is left to merge, so a short text cannot make a
    large vocabulary: that is an error naming the size the text gives, never a smaller tokenizer."""
    tk = _tokenizers()
    check_vocab(vocab)
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((text for text, _ in documents(files, reader)), trainer)
    made = tok.get_vocab_size(with_added_tokens=True)
    if made < vocab:
        raise ValueError(f"--train-tokenizer {vocab:,}: byte-level BPE on this text stops at {made:,} ids (no pair "
                         f"of tokens is left to merge); ask for at most {made:,}, or give more text")
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / TOKENIZER))
    return tok


def write_shards(tok, files: list[Path], out: Path, tokenizer_name: str, shard_tokens: int = 1 << 27,
                 stream=None, extra: dict | None = None, reader: Reader | None = None) -> dict:
    """Tokenize the documents of ``files`` (a text file is one document, a record of a JSON Lines,
    JSON, Parquet or saved-dataset source is one: :mod:`meshfold.data.records`) into ``out``'s
    shards and index, the end-of-text id between documents, beside a copy of the tokenizer
    (``tokenizer.json``: what decodes the ids, e.g. for ``meshfold generate``); returns the index.

    Documents are encoded a batch at a time (``encode_batch``, the tokenizer's own threads) and
    written shard by shard, so memory holds one batch and one shard. A progress line is drawn on
    ``stream`` (None: ``sys.stdout`` when called) when it is a terminal. The index is written
    last, so an interrupted run leaves a folder ``meshfold train`` refuses (no index) rather than
    a silently short one."""
    stream = sys.stdout if stream is None else stream
    reader = reader or Reader()
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    eos = eos_id(tok)
    out.mkdir(parents=True, exist_ok=True)
    (out / INDEX).unlink(missing_ok=True)
    tok.save(str(out / TOKENIZER))
    shards, buf, total, records, pending = [], [], 0, 0, 0
    progress = Progress(stream, sum(source_bytes(f) for f in files))

    def flush():
        ids = np.concatenate(buf).astype(dtype) if buf else np.zeros(0, dtype)
        name = f"shard-{len(shards):05d}.bin"
        ids.tofile(out / name)
        shards.append({"file": name, "tokens": int(ids.size)})
        buf.clear()

    done = 0
    for texts, done in _batches(documents(files, reader)):
        for enc in tok.encode_batch(texts):
            doc = np.asarray(([eos] if total else []) + enc.ids, dtype=np.int64)
            buf.append(doc)
            pending += doc.size
            total += doc.size
            if pending >= shard_tokens:
                flush()
                pending = 0
        records += len(texts)
        progress.update(records, done, total)
    if buf or not shards:
        flush()
    progress.update(records, progress.total, total, final=True)
    if records == 0:
        raise ValueError(f"{' '.join(map(str, files))}: no documents (empty sources); nothing to tokenize")
    index = {"format": FORMAT, "dtype": np.dtype(dtype).name, "vocab_size": vocab, "eos_id": eos,
             "tokenizer": tokenizer_name, "tokens": total, "shards": shards, "documents": records,
             "sources": sources(files), "reader": reader.settings(), **(extra or {})}
    (out / INDEX).write_text(json.dumps(index, indent=1) + "\n")
    return index


def _batches(docs, size: int = 1024):
    """``(texts, position)`` of up to ``size`` documents at a time: what one ``encode_batch`` takes."""
    texts, pos = [], 0
    for text, pos in docs:
        texts.append(text)
        if len(texts) == size:
            yield texts, pos
            texts = []
    if texts:
        yield texts, pos


def _check_out(out: Path, force: bool) -> None:
    """``--out`` is new or empty, or (``--force``) holds a tokenization that may be replaced."""
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
             shard_tokens: int = 1 << 27, force: bool = False, reader: Reader | None = None) -> dict:
    """Tokenize ``files`` into ``out`` with a given tokenizer or one trained on them; the index.

    Everything about the request is checked before a file is read; the tokenization is written
    into a folder beside ``out`` and moved into place whole, so a failure or an interruption
    leaves ``out`` as it was."""
    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens must be >= 1, got {shard_tokens}")
    if train_vocab is not None:
        check_vocab(train_vocab)
    out = Path(out)
    _check_out(out, force)
    paths = corpus_files(files, given_as="meshfold tokenize file argument")
    if not any(source_bytes(f) for f in paths):
        raise ValueError(f"{' '.join(map(str, files))}: the files are empty (0 bytes); nothing to tokenize")
    tok = None if train_vocab is not None else load_tokenizer(tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(stage, ignore_errors=True)
    try:
        if tok is None:
            tok, name = train_tokenizer(paths, train_vocab, stage, reader), str(out / TOKENIZER)
        else:
            name = str(tokenizer)
        index = write_shards(tok, paths, stage, name, shard_tokens, reader=reader)
        if index["tokens"] == 0:
            raise ValueError(f"{' '.join(map(str, files))}: the tokenizer made no tokens of this text")
        _move_into_place(stage, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return index


def sources(files: list[Path]) -> list:
    """What a token folder was made from: ``[path, size, mtime_ns]`` of each file, to reuse it
    only while the text (and the tokenizer file) is unchanged."""
    return [[str(Path(f).resolve()), source_bytes(f), Path(f).stat().st_mtime_ns] for f in files]


def tokenize_for_run(paths: list, tokenizer: str, folder: Path, stream=None, reader: Reader | None = None) -> Path:
    """``data.tokenizer``: the text ``paths`` tokenized into ``folder`` (reused while the text
    and the tokenizer are the same); returns the folder to train on. Says which on ``stream``
    (None: ``sys.stdout`` when called, so a caller's redirection holds)."""
    stream = sys.stdout if stream is None else stream
    files = corpus_files(paths) if paths else default_corpus_paths()
    file = tokenizer_file(tokenizer)
    reader = reader or Reader()
    try:
        index = json.loads((folder / INDEX).read_text())
        if (index.get("sources") == sources(files) and index.get("tokenizer_file") == sources([file])[0]
                and index.get("reader") == reader.settings()):
            read_index(folder)
            stream.write(f"  data: reusing the tokens in {folder}/\n")
            return folder
    except (OSError, ValueError):
        pass
    stream.write(f"  data: tokenizing {len(files)} files with {tokenizer} into {folder}/\n")
    write_shards(load_tokenizer(tokenizer), files, folder, str(Path(tokenizer).resolve()), stream=stream,
                 extra={"tokenizer_file": sources([file])[0]}, reader=reader)
    return folder


def is_token_folder(paths) -> bool:
    """Whether ``--data`` names one pre-tokenized folder (it has an index.json)."""
    return len(paths) == 1 and (Path(paths[0]) / INDEX).is_file()


def read_index(folder: str | Path) -> dict:
    """The folder's index, with every shard checked to exist and to hold as many ids as it says."""
    folder = Path(folder)
    try:
        index = json.loads((folder / INDEX).read_text())
        shards, dtype = index["shards"], np.dtype(index["dtype"])
        assert index["format"] == FORMAT and dtype in (np.uint16, np.uint32)
        int(index["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as err:
        raise ValueError(f"{folder / INDEX} is not a meshfold token index ({type(err).__name__}: {err}); "
                         f"rewrite it with meshfold tokenize") from None
    if sum(s["tokens"] for s in shards) != index.get("tokens"):
        raise ValueError(f"{folder / INDEX}: its shards hold {sum(s['tokens'] for s in shards):,} tokens, "
                         f"not the {index.get('tokens')} it says; rerun meshfold tokenize")
    for s in shards:
        path = folder / s["file"]
        size = path.stat().st_size if path.is_file() else -1
        if size != s["tokens"] * dtype.itemsize:
            raise ValueError(f"{path} is {'missing' if size < 0 else f'{size:,} bytes'}, not the "
                             f"{s['tokens']:,} tokens x {dtype.itemsize} bytes the index says; rerun "
                             f"meshfold tokenize")
    return index


class TokenStream:
    """The shards of a token folder as one read-only stream of ids, memory-mapped: ``len`` and
    slicing (``stream[a:b]``, a numpy array) read only the bytes asked for."""

    def __init__(self, folder: str | Path, index: dict | None = None):
        folder = Path(folder)
        index = index or read_index(folder)
        self.maps = [np.memmap(folder / s["file"], dtype=index["dtype"], mode="r")
                     for s in index["shards"] if s["tokens"]]
        self.offsets = np.cumsum([0] + [m.size for m in self.maps])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, window: slice) -> np.ndarray:
        lo, hi, _ = window.indices(len(self))
        parts = []
        first = int(np.searchsorted(self.offsets, lo, side="right")) - 1
        for k in range(max(first, 0), len(self.maps)):
            a, b = self.offsets[k], self.offsets[k + 1]
            if a >= hi:
                break
            parts.append(self.maps[k][max(lo, a) - a:min(hi, b) - a])
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)
