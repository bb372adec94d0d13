"""Checkpoints: torch.distributed.checkpoint (DCP) in safetensors files, atomic, reshardable.

Layout of ``<out_dir>/checkpoints/``::

    step_000100/            a complete checkpoint (renamed into place only when every rank is done)
        shard-*.safetensors DCP's Hugging Face storage: tensors + JSON sharding metadata
        trainer.json        step, config, fold, metrics counters (rank 0); written last, it
                            lists every other file with its size and BLAKE2b checksum, so a
                            lost shard or a flipped byte in one is seen before a rank reads it
        rng_rank0.json ...  each rank's torch RNG state (CPU, and its GPU's under CUDA)
    step_000200.tmp/        a save in progress or interrupted: never read

Why these choices:

* DCP stores every DTensor with its global shape and the offsets of each rank's piece, so a
  checkpoint saved on one fold loads on another (4 ranks ep4 -> 2 ranks tp2 | etp2): each rank
  reads just the regions its new shards cover.
* The Hugging Face storage writes safetensors with JSON metadata, so loading never unpickles
  anything (DCP's default ``.metadata`` file is a pickle); trainer state is JSON.
* Atomic: ranks write into ``step_N.tmp``, then rank 0 renames it to ``step_N`` after a barrier.
  A crash mid-save leaves only a ``.tmp`` folder, and :func:`latest` ignores those.
* Tensors are saved under their single-device names (``model.layers.0.attn.wq``,
  ``optim.<name>.exp_avg``), so ``meshfold generate`` / ``export`` read them on one process.
  Experts re-placed at train time (``train.expert_placement = "balanced"``) are saved in
  single-device expert order too (moved back for the save, then again to their slots), so a
  checkpoint resumes on any fold under either placement.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not Exception

from meshfold.parallel.expert_placement import folded_moe_layers, in_expert_order, replace_experts
from meshfold.parallel.transformer import single_device_name

__all__ = ["save", "load", "latest", "verify", "newest_intact", "checksum", "CheckpointError"]

_STEP = re.compile(r"^step_(\d{6,})$")
NO_CHECKSUMS = "carries no checksums (written before meshfold recorded them): its sizes and headers are checked, " \
               "not its contents"


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or damaged."""


