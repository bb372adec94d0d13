"""meshfold's layers, as its folders state them: no import points up the layers or runs in a circle
(the import-linter contracts of pyproject.toml), models import nothing distributed, and the
planner imports no torch."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Imports every module of a package (its entry point excepted) in a fresh interpreter, after
# `before`, and prints the modules that importing them loaded.
LOADED = """
import importlib, json, pkgutil, sys
{before}
loaded = set(sys.modules)
package = importlib.import_module({package!r})
for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    if not info.name.endswith("__main__"):
        importlib.import_module(info.name)
print(json.dumps(sorted(set(sys.modules) - loaded)))
"""


def loaded_by(package: str, before: str = "") -> list[str]:
    proc = subprocess.run([sys.executable, "-c", LOADED.format(package=package, before=before)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_import_contracts_hold():
    """Layers, models without placements or parallel, parallelize naming no model, a torch-free
    planner, hypothesis only in meshfold.testing.strategies, no circles: ``lint-imports`` exits 0."""
    pytest.importorskip("importlinter", reason="needs import-linter, a test extra: pip install -e '.[test]'")
    proc = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports; "
                           "raise SystemExit(lint_imports(no_cache=True, no_logo=True))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_models_import_nothing_distributed():
    """Importing every module of meshfold.models after torch loads no torch.distributed module,
    no meshfold.placements and no meshfold.parallel (torch itself loads torch.distributed's core)."""
    new = loaded_by("meshfold.models", before="import torch")
    distributed = [m for m in new if m.startswith(("torch.distributed", "meshfold.placements", "meshfold.parallel"))]
    assert distributed == []


def test_the_planner_imports_no_torch():
    assert "torch" not in loaded_by("meshfold.plan")
