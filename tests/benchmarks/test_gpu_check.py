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
