"""The runnable examples in examples/ work: each exits 0 and prints its verdict line.

They run as a researcher runs them (a fresh ``python examples/...`` process, spawning its own 4
gloo ranks), so a change that breaks an example's public API use fails here.
"""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multirank

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          timeout=300, cwd=EXAMPLES.parent)  # ~25 s each alone; slack for a loaded CI box
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_custom_router_block_matches_one_device_on_drawn_folds():
    out = run_example("custom_router_block.py", "--examples", "3")
    assert "all folds match one device (3 folds, fp64 and bf16 compute)" in out


def test_hf_checkpoint_loaded_folded_gives_transformers_logits():
    out = run_example("hf_checkpoint_folded.py", "--tp", "2", "--cp", "2", "--ep", "4")
    assert "vs transformers on one process" in out and "(match," in out
