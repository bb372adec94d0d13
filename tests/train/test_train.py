"""``meshfold train`` end to end: the default run learns, settings are checked before spawning,
checkpoints resume exactly (also on another fold), and failures end the job promptly.

The README's command and torchrun run as subprocesses, as a user runs them; the other runs go
through ``meshfold_here`` (tests/run_here.py: the same command in this process, seconds cheaper)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.run_here import meshfold_here

pytestmark = pytest.mark.multirank
ROOT = Path(__file__).resolve().parents[2]
# a small, quick setting shared by the checkpoint tests (the plots: test_default_run_learns)
SMALL = ["--set", "train.batch=4", "--set", "train.seq=32", "--set", "train.eval_every=1000",
         "--set", "train.warmup=2", "--set", "model.layers=2", "--set", "train.plots=false"]
# the same on 2 ranks (tp2 | ep2), for tests of the job around training (failures, checkpoints,
# generate/export) whose subject is not the fold: each rank process costs ~2.5 s of start-up
SMALL2 = [*SMALL, "--set", "fold.world_size=2", "--set", "fold.ep=2"]


def meshfold(*args, timeout=600, faults=None):
    """Run ``python -m meshfold ARGS``; ``faults`` sets MESHFOLD_FAULTS (meshfold.train.faults)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MESHFOLD_FAULTS", None)
    if faults:
        env["MESHFOLD_FAULTS"] = faults
    return subprocess.run([sys.executable, "-m", "meshfold", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def meshfold_before_spawning(monkeypatch, capsys, *args):
    """``meshfold ARGS`` in this process, for a command that must end before any process starts:
    (exit status, stdout, stderr); fails if it started a rank or the server ranks fork from."""
    from meshfold import cli
    from meshfold.runtime import launch

    started = []
    capsys.readouterr()
    with monkeypatch.context() as patched:  # undone on return: a later run in the test starts ranks
        patched.setattr(launch, "spawn", lambda *a, **k: started.append("ranks"))
        patched.setattr(launch, "start_server", lambda: started.append("forkserver"))
        rc = cli.main(list(args))
    assert not started, f"meshfold {' '.join(args)} started {started}"
    out, err = capsys.readouterr()
    return rc, out, err


def losses(out_dir):
    return {r["step"]: r for r in map(json.loads, open(Path(out_dir) / "metrics.jsonl"))}


def assert_ep_rank_rows_follow_the_static_placement(r, ep):
    """Each MoE layer's rows per ep rank are its experts' rows (static placement: ep rank i holds
    the i-th block of E / ep experts), and max/mean is the busiest rank's over their mean."""
    assert len(r["ep_rank_rows"]) == len(r["tokens_per_expert"]) == len(r["ep_max_over_mean"])
    for per_expert, per_rank, ratio in zip(r["tokens_per_expert"], r["ep_rank_rows"], r["ep_max_over_mean"]):
        n = len(per_expert) // ep
        assert per_rank == [sum(per_expert[i * n:(i + 1) * n]) for i in range(ep)]
        assert ratio == pytest.approx(max(per_rank) * ep / sum(per_rank), rel=1e-12)


@pytest.mark.slow
def test_default_run_learns(tmp_path):
    proc = meshfold("train", "--steps", "40", "--out-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "attn  pp1 x dp2 x cp1 x tp2   moe  pp1 x edp1 x ep4 x etp1" in proc.stdout
    rows = losses(tmp_path)
    first = rows[1]["loss"]
    last = sum(rows[s]["loss"] for s in range(36, 41)) / 5
    assert first > 5.0 and last < first - 1.5, (first, last)  # ln 256 = 5.55 at the start
    r = rows[40]
    assert r["val_loss"] < first - 1.0 and 0 < r["mfu_of_measured_gemm"] < 1 and r["tokens_per_s"] > 0
    assert r["mfu"] is None  # a CPU has no datasheet peak; train.gpu / train.peak_tflops give one
    assert len(r["tokens_per_expert"][0]) == 4 and r["dropped_fraction"] == 0
    for row in rows.values():
        assert_ep_rank_rows_follow_the_static_placement(row, ep=4)
    # the progress line names the worst MoE layer's busiest ep rank over the mean
    worst = max(r["ep_max_over_mean"])
    assert f"ep load max/mean {worst:.2f} (moe layer {r['ep_max_over_mean'].index(worst)})" in proc.stdout
    assert (tmp_path / "checkpoints" / "step_000040" / "trainer.json").exists()
    assert f"plots: {tmp_path / 'loss.png'}, {tmp_path / 'expert_load.png'}" in proc.stdout
    assert (tmp_path / "loss.png").stat().st_size > 0 and (tmp_path / "expert_load.png").stat().st_size > 0


@pytest.mark.parametrize("override, message", [
    ("fold.ep=3", "etp*ep*pp = 3 does not divide world size 4"),
    ("train.batch=3", "train.batch = 3 is not divisible by dp = 2"),
    ("fold.colour=1", "fold has no settings ['colour']"),
    ("moe.capacity_factor=-1.0", "capacity_factor must be >= 0"),
    ("train.dtype=\"int8\"", "train.dtype = 'int8'"),
    ("train.retain_cpu_memory=yes", "train.retain_cpu_memory must be true or false, got 'yes'"),
    ("train.compile=\"blocks\"", "train.compile must be true or false, got 'blocks'"),
    ("train.lr=abc", "train.lr must be a number > 0, got 'abc'"),
    ("train.warmup=abc", "train.warmup must be an integer >= 0, got 'abc'"),
    ("train.grad_clip=abc", "train.grad_clip must be a number >= 0, got 'abc'"),
    ("train.timeout=abc", "train.timeout must be a number > 0, got 'abc'"),
    ("model.layers=2.5", "model.layers must be an integer, got 2.5"),
    ("train.inject_nan_at=3", "[train] has no setting 'inject_nan_at'"),
])
def test_bad_settings_fail_before_spawning(tmp_path, monkeypatch, capsys, override, message):
    rc, _, err = meshfold_before_spawning(monkeypatch, capsys, "train", "--set", override, "--out-dir", str(tmp_path))
    assert rc == 2 and message in err and "Traceback" not in err, err


@pytest.mark.slow
def test_resume_equals_uninterrupted(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    common = [*SMALL, "--set", "train.ckpt_every=4"]
    assert meshfold_here("train", "--steps", "8", "--out-dir", str(a), *common).returncode == 0
    # interrupted after step 4 (the learning-rate schedule still spans 8 steps)
    assert meshfold_here("train", "--steps", "8", "--out-dir", str(b), *common, "--set", "train.stop_at=4").returncode == 0
    proc = meshfold_here("train", "--steps", "8", "--out-dir", str(b), *common)
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-2000:]
    la, lb = losses(a), losses(b)
    assert [la[s]["loss"] for s in range(5, 9)] == [lb[s]["loss"] for s in range(5, 9)]  # bit-exact


@pytest.mark.slow
def test_resharded_resume_continues_with_the_same_loss(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    fp64 = [*SMALL, "--set", "train.dtype=\"float64\"", "--set", "train.ckpt_every=3"]
    assert meshfold_here("train", "--steps", "4", "--out-dir", str(a), *fp64).returncode == 0
    Path(b / "checkpoints").mkdir(parents=True)
    os.replace(a / "checkpoints" / "step_000003", b / "checkpoints" / "step_000003")
    # 4 ranks tp2 x dp2 | ep4  ->  2 ranks tp2 | ep1 x etp2
    proc = meshfold_here("train", "--steps", "4", "--out-dir", str(b), *fp64, "--set", "fold.world_size=2",
                    "--set", "fold.tp=2", "--set", "fold.ep=1", "--set", "fold.etp=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert abs(losses(a)[4]["loss"] - losses(b)[4]["loss"]) < 1e-9 * losses(a)[4]["loss"]


@pytest.mark.slow
def test_allreduce_data_parallel_trains_the_same_losses_as_fsdp(tmp_path):
    # meshfold plan often proposes train.data_parallel=allreduce: it must be the same training
    fp64 = [*SMALL, "--set", "train.dtype=\"float64\"", "--set", "fold.world_size=2", "--set", "fold.tp=1",
            "--set", "fold.ep=1"]  # attn dp2, moe edp2: both data-parallel reductions
    runs = {}
    for mode in ("fsdp", "allreduce"):
        out = tmp_path / mode
        proc = meshfold_here("train", "--steps", "3", "--out-dir", str(out), *fp64, "--set", f"train.data_parallel={mode}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[mode] = [losses(out)[s]["loss"] for s in (1, 2, 3)]
    assert runs["fsdp"] == pytest.approx(runs["allreduce"], rel=1e-9, abs=0)
    assert runs["fsdp"][2] != runs["fsdp"][0]  # the steps did change the model


@pytest.mark.slow
def test_pipeline_run_checkpoint_resumes_without_pp_with_the_same_loss(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    fp64 = [*SMALL, "--set", "train.dtype=\"float64\"", "--set", "train.ckpt_every=3", "--set", "model.layers=4"]
    # 4 ranks pp2 x dp2 | pp2 x ep2, interleaved 1F1B with 2 chunks per rank
    proc = meshfold_here("train", "--steps", "4", "--out-dir", str(a), *fp64, "--set", "fold.pp=2", "--set", "fold.tp=1",
                    "--set", "fold.ep=2", "--set", "train.schedule=\"interleaved-1f1b\"", "--set", "train.virtual=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pp2 x dp2 x cp1 x tp1" in proc.stdout
    rows = losses(a)
    assert len(rows[4]["tokens_per_expert"]) == 4  # every stage's MoE layers are in the metrics
    assert_ep_rank_rows_follow_the_static_placement(rows[4], ep=2)  # two experts a rank, layers of both stages
    Path(b / "checkpoints").mkdir(parents=True)
    os.replace(a / "checkpoints" / "step_000003", b / "checkpoints" / "step_000003")
    proc = meshfold_here("train", "--steps", "4", "--out-dir", str(b), *fp64)  # the default fold, pp = 1
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-3000:]
    assert abs(rows[4]["loss"] - losses(b)[4]["loss"]) < 1e-9 * rows[4]["loss"]


@pytest.mark.slow
def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path):
    proc = meshfold_here("train", "--steps", "6", "--out-dir", str(tmp_path), *SMALL2,
                    "--set", "train.ckpt_every=3", faults="crash_in_save_at=6")
    assert proc.returncode == 1 and "rank 0 failed" in proc.stderr
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert ckpts == ["step_000003", "step_000006.tmp"]
    proc = meshfold_here("train", "--steps", "6", "--out-dir", str(tmp_path), *SMALL2, "--set", "train.ckpt_every=3")
    assert proc.returncode == 0 and "step_000003 at step 3" in proc.stdout, proc.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4, 5, 6]  # steps 4-6 logged once, by the run that kept them


@pytest.mark.slow
def test_nonfinite_loss_stops_naming_step_and_checkpoint(tmp_path):
    proc = meshfold_here("train", "--steps", "6", "--out-dir", str(tmp_path), *SMALL2,
                    "--set", "train.ckpt_every=2", faults="nan_at=3")
    assert proc.returncode == 1
    assert "non-finite loss nan at step 3" in proc.stderr and "step_000002" in proc.stderr
    proc = meshfold_here("train", "--steps", "6", "--out-dir", str(tmp_path / "skip"), *SMALL2,
                    "--set", "train.skip_nonfinite=true", faults="nan_at=3")
    assert proc.returncode == 0 and "step 3: loss nan is not finite: skipped" in proc.stdout, proc.stdout
    assert losses(tmp_path / "skip")[6]["skipped_steps"] == 1


@pytest.mark.slow
def test_generate_and_export(tmp_path, monkeypatch, capsys):
    assert meshfold_here("train", "--steps", "3", "--out-dir", str(tmp_path), *SMALL2).returncode == 0
    assert not (tmp_path / "loss.png").exists()  # train.plots=false
    proc = meshfold("generate", str(tmp_path), "--prompt", "import ", "--tokens", "20")
    assert proc.returncode == 0 and proc.stdout.startswith("import ")
    assert "byte-level (the run trained on bytes)" in proc.stderr, proc.stderr  # says how it decodes
    assert "Warning" not in proc.stderr, proc.stderr  # e.g. torch's "assuming ... a single process"
    proc = meshfold_here("export", str(tmp_path), str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    # a folder that is not empty, or the run being read, is refused (with one line)
    for target in (tmp_path / "hf", tmp_path, tmp_path / "checkpoints" / "step_000003"):
        rc, _, err = meshfold_before_spawning(monkeypatch, capsys, "export", str(tmp_path), str(target))
        assert rc == 2 and "Traceback" not in err, err
        assert ("not empty" if target.name == "hf" else "run being read") in err, err
    assert meshfold_before_spawning(monkeypatch, capsys, "export", str(tmp_path), str(tmp_path / "hf"), "--force")[0] == 0
    import torch

    from meshfold.interop.hf import from_pretrained
    from meshfold.train.trained import load_trained

    model, _ = load_trained(str(tmp_path))
    exported = from_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, 256, (1, 16))
    torch.testing.assert_close(exported(tokens), model(tokens))


@pytest.mark.slow
def test_torchrun_launch(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
         "127.0.0.1", "--master-port", port, "--local-addr", "127.0.0.1", "-m", "meshfold", "train",
         "--steps", "3", "--out-dir", str(tmp_path), *SMALL2], capture_output=True, text=True, timeout=300,
        env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(losses(tmp_path)) == [1, 2, 3]


# On 4 ranks: tp2 | ep2 x etp2 (no edp); ep2 x edp2 with 2 local experts, which FSDP2 cuts on dim 0
# (a strided shard); ep2 x edp2 with one local expert, which FSDP2 cuts on the hidden dim. The pruner
# once masked by the fold's ep / etp slice alone, so under edp > 1 it zeroed the wrong elements and
# left pruned tiles alive.
SPARSE_FOLDS = {"etp2": ["fold.ep=2", "fold.etp=2"], "edp2-experts": ["fold.ep=2", "fold.etp=1"],
                "edp2-hidden": ["fold.ep=2", "fold.etp=1", "moe.num_experts=2"]}


@pytest.mark.slow
@pytest.mark.parametrize("fold", SPARSE_FOLDS)
def test_tile_sparse_training_reaches_each_stage_and_keeps_pruned_weights_zero(tmp_path, fold):
    sets = [a for s in SPARSE_FOLDS[fold] for a in ("--set", s)]
    proc = meshfold_here("train", "--steps", "9", "--out-dir", str(tmp_path), *SMALL,
                    "--set", "sparsity.tile=[16, 16]", "--set", "sparsity.schedule=[0.25, 0.5]",
                    "--set", "sparsity.start_step=3", "--set", "sparsity.steps_per_stage=3", *sets)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = losses(tmp_path)
    assert [round(rows[s]["expert_sparsity"], 2) for s in (2, 3, 5, 6, 9)] == [0, 0.25, 0.25, 0.5, 0.5]
    from meshfold.train.trained import load_trained

    model, _ = load_trained(str(tmp_path))
    for layer in model.moe_layers():
        for w, mask in layer.sparse_layers().values():  # w as [E, K, N], mask [E, K / bk, N / bn]
            w = w.detach().reshape(w.shape[0], w.shape[1], -1)
            # expanded here by hand, not with expand_tile_mask, which the pruner itself uses
            bk, bn = w.shape[1] // mask.shape[1], w.shape[2] // mask.shape[2]
            keep = mask.repeat_interleave(bk, 1).repeat_interleave(bn, 2)
            assert torch_all_zero(w[~keep])  # pruned tiles stayed zero through AdamW steps


def torch_all_zero(t):
    return bool((t == 0).all())


def test_config_file_and_own_data(tmp_path):
    """Settings from a TOML file (overridden on the command line) and --data text files, with a
    held-out validation split."""
    text = tmp_path / "corpus"
    text.mkdir()
    (text / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    (text / "b.txt").write_text("pack my box with five dozen liquor jugs! " * 400)
    config = tmp_path / "run.toml"
    config.write_text('[fold]\nworld_size = 2\ntp = 1\nep = 2\n\n[train]\nsteps = 50\nbatch = 4\n'
                      'seq = 32\neval_every = 3\n\n[model]\nlayers = 1\n\n[moe]\ncapacity_factor = 1.0\n')
    proc = meshfold_here("train", "--config", str(config), "--steps", "6", "--out-dir", str(tmp_path / "run"),
                    "--data", str(text))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on 2 ranks" in proc.stdout and "corpus" in proc.stdout
    rows = losses(tmp_path / "run")
    assert sorted(rows) == [1, 2, 3, 4, 5, 6] and "val_loss" in rows[3]  # steps from --steps
    from meshfold.data.corpus import load_corpus

    corpus = load_corpus([text], val_fraction=0.05)
    total = len(corpus.train) + len(corpus.val)
    assert total == 400 * 45 + 400 * 41 + 1  # both files, joined by one newline
    assert abs(len(corpus.val) - 0.05 * total) <= 1  # the last 5% is held out
