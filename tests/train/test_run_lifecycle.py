"""The life of a ``meshfold train`` job around its training: signals, stalls, one run per folder,
resumes that cannot mix runs, and failures that name what failed.

Each test runs the real command in its own session (process group), with real signals and real
files, bounded in time, and checks that no process of the job is left behind. After every fault
the newest complete checkpoint is intact and a rerun continues from it bit-exactly: the loss of
every later step equals an uninterrupted run's (the ``reference`` run below). The jobs that are
signalled, stopped or killed are subprocesses; reruns and runs whose subject is their files and
messages go through ``meshfold_here`` (tests/run_here.py), the same command in this process.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.run_here import meshfold_here
from tests.train.test_train import ROOT, SMALL2, losses, meshfold_before_spawning

pytestmark = pytest.mark.multirank

STEPS = 8
# checkpoints every 2 steps; one run of these settings is the uninterrupted reference
RUN = ["--steps", str(STEPS), *SMALL2, "--set", "train.ckpt_every=2"]


def start(out_dir, *extra, faults="step_sleep=0.15"):
    """Start ``meshfold train`` in a session of its own (slowed by ``faults`` so it can be hit)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), MESHFOLD_FAULTS=faults)
    return subprocess.Popen([sys.executable, "-m", "meshfold", "train", *RUN, "--out-dir", str(out_dir),
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=ROOT, start_new_session=True, preexec_fn=_as_started_from_a_terminal)


def _as_started_from_a_terminal():
    """Ctrl-C's default disposition, whatever this test process inherited: a shell starts a
    background job (``cmd &``, as CI scripts do) with SIGINT ignored, and Python keeps an ignored
    SIGINT ignored, so the launcher would never see the test's Ctrl-C and would train to the end."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def live_in_group(pgid: int, states: str | None = None) -> list[int]:
    """PIDs of the processes (not zombies) in process group ``pgid``; only those in one of
    ``states`` (``/proc`` state letters, e.g. "T" for stopped) if given."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
            if int(fields[2]) == pgid and fields[0] != "Z" and (states is None or fields[0] in states):
                pids.append(int(entry.name))
    return pids


def message_lines(stderr: str) -> list[str]:
    """meshfold's own lines of a job's stderr: without the C++ log lines of torch's ranks
    (``[W ...]``), which a torn connection may add and meshfold does not control."""
    return [line for line in stderr.strip().splitlines() if line.strip() and not line.startswith(("[W", "[E", "[I"))]


def wait_until(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def assert_group_ends(proc, timeout: float = 20):
    """Every process of the job's session is gone within ``timeout`` (then killed, to clean up)."""
    try:
        wait_until(lambda: not live_in_group(proc.pid), timeout, f"the job's processes {live_in_group(proc.pid)}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def assert_resumes_like_reference(out_dir, reference):
    """A plain rerun resumes from the newest complete checkpoint and then matches the
    uninterrupted run bit for bit."""
    ckpts = sorted(p.name for p in (Path(out_dir) / "checkpoints").glob("step_*") if not p.name.endswith(".tmp"))
    assert ckpts, "no complete checkpoint was kept"
    newest = int(ckpts[-1][5:])
    proc = meshfold_here("train", *RUN, "--out-dir", str(out_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    if newest < STEPS:
        assert f"resumed from {Path(out_dir) / 'checkpoints' / ckpts[-1]} at step {newest}" in proc.stdout
    ref, got = losses(reference), losses(out_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s]["loss"] for s in range(newest + 1, STEPS + 1)] == \
        [ref[s]["loss"] for s in range(newest + 1, STEPS + 1)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    proc = meshfold_here("train", *RUN, "--out-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def newest_step(out_dir) -> int:
    found = [int(p.name[5:]) for p in (Path(out_dir) / "checkpoints").glob("step_??????")] if \
        (Path(out_dir) / "checkpoints").is_dir() else []
    return max(found, default=0)


@pytest.mark.slow
@pytest.mark.parametrize("sig, to_group", [(signal.SIGTERM, False), (signal.SIGINT, True), (signal.SIGKILL, False)],
                         ids=["SIGTERM", "Ctrl-C", "SIGKILL"])
def test_ranks_never_outlive_the_launcher(tmp_path, reference, sig, to_group):
    """Whatever ends the launcher, every rank (and the forkserver) ends within seconds; SIGTERM and
    Ctrl-C (SIGINT to the whole terminal group) stop it with one line, not a traceback."""
    # Signalled once checkpoint 2 exists; 6 steps of 0.75 s remain, so the run is still training
    # when the signal lands even if this process is not scheduled for seconds (with 0.15 s steps,
    # at a load average of 90, a run once finished all 8 steps before its Ctrl-C arrived)
    proc = start(tmp_path, faults="step_sleep=0.75")
    try:
        wait_until(lambda: newest_step(tmp_path) >= 2 or proc.poll() is not None, 120, "checkpoint 2")
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        (os.killpg if to_group else os.kill)(proc.pid, sig)
        proc.wait(timeout=30)
        assert_group_ends(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = proc.stderr.read()
    if sig == signal.SIGKILL:  # and nothing of the launcher's is left for Python to clean up
        assert proc.returncode == -signal.SIGKILL and "leaked" not in err, err
    else:
        assert proc.returncode == 128 + sig, err
        assert "Traceback" not in err and f"stopped by {sig.name}" in err, err
        assert len(message_lines(err)) == 1, err
    step = losses(tmp_path)
    time.sleep(1.5)  # nothing writes after the launcher is gone
    assert losses(tmp_path) == step and max(step) < STEPS
    if sig == signal.SIGKILL:  # the hardest end; after the others the checkpoint is checked whole
        assert_resumes_like_reference(tmp_path, reference)
    else:
        from meshfold.train.checkpoint import latest, verify

        verify(latest(tmp_path / "checkpoints"))


@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_within_the_timeout_naming_it(tmp_path, reference):
    """A rank stopped with SIGSTOP beats no heartbeat: the job ends within train.timeout, names it,
    and keeps the tracebacks in the run folder's log."""
    proc = start(tmp_path, "--set", "train.timeout=20", faults="stop=1@4")
    try:
        output: list = []
        reader = threading.Thread(target=lambda: output.extend(proc.communicate(timeout=120)))
        reader.start()
        stopped_at = None
        while reader.is_alive():  # timed from the stall itself, not from a start-up that a
            if stopped_at is None and live_in_group(proc.pid, "T"):  # loaded machine slows down
                stopped_at = time.monotonic()
            time.sleep(0.1)
        ended_at = time.monotonic()
        out, err = output
        assert stopped_at is not None, err
        took = ended_at - stopped_at
        assert_group_ends(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, err
    assert "rank 1 failed: stopped responding" in err and "Traceback" not in err, err
    log = Path(err.split("tracebacks: ")[1].strip())
    assert log.parent == tmp_path / "logs" and "rank 1" in log.read_text()
    assert took < 20 + 15, took  # within the timeout after the stall, plus the teardown
    assert_resumes_like_reference(tmp_path, reference)


@pytest.mark.slow
def test_a_killed_rank_ends_the_job_and_leaves_no_process(tmp_path, reference):
    proc = start(tmp_path, faults="kill=1@4")
    try:
        out, err = proc.communicate(timeout=120)
        assert_group_ends(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1 and "rank 1 failed: process exited with code -9" in err, err
    assert len(message_lines(err)) == 2, err  # the failure, and where the tracebacks are
    assert_resumes_like_reference(tmp_path, reference)


@pytest.mark.slow
def test_one_run_per_folder(tmp_path, reference, monkeypatch, capsys):
    """A second run on a folder in use fails at once naming the first's PID; the first finishes
    with every step logged once, in order; the lock of a dead run is taken over."""
    first = start(tmp_path)
    try:
        wait_until(lambda: (tmp_path / "metrics.jsonl").exists() or first.poll() is not None, 120, "step 1")
        rc, _, err = meshfold_before_spawning(monkeypatch, capsys, "train", *RUN, "--out-dir", str(tmp_path))
        assert rc == 2 and f"in use by another meshfold train (PID {first.pid}" in err, err
        assert "Traceback" not in err
        assert first.wait(timeout=180) == 0, first.stderr.read()[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    steps = [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")]
    assert steps == list(range(1, STEPS + 1))
    got, ref = losses(tmp_path), losses(reference)
    assert [got[s]["loss"] for s in got] == [ref[s]["loss"] for s in ref]  # undisturbed by the second
    # the lock of a run that was killed holding it is taken over
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from meshfold.train.rundir import RunLock; "
                               "lock = RunLock(sys.argv[1]); print('locked', flush=True); sys.stdin.read()",
                               str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert holder.stdout.readline().strip() == "locked"
    rc, _, err = meshfold_before_spawning(monkeypatch, capsys, "train", *RUN, "--out-dir", str(tmp_path))
    assert rc == 2 and f"PID {holder.pid}" in err, err
    holder.kill()
    holder.wait()
    rc, out, err = meshfold_before_spawning(monkeypatch, capsys, "train", *RUN, "--out-dir", str(tmp_path))
    assert rc == 0 and "nothing to train" in out, err


@pytest.mark.slow
def test_resume_false_starts_the_folder_over_and_never_mixes_runs(tmp_path, monkeypatch, capsys):
    """train.resume=false moves the earlier run aside whole; the folder then holds only the new
    run's checkpoints and metrics, and a plain rerun resumes the new run."""
    common = [*SMALL2, "--set", "train.ckpt_every=2", "--out-dir", str(tmp_path / "run")]
    proc = meshfold_here("train", "--steps", "6", *common, "--set", "train.resume=false")  # a new folder
    assert proc.returncode == 0 and "moved" not in proc.stdout, proc.stdout  # nothing to move aside
    proc = meshfold_here("train", "--steps", "4", *common, "--set", "train.resume=false", "--set", "train.lr=0.001")
    assert proc.returncode == 0 and "moved the earlier run" in proc.stdout, proc.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3, 4]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(aside) == 1 and sorted(losses(aside[0])) == [1, 2, 3, 4, 5, 6]
    assert newest_step(aside[0]) == 6
    rc, out, err = meshfold_before_spawning(monkeypatch, capsys, "train", "--steps", "4", *common,
                                           "--set", "train.lr=0.001")  # the new run's settings
    assert rc == 0 and "the newest checkpoint is at step 4" in out, err


@pytest.mark.slow
def test_a_rerun_with_other_settings_is_refused_naming_them(tmp_path, monkeypatch, capsys):
    out = ["--out-dir", str(tmp_path)]
    assert meshfold_here("train", "--steps", "2", *SMALL2, *out).returncode == 0
    rc, _, err = meshfold_before_spawning(monkeypatch, capsys, "train", "--steps", "2", *SMALL2, *out,
                                          "--set", "model.layers=3", "--set", "train.seed=1")
    assert rc == 2 and "model.layers 2 -> 3" in err and "train.seed 0 -> 1" in err
    assert "--out-dir" in err and len(message_lines(err)) == 1, err
    # a changed fold is a resharded resume, and a changed train.steps is said, not silent
    proc = meshfold_here("train", "--steps", "3", *SMALL2, *out, "--set", "fold.ep=1", "--set", "fold.etp=2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "train.steps 2 -> 3: the learning-rate schedule now spans 3 steps" in proc.stdout
    assert json.loads((tmp_path / "checkpoints" / "step_000003" / "trainer.json").read_text())["train_steps"] == 3
    rc, stdout, err = meshfold_before_spawning(monkeypatch, capsys, "train", "--steps", "2", *SMALL2, *out)
    assert rc == 0 and "the newest checkpoint is at step 3" in stdout, err


@pytest.mark.slow
def test_a_damaged_checkpoint_names_the_shard_and_the_intact_one(tmp_path, monkeypatch, capsys):
    out = ["--out-dir", str(tmp_path)]
    assert meshfold_here("train", "--steps", "4", *SMALL2, "--set", "train.ckpt_every=2", *out).returncode == 0
    step4 = tmp_path / "checkpoints" / "step_000004"
    shard = sorted(step4.glob("*.safetensors"))[-1]  # the last rank's
    # a lost shard file: refused before any rank starts, naming it and the intact checkpoint
    os.replace(shard, tmp_path / shard.name)
    proc = meshfold_here("train", "--steps", "6", *SMALL2, "--set", "train.ckpt_every=2", *out)
    assert proc.returncode == 2 and f"{shard.name} is missing" in proc.stderr, proc.stderr
    assert "newest intact checkpoint is step_000002" in proc.stderr and len(message_lines(proc.stderr)) == 1
    for command in (["generate", str(tmp_path), "--tokens", "2"], ["export", str(tmp_path), str(tmp_path / "hf")]):
        proc = meshfold_here(*command)
        assert proc.returncode == 2 and f"{shard.name} is missing" in proc.stderr, proc.stderr
        assert "step_000002 to use the newest intact one" in proc.stderr and len(message_lines(proc.stderr)) == 1
    os.replace(tmp_path / shard.name, shard)
    # a checkpoint from before trainer.json listed its files: each rank's RNG file is still required
    from meshfold.train.checkpoint import CheckpointError, verify

    state = json.loads((step4 / "trainer.json").read_text())
    (step4 / "trainer.json").write_text(json.dumps({k: v for k, v in state.items() if k != "files"}))
    verify(step4)
    os.replace(step4 / "rng_rank1.json", tmp_path / "rng_rank1.json")
    with pytest.raises(CheckpointError, match="rng_rank1.json is missing"):
        verify(step4)
    os.replace(tmp_path / "rng_rank1.json", step4 / "rng_rank1.json")
    shard.write_bytes(shard.read_bytes()[:-100])
    rc, _, err = meshfold_before_spawning(monkeypatch, capsys, "train", "--steps", "6", *SMALL2,
                                          "--set", "train.ckpt_every=2", *out)
    assert rc == 2 and "Traceback" not in err
    assert f"{shard.name} is truncated" in err and "newest intact checkpoint is step_000002" in err
    assert len(message_lines(err)) == 1, err
    (tmp_path / "checkpoints" / "step_000002" / "trainer.json").write_text("{step: 2")
    rc, _, err = meshfold_before_spawning(monkeypatch, capsys, "generate", str(tmp_path), "--tokens", "2")
    assert rc == 2 and f"step_000004 could not be read: {shard.name} is truncated" in err  # the newest
    rc, _, err = meshfold_before_spawning(monkeypatch, capsys, "generate", str(tmp_path / "checkpoints" / "step_000002"),
                                          "--tokens", "2")
    assert rc == 2 and "step_000002 could not be read: trainer.json is damaged" in err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, a device whose writes fail as a full disk's")
def test_a_full_disk_names_the_folder_and_keeps_no_empty_log(tmp_path, monkeypatch):
    """A checkpoint write that fails names its folder; a failure log that cannot be written is
    removed, and the line says so and why, naming its path."""
    import errno

    import torch

    from meshfold.runtime.launch import RankError
    from meshfold.train import checkpoint
    from meshfold.cli.train import _write_failure_log

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a write on a full disk does

    monkeypatch.setattr(checkpoint.dcp, "save", full)
    with pytest.raises(checkpoint.CheckpointError, match=f"cannot write checkpoint {tmp_path}/step_000003.tmp: "
                                                         f"No space left on device; a checkpoint of this model "
                                                         f"needs about 24 bytes, [0-9,]+ are free there"):
        checkpoint.save(tmp_path, 3, torch.nn.Linear(2, 2), None, {"step": 3})
    monkeypatch.setattr(time, "strftime", lambda fmt: "20250101-000000")
    (tmp_path / "logs").mkdir()
    log = tmp_path / "logs" / "failure-20250101-000000.log"
    log.symlink_to("/dev/full")  # every write to it fails with ENOSPC
    line = _write_failure_log(tmp_path, RankError(0, "Traceback ...\nOSError: [Errno 28] No space left on device"))
    assert line == f"  (no log kept: cannot write {log}: No space left on device)"
    assert not list((tmp_path / "logs").iterdir())


@pytest.mark.parametrize("make, message", [
    (lambda d: ["--data", str(d / "missing")], "no such file or folder"),
    (lambda d: ["--data", str(d / "empty")], "no text files found"),
    (lambda d: ["--data", str(d / "short.txt")], "the validation text would have 100 bytes"),
    (lambda d: ["--set", "data.val_fraction=0"], "data.val_fraction must be a number > 0 and < 1, got 0"),
    (lambda d: ["--out-dir", str(d / "blocked")], "checkpoints is a file, where a folder belongs"),
], ids=["missing", "empty", "too-short", "no-validation", "unwritable"])
def test_data_and_folder_problems_fail_before_spawning(tmp_path, monkeypatch, capsys, make, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / ".hidden.txt").write_text("x" * 10_000)
    (tmp_path / "short.txt").write_text("x" * 2000)
    (tmp_path / "blocked").mkdir()
    (tmp_path / "blocked" / "checkpoints").write_text("a file where the checkpoints folder belongs")
    args = make(tmp_path)
    if "--out-dir" not in args:
        args += ["--out-dir", str(tmp_path / "run")]
    rc, _, err = meshfold_before_spawning(monkeypatch, capsys, "train", *args)
    assert rc == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()
