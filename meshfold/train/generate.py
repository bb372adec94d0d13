"""``meshfold generate``: text sampled from a trained model, encoded and decoded as its run was.

A run trained on bytes (the text's UTF-8, ids 0-255) samples bytes. A run trained on tokens
(``data.tokenizer``, or a folder of ``meshfold tokenize``) keeps the tokenizer that made them
as ``<out_dir>/tokenizer.json`` and says so in ``run.json``: the prompt is encoded and the
samples decoded with it. Which of the two is used is always said.

The text is written as it is sampled: each piece as soon as it decodes to whole characters
(a UTF-8 character or a byte-level BPE token may take several ids), so a long generation shows
its progress and Ctrl-C keeps what was written.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Iterable, Iterator

__all__ = ["MAX_TOKENS", "ByteCodec", "TokenizerCodec", "run_codec", "sample", "stream_text"]

# each id is one forward over up to max_seq ids (no KV cache): 10,000 are minutes on a CPU
MAX_TOKENS = 10_000
# a UTF-8 character is at most 4 bytes: after that many ids a replacement character is final
MAX_PENDING = 4


class ByteCodec:
    """Text as its UTF-8 bytes (what ``meshfold train`` trains on without a tokenizer)."""

    vocab = 256
    start = 10  # a newline begins an empty prompt

    def __init__(self, why: str):
        self.name = f"byte-level ({why})"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class TokenizerCodec:
    """Text as the ids of a Hugging Face ``tokenizers`` file."""

    def __init__(self, path, why: str):
        from meshfold.data.tokens import EOS_NAMES, load_tokenizer, tokenizer_file

        self.tok = load_tokenizer(path)
        self.name = f"{tokenizer_file(path)} ({why})"
        self.vocab = self.tok.get_vocab_size(with_added_tokens=True)
        self.start = next((i for i in map(self.tok.token_to_id, EOS_NAMES) if i is not None), None)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


def run_codec(checkpoint: str | Path, vocab: int, tokenizer: str | None = None):
    """How the run that wrote ``checkpoint`` (a run folder or one of its checkpoints) encoded
    text: ``tokenizer`` if given, else what its ``run.json`` records; a checkpoint without a
    run.json is byte-level only if its vocabulary is bytes. Raises ValueError naming what to pass."""
    from meshfold.data.tokens import INDEX, TOKENIZER

    if tokenizer is not None:
        return _fits(TokenizerCodec(tokenizer, "--tokenizer"), vocab)
    path = Path(checkpoint)
    run = path if (path / "checkpoints").is_dir() else path.parent.parent if path.parent.name == "checkpoints" else None
    record = run / "run.json" if run is not None else None
    if record is None or not record.is_file():
        if vocab <= ByteCodec.vocab:
            return ByteCodec(f"no run.json beside {path}; its vocabulary is {vocab}")
        raise ValueError(f"{path}: no run.json says how its run encoded text, and a vocabulary of {vocab:,} "
                         f"is not bytes; pass --tokenizer FILE")
    rec = json.loads(record.read_text())
    if "tokenizer" not in rec:  # recorded before runs kept their tokenizer: read what it trained on
        data = rec.get("identity", {})
        paths = data.get("data.paths")
        folder = Path(paths[0]) if isinstance(paths, list) and len(paths) == 1 else None
        if data.get("data.tokenizer"):
            rec["tokenizer"] = data["data.tokenizer"]
        elif folder is not None and (folder / INDEX).is_file():
            rec["tokenizer"] = str(folder / TOKENIZER)
        elif vocab > ByteCodec.vocab:  # a token folder since removed, perhaps: not guessed
            raise ValueError(f"{record} does not say which tokenizer its run used, and a vocabulary of "
                             f"{vocab:,} is not bytes; pass --tokenizer FILE")
        else:
            rec["tokenizer"] = None
    if rec["tokenizer"] is None:
        return ByteCodec("the run trained on bytes")
    file = run / rec["tokenizer"]  # an absolute path stays itself
    if not file.exists():
        raise ValueError(f"{file} is missing: {run}'s run trained on the ids of that tokenizer; pass "
                         f"--tokenizer FILE")
    return _fits(TokenizerCodec(file, "the run's tokenizer"), vocab)


def _fits(codec, vocab: int):
    if codec.vocab > vocab:
        raise ValueError(f"tokenizer {codec.name} has {codec.vocab:,} ids but the model's vocabulary is "
                         f"{vocab:,}: not the tokenizer it trained with")
    return codec


def sample(model, prompt_ids: list[int], tokens: int, temperature: float, top_k: int, seed: int,
           vocab: int) -> Iterator[int]:
    """``tokens`` ids drawn one at a time after ``prompt_ids``, each yielded as soon as it is
    drawn: top-k of the last position's logits over the codec's ``vocab`` ids, at
    ``temperature``, from a generator seeded with ``seed``; the context is the last max_seq ids."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(tokens):
            logits = model(torch.tensor([ids[-model.cfg.max_seq:]]))[0, -1, :vocab].float() / temperature
            top = torch.topk(logits, min(top_k, logits.numel()))
            ids.append(int(top.indices[torch.multinomial(torch.softmax(top.values, -1), 1, generator=g)]))
            yield ids[-1]


def stream_text(codec, prompt_ids: list[int], new_ids: Iterable[int]) -> Iterator[str]:
    """The text of the prompt and then of ``new_ids``, in pieces, each as soon as it decodes to
    whole characters. Decoding restarts after each newline, so no id is decoded more than a
    line's length of times; joined, the pieces are ``codec.decode`` of all ids."""
    ids, line_start, shown, pending = list(prompt_ids), 0, 0, 0
    for i in itertools.chain([None], new_ids):  # None: the prompt alone, before any id is drawn
        if i is not None:
            ids.append(i)
        text = codec.decode(ids[line_start:])
        if text.endswith("\ufffd") and pending < MAX_PENDING:  # a character still being sampled
            pending += 1
            continue
        pending = 0
        if len(text) > shown:
            yield text[shown:]
        line_start, shown = (len(ids), 0) if text.endswith("\n") else (line_start, max(shown, len(text)))
    text = codec.decode(ids[line_start:])
    if len(text) > shown:
        yield text[shown:]
