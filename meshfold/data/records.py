"""Documents from the formats training data comes in: plain text, JSON Lines, JSON, Parquet and
Hugging Face datasets saved with ``save_to_disk``.

Each record is one document. Every reader streams: it holds one line (JSON Lines), one file
(``.json``, an array), one record batch (Parquet) or the memory-mapped Arrow files of a dataset
folder at a time, never the whole corpus. Parquet is read with pyarrow and dataset folders with
Hugging Face ``datasets`` (optional extras, ``pip install "meshfold[parquet]"`` or
``"meshfold[datasets]"``); nothing is fetched from a hub.

A reader yields ``(text, position)``: the document and how far into its source it has read, in
the source's bytes on disk, so that a progress line can show an ETA.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

__all__ = ["RECORD_SUFFIXES", "Reader", "documents", "is_dataset_folder", "is_records_file", "source_bytes"]

RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet")
# data formats meshfold does not read: named, one is an error rather than a binary file skipped
# or a compressed file read as text
UNREAD_SUFFIXES = (".csv", ".tsv", ".arrow", ".feather", ".json.gz", ".gz", ".zst", ".bz2", ".xz", ".zip",
                   ".tar", ".parquet.gz")
DATASET_MARKERS = ("dataset_dict.json", "state.json")  # what save_to_disk writes (DatasetDict, Dataset)


def _suffix(path: Path) -> str:
    name = path.name.lower()
    for s in sorted(RECORD_SUFFIXES + UNREAD_SUFFIXES, key=len, reverse=True):
        if name.endswith(s):
            return s
    return path.suffix.lower()


def is_records_file(path: Path) -> bool:
    """Whether ``path`` is read as records (one document per record) rather than as one text."""
    return _suffix(Path(path)) in RECORD_SUFFIXES


def check_suffix(path: Path) -> None:
    """A data format meshfold does not read is an error naming the file and the formats it reads."""
    if _suffix(path) in UNREAD_SUFFIXES:
        raise ValueError(f"{path}: meshfold does not read {_suffix(path)} files; valid: "
                         f"{', '.join(RECORD_SUFFIXES)}, a folder written by datasets' save_to_disk, or "
                         f"plain text (any other name)")


def is_dataset_folder(path: Path) -> bool:
    """Whether ``path`` is a folder written by Hugging Face ``datasets``' ``save_to_disk``."""
    return Path(path).is_dir() and any((Path(path) / m).is_file() for m in DATASET_MARKERS)


def source_bytes(path: Path) -> int:
    """A source's size on disk (a dataset folder: its files together)."""
    path = Path(path)
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


