"""``meshfold train``'s settings, data selection, launch checks and progress line, without spawning."""

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshfold.train import faults, preflight
from meshfold.train.config import DataSettings, TrainSettings, load_config, rules

ROOT = Path(__file__).resolve().parents[2]


def test_docs_list_every_setting_as_the_code_checks_it():
    from meshfold.train.settings_doc import BEGIN, END, reference

    text = (ROOT / "docs" / "config.md").read_text()
    assert text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip() == reference().strip(), \
        "docs/config.md is stale: python -m meshfold.train.settings_doc --write docs/config.md"
    for section, obj in (("train", TrainSettings()), ("data", DataSettings())):
        for key in rules(obj):
            assert f"`{section}.{key}`" in text


def test_every_default_passes_its_own_rule():
    for obj in (TrainSettings(), DataSettings()):
        for key, rule in rules(obj).items():
            assert rule.check(key, getattr(obj, key)) == getattr(obj, key)


def test_the_example_toml_holds_only_real_settings_and_validates():
    cfg = load_config(str(ROOT / "examples" / "train.toml"))
    spec, _ = cfg.validate()
    assert spec.world_size == 4


def test_fault_injection_is_not_a_setting():
    for hook in ("inject_nan_at", "kill_rank_at", "crash_in_save_at"):
        with pytest.raises(ValueError, match="has no setting") as err:
            load_config(None, [f"train.{hook}=3"])
        assert hook not in str(err.value).split("valid:")[1]
    assert faults.parse("kill=2@3,nan_at=4,step_sleep=0.5") == {"kill": (2, 3), "nan_at": 4, "step_sleep": 0.5}
    with pytest.raises(ValueError, match="cannot read 'kill=2'"):
        faults.parse("kill=2")


def test_data_folders_skip_hidden_and_binary_files(tmp_path):
    from meshfold.data.corpus import load_corpus
    from meshfold.data.files import corpus_files

    (tmp_path / ".git" / "objects").mkdir(parents=True)
    (tmp_path / ".git" / "objects" / "pack").write_text("x" * 5000)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("print('a')\n")
    (tmp_path / "src" / ".env").write_text("SECRET=1\n")
    (tmp_path / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(200))
    (tmp_path / "notes.txt").write_text("notes\n")
    assert corpus_files([tmp_path]) == [tmp_path / "notes.txt", tmp_path / "src" / "a.py"]
    with pytest.raises(ValueError, match="logo.png is a binary file .*not text"):  # named, not skipped
        corpus_files([tmp_path / "notes.txt", tmp_path / "logo.png"])
    corpus = load_corpus([tmp_path], val_fraction=0.5)
    assert bytes(corpus.train) + bytes(corpus.val) == b"notes\n\nprint('a')\n"


def test_ranks_beyond_two_per_core_warn():
    cores = len(os.sched_getaffinity(0))
    assert preflight.check_launch(2 * cores) == []
    (warning,) = preflight.check_launch(2 * cores + 1)
    assert f"{2 * cores + 1} ranks on {cores} cores" in warning


def test_torchrun_world_size_must_be_the_fold_world_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"fold.world_size = 4 but torchrun started 2 ranks; set --set "
                                         r"fold.world_size=2"):
        preflight.check_launch(4)
    assert preflight.check_launch(2) == []


class _Terminal(io.StringIO):
    """A terminal screen: ``\\r`` returns to column 0, ``ESC[K`` clears the rest of the line,
    ``\\n`` starts a new one."""

    def isatty(self):
        return True

    def screen(self) -> str:
        done, line, col = [], [], 0
        for token in re.split(r"(\r|\n|\x1b\[K)", self.getvalue()):
            if token == "\r" or token == "\n":
                col = 0
                if token == "\n":
                    done.append("".join(line))
                    line = []
            elif token == "\x1b[K":
                del line[col:]
            else:
                for ch in token:
                    line[col:col + 1] = [ch]
                    col += 1
        return "\n".join(done + ["".join(line)])


def test_progress_line_on_a_terminal_leaves_no_remnants():
    from meshfold.train.progress import Progress

    term = _Terminal()
    p = Progress(10, stream=term)
    p.update({"step": 5, "loss": 1.0, "val_loss": 2.0, "tokens_per_s": 1e6, "mfu": None,
              "mfu_of_measured_gemm": 0.5})  # a longer line
    p.update({"step": 6, "loss": 1.0, "tokens_per_s": 1.0, "mfu": 0.5, "mfu_of_measured_gemm": 0.5})
    screen = term.screen()
    assert screen.startswith("[") and "step 6/10" in screen
    assert screen.count("ETA") == 1 and "val" not in screen and screen.endswith("s"), screen


def test_a_skipped_step_is_said_on_a_line_of_its_own_and_the_progress_line_goes_on():
    from meshfold.train.progress import Progress

    row = {"loss": 1.0, "tokens_per_s": 1.0, "mfu": None, "mfu_of_measured_gemm": 0.5}
    term, log = _Terminal(), io.StringIO()
    for stream in (term, log):
        p = Progress(10, stream=stream)
        p.update({"step": 2, **row})
        p.note("step 3: loss nan is not finite: skipped")
        p.update({"step": 4, **row})
    lines = term.screen().splitlines()
    assert lines[0] == "step 3: loss nan is not finite: skipped" and "step 4/10" in lines[1] and len(lines) == 2
    assert "\nstep 3: loss nan is not finite: skipped\n" in log.getvalue()


