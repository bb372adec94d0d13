"""Which files a run reads: the ``--data`` paths as files, or the Python standard library's sources.

The default corpus is the running Python's own standard-library sources: real text, present on
every machine that can run meshfold, no download. Folders are read in sorted order, without
hidden files and folders or binary files.
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

from meshfold.data.records import check_suffix, is_dataset_folder, is_records_file, not_a_folder

__all__ = ["corpus_files", "default_corpus_paths", "is_token_index"]

# What marks a token folder (:mod:`meshfold.data.tokens`), so that text never reads one as text.
FORMAT = "meshfold-tokens-1"
INDEX = "index.json"
SHARD_GLOB = "shard-[0-9][0-9][0-9][0-9][0-9].bin"


def default_corpus_paths(limit_bytes: int = 8_000_000) -> list[Path]:
    """The standard library's ``*.py`` files (sorted), up to about ``limit_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests"}
    found = []
    for folder, dirs, files in os.walk(root):  # not into the skipped folders: site-packages is most
        dirs[:] = [d for d in dirs if d not in skip]  # of the tree, and every rank lists it
        found += [Path(folder, f) for f in files if f.endswith(".py")]
    out, total = [], 0
    for path in sorted(found):
        if skip.intersection(path.parts):
            continue
        try:
            size = path.stat().st_size
        except OSError:
            continue
        out.append(path)
        total += size
        if total >= limit_bytes:
            break
    if not out:
        raise FileNotFoundError(f"no Python sources found under {root}; pass --data")
    return out


def _is_binary(path: Path) -> bool:
    """A file whose first 8 KiB hold a NUL byte (images, archives, compiled code): not text."""
    try:
        with open(path, "rb") as f:
            return b"\0" in f.read(8192)
    except OSError:
        return False  # reading it later names the error


def is_token_index(path: Path) -> bool:
    """Whether ``path`` is a meshfold token index (a text folder may hold an index.json of its own)."""
    try:
        return json.loads(path.read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _tokens_not_text(folder: Path) -> str | None:
    """Why ``folder`` is a token folder rather than text, or None: its index (a token folder
    trains alone, ``--data DIR``), or shards without an index (a tokenization cut short, or an
    index removed), whose text would otherwise be the tokenizer's JSON."""
    if is_token_index(folder / INDEX):
        return (f"--data {folder} is a token folder (it has an {INDEX}): train on it alone, --data {folder}, "
                f"not beside other paths")
    if any(folder.glob(SHARD_GLOB)):
        return (f"--data {folder} holds token shards ({SHARD_GLOB}) but no {INDEX}: a meshfold tokenize "
                f"that was cut short, or an index removed; rerun meshfold tokenize into it")
    return None


def corpus_files(paths: list[str | Path], given_as: str = "--data") -> list[Path]:
    """The sources ``--data`` names: files as given (a binary one is refused), folders' files
    in sorted order without hidden files and folders (``.git/``, ``.venv/``) or binary files.
    Record files (JSON Lines, JSON, Parquet: :mod:`meshfold.data.records`) are kept whatever their
    bytes, a folder written by ``save_to_disk`` is one source, and a data format meshfold does
    not read is refused. A token folder is refused here: it is read as tokens
    (:mod:`meshfold.data.tokens`), never as text.
    Errors name the paths as the command took them, ``given_as`` (``meshfold tokenize`` takes
    them as its file arguments, not ``--data``)."""
    files = []
    for p in map(Path, paths):
        if is_dataset_folder(p):
            files.append(p)
        elif p.is_dir():
            problem = _tokens_not_text(p)
            if problem:
                raise ValueError(problem.replace("--data", given_as, 1))
            for f in sorted(p.rglob("*")):
                rel = f.relative_to(p).parts
                if not f.is_file() or any(part.startswith(".") for part in rel):
                    continue
                check_suffix(f)
                if is_records_file(f) or not _is_binary(f):
                    files.append(f)
        elif p.is_file():
            check_suffix(p)
            if not is_records_file(p) and _is_binary(p):
                raise ValueError(f"{given_as} {p} is a binary file (a NUL byte in its first 8 KiB), not text; "
                                 f"name text files, or a folder (whose binary files are skipped)")
            files.append(p)
        else:
            raise ValueError(f"{given_as} {not_a_folder(str(p))}")
    if not files:
        raise ValueError(f"{given_as} {' '.join(map(str, paths))}: no text files found (hidden and binary "
                         f"files are skipped)")
    return files
