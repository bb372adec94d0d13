"""``meshfold train``, ``meshfold generate`` and ``meshfold export``."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

__all__ = ["configure", "main", "configure_generate", "main_generate", "configure_export", "main_export"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML settings file (sections model, moe, fold, train, data)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one setting, e.g. --set fold.ep=2 (repeatable)")
    parser.add_argument("--steps", type=int, help="shorthand for --set train.steps=N")
    parser.add_argument("--out-dir", help="shorthand for --set train.out_dir=DIR")
    parser.add_argument("--data", nargs="+", help="text files or folders to train on "
                                                   "(default: the Python standard library)")


def _config(args):
    from meshfold.train.config import load_config

    overrides = list(args.set)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.out_dir:
        overrides.append(f"train.out_dir={json.dumps(args.out_dir)}")
    cfg = load_config(args.config, overrides)
    if args.data:
        cfg.data.paths = list(args.data)
    return cfg


class Stopped(KeyboardInterrupt):
    """The launcher was asked to stop (SIGTERM): raised in the main thread, handled like Ctrl-C."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def _exit_code(err: KeyboardInterrupt) -> tuple[str, int]:
    """(signal name, exit status) of a Ctrl-C or a SIGTERM (``Stopped``)."""
    signum = err.signum if isinstance(err, Stopped) else signal.SIGINT
    return signal.Signals(signum).name, 128 + signum


def _raise_stopped(signum, frame):
    signal.signal(signum, signal.SIG_IGN)  # one stop is enough: a second signal must not interrupt it
    raise Stopped(signum)


def main(args: argparse.Namespace) -> int:
    from meshfold.launch import under_torchrun

    local = not under_torchrun()  # under torchrun, torchrun supervises and signals the ranks
    if not local:
        return _main(args, local)
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        return _main(args, local)
    except KeyboardInterrupt as err:  # before or after the ranks ran (during them: _launch)
        name, code = _exit_code(err)
        print(f"\nmeshfold train: stopped by {name}", file=sys.stderr)
        return code
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(args: argparse.Namespace, local: bool) -> int:
    cfg = _config(args)
    spec, mcfg = cfg.validate()  # every setting checked before any process starts
    from meshfold.train import faults, preflight

    faults.parse()  # a test's fault list that does not parse fails here, not in the ranks
    if cfg.data.tokenizer and not local:
        raise ValueError("data.tokenizer under torchrun: tokenize once beforehand with meshfold tokenize "
                         "--tokenizer T --out DIR FILES, then train with --data DIR")
    warnings = preflight.check_launch(spec.world_size)
    preflight.check_data(cfg)
    if cfg.train.init_from is not None:
        preflight.check_init_from(cfg.train.init_from, mcfg)
    out = Path(cfg.train.out_dir)
    rank = 0 if local else int(os.environ["RANK"])
    lock = None
    if rank == 0:  # under torchrun the global rank 0 keeps the folder for the whole job
        from meshfold.train.rundir import RunLock, prepare

        lock = RunLock(out)
    try:
        if rank == 0:
            preflight.check_writable(out)
            preflight.check_resume(out, cfg.train.resume)
            notes = prepare(lock, cfg, mcfg)  # last: a run that fails a check records nothing
            done = _steps_done(out) if cfg.train.resume and local else 0
            end = min(cfg.train.steps, cfg.train.stop_at or cfg.train.steps)
            if local and done < end:
                _start_rank_server()
            _print_header(cfg, spec, mcfg, out, warnings + notes)
            if done >= end:  # no rank needs to start to learn that
                print(_nothing_to_train(done, cfg, _latest_checkpoint(out)))
                return 0
        if cfg.data.tokenizer:  # local only: the ranks start after the folder is filled
            from meshfold.tokens import tokenize_for_run

            cfg.data.paths = [str(tokenize_for_run(cfg.data.paths, cfg.data.tokenizer, out / "tokens"))]
            cfg.data.tokenizer = None  # the ranks read the tokens (run.json keeps what made them)
            preflight.check_data(cfg)  # the size again, now in tokens
        return _launch(cfg, spec, out, rank)
    finally:
        if lock is not None:
            lock.release()