def test_version_is_the_package_version():
    proc = subprocess.run([sys.executable, "-m", "meshfold", "--version"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert proc.returncode == 0 and proc.stdout.strip() == f"meshfold {version}"


def test_train_and_plan_know_the_same_model_names_and_shapes():
    from meshfold.models.configs import CONFIGS
    from meshfold.plan.models import MODELS, shape_of_config

    assert set(MODELS) == set(CONFIGS)
    for name, cfg in CONFIGS.items():
        assert shape_of_config(name, cfg) == MODELS[name], name


def test_an_unusable_file_is_one_line_naming_it(tmp_path):
    """An OSError (a folder given as the config file, a path through a file) names the path in one
    line instead of a traceback."""
    (tmp_path / "file").write_text("x")
    for args in (["train", "--config", str(tmp_path)], ["train", "--out-dir", str(tmp_path / "file" / "run")]):
        proc = subprocess.run([sys.executable, "-m", "meshfold", *args], capture_output=True, text=True,
                              cwd=ROOT, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and str(tmp_path) in proc.stderr, proc.stderr


def test_mfu_is_over_the_hardware_peak_when_one_is_named():
    from meshfold.plan.hardware import HARDWARE
    from meshfold.train.loop import hardware_peak

    assert hardware_peak(TrainSettings(), 4) is None  # no datasheet peak: only the measured-GEMM share
    assert hardware_peak(TrainSettings(gpu="h100"), 4) == 4 * HARDWARE["h100"].peak_tflops * 1e12
    assert hardware_peak(TrainSettings(gpu="h100", peak_tflops=100.0), 2) == 2 * 100e12
    with pytest.raises(ValueError, match="train.gpu = 'h1000'; valid: h100"):
        load_config(None, ["train.gpu=h1000"]).check_types()


@pytest.mark.parametrize("dtype, master, resolved", [
    ("bfloat16", None, "float32"), ("float32", None, "float32"), ("float64", None, "float64"),
    ("bfloat16", "bfloat16", "bfloat16"), ("bfloat16", "float64", "float64")])
def test_master_dtype_defaults_to_fp32_or_the_wider_compute_dtype(dtype, master, resolved):
    sets = [f"train.dtype={dtype}"] + ([f"train.master_dtype={master}"] if master else [])
    run = load_config(None, sets).resolve()
    mcfg = run.model
    assert run.train.master_dtype == resolved
    assert str(mcfg.moe.router_dtype) == ("torch.float64" if "float64" in (dtype, resolved) else "torch.float32")


@pytest.mark.parametrize("dtype, master, valid", [("float32", "bfloat16", "float32, float64"),
                                                  ("float64", "float32", "float64")])
def test_a_master_dtype_narrower_than_the_compute_dtype_is_refused_naming_both(dtype, master, valid):
    cfg = load_config(None, [f"train.dtype={dtype}", f"train.master_dtype={master}"])
    with pytest.raises(ValueError) as err:
        cfg.validate()
    assert str(err.value) == (f"train.master_dtype = {master!r} is narrower than train.dtype = {dtype!r}; "
                              f"valid master dtypes for {dtype} compute: {valid}")


@pytest.mark.parametrize("old_dtype, refused", [("float32", False), ("bfloat16", True)])
def test_a_run_recorded_before_master_dtype_resumes_only_if_its_weights_were_fp32(tmp_path, old_dtype, refused):
    """run.json written before train.master_dtype existed: that run's weights were train.dtype."""
    import json

    from meshfold.train.rundir import RunLock, identity, prepare

    old = load_config(None, [f"train.dtype={old_dtype}", f"train.out_dir={json.dumps(str(tmp_path))}"]).resolve()
    recorded = {k: v for k, v in identity(old.cfg, old.model).items() if k != "train.master_dtype"}
    (tmp_path / "run.json").write_text(json.dumps({"identity": recorded, "steps": 200}))
    now = load_config(None, [f"train.dtype={old_dtype}", f"train.out_dir={json.dumps(str(tmp_path))}"]).resolve()
    with RunLock(tmp_path) as lock:  # master_dtype: the default, float32
        if refused:
            with pytest.raises(ValueError, match="train.master_dtype 'bfloat16' -> 'float32'"):
                prepare(lock, now.cfg, now.model)
        else:
            assert prepare(lock, now.cfg, now.model) == []


def test_a_config_that_is_not_utf8_or_is_a_folder_is_named_as_the_config(tmp_path):
    bad = tmp_path / "latin1.toml"
    bad.write_bytes("[train]\n# d\xe9j\xe0 vu\nsteps = 3\n".encode("latin-1"))
    with pytest.raises(ValueError, match=re.escape(f"--config {bad}: not UTF-8 text (byte 0xe9 at offset 11)")):
        load_config(str(bad))
    with pytest.raises(ValueError, match=re.escape(f"--config {tmp_path} is a folder")):
        load_config(str(tmp_path))


def test_generate_writes_each_character_as_soon_as_it_is_sampled():
    from meshfold.train.generate import ByteCodec, stream_text

    drawn = []

    def samples():  # "é" is two bytes: written once both are drawn
        for i in [ord("a"), 0xC3, 0xA9, ord("\n"), ord("b")]:
            drawn.append(i)
            yield i

    pieces = [(piece, len(drawn)) for piece in stream_text(ByteCodec("test"), list(b"x"), samples())]
    assert pieces == [("x", 0), ("a", 1), ("\u00e9", 3), ("\n", 4), ("b", 5)]
