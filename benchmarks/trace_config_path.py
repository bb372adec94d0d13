"""How far a reader travels from ``meshfold train`` to the first training step: files and returns.

Runs ``meshfold train`` as a one-rank torchrun job in this process (torchrun's environment
variables, set here, make the launcher call the rank function in place), under
``sys.settrace``, from the command's ``main`` until the training loop first calls
``_global_loss`` (the first step's forward). The config is followed: a meshfold function frame
counts when one of its arguments is a settings object (``TrainConfig``, ``TrainSettings``,
``DataSettings`` or ``Resolved``); library frames, module bodies run by imports and functions
that are not handed the settings are skipped, as a reader following the settings would skip
them. Printed:

* ``files``: distinct meshfold source files the settings pass through;
* ``climbs``: returns from such a function back up into a different file (the nearest caller
  that holds the settings);
* ``returns``: moves into a file already left earlier (by a call or a return), i.e. the times
  a reader has to go back to a file they had put down.

The model is the README's default (tiny-mixtral) on one rank; the path through the settings,
the checks, the build and the loop's set-up is the same as on four. Usage (from a checkout,
``PYTHONPATH`` at it)::

    python benchmarks/trace_config_path.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path


SETTINGS = {"TrainConfig", "TrainSettings", "DataSettings", "Resolved"}  # the config's objects


class _FirstStep(Exception):
    pass


def trace(out_dir: str) -> dict:
    import meshfold
    from meshfold.cli import main as cli_main

    root = str(Path(meshfold.__file__).resolve().parent)
    path: list[str] = []  # the file of each move, in order
    climbs = 0

    def own(frame) -> str | None:
        name = frame.f_code.co_filename
        return os.path.relpath(name, os.path.dirname(root)) if name.startswith(root) else None

    def carries(frame) -> bool:  # a frame handed the settings: an argument is one of their objects
        return any(type(v).__name__ in SETTINGS for v in frame.f_locals.values())

    def enclosing(frame) -> str | None:  # the file of the nearest caller that holds the settings
        back = frame.f_back
        while back is not None and not (own(back) and back in holding):
            back = back.f_back
        return own(back) if back is not None else None

    holding: set = set()

    def local(frame, event, arg):
        nonlocal climbs
        if event == "return" and frame in holding:
            holding.discard(frame)
            up = enclosing(frame)
            if up is not None and up != own(frame):
                climbs += 1
                path.append(up)
        return local

    importing = 0  # module bodies being run by an import: not the path of the config

    def imported(frame, event, arg):
        nonlocal importing
        if event == "return":
            importing -= 1
        return None

    def calls(frame, event, arg):
        nonlocal importing
        name = own(frame)
        if name is None or importing:
            return None
        if frame.f_code.co_name == "<module>":
            importing += 1
            return imported
        if frame.f_code.co_name == "_global_loss":
            raise _FirstStep
        if not carries(frame):
            return None
        holding.add(frame)
        if not path or path[-1] != name:
            path.append(name)
        return local

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    argv = ["train", "--out-dir", out_dir, "--steps", "2", "--set", "fold.world_size=1", "--set", "fold.tp=1",
            "--set", "fold.ep=1"]
    sys.settrace(calls)
    try:
        cli_main(argv)
    except _FirstStep:
        pass
    finally:
        sys.settrace(None)
    seen, returns = set(), 0
    for prev, name in zip(path, path[1:]):
        seen.add(prev)
        if name != prev and name in seen:
            returns += 1
    files = sorted(set(path))
    return {"files": len(files), "climbs": climbs, "returns": returns, "file_list": files, "path": path}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the counts and the files here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = trace(str(Path(tmp) / "run"))
    print(f"files {result['files']}, climbs {result['climbs']}, returns to files already left {result['returns']}")
    for name in result["file_list"]:
        print(f"  {name}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
