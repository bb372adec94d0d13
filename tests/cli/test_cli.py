"""The ``meshfold`` command line and the README's promise of two commands."""

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "meshfold", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def readme_command(marker):
    text = open(os.path.join(ROOT, "README.md")).read()
    m = re.search(rf"<!-- {marker} -->\s*```bash\n(.+?)\n```", text, re.S)
    assert m, f"README has no command block after <!-- {marker} -->"
    return m.group(1)


def test_layout_prints_both_views():
    proc = run_cli("layout", "--world-size", "16", "--tp", "2", "--cp", "2", "--pp", "2", "--ep", "8")
    assert proc.returncode == 0, proc.stderr
    assert "attn view (pp2 x dp2 x cp2 x tp2)" in proc.stdout
    assert "moe view (pp2 x edp1 x ep8 x etp1)" in proc.stdout


def test_layout_rejects_invalid_input_with_the_numbers():
    proc = run_cli("layout", "--world-size", "12", "--tp", "5")
    assert proc.returncode == 2
    assert "attn tp*cp*pp = 5 does not divide world size 12" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_cli("layout", "--world-size", "8", "--pp", "2", "--moe-pp", "4")
    assert proc.returncode == 2 and "pp differs between views" in proc.stderr


def test_ci_runs_exactly_the_readmes_test_command():
    cmd = readme_command("test-command")
    assert "pytest" in cmd and "torch==2.13.0" in cmd
    # .ci/run extracts the block itself; check it finds the same text.
    extracted = subprocess.run(
        ["bash", "-c", "grep -o \"awk '.*' README.md\" .ci/run | head -1 | bash"],
        capture_output=True, text=True, cwd=ROOT).stdout.strip()
    assert extracted == cmd


def test_readme_main_command_is_the_default_training_run():
    """The README's first command ends in ``meshfold train`` with no arguments: the embedded
    default run, which tests/train/test_train.py runs (shortened) and checks the loss falls."""
    cmd = readme_command("main-command")
    assert cmd.split("&&")[-1].split() == ["meshfold", "train"]
    proc = run_cli("train", "--help")
    assert proc.returncode == 0 and "--config" in proc.stdout


@pytest.mark.slow
def test_readme_python_examples_run(tmp_path):
    """Every README and docs/ example that is a whole script (has a __main__ guard) runs as written."""
    pages = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    text = "\n".join(open(page).read() for page in pages)
    scripts = list(dict.fromkeys(c for c in re.findall(r"```python\n(.*?)```", text, re.S) if "__main__" in c))
    assert scripts
    for n, code in enumerate(scripts):
        path = tmp_path / f"example{n}.py"
        path.write_text(code)
        env = dict(os.environ, PYTHONPATH=ROOT)
        proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                              cwd=tmp_path, timeout=300, env=env)
        assert proc.returncode == 0, f"README example {n} failed:\n{proc.stderr[-2000:]}"
