"""The runnable examples in examples/ work: each exits 0 and prints its verdict line.

They run as a researcher runs them (a fresh ``python examples/...`` process, spawning its own 4
gloo ranks), so a change that breaks an example's public API use fails here; ``your_own_model.py``
runs its checks on the session's ranks instead (its ``check`` on each of its folds), which spares
the start of a process and its ranks.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


@pytest.mark.slow
def test_hf_checkpoint_loaded_folded_gives_transformers_logits():
    out = run_example("hf_checkpoint_folded.py", "--tp", "2", "--cp", "2", "--ep", "4")
    assert "vs transformers on one process" in out and "(match," in out


def _example(name: str):
    """The example module ``examples/<name>`` (imported once per process, by path)."""
    import importlib.util

    module = sys.modules.get(f"examples.{name}")
    if module is None:
        spec = importlib.util.spec_from_file_location(f"examples.{name}", EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


def _your_own_model_fold(rank, world_size, i):
    example = _example("your_own_model")
    return example.check(rank, world_size, *example.FOLDS[i])


def test_your_own_model_matches_one_device_on_its_folds(worlds):
    """What ``python examples/your_own_model.py`` checks, on the session's ranks: each of its folds
    (cp, etp, FSDP2, full recompute, bf16 compute over fp32 masters among them) equals one device."""
    folds = _example("your_own_model").FOLDS
    covered = {"cp": any(s.cp > 1 for s, *_ in folds), "etp": any(s.etp > 1 for s, *_ in folds),
               "fsdp": any(dp == "fsdp" for _, dp, _, _ in folds),
               "full recompute": any(r == "full" for *_, r in folds),
               "bf16": any(c == torch.bfloat16 for _, _, c, _ in folds)}
    assert len(folds) >= 3 and all(covered.values()), covered
    for i in range(len(folds)):
        diffs = worlds(4).run(_your_own_model_fold, i)
        assert len(diffs) == 4
