"""The run folder of ``meshfold train``: one run per folder, and resumes that cannot mix runs.

A run folder (``train.out_dir``) holds one training run: ``checkpoints/``, ``metrics.jsonl``,
plots, ``logs/``, ``run.json`` (the run's identity, and which tokenizer if any made its ids) and,
for a run on tokens, ``tokenizer.json``, a copy of that tokenizer. Three rules keep it whole:

* **One run at a time.** The launcher (global rank 0 under torchrun) holds an exclusive
  ``flock`` on ``<out_dir>/.lock`` for the run's life. The kernel (on NFS, the server) drops it
  however the process ends (even SIGKILL), so a lock file left by a dead run is simply taken
  over: the PID and host written in it only name the holder to a refused run, never decide
  whether it lives. A live holder makes a second run fail at once, naming its PID and host; a
  filesystem that refuses locks is an error, not a run without one. Across nodes the lock is
  as good as the filesystem's ``flock`` (docs/cluster.md).
* **A rerun continues the same run or refuses.** ``run.json`` records every setting that
  changes what is trained (model, MoE, sparsity, data, seed, batch, sequence, micro-batches,
  optimizer and schedule, dtype). A rerun whose settings differ fails before any rank starts,
  naming the differences. What may change: the fold (checkpoints reshard; the micro-batch count
  it implies must stay), ``train.steps`` (the learning-rate schedule is recomputed, and the
  run says so), and settings of how the run is watched or kept (evaluation and checkpoint
  intervals, timeout, ``stop_at``, memory, tracking and profiling).
* **One folder for every rank.** On several nodes the folder must be the same one everywhere (a
  shared filesystem): at start rank 0 writes a file of a new name into it and every rank must
  read it back, or the job fails naming the ranks and hosts that do not see it; rank 0 alone
  picks the checkpoint every rank resumes from. A folder local to each node would otherwise
  split each checkpoint across the nodes and let each node resume from a different step.
* **Starting over is one rename.** ``train.resume=false`` on a folder that holds a run moves the
  whole folder aside to ``<out_dir>.replaced-<time>`` and starts in an empty one, so old and new
  checkpoints and metrics are never mixed.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path

__all__ = ["RunLock", "identity", "prepare", "resume_point"]

LOCK = ".lock"
IDENTITY = "run.json"
# train.* settings that change what is trained; the others change how the run is watched or kept
IDENTITY_TRAIN = ("batch", "seq", "lr", "min_lr_ratio", "warmup", "weight_decay", "no_weight_decay", "betas", "eps",
                  "grad_clip", "seed", "dtype", "master_dtype", "init_from")
# what a run.json written before these settings existed trained with (the micro-batch count was
# not recorded: such a run continues with any)
BEFORE_RECORDED = {"train.betas": [0.9, 0.95], "train.eps": 1e-8, "train.no_weight_decay": []}


class RunLock:
    """An exclusive lock on a run folder, held while the object lives (or until ``release``)."""

    def __init__(self, out_dir: str | os.PathLike):
        self.out = Path(out_dir)
        self._file = None
        self.acquire()

    def acquire(self) -> None:
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            f = open(self.out / LOCK, "a+")
        except OSError as err:
            raise ValueError(f"train.out_dir {self.out}: cannot create the run folder or its lock "
                             f"({err.strerror}); choose a writable --out-dir") from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EACCES):
                f.close()  # a filesystem without locks (NFS without lockd, Lustre noflock): never run unlocked
                raise ValueError(f"train.out_dir {self.out}: its filesystem refuses file locks "
                                 f"({errno.errorcode.get(err.errno, err.errno)}: {err.strerror}), so one run "
                                 f"per folder cannot be ensured; choose a folder on a filesystem with locking "
                                 f"(an NFS mount without nolock, Lustre mounted with flock)") from None
            f.seek(0)
            holder = _holder(f.read())
            f.close()
            raise ValueError(f"train.out_dir {self.out} is in use by another meshfold train ({holder}); "
                             f"wait for it to end, or choose another --out-dir") from None
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                            "since": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the file drops the flock
            self._file = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _holder(text: str) -> str:
    try:
        h = json.loads(text)
        return f"PID {h['pid']} on {h['host']}, since {h['since']}"
    except (ValueError, KeyError, TypeError):
        return "PID unknown"


def identity(cfg, mcfg) -> dict:
    """Flat ``{"section.key": value}`` of everything that defines what a run trains.

    The model is recorded as resolved (every field of the named config after overrides), so a
    setting spelled out and the same value left at its default compare equal.
    """
    model = dataclasses.asdict(dataclasses.replace(mcfg, moe=None))
    out = {f"model.{k}": v for k, v in model.items() if k != "moe"}
    if mcfg.moe is not None:
        moe = dataclasses.asdict(dataclasses.replace(mcfg.moe, expert_sparsity=None))
        out.update({f"moe.{k}": v for k, v in moe.items() if k != "expert_sparsity"})
        sp = mcfg.moe.expert_sparsity
        if sp is not None:
            out.update({f"sparsity.{k}": v for k, v in dataclasses.asdict(sp).items()})
    out.update({f"train.{k}": getattr(cfg.train, k) for k in IDENTITY_TRAIN})
    # micro-batches as resolved: each one's balancing losses are computed on its own tokens
    pp = cfg.fold_spec().pp
    out["train.microbatches"] = cfg.train.microbatches or (pp if pp > 1 else 1)
    out["data.paths"] = [os.path.abspath(p) for p in cfg.data.paths] or "Python standard library"
    out["data.val_fraction"] = cfg.data.val_fraction
    out["data.tokenizer"] = os.path.abspath(cfg.data.tokenizer) if cfg.data.tokenizer else None
    return json.loads(json.dumps(out, default=str))  # as it reads back from run.json


def _has_run(out: Path) -> bool:
    """Whether the folder holds anything of a run (an empty checkpoints/ does not count)."""
    ckpts = out / "checkpoints"
    return (out / "metrics.jsonl").exists() or (out / IDENTITY).exists() or \
        (ckpts.is_dir() and any(p.name.startswith("step_") for p in ckpts.iterdir()))


def _recorded(out: Path, cfg, now: dict) -> tuple[dict, int | None]:
    """(identity, steps) of the run the folder holds; from a checkpoint's trainer.json for a
    folder written before run.json existed (model, MoE, sparsity and seed only)."""
    path = out / IDENTITY
    if path.exists():
        try:
            rec = json.loads(path.read_text())
            ident = rec["identity"]
            if "train.dtype" in ident:  # recorded before train.master_dtype: weights were train.dtype
                ident.setdefault("train.master_dtype", ident["train.dtype"])
            if "train.batch" in ident:  # recorded before the optimizer's settings and micro-batches
                for key, value in {**BEFORE_RECORDED, "train.microbatches": now["train.microbatches"]}.items():
                    ident.setdefault(key, value)
            return ident, rec.get("steps")
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path} is damaged ({err}); move it aside to continue the run "
                             f"unchecked, or start over with train.resume=false") from None
    from meshfold.train import checkpoint

    last = checkpoint.latest(out / "checkpoints")
    if last is None:
        return {}, None
    try:
        state = json.loads((last / "trainer.json").read_text())
    except (OSError, ValueError):
        return {}, None  # the checkpoint's own check names the damage
    old = dataclasses.replace(cfg, model=state.get("model", {}), moe=state.get("moe", {}),
                              sparsity=state.get("sparsity", {}),
                              train=dataclasses.replace(cfg.train, seed=state.get("seed", cfg.train.seed)))
    try:
        ident = identity(old, old.model_config())
    except (ValueError, TypeError):
        return {}, None
    keep = ("model.", "moe.", "sparsity.", "train.seed")
    return {k: v for k, v in ident.items() if k.startswith(keep)}, None


def prepare(lock: RunLock, cfg, mcfg) -> list[str]:
    """Make the locked folder ready for this run; returns lines to tell the user.

    Starts it over (``train.resume=false``) or checks that this run continues the recorded one,
    then records this run's identity. Raises ValueError naming every differing setting.
    """
    out, notes = lock.out, []
    now = identity(cfg, mcfg)
    steps = cfg.train.steps
    if _has_run(out) and not cfg.train.resume:
        real = out.resolve()  # a symlinked run folder: move what it points to, not the link
        aside = real.with_name(f"{real.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        os.rename(real, aside)  # the held lock moves with it: nobody can enter the old run
        lock.release()
        lock.acquire()  # a fresh folder and lock; if another run got in first, this raises
        notes.append(f"train.resume=false: moved the earlier run in {out} to {aside}; starting over")
    elif _has_run(out):
        old, old_steps = _recorded(out, cfg, now)
        # a run.json lists every identity key, so a setting only one side has differs too; a
        # folder from before run.json existed records only some keys, and only those compare
        keys = set(old) | set(now) if (out / IDENTITY).exists() else set(old)
        diff = sorted(k for k in keys if old.get(k) != now.get(k))
        if diff:
            shown = "; ".join(f"{k} {old.get(k)!r} -> {now.get(k)!r}" for k in diff[:6])
            more = f" (and {len(diff) - 6} more)" if len(diff) > 6 else ""
            raise ValueError(f"{out} holds a run with other settings: {shown}{more}. Use another "
                             f"--out-dir for a new run, or train.resume=false to start this one over")
        if old_steps is not None and old_steps != steps:
            notes.append(f"train.steps {old_steps} -> {steps}: the learning-rate schedule now spans "
                         f"{steps} steps (warm-up {cfg.train.warmup}, cosine decay to step {steps})")
    if cfg.train.warmup >= steps:
        notes.append(f"train.warmup = {cfg.train.warmup} >= train.steps = {steps}: the run ends inside the "
                     f"warm-up, at lr x {steps}/{cfg.train.warmup}, before any decay")
    tokenizer, note = _keep_tokenizer(out, cfg)
    notes += note
    tmp = out / (IDENTITY + ".tmp")
    tmp.write_text(json.dumps({"identity": now, "steps": steps, "tokenizer": tokenizer}, indent=1) + "\n")
    os.replace(tmp, out / IDENTITY)
    return notes


def _keep_tokenizer(out: Path, cfg) -> tuple[str | None, list[str]]:
    """(``run.json``'s ``tokenizer``, notes): a run that trains on tokens keeps a copy of the
    tokenizer that made them as ``<out>/tokenizer.json`` (what ``meshfold generate`` decodes
    with, whatever becomes of the data); None for a run on bytes."""
    from meshfold.data.tokens import INDEX, TOKENIZER, is_token_folder, tokenizer_file

    paths = cfg.data.paths
    if cfg.data.tokenizer:
        source = tokenizer_file(cfg.data.tokenizer)
    elif paths and is_token_folder(paths):
        source = Path(paths[0]) / TOKENIZER
        if not source.is_file():  # a folder tokenized before token folders kept their tokenizer
            named = json.loads((Path(paths[0]) / INDEX).read_text()).get("tokenizer")
            source = tokenizer_file(named) if named else source
    else:
        return None, []
    if not source.is_file():
        return TOKENIZER, [f"warning: the tokenizer of {paths[0]} is not found ({source}): meshfold generate on "
                           f"this run will need --tokenizer FILE"]
    tmp = out / (TOKENIZER + ".tmp")
    shutil.copyfile(source, tmp)
    os.replace(tmp, out / TOKENIZER)
    return TOKENIZER, []


def resume_point(out: Path, resume: bool) -> Path | None:
    """The checkpoint every rank resumes from (None: start at step 0); collective.

    Checks first that every rank sees ``out`` as rank 0 writes it (a file of a name never used
    before, so no filesystem cache of an older listing can answer), then rank 0 alone picks the
    newest complete checkpoint, so ranks never resume from different steps. Raises ValueError on
    every rank, naming the ranks and hosts that do not see the folder.
    """
    import secrets

    import torch.distributed as dist

    from meshfold.train import checkpoint

    rank = dist.get_rank()
    mark = [f".rank0-{secrets.token_hex(8)}", socket.gethostname()] if rank == 0 else [None, None]
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / mark[0]).write_text(mark[0])
    dist.broadcast_object_list(mark, src=0)
    name, host0 = mark
    try:
        seen = (out / name).read_text() == name
    except OSError:
        seen = False
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, (seen, socket.gethostname()))
    if rank == 0:
        (out / name).unlink()
    blind = [(r, host) for r, (ok, host) in enumerate(views) if not ok]
    if blind:
        ranks, hosts = [r for r, _ in blind], sorted({host for _, host in blind})
        raise ValueError(f"train.out_dir {out} is not one folder for every rank: ranks {ranks} on {', '.join(hosts)} "
                         f"do not see the file rank 0 wrote there on {host0}; put the run folder on a "
                         f"filesystem every node mounts, at the same path (docs/cluster.md)")
    last = [checkpoint.latest(out / "checkpoints") if rank == 0 and resume else None]
    dist.broadcast_object_list(last, src=0)
    return last[0]
