"""``meshfold train`` on several nodes, as docs/cluster.md describes it: torchrun agents that
train, checkpoint, are stopped and resume bit-exactly; the run-folder lock between jobs and what
it relies on; the Slurm script's command.

Two torchrun agents on one machine, meeting by the c10d rendezvous on loopback, each play one
node of 2 ranks: the command is docs/cluster.md's own block (with this test's port, folder and
a shorter run), so the documented command is the tested one.
"""

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.run_here import meshfold_here
from tests.train.test_run_lifecycle import live_in_group, newest_step, wait_until
from tests.train.test_train import ROOT, SMALL, losses, meshfold_before_spawning

pytestmark = pytest.mark.multirank

STEPS = 6


def documented_agent(out_dir, port: int, job: str) -> tuple[list[str], dict]:
    """(argv, environment) of one agent of docs/cluster.md's two-agent block, with this test's
    rendezvous port and id, run folder, and a short run of SMALL settings."""
    doc = (ROOT / "docs" / "cluster.md").read_text()
    block = re.search(r"<!-- two-agents -->\s*```bash\n(.+?)\n```", doc, re.S).group(1)
    line = re.search(r"(\w+=\S+ )?torchrun (.+?) &\n", block.replace("\\\n", " "), re.S)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("MESHFOLD_FAULTS", None)
    if line.group(1):
        key, value = line.group(1).strip().split("=")
        env[key] = value
    given = {"--rdzv-endpoint": f"127.0.0.1:{port}", "--rdzv-id": job, "--out-dir": str(out_dir),
             "--steps": str(STEPS)}
    args = shlex.split(line.group(2))
    for i, arg in enumerate(args[:-1]):
        if arg in given:
            args[i + 1] = given[arg]
        if args[i + 1] == "train.ckpt_every=5":
            args[i + 1] = "train.ckpt_every=2"
    assert set(given) <= set(args) and "train.ckpt_every=2" in args, args
    return [sys.executable, "-m", "torch.distributed.run", *args, *SMALL], env


def free_port() -> int:
    with socket.socket() as s:  # the rendezvous needs a concrete port; a brief race is acceptable here
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_agents(out_dir, job: str, faults: str | None = None) -> list[subprocess.Popen]:
    """Two torchrun agents, each in a session of its own (a node's process tree)."""
    port, agents = free_port(), []
    for _ in range(2):
        argv, env = documented_agent(out_dir, port, job)
        if faults:
            env["MESHFOLD_FAULTS"] = faults
        agents.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       env=env, cwd=ROOT, start_new_session=True))
    return agents