def _start_rank_server() -> None:
    """Start the process the ranks fork from now, with torch and the training code imported in it
    (seconds of CPU), while this process prints the header and imports the same code itself."""
    from meshfold import launch

    launch.preload("meshfold.train.loop", "meshfold.data")  # this command's code cannot change under it
    launch.start_server()


def _nothing_to_train(done: int, cfg, last) -> str:
    return (f"done: nothing to train: the newest checkpoint is at step {done} and train.steps = "
            f"{cfg.train.steps}; checkpoint {last}")


def _latest_checkpoint(out: Path):
    from meshfold.train import checkpoint

    return checkpoint.latest(out / "checkpoints")


def _steps_done(out: Path) -> int:
    """The step of the run folder's newest complete checkpoint (0 without one)."""
    last = _latest_checkpoint(out)
    return json.loads((last / "trainer.json").read_text())["step"] if last is not None else 0


def _print_header(cfg, spec, mcfg, out: Path, notes: list[str]) -> None:
    from meshfold.data import corpus_description

    n_params = _count_params(mcfg)
    name = cfg.train.init_from or cfg.model.get("name", "model")
    print(f"meshfold train: {name} ({n_params / 1e6:.2f}M parameters, "
          f"{len(mcfg.moe_layer_ids)} MoE layers) on {spec.world_size} ranks", flush=True)
    print(f"  attn  pp{spec.pp} x dp{spec.dp} x cp{spec.cp} x tp{spec.tp}   "
          f"moe  pp{spec.pp} x edp{spec.edp} x ep{spec.ep} x etp{spec.etp}", flush=True)
    print(f"  data: {corpus_description(cfg.data.paths)}; {cfg.train.steps} steps of "
          f"{cfg.train.batch} x {cfg.train.seq} tokens; output in {out}/", flush=True)
    for line in notes:
        print(f"  {line}", flush=True)


def _launch(cfg, spec, out: Path, rank: int) -> int:
    """Run the ranks; every way the job can end becomes one or two lines and an exit code."""
    from meshfold.launch import RankError, spawn
    from meshfold.train.loop import train_rank
    from meshfold.train.plots import write_plots

    try:  # train.timeout bounds each collective; the run itself may take as long as it needs
        results = spawn(train_rank, spec.world_size, cfg, timeout=cfg.train.timeout)
    except RankError as err:
        log = _write_failure_log(out, err)
        summary = err.summary if len(err.summary) <= 600 else err.summary[:600] + " ..."
        print(f"meshfold train: rank {err.rank} failed: {summary}", file=sys.stderr)
        print(f"  tracebacks: {log}" if log else "  (the run folder is not writable: no log kept)",
              file=sys.stderr)
        return 1
    except TimeoutError as err:
        print(f"meshfold train: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM as Stopped
        name, code = _exit_code(err)
        print(f"\nmeshfold train: stopped by {name}; every rank has ended. Newest checkpoint: "
              f"{_latest_checkpoint(out) or 'none yet'}; rerun the same command to resume", file=sys.stderr)
        return code
    if rank == 0:
        plots = write_plots(out) if cfg.train.plots else None
        r = results[0]
        if r["final_loss"] is not None:
            print(f"done: final loss {r['final_loss']:.4f}; metrics {out / 'metrics.jsonl'}; "
                  f"checkpoint {r['checkpoint']}")
        else:  # under torchrun, where the ranks decide
            print(_nothing_to_train(r["start"], cfg, r["checkpoint"]))
        if plots is not None:
            print(f"plots: {', '.join(map(str, plots))}" if isinstance(plots, list) else f"note: {plots}")
    return 0


def _write_failure_log(out: Path, err) -> Path | None:
    """Every failed rank's traceback, in ``<out>/logs/failure-<time>.log``; None if unwritable."""
    import time

    path = out / "logs" / f"failure-{time.strftime('%Y%m%d-%H%M%S')}.log"
    parts = [f"rank {err.rank} (the first failure):\n{err.remote_traceback}"]
    parts += [f"rank {r} (after it):\n{tb}" for r, tb in err.others]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(parts))
    except OSError:
        return None
    return path


def _count_params(mcfg) -> int:
    import torch

    from meshfold.models.transformer import MoETransformer

    with torch.device("meta"):
        model = MoETransformer(mcfg)
    return sum(p.numel() for p in model.parameters())


