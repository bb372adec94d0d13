"""Run a ``meshfold`` command in the test process and see what its subprocess would print.

A ``python -m meshfold train`` subprocess spends about 8 of the 11 s a tiny two-rank run takes
starting an interpreter, importing torch and meshfold, and starting the server its ranks fork
from. :func:`meshfold_here` runs the same command through ``meshfold.cli.main`` in this process:
its ranks fork from the session's server, which has imported that code already
(``PRELOAD_MODULES`` in tests/conftest.py), and they write to this process's stdout and stderr of
the moment (``meshfold.runtime.launch``), which :func:`fds_to_files` points at files. Tests whose
subject is a run's results, files and messages use it; tests whose subject is the process itself
(the README's command, signals, exit codes of a killed launcher, torchrun) start a subprocess.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def fds_to_files():
    """Point this process's file descriptors 1 and 2 at two new files while inside (as a test
    capture or a notebook cell does); yields the two files, readable afterwards."""
    files = [tempfile.TemporaryFile(mode="w+") for _ in (1, 2)]
    saved = [os.dup(fd) for fd in (1, 2)]
    sys.stdout.flush(), sys.stderr.flush()
    try:
        for fd, f in zip((1, 2), files):
            os.dup2(f.fileno(), fd)
        yield files
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)


def meshfold_here(*args, faults: str | None = None) -> subprocess.CompletedProcess:
    """``meshfold ARGS`` run by this process, from the repository root, returning what
    ``subprocess.run`` would: exit status, stdout, stderr. ``faults`` sets MESHFOLD_FAULTS for
    the command (meshfold.train.faults); the environment is restored afterwards."""
    from meshfold import cli

    args = [str(a) for a in args]
    saved_faults, saved_cwd = os.environ.pop("MESHFOLD_FAULTS", None), os.getcwd()
    if faults:
        os.environ["MESHFOLD_FAULTS"] = faults
    try:
        os.chdir(ROOT)
        with fds_to_files() as (out, err):
            old = sys.stdout, sys.stderr  # under pytest these are its own capture
            sys.stdout, sys.stderr = here = [open(fd, "w", closefd=False) for fd in (1, 2)]
            try:
                rc = cli.main(args)
            finally:
                sys.stdout, sys.stderr = old
                for f in here:
                    f.close()
    finally:
        os.chdir(saved_cwd)
        os.environ.pop("MESHFOLD_FAULTS", None)
        if saved_faults is not None:
            os.environ["MESHFOLD_FAULTS"] = saved_faults
    out.seek(0), err.seek(0)
    return subprocess.CompletedProcess(["meshfold", *args], rc, out.read(), err.read())