def finish(agents, timeout: float) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of each agent; every process of theirs is killed afterwards."""
    try:
        return [(a.wait(timeout=timeout), *a.communicate()) for a in agents]
    finally:
        for a in agents:
            for pid in [a.pid, *live_in_group(a.pid)]:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


@pytest.mark.slow
def test_two_agents_train_refuse_a_second_job_and_resume_bit_exactly_after_a_stop(tmp_path):
    """2 nodes x 2 ranks on loopback: a second job on the folder is refused while the first
    trains (naming its holder) and leaves it undisturbed; the first, stopped with SIGTERM after
    a checkpoint, resumes on new agents, and every step's loss equals an uninterrupted run's on
    four ranks spawned by one ``meshfold train`` (the same fold, tp2 | ep4)."""
    reference = tmp_path / "reference"
    proc = meshfold_here("train", "--steps", STEPS, "--out-dir", reference, *SMALL, "--set", "train.ckpt_every=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    first = start_agents(run, "first", faults="step_sleep=4")  # slow enough to be hit mid-run
    try:
        wait_until(lambda: (run / "metrics.jsonl").exists() or any(a.poll() is not None for a in first),
                   240, "the first job's step 1")
        second = finish(start_agents(run, "second"), timeout=180)
        assert all(rc != 0 for rc, _, _ in second), second
        refused = "".join(err for _, _, err in second)
        assert f"train.out_dir {run} is in use by another meshfold train (PID " in refused, refused[-3000:]
        assert f" on {socket.gethostname()}, since " in refused
        wait_until(lambda: newest_step(run) >= 2 or any(a.poll() is not None for a in first), 120, "checkpoint 2")
        assert all(a.poll() is None for a in first), "the first job ended before it could be stopped"
        for a in first:
            os.killpg(a.pid, signal.SIGTERM)  # as scancel or a time limit stops a job's agents
        stopped = finish(first, timeout=60)
    finally:
        finish(first, timeout=0.1) if any(a.poll() is None for a in first) else None
    assert all(rc != 0 for rc, _, _ in stopped)
    assert not any(live_in_group(a.pid) for a in first)  # no rank outlives its agent
    newest = newest_step(run)
    assert 2 <= newest < STEPS, newest
    resumed = finish(start_agents(run, "resumed"), timeout=300)
    assert all(rc == 0 for rc, _, _ in resumed), "\n".join(err[-3000:] for _, _, err in resumed)
    out = "".join(o for _, o, _ in resumed)
    assert f"resumed from {run / 'checkpoints' / f'step_{newest:06d}'} at step {newest}" in out, out[-2000:]
    steps = [json.loads(line)["step"] for line in open(run / "metrics.jsonl")]
    assert steps == list(range(1, STEPS + 1))  # each step once: the rows after the checkpoint were redone
    got, ref = losses(run), losses(reference)
    assert [got[s]["loss"] for s in steps] == [ref[s]["loss"] for s in steps]


def hold_lock(folder, host: str) -> subprocess.Popen:
    """A process on "another host" (its host name reads ``host``) holding the run folder's lock."""
    code = ("import socket, sys; socket.gethostname = lambda: sys.argv[2]; "
            "from meshfold.train.rundir import RunLock; lock = RunLock(sys.argv[1]); "
            "print('locked', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code, str(folder), host], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_live_holder_on_another_host_is_refused_naming_its_pid_and_host(tmp_path):
    from meshfold.train.rundir import RunLock

    holder = hold_lock(tmp_path, "node07")
    try:
        with pytest.raises(ValueError, match=rf"in use by another meshfold train \(PID {holder.pid} on node07, "):
            RunLock(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    with RunLock(tmp_path):  # its end dropped the lock, whatever the file still says
        held = json.loads((tmp_path / ".lock").read_text())
        assert (held["pid"], held["host"]) == (os.getpid(), socket.gethostname())


def test_a_lock_file_left_by_a_dead_run_is_taken_over_whatever_it_names(tmp_path):
    """The flock is the lock; the PID and host in the file are never used to judge the holder
    alive (a PID means nothing on another host), so a file naming a live PID elsewhere, with no
    lock on it, is taken over."""
    from meshfold.train.rundir import RunLock

    (tmp_path / ".lock").write_text(json.dumps({"pid": os.getppid(), "host": "node07", "since": "then"}) + "\n")
    with RunLock(tmp_path):
        held = json.loads((tmp_path / ".lock").read_text())
        assert (held["pid"], held["host"]) == (os.getpid(), socket.gethostname())


@pytest.mark.parametrize("code", ["ENOLCK", "ENOSYS"])
def test_a_filesystem_that_refuses_locks_fails_before_any_rank_naming_the_folder(tmp_path, monkeypatch, capsys,
                                                                                 code):
    """NFS without lockd (ENOLCK), Lustre mounted noflock (ENOSYS): an error naming the folder,
    never a run without the lock."""
    import errno
    import fcntl

    def refuse(f, how):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(fcntl, "flock", refuse)
    rc, _, err = meshfold_before_spawning(monkeypatch, capsys, "train", "--out-dir", str(tmp_path), *SMALL)
    assert rc == 2 and f"train.out_dir {tmp_path}: its filesystem refuses file locks ({code}:" in err, err
    assert not (tmp_path / "run.json").exists()


def test_the_slurm_script_starts_one_agent_per_node_with_a_fold_for_all_their_gpus(tmp_path):
    """examples/slurm_train.sbatch under stand-ins for srun and scontrol: one torchrun per node,
    the rendezvous on the first node, the job's id, and a ``meshfold train`` whose settings pass
    every check for 2 nodes x 8 GPUs."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "scontrol").write_text("#!/bin/sh\nprintf 'gpu017\\ngpu018\\n'\n")
    (bin_ / "srun").write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path / 'srun.args'}\n")
    for tool in ("scontrol", "srun"):
        (bin_ / tool).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_NUM_NODES="2",
               SLURM_JOB_NODELIST="gpu[017-018]", SLURM_JOB_ID="4242", SLURM_JOB_NAME="moe",
               SLURM_SUBMIT_DIR=str(tmp_path))
    proc = subprocess.run(["bash", str(ROOT / "examples" / "slurm_train.sbatch"), "--set", "fold.ep=4"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    argv = (tmp_path / "srun.args").read_text().splitlines()
    agent = argv[argv.index("torchrun"):]
    assert argv[:argv.index("torchrun")] == ["--kill-on-bad-exit=1", "--ntasks-per-node=1"]
    assert agent[:11] == ["torchrun", "--nnodes", "2", "--nproc-per-node", "8", "--rdzv-backend", "c10d",
                          "--rdzv-endpoint", "gpu017:29400", "--rdzv-id", "4242"]
    train = agent[agent.index("meshfold") + 1:]
    assert train[:3] == ["train", "--out-dir", str(tmp_path / "runs" / "moe")]
    from meshfold.cli import build_parser
    from meshfold.cli.train import _config

    spec, _ = _config(build_parser(load="train").parse_args(train)).validate()
    assert (spec.world_size, spec.tp, spec.ep) == (16, 2, 4)


def _resume_point_of(rank, world_size, folders, resume):
    from meshfold.train.rundir import resume_point

    try:
        return str(resume_point(Path(folders[rank]), resume))
    except ValueError as err:
        return f"ValueError: {err}"


def test_ranks_that_do_not_share_the_run_folder_fail_together_naming_them(tmp_path, worlds):
    """A run folder local to each node (here: one folder per rank) is refused on every rank, at
    start, naming the ranks that do not see rank 0's folder; on a shared folder every rank
    resumes from rank 0's newest complete checkpoint. (Before this check, such a job trained to
    the end, each checkpoint's shards split across the nodes' folders.)"""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    for folder in folders:
        folder.mkdir()
    got = worlds(2).run(_resume_point_of, [str(f) for f in folders], True)
    assert all(g.startswith(f"ValueError: train.out_dir {f} is not one folder for every rank: ranks [1] on "
                            f"{socket.gethostname()} do not see") for g, f in zip(got, folders)), got
    assert not any(p.name.startswith(".rank0-") for f in folders for p in f.iterdir())  # the probe is removed
    shared = [str(folders[0])] * 2
    for step in (2, 4):
        (folders[0] / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
    (folders[0] / "checkpoints" / "step_000006.tmp").mkdir()  # an interrupted save: never resumed from
    newest = str(folders[0] / "checkpoints" / "step_000004")
    assert worlds(2).run(_resume_point_of, shared, True) == [newest, newest]
    assert worlds(2).run(_resume_point_of, shared, False) == ["None", "None"]
