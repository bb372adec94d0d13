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


def test_layout_of_an_absurd_world_size_answers_at_once():
    """No rank is enumerated to describe a fold: 10^8 ranks print as fast as 16 (run_cli's
    timeout fails a layout that walks the world)."""
    proc = run_cli("layout", "--world-size", "100000000", "--tp", "2")
    assert proc.returncode == 0, proc.stderr
    assert "dp size 50000000: [0,2,4,...,99999998] [1,3,5,...,99999999]" in proc.stdout
    assert "tp size   2: [0,1] [2,3]" in proc.stdout and "(50000000 groups)" in proc.stdout
    proc = run_cli("layout", "--world-size", "99999989", "--tp", "2")  # a prime: its divisors named
    assert proc.returncode == 2 and "divisors of 99999989: [1, 99999989]" in proc.stderr, proc.stderr


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


def _train_args(*argv):
    from meshfold.cli import build_parser

    return build_parser(load="train").parse_args(["train", *argv])


@pytest.mark.parametrize("argv, message", [
    (["--set", "train.steps=3", "--steps", "4"], "--steps 4 and --set train.steps=3 disagree"),
    (["--set", "train.out_dir=a", "--out-dir", "b"], "--out-dir b and --set train.out_dir=a disagree"),
    (["--out-dir", ""], "--out-dir '': give a folder"),
], ids=["steps", "out-dir", "empty-out-dir"])
def test_a_shorthand_that_contradicts_its_setting_or_is_empty_is_refused(argv, message):
    from meshfold.cli.train import _config

    with pytest.raises(ValueError, match=re.escape(message)):
        _config(_train_args(*argv))
    assert _config(_train_args("--set", "train.steps=4", "--steps", "4")).train.steps == 4  # agreeing: fine


def test_export_to_a_file_says_it_is_a_file(tmp_path):
    from meshfold.cli import build_parser
    from meshfold.cli.export import main_export

    (tmp_path / "out.bin").write_bytes(b"x")
    args = build_parser(load="export").parse_args(["export", str(tmp_path / "run"), str(tmp_path / "out.bin")])
    with pytest.raises(ValueError, match="out.bin is a file; give a folder"):
        main_export(args)


def test_generate_bounds_the_tokens_before_loading_anything(tmp_path, capsys):
    from meshfold.cli import main
    from meshfold.train.generate import MAX_TOKENS

    assert main(["generate", str(tmp_path / "no-run"), "--tokens", "100000000"]) == 2
    assert f"need 1 <= --tokens <= {MAX_TOKENS:,}" in capsys.readouterr().err
