"""What ``meshfold train`` checks on the machine before any rank starts.

The settings themselves are checked by :meth:`TrainConfig.validate` (one rule table). Here: the
launch (torchrun's world size against ``fold.world_size``; ranks per core), the data (the files
exist, hold text, and give one training and one validation batch at ``train.seq``), the run
folder (writable), the checkpoint a resume would read (whole), and the Hugging Face checkpoint
``train.init_from`` starts from (every tensor the model needs, in its shape). Each failure is one
ValueError naming the value and what to do, so it prints as one line and no rank starts to meet
it minutes later.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["check_launch", "check_data", "check_writable", "check_resume", "check_init_from"]

RANKS_PER_CORE_WARNING = 2


def check_launch(world_size: int) -> list[str]:
    """Torchrun's world size must be ``fold.world_size``; returns warnings (ranks per core)."""
    started = os.environ.get("WORLD_SIZE")
    if started is not None and "RANK" in os.environ:
        if int(started) != world_size:
            raise ValueError(f"fold.world_size = {world_size} but torchrun started {started} ranks; "
                             f"set --set fold.world_size={started} (or torchrun --nproc-per-node "
                             f"{world_size})")
        return []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if world_size > RANKS_PER_CORE_WARNING * cores:
        return [f"warning: {world_size} ranks on {cores} cores (more than {RANKS_PER_CORE_WARNING} per "
                f"core): every step waits for ranks that share a core; expect it to be very slow"]
    return []


def check_schedule(train, pp: int) -> list[str]:
    """Warnings for pipeline settings that run correctly but slowly: recomputation under a
    zero-bubble schedule, whose weight pass (torch's ``stage_backward_weight``) takes each
    parameter group's gradients in a backward call of its own, and a checkpointed block is
    recomputed in each (14-26 recomputations of a block per micro-batch against 1F1B's one, and a
    step 3.7x 1F1B's with selective recompute, measured on pp 2, benchmarks/RESULTS.md)."""
    from meshfold.catalog import ZERO_BUBBLE

    if pp > 1 and train.schedule in ZERO_BUBBLE and train.recompute != "none":
        return [f"warning: train.recompute = {train.recompute!r} with train.schedule = {train.schedule!r}: torch's "
                f"weight pass recomputes each checkpointed block once per parameter group (14-26x 1F1B's "
                f"recomputation measured, a step 3.7x slower); the gradients are right, the time is not"]
    return []


def check_data(cfg) -> None:
    """The training text exists and gives one batch of ``train.seq + 1`` bytes in each split."""
    from meshfold.data.corpus import split_point, split_sizes, text_only
    from meshfold.data.files import corpus_files, default_corpus_paths
    from meshfold.data.tokens import is_token_folder, read_index

    paths, vf, seq = cfg.data.paths, cfg.data.val_fraction, cfg.train.seq
    if cfg.data.weights:
        from meshfold.data.mixture import check_mixture

        if cfg.data.tokenizer:
            raise ValueError("data.weights with data.tokenizer: a mixture's sources are token folders; tokenize "
                             "each source with meshfold tokenize, then name the folders in data.paths")
        check_mixture(paths, cfg.data.weights, vf, seq, cfg.model_config().vocab)
        return
    if cfg.data.tokenizer and paths and is_token_folder(paths):
        raise ValueError(f"data.tokenizer with --data {paths[0]}, which is tokenized already: drop one of them")
    if cfg.data.tokenizer and not (paths and is_token_folder(paths)):
        from meshfold.data.tokens import load_tokenizer

        ids, vocab = load_tokenizer(cfg.data.tokenizer).get_vocab_size(with_added_tokens=True), cfg.model_config().vocab
        if ids > vocab:
            raise ValueError(f"data.tokenizer {cfg.data.tokenizer} has {ids:,} ids but model.vocab = {vocab:,} "
                             f"(ids >= {vocab:,} have no embedding); set --set model.vocab={ids}")
    if paths and is_token_folder(paths):
        index = read_index(paths[0])  # names a malformed index or a short shard
        vocab = cfg.model_config().vocab
        if index["vocab_size"] > vocab:
            raise ValueError(f"data {paths[0]}: its tokenizer has {index['vocab_size']:,} ids but model.vocab "
                             f"= {vocab:,} (ids >= {vocab:,} have no embedding); set --set "
                             f"model.vocab={index['vocab_size']}")
        n_train = split_point(index["tokens"], vf)
        n_val, unit = index["tokens"] - n_train, "tokens"
    else:
        unit = "bytes"
        files = corpus_files(paths) if paths else default_corpus_paths()
        if not cfg.data.tokenizer:
            text_only(files)
        n_train, n_val = split_sizes(files, vf)
    where = f"data {' '.join(map(str, paths))}" if paths else "the standard library's text"
    for split, n in (("training", n_train), ("validation", n_val)):
        if n <= seq + 1:
            raise ValueError(f"{where}: the {split} text would have {n:,} {unit} (data.val_fraction "
                             f"= {vf:g} of {n_train + n_val:,}), not more than train.seq + 1 = {seq + 1}; "
                             f"give more text, a shorter train.seq or another data.val_fraction")


def check_writable(out: Path) -> None:
    """The run folder and its ``checkpoints/`` accept new files."""
    for folder in (out, out / "checkpoints"):
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"train.out_dir: {folder} is a file, where a folder belongs; move it or choose "
                             f"another --out-dir")
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
                pass
        except OSError as err:
            raise ValueError(f"train.out_dir: cannot write in {folder} ({err.strerror}); make it a "
                             f"writable folder or choose another --out-dir") from None


def check_resume(out: Path, resume: bool) -> list[str]:
    """The newest checkpoint a resume would read is whole and its files match their checksums;
    else name the damaged file and the newest intact checkpoint (which is not used silently: the
    user decides). Returns the note on a checkpoint that carries no checksums."""
    from meshfold.train.checkpoint import newest_intact

    if not resume:
        return []
    intact, damaged, note = newest_intact(out / "checkpoints")
    if damaged is None:
        return [note] if note else []
    if intact is None:
        raise ValueError(f"{damaged}; no earlier checkpoint is intact: start over with "
                         f"train.resume=false (the damaged run is moved aside)")
    raise ValueError(f"{damaged}; the newest intact checkpoint is {intact.name}: move the checkpoints "
                     f"after it out of {out / 'checkpoints'} to resume from it")


def check_init_from(path, mcfg) -> None:
    """Every tensor the model needs is in ``train.init_from``'s safetensors with the shape the
    model config asks for (headers only: an empty slice of each is read), else one ValueError
    naming the tensor and both shapes."""
    import torch

    from meshfold.interop.hf import load_state
    from meshfold.models.transformer import MoETransformer

    with torch.device("meta"):
        model = MoETransformer(mcfg)
        # buffers too: a checkpoint may hold some (DeepSeek-V3's e_score_correction_bias)
        ndim = {n: t.dim() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    try:  # an empty slice of each tensor's last dim: shapes and names checked, nothing read
        load_state(path, mcfg, select=lambda name: (slice(None),) * (ndim[name] - 1) + (slice(0, 0),))
    except ValueError as err:
        raise ValueError(f"train.init_from {path}: {err}") from None