def latest(ckpt_dir: str | os.PathLike) -> Path | None:
    """Newest complete checkpoint folder, or None."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return None
    done = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and p.is_dir())
    return done[-1][1] if done else None


def checksum(file: str | os.PathLike) -> str:
    """BLAKE2b (16-byte digest, hex) of a file's bytes: catches a flipped byte that leaves the
    size and the safetensors header intact (a bad disk block, a partial copy). BLAKE2b is in the
    standard library and, unlike a CRC, not fooled by a systematic change."""
    with open(file, "rb") as f:
        return hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=16)).hexdigest()


def verify(path: str | os.PathLike) -> str | None:
    """Check a checkpoint folder's files without loading them into a model: every file
    trainer.json lists is there at its size (each rank's shard and RNG state; a checkpoint
    written before that list needs an RNG file per rank of its world) and with its checksum,
    trainer.json and the RNG files parse, and every safetensors file is whole (its header parses
    and the file is as long as the header says). Raises :class:`CheckpointError` naming the
    first bad file; returns a one-line note for a checkpoint written before checksums were
    recorded (its contents cannot be checked), else None."""
    path = Path(path)

    def bad(detail: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path} could not be read: {detail}")

    def parse(name: str):
        try:
            return json.loads((path / name).read_text())
        except OSError as err:
            raise bad(f"{name}: {err.strerror}") from None
        except ValueError as err:
            raise bad(f"{name} is damaged (not valid JSON: {err})") from None

    state = parse("trainer.json")
    if not isinstance(state, dict):
        raise bad("trainer.json is damaged (not a JSON object)")
    listed = state.get("files")
    if listed is None:  # written before the list: every rank of its world wrote an RNG file
        listed = {f"rng_rank{r}.json": None for r in range(state.get("world_size", 0))}
    missing = [name for name in listed if not (path / name).is_file()]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise bad(f"{missing[0]} is missing{more}; trainer.json lists {len(listed)} files of every rank")
    for name, size in listed.items():
        got = (path / name).stat().st_size
        if size is not None and got < size:
            raise bad(f"{name} is truncated ({got:,} of {size:,} bytes)")
        if size is not None and got != size:
            raise bad(f"{name} is {got:,} bytes, not the {size:,} trainer.json lists")
    for name in sorted(p.name for p in path.glob("rng_rank*.json")):
        parse(name)
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise bad("it holds no .safetensors files")
    for shard in shards:
        size = shard.stat().st_size
        try:
            with open(shard, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if not 0 < n <= size - 8:
                    raise ValueError("header cut off")
                header = json.loads(f.read(n))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError):
            raise bad(f"{shard.name} is damaged (its safetensors header is unreadable; {size:,} bytes)") from None
        if size != 8 + n + end:
            raise bad(f"{shard.name} is truncated ({size:,} of {8 + n + end:,} bytes)")
    sums = state.get("checksums")
    for name, digest in (sums or {}).items():  # last: the checks above name a cause more precisely
        if not (path / name).is_file():
            raise bad(f"{name} is missing; trainer.json lists its checksum")
        if checksum(path / name) != digest:
            raise bad(f"{name} is damaged (its contents do not match the checksum trainer.json lists)")
    return None if sums is not None else f"note: checkpoint {path} {NO_CHECKSUMS}"


def newest_intact(ckpt_dir: str | os.PathLike) -> tuple[Path | None, CheckpointError | None, str | None]:
    """(the newest complete checkpoint that :func:`verify` passes, the error of the newest one if
    that one is damaged, :func:`verify`'s note on the intact one). With no damage the error is
    None."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return None, None, None
    done = sorted(((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()),
                  reverse=True)
    first_error = None
    for _, p in done:
        try:
            note = verify(p)
            return p, first_error, note
        except CheckpointError as err:
            first_error = first_error or err
    return None, first_error, None


def _cause(err: BaseException) -> BaseException:
    """The error under DCP's CheckpointException, whose text is every rank's whole traceback."""
    if isinstance(err, CheckpointException) and err.failures:
        return next(iter(err.failures.values()))[0]
    return err


def _why(err: OSError, folder: Path, model, optimizer) -> str:
    """The reason of a failed write; where the disk is full, the space a checkpoint needs and the
    space left there (the partial save is removed by then, so that is what a retry finds)."""
    reason = err.strerror or str(err)
    if err.errno == errno.ENOSPC:
        reason += f"; a checkpoint of this model needs about {_checkpoint_bytes(model, optimizer):,} bytes"
        try:
            reason += f", {shutil.disk_usage(folder.parent).free:,} are free there"
        except OSError:
            pass
    return reason


def _checkpoint_bytes(model, optimizer) -> int:
    """Bytes of every tensor a checkpoint of ``model`` holds, at their global shapes (DCP writes
    each once, whichever ranks share it)."""
    with torch.no_grad(), in_expert_order(model, optimizer):
        return sum(t.numel() * t.element_size() for t in _tensors(model, optimizer).values())


def _checksums(folder: Path, rank: int) -> dict[str, str]:
    """{file name: :func:`checksum`} of every file in ``folder``, each rank hashing its share of
    the files (collective): a save's hashing takes a rank's part of the time, not the world's."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    names = sorted(p.name for p in folder.iterdir())
    mine = {name: checksum(folder / name) for name in names[rank::world]}
    if world == 1:
        return mine
    every: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(every, mine)
    return {name: digest for part in every for name, digest in sorted(part.items())}


def _reshard(model) -> None:
    """Put every FSDP2 group of ``model`` (a parallelized model or a Pipeline) back in its sharded
    state. After a forward without backward (evaluation) FSDP2 keeps the root's parameters
    unsharded, and ``named_parameters`` then yields those copies, in the compute dtype: a
    checkpoint must hold the sharded master weights."""
    from torch.distributed.fsdp import FSDPModule

    for chunk in getattr(model, "chunks", [model]):
        for m in chunk.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


def _tensors(model, optimizer) -> dict[str, torch.Tensor]:
    """Flat {name: tensor} of model parameters, buffers and AdamW moments (state created if
    missing, so a fresh optimizer can be loaded into)."""
    _reshard(model)
    out = {}
    for name, p in model.named_parameters():
        out["model." + single_device_name(name)] = p
        if optimizer is not None:
            st = optimizer.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"optim.{single_device_name(name)}.{key}"] = st[key]
            out[f"optim.{single_device_name(name)}.step"] = st["step"]
    for name, b in model.named_buffers():
        out["model." + single_device_name(name)] = b
    return out


def save(path_root: str | os.PathLike, step: int, model, optimizer, trainer_state: dict,
         crash_before_rename: bool = False) -> Path:
    """Save on every rank (collective); returns the final folder. ``crash_before_rename`` is a
    testing aid: rank 0 dies after the files are written but before the folder is complete."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    root = Path(path_root)
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    try:  # a write that fails (a full disk) names the folder, not only the errno's text
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        if dist.is_initialized():
            dist.barrier()
        with torch.no_grad(), in_expert_order(model, optimizer):  # re-placed experts: saved in expert order
            dcp.save(_tensors(model, optimizer),
                     storage_writer=dcp.HuggingFaceStorageWriter(str(tmp), save_distributed=True))
        rng = {"torch": torch.get_rng_state().tolist()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # this rank's own GPU's stream too
            rng["cuda"] = torch.cuda.get_rng_state().tolist()
        with open(tmp / f"rng_rank{rank}.json", "w") as f:
            json.dump(rng, f)
        if dist.is_initialized():
            dist.barrier()  # every rank has written its shard and RNG state
        sums = _checksums(tmp, rank)
        if rank == 0:  # last, listing every rank's files: verify() then knows a checkpoint is whole
            files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
            with open(tmp / "trainer.json", "w") as f:
                json.dump({**trainer_state, "files": files, "checksums": sums}, f, indent=1)
    except (OSError, CheckpointException) as err:
        cause = _cause(err)
        if not isinstance(cause, OSError):
            raise
        if rank == 0:  # a partial save left behind would starve the next try of the same space
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot write checkpoint {tmp}: {_why(cause, tmp, model, optimizer)}") from None
    if crash_before_rename and rank == 0:
        os._exit(3)
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    if dist.is_initialized():
        dist.barrier()
    return final


def load(path: str | os.PathLike, model, optimizer=None, restore_rng: bool = True) -> dict:
    """Load a checkpoint folder into ``model`` (and ``optimizer``), whatever fold saved it.

    Returns the trainer state. Raises :class:`CheckpointError` naming the folder for a missing,
    incomplete or damaged checkpoint instead of an error deep inside torch.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.name.endswith(".tmp"):
        raise CheckpointError(f"checkpoint {path} is an interrupted save (.tmp); use a complete one")
    try:
        with open(path / "trainer.json") as f:
            state = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint {path}: trainer.json is missing or damaged ({err})") from None
    for layer in folded_moe_layers(model):  # the checkpoint is in expert order: route by it
        if layer.comm.slots is not None:
            replace_experts(layer, range(layer.cfg.num_experts), optimizer)
    tensors = _tensors(model, optimizer)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # one process (generate, export) is meant: torch warns that it assumes so even when
            # told with no_dist=True, so that warning alone is silenced
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(tensors, storage_reader=dcp.HuggingFaceStorageReader(str(path)),
                     no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - re-raised naming the folder
        cause = _cause(err)
        raise CheckpointError(f"checkpoint {path} could not be read (damaged or truncated file, or "
                              f"a model that does not match it): {type(cause).__name__}: {cause}") from err
    if restore_rng:
        rank = dist.get_rank() if dist.is_initialized() else 0
        rng = path / f"rng_rank{rank}.json"
        if rng.exists():  # absent when resuming on more ranks than saved: fresh streams
            with open(rng) as f:
                states = json.load(f)
            torch.set_rng_state(torch.tensor(states["torch"], dtype=torch.uint8))
            if "cuda" in states and torch.cuda.is_initialized():  # a rank training on its GPU
                torch.cuda.set_rng_state(torch.tensor(states["cuda"], dtype=torch.uint8))
    return state