# ---- loading a trained model on one process -----------------------------------------------------
def load_trained(run_or_checkpoint: str):
    """(model, trainer state) from a run folder (its newest checkpoint) or a checkpoint folder."""
    from meshfold.models.transformer import MoETransformer
    from meshfold.train import checkpoint
    from meshfold.train.config import TrainConfig
    from meshfold.train.loop import DTYPES

    path = Path(run_or_checkpoint)
    if (path / "checkpoints").is_dir():
        found = checkpoint.latest(path / "checkpoints")
        if found is None:
            raise ValueError(f"{path}/checkpoints has no complete checkpoint")
        path = found
    if not (path / "trainer.json").exists():
        raise ValueError(f"{path} is neither a run folder nor a checkpoint (no trainer.json)")
    checkpoint.verify(path)  # names a damaged trainer.json or shard before torch reads it
    state = json.loads((path / "trainer.json").read_text())
    cfg = TrainConfig(model=state["model"], moe=state.get("moe", {}), sparsity=state.get("sparsity", {}))
    cfg.train.init_from = state.get("init_from")  # the model's shape is that checkpoint's config.json
    cfg.train.dtype = state.get("dtype", "float32")  # checkpoints before train.master_dtype: float32, as then
    cfg.train.master_dtype = state.get("master_dtype", "float32")
    model = MoETransformer(cfg.model_config(), dtype=DTYPES[cfg.train.master_dtype])  # the master weights
    checkpoint.load(path, model, None, restore_rng=False)
    return model.eval(), state


def configure_generate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", nargs="?", default="runs/default",
                        help="run folder or checkpoint folder (default runs/default)")
    parser.add_argument("--prompt", default="def ", help="text to continue")
    parser.add_argument("--tokens", type=int, default=200, help="bytes to generate")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)


def main_generate(args: argparse.Namespace) -> int:
    import torch

    if args.tokens < 1 or args.temperature <= 0 or args.top_k < 1:
        raise ValueError(f"need --tokens >= 1, --temperature > 0, --top-k >= 1; got {args.tokens}, "
                         f"{args.temperature}, {args.top_k}")
    model, state = load_trained(args.checkpoint)
    g = torch.Generator().manual_seed(args.seed)
    ids = list(args.prompt.encode("utf-8")) or [10]
    max_seq = model.cfg.max_seq
    with torch.no_grad():
        for _ in range(args.tokens):
            ctx = torch.tensor([ids[-max_seq:]])
            logits = model(ctx)[0, -1].float() / args.temperature
            top = torch.topk(logits, min(args.top_k, logits.numel()))
            probs = torch.softmax(top.values, -1)
            ids.append(int(top.indices[torch.multinomial(probs, 1, generator=g)]))
    print(bytes(ids).decode("utf-8", errors="replace"))
    return 0


def configure_export(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="run folder or checkpoint folder")
    parser.add_argument("out", help="output folder for config.json + model.safetensors")
    parser.add_argument("--arch", default=None, help="Hugging Face architecture (default: Mixtral, "
                                                      "or Qwen2-MoE when the model has shared experts)")
    parser.add_argument("--force", action="store_true", help="write into a folder that is not empty")
    parser.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default=None,
                        help="dtype of the written weights, routers excepted (default: the run's compute "
                             "dtype, train.dtype; checkpoints hold the master weights)")


def main_export(args: argparse.Namespace) -> int:
    from meshfold.models.hf import save_pretrained

    src, dst = Path(args.checkpoint).resolve(), Path(args.out).resolve()
    run = src.parent.parent if src.parent.name == "checkpoints" else src
    if dst in (run, src) or run / "checkpoints" in (dst, *dst.parents):
        raise ValueError(f"export target {args.out} is the run being read or inside its checkpoints; "
                         f"choose a folder of its own")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())) and not args.force:
        raise ValueError(f"export target {args.out} is not empty; choose an empty or new folder, or pass "
                         f"--force to overwrite its config.json and model.safetensors")
    model, state = load_trained(args.checkpoint)
    from meshfold.train.loop import DTYPES

    dtype = args.dtype or state.get("dtype", "float32")
    save_pretrained(model, args.out, arch=args.arch, dtype=DTYPES[dtype])
    print(f"wrote {args.out}/config.json and model.safetensors (Hugging Face format, {dtype})")
    return 0
