"""``meshfold train``: settings from the command line, checks, then the ranks (and what ends them)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

__all__ = ["configure", "main"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML settings file (sections model, moe, fold, train, data)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one setting, e.g. --set fold.ep=2 (repeatable)")
    parser.add_argument("--steps", type=int, help="shorthand for --set train.steps=N")
    parser.add_argument("--out-dir", help="shorthand for --set train.out_dir=DIR")
    parser.add_argument("--data", nargs="+", help="text files or folders to train on "
                                                   "(default: the Python standard library)")


def _config(args):
    from meshfold.train.config import load_config, parse_override

    overrides = list(args.set)
    if args.out_dir is not None and not args.out_dir.strip():
        raise ValueError(f"--out-dir {args.out_dir!r}: give a folder for the run (default runs/default)")
    given = {f"{section}.{key}": value for section, key, value in map(parse_override, overrides)}
    for flag, key, value in (("--steps", "train.steps", args.steps), ("--out-dir", "train.out_dir", args.out_dir),
                             ("--data", "data.paths", args.data)):
        if value is not None and key in given and given[key] != value:
            raise ValueError(f"{flag} {value} and --set {key}={given[key]} disagree: give one of them")
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.out_dir is not None:
        overrides.append(f"train.out_dir={json.dumps(args.out_dir)}")
    if args.data:
        overrides.append(f"data.paths={json.dumps(list(args.data))}")
    return load_config(args.config, overrides)


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
    from meshfold.runtime.launch import under_torchrun

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
    run = _config(args).resolve()  # every setting checked once, before any process starts
    cfg, spec, mcfg = run.cfg, run.spec, run.model
    from meshfold.train import faults, preflight
    from meshfold.train.tracking import check_trackers

    faults.parse()  # a test's fault list that does not parse fails here, not in the ranks
    check_trackers(cfg.train)  # a tracker asked for without its package
    if cfg.data.tokenizer and not local:
        raise ValueError("data.tokenizer under torchrun: tokenize once beforehand with meshfold tokenize "
                         "--tokenizer T --out DIR FILES, then train with --data DIR")
    warnings = preflight.check_launch(spec.world_size) + preflight.check_schedule(cfg.train, spec.pp)
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
            notes = preflight.check_resume(out, cfg.train.resume)
            notes += prepare(lock, cfg, mcfg)  # last: a run that fails a check records nothing
            done = _steps_done(out) if cfg.train.resume and local else 0
            end = min(cfg.train.steps, cfg.train.stop_at or cfg.train.steps)
            if local and done < end:
                _start_rank_server()
            _print_header(cfg, spec, mcfg, out, warnings + notes)
            if done >= end:  # no rank needs to start to learn that
                print(_nothing_to_train(done, cfg, _latest_checkpoint(out)))
                return 0
        if cfg.data.tokenizer:  # local only: the ranks start after the folder is filled
            run = _tokenized(run, out)
        return _launch(run, out, rank)
    finally:
        if lock is not None:
            lock.release()


def _tokenized(run, out: Path):
    """``run`` reading the tokens ``data.tokenizer`` makes of its text files (once, into
    ``<out>/tokens``) instead of the text: the ranks read the tokens, and run.json keeps what
    made them."""
    import dataclasses

    from meshfold.data.records import Reader
    from meshfold.data.tokens import tokenize_for_run
    from meshfold.train import preflight

    reader = Reader(run.cfg.data.text_field, run.cfg.data.split)
    tokens = tokenize_for_run(run.cfg.data.paths, run.cfg.data.tokenizer, out / "tokens", reader=reader)
    data = dataclasses.replace(run.cfg.data, paths=[str(tokens)], tokenizer=None)
    run = dataclasses.replace(run, cfg=dataclasses.replace(run.cfg, data=data))
    preflight.check_data(run.cfg)  # the size again, now in tokens
    return run


def _start_rank_server() -> None:
    """Start the process the ranks fork from now, with torch and the training code imported in it
    (seconds of CPU), while this process prints the header and imports the same code itself."""
    from meshfold.runtime import launch

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
    from meshfold.data.corpus import corpus_description

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


def _launch(run, out: Path, rank: int) -> int:
    """Run the ranks; every way the job can end becomes one or two lines and an exit code."""
    from meshfold.runtime.launch import RankError, spawn
    from meshfold.train.loop import train_rank
    from meshfold.train.plots import write_plots

    cfg = run.cfg
    try:  # train.timeout bounds each collective; the run itself may take as long as it needs
        results = spawn(train_rank, run.spec.world_size, run, timeout=cfg.train.timeout)
    except RankError as err:
        log = _write_failure_log(out, err)
        summary = err.summary if len(err.summary) <= 600 else err.summary[:600] + " ..."
        print(f"meshfold train: rank {err.rank} failed: {summary}", file=sys.stderr)
        print(log, file=sys.stderr)
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


def _write_failure_log(out: Path, err) -> str:
    """Every failed rank's traceback, in ``<out>/logs/failure-<time>.log``; returns the line that
    says where, or why no log was kept (a log cut short, e.g. by a full disk, is removed)."""
    import time

    path = out / "logs" / f"failure-{time.strftime('%Y%m%d-%H%M%S')}.log"
    parts = [f"rank {err.rank} (the first failure):\n{err.remote_traceback}"]
    parts += [f"rank {r} (after it):\n{tb}" for r, tb in err.others]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(parts))
    except OSError as failed:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass
        return f"  (no log kept: cannot write {path}: {failed.strerror or failed})"
    return f"  tracebacks: {path}"


def _count_params(mcfg) -> int:
    import torch

    from meshfold.models.transformer import MoETransformer

    with torch.device("meta"):
        model = MoETransformer(mcfg)
    return sum(p.numel() for p in model.parameters())
