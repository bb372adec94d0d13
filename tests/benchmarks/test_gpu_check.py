"""benchmarks/gpu_check.sh, the prepared check for a lent GPU, on a machine without one: it must
fail at once, with a JSON summary saying why, rather than skip its way to a pass."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_without_cuda_the_gpu_check_fails_in_seconds_saying_why(tmp_path):
    # the script runs `python`: this test's interpreter, even when its venv is not activated
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {**os.environ, "OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": "", "PATH": path}
    start = time.perf_counter()
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - start
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert seconds < 60, f"took {seconds:.0f} s to give up"
    parts = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert parts["preflight"]["status"] == "failed"
    assert "CUDA is not visible" in parts["preflight"]["error"]
    assert parts["preflight"]["log_tail"] and (tmp_path / "preflight.log").exists()
    assert {name for name, p in parts.items() if p["status"] == "not run"} == set(parts) - {"preflight"}


def test_the_memory_parts_dry_run_builds_the_job_it_trains(tmp_path):
    import argparse
    import dataclasses

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_check import MEMORY_RUN, memory_dryrun_args
    from meshfold.cli import dryrun as cli
    from meshfold.train.config import load_config

    sets = {**MEMORY_RUN, "train.dtype": "bfloat16", "train.out_dir": str(tmp_path), "fold.world_size": 1,
            "fold.tp": 1, "fold.ep": 1}
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    args = parser.parse_args(memory_dryrun_args(sets, tmp_path / "report.json")[1:])
    assert args.device == "cuda"
    trained = load_config(None, [f"{k}={v}" for k, v in sets.items()]).resolve()
    dry = cli.train_config(args).resolve()
    assert dry.train.gpu == "h200"  # the budget the report is read against: no part of the step
    same_train = dataclasses.replace(dry.train, gpu=trained.train.gpu)
    assert (dry.model, dry.spec, same_train) == (trained.model, trained.spec, trained.train)