class Reader:
    """How records become documents: the field (or Parquet column) that holds the text, and the
    split of a dataset folder saved as a ``DatasetDict``."""

    def __init__(self, text_field: str = "text", split: str = "train"):
        self.text_field, self.split = text_field, split

    def settings(self) -> dict:
        """What the reader takes from records (kept in a token index, to reuse it only for the same)."""
        return {"text_field": self.text_field, "split": self.split}

    def documents(self, path: Path) -> Iterator[tuple[str, int]]:
        """``(text, position)`` of each document in ``path``, in order."""
        path = Path(path)
        if path.is_dir():
            return self._dataset(path)
        suffix = _suffix(path)
        check_suffix(path)
        if suffix in (".jsonl", ".jsonl.gz", ".json"):
            return self._json(path, suffix)
        if suffix == ".parquet":
            return self._parquet(path)
        return iter([(path.read_text(encoding="utf-8", errors="replace"), source_bytes(path))])

    def _text(self, record, where: str) -> str:
        """The record's text field, or an error naming the record and what it holds instead."""
        if not isinstance(record, dict):
            raise ValueError(f"{where}: a {type(record).__name__}, not an object with a {self.text_field!r} field")
        if self.text_field not in record:
            fields = ", ".join(map(str, record)) or "none"
            raise ValueError(f"{where}: no field {self.text_field!r} (fields: {fields}); name the text with "
                             f"--text-field (data.text_field)")
        text = record[self.text_field]
        if not isinstance(text, str):
            raise ValueError(f"{where}: field {self.text_field!r} is a {type(text).__name__}, not a string")
        return text

    def _json(self, path: Path, suffix: str) -> Iterator[tuple[str, int]]:
        raw = open(path, "rb")
        with raw, (gzip.open(raw) if suffix == ".jsonl.gz" else raw) as f:
            if suffix == ".json" and f.read(1024).lstrip()[:1] == b"[":  # an array; else JSON Lines
                f.seek(0)
                try:
                    records = json.load(f)
                except ValueError as err:
                    raise ValueError(f"{path}: not valid JSON ({err})") from None
                for i, record in enumerate(records):
                    yield self._text(record, f"{path} record {i}"), raw.tell()
                return
            f.seek(0)
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as err:
                    raise ValueError(f"{path} line {n}: not JSON ({err})") from None
                yield self._text(record, f"{path} line {n}"), raw.tell()

    def _parquet(self, path: Path) -> Iterator[tuple[str, int]]:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f'{path}: reading Parquet needs pyarrow: pip install "meshfold[parquet]"') from None
        try:
            file = pq.ParquetFile(path)
        except Exception as err:  # noqa: BLE001 - pyarrow raises its own exception types
            raise ValueError(f"{path}: not a Parquet file ({err})") from None
        names = file.schema_arrow.names
        if self.text_field not in names:
            raise ValueError(f"{path}: no column {self.text_field!r} (columns: {', '.join(names)}); name the "
                             f"text with --text-field (data.text_field)")
        kind = file.schema_arrow.field(self.text_field).type
        if str(kind) not in ("string", "large_string", "string_view"):
            raise ValueError(f"{path}: column {self.text_field!r} is {kind}, not strings")
        size, row, groups = source_bytes(path), 0, max(file.num_row_groups, 1)
        for g in range(file.num_row_groups):
            for batch in file.iter_batches(columns=[self.text_field], row_groups=[g]):
                for text in batch.column(0).to_pylist():
                    if text is None:
                        raise ValueError(f"{path} row {row}: column {self.text_field!r} is null, not a string")
                    yield text, size * g // groups
                    row += 1

    def _dataset(self, path: Path) -> Iterator[tuple[str, int]]:
        try:
            import datasets
        except ImportError:
            raise ValueError(f'{path}: reading a saved dataset needs datasets: pip install "meshfold[datasets]"'
                             ) from None
        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            if self.split not in data:
                raise ValueError(f"{path}: no split {self.split!r} (splits: {', '.join(data)}); name one with "
                                 f"--split (data.split)")
            data = data[self.split]
        if self.text_field not in data.column_names:
            raise ValueError(f"{path}: no column {self.text_field!r} (columns: {', '.join(data.column_names)}); "
                             f"name the text with --text-field (data.text_field)")
        feature = data.features[self.text_field]
        if getattr(feature, "dtype", None) not in ("string", "large_string"):
            raise ValueError(f"{path}: column {self.text_field!r} is {feature}, not strings")
        size, rows = source_bytes(path), max(len(data), 1)
        column = data.select_columns([self.text_field])
        for i, record in enumerate(column):  # reads the memory-mapped Arrow files a batch at a time
            yield self._text(record, f"{path} row {i}"), size * i // rows


def documents(paths: list[Path], reader: Reader | None = None) -> Iterator[tuple[str, int]]:
    """Every document of ``paths`` in order, each ``(text, bytes of the sources read so far)``."""
    reader = reader or Reader()
    done = 0
    for path in paths:
        n = 0
        for n, (text, pos) in enumerate(reader.documents(path), 1):
            yield text, done + pos
        if n == 0:
            raise ValueError(f"{path}: no records (an empty source); remove it or fill it")
        done += source_bytes(path)


def not_a_folder(path: str) -> str:
    """The error for a ``--data`` / tokenize path that does not exist: a hub dataset name is not
    fetched, and the message says how to save one to disk."""
    hint, folder = "", f"data/{Path(path).name}"
    if not path.startswith((".", "/", "~")) and not Path(path).suffix:
        hint = (f"; if {path!r} is a Hugging Face dataset name, meshfold does not download it: save it to disk "
                f"first, python -c \"import datasets; datasets.load_dataset({path!r}).save_to_disk('{folder}')\", "
                f"then name the folder: {folder}")
    return f"{path}: no such file or folder{hint}"
