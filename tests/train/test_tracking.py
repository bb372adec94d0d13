"""What a run records besides the model: per-rank memory, TensorBoard events, W&B logs and a
profiler trace, each holding the run's steps, across a resume for more steps (whose schedule
is the documented one of the new length)."""

import importlib.util
import io
import json
import sys
import types

import pytest

from meshfold.train.optim import lr_at

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


def _fake_wandb(log_path):
    """A stand-in ``wandb`` module that appends every call to ``log_path`` (JSON lines)."""
    def write(**row):
        with open(log_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    run = types.SimpleNamespace(log=lambda values, step: write(call="log", step=step, values=values),
                                finish=lambda: write(call="finish"))

    def init(**kwargs):
        write(call="init", name=kwargs.get("name"), config=kwargs.get("config"))
        return run

    return types.SimpleNamespace(init=init)


BIG = 64 << 20  # bytes rank 1 allocates, with a view and an in-place op on it, in step 4's update


def _train(rank, world_size, cfg, wandb_log):
    """One rank of the run; rank 1 also allocates a BIG-byte tensor just before step 4's update,
    and returns the bytes of its weights, gradients and optimizer state at that moment (each
    storage once, DTensors by their local shards: what the tensor peak holds then besides it)."""
    import torch
    from torch.distributed.tensor import DTensor

    from meshfold.train import loop

    update = loop._update
    state = {}

    def update_allocating(built, t, n, *args):
        if rank != 1 or n != 4:
            return update(built, t, n, *args)
        model, opt = built.model, built.optimizer
        big = torch.ones(BIG, dtype=torch.uint8)
        big.view(2, -1)[0].add_(1)  # no new storage
        tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None),
                   *(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))]
        tensors = [x.to_local() if isinstance(x, DTensor) else x for x in tensors]
        storages = {x.untyped_storage()._cdata: x.untyped_storage().nbytes() for x in tensors}
        state["bytes"] = sum(storages.values())
        del big
        return update(built, t, n, *args)

    sys.modules["wandb"] = _fake_wandb(wandb_log)
    loop._update = update_allocating
    try:
        return {**loop.train_rank(rank, world_size, cfg.resolve()), **state}
    finally:
        del sys.modules["wandb"]
        loop._update = update


def _run(world, out, steps, wandb_log):
    """One ``meshfold train`` invocation on the session's 2-rank world: the launcher's part
    (settings, run.json) here, the ranks there. Returns the launcher's notes."""
    from meshfold.train.config import load_config
    from meshfold.train.rundir import RunLock, prepare

    sets = [f"train.steps={steps}", "train.batch=4", "train.seq=16", "train.warmup=2", "train.eval_every=1000",
            "model.layers=2", "fold.world_size=2", "fold.tp=1", "fold.ep=2", "train.ckpt_every=1000",
            "train.profile_steps=[2, 3]", "train.wandb=true", "train.tensor_memory=true",
            f"train.tensorboard={str(HAS_TENSORBOARD).lower()}",
            f"train.out_dir={json.dumps(str(out))}"]
    cfg = load_config(None, sets)
    _, mcfg = cfg.validate()
    with RunLock(out) as lock:
        notes = prepare(lock, cfg, mcfg)
    results = world.run(_train, cfg, str(wandb_log), timeout=600)
    return notes, results


@pytest.mark.multirank
@pytest.mark.slow
def test_a_run_records_memory_events_logs_and_a_profile_of_its_steps_across_a_longer_resume(worlds, tmp_path):
    out, wandb_log = tmp_path / "run", tmp_path / "wandb.jsonl"
    world = worlds(2)
    _run(world, out, 3, wandb_log)
    notes, results = _run(world, out, 5, wandb_log)  # resumed from step 3's checkpoint, for 2 more steps
    assert any("train.steps 3 -> 5: the learning-rate schedule now spans 5 steps" in n for n in notes), notes

    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    t = types.SimpleNamespace(lr=3e-3, warmup=2, min_lr_ratio=0.1)
    for r in rows:  # steps 4 and 5 on the 5-step schedule, the earlier ones on the 3-step one
        assert r["lr"] == pytest.approx(lr_at(r["step"], types.SimpleNamespace(**vars(t), steps=3 if r["step"] <= 3
                                                                                else 5)), rel=1e-15)
        m = r["memory"]
        assert m["kind"] == "cpu_peak_rss" and len(m["mib"]) == 2 and all(x > 50 for x in m["mib"])
        assert m["mib"][m["peak_rank"]] == max(m["mib"])
        assert len(m["tensor_mib"]) == 2 and m["tensor_mib"][m["tensor_peak_rank"]] == max(m["tensor_mib"])
    # the tensor peak counts rank 1's BIG tensor once, on top of the state alive beside it, and
    # stays below the resident set, which holds every tensor
    big_mib, state_mib = BIG / 2**20, results[1]["bytes"] / 2**20
    others = max(r["memory"]["tensor_mib"][1] for r in rows if r["step"] != 4)
    step4 = rows[3]["memory"]
    assert big_mib + state_mib <= step4["tensor_mib"][1] < big_mib + others, (step4, state_mib, others)
    assert step4["tensor_peak_rank"] == 1 and step4["tensor_mib"][1] < step4["mib"][1]
    assert all(state_mib < r["memory"]["tensor_mib"][1] < big_mib for r in rows if r["step"] != 4)

    calls = [json.loads(line) for line in open(wandb_log)]
    assert [c["call"] for c in calls] == ["init", "log", "log", "log", "finish", "init", "log", "log", "finish"]
    assert [c["step"] for c in calls if c["call"] == "log"] == [1, 2, 3, 4, 5]
    assert calls[0]["config"]["train.betas"] == [0.9, 0.95]  # the run's identity
    assert {"loss", "lr", "grad_norm", "memory/peak_mib", "memory/tensor_peak_mib", "aux/aux"} <= set(
        calls[1]["values"])

    trace = json.loads((out / "profile" / "rank0-steps2-3.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"step 2", "step 3"} <= names and "step 1" not in names and "step 4" not in names
    assert not (out / "profile" / "rank1-steps2-3.json").exists()  # rank 0 only, by default

    if HAS_TENSORBOARD:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(out / "tensorboard")).Reload()
        loss = events.Scalars("loss")
        assert [e.step for e in loss] == [1, 2, 3, 4, 5]
        assert [e.value for e in loss] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
        assert [e.step for e in events.Scalars("memory/peak_mib")] == [1, 2, 3, 4, 5]


def test_a_tracker_without_its_package_is_refused_naming_the_extra(monkeypatch):
    from meshfold.train import tracking

    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None)
    for setting in ("tensorboard", "wandb"):
        t = types.SimpleNamespace(tensorboard=setting == "tensorboard", wandb=setting == "wandb")
        with pytest.raises(ValueError, match=rf'train.{setting} = true needs the {setting} package, which is not '
                                             rf'installed: pip install "meshfold\[{setting}\]"'):
            tracking.check_trackers(t)
    tracking.check_trackers(types.SimpleNamespace(tensorboard=False, wandb=False))  # not asked: no check


def test_the_progress_line_names_the_busiest_ranks_memory():
    from meshfold.train.progress import Progress

    stream = io.StringIO()
    Progress(10, stream=stream).update({"step": 10, "loss": 1.0, "tokens_per_s": 5.0, "mfu": None,
                                        "mfu_of_measured_gemm": 0.1,
                                        "memory": {"kind": "cpu_peak_rss", "mib": [100.0, 312.4], "peak_rank": 1,
                                                   "tensor_mib": [20.25, 8.0], "tensor_peak_rank": 0}})
    assert "mem 312 MiB (rank 1), tensors 20.2 MiB (rank 0)" in stream.getvalue()


def test_the_progress_line_names_the_worst_moe_layers_ep_load():
    from meshfold.train.progress import Progress

    stream = io.StringIO()
    Progress(10, stream=stream).update({"step": 10, "loss": 1.0, "tokens_per_s": 5.0, "mfu": None,
                                        "mfu_of_measured_gemm": 0.1, "ep_max_over_mean": [1.25, 1.9375, 1.5]})
    assert "ep load max/mean 1.94 (moe layer 1)" in stream.getvalue()


def test_trackers_log_the_worst_moe_layers_ep_load():
    from meshfold.train.tracking import scalars

    got = scalars({"step": 3, "loss": 1.0, "ep_rank_rows": [[5, 1], [3, 3]], "ep_max_over_mean": [5 / 3, 1.0]})
    assert got == {"loss": 1.0, "ep_load/max_over_mean": 5 / 3}


def test_profile_steps_outside_the_run_are_refused():
    from meshfold.train.config import load_config

    for steps in ("[3, 2]", "[1, 300]"):
        with pytest.raises(ValueError, match=r"train.profile_steps = \[\d+, \d+\] must be \[a, b\] with a <= b"):
            load_config(None, [f"train.profile_steps={steps}"]).validate()


def test_a_step_where_clear_refs_cannot_be_written_still_records_the_next_one(tmp_path):
    import torch

    from meshfold.train.tracking import StepMemory

    memory = StepMemory(torch.device("cpu"), tensors=True)
    memory._clear_refs = tmp_path / "absent" / "clear_refs"  # as on a system without it
    for _ in range(2):
        with memory.step():
            x = torch.empty(1 << 20, dtype=torch.uint8)
        assert memory.tensors.peak >= 1 << 20
        del x


REPLACED = {"step": 10, "loss": 1.0, "tokens_per_s": 5.0, "mfu": None, "mfu_of_measured_gemm": 0.1,
            "ep_rank_rows": [[40, 10, 10, 20], [30, 20, 15, 15]], "ep_max_over_mean": [2.0, 1.5],
            "expert_placement": {"moved_bytes": 4096, "seconds": 0.1, "max_over_mean_before": 2.0,
                                 "max_over_mean_after": 1.1, "placements": [list(range(8))] * 2,
                                 "copies": [[3, 0, 0, 0], [1, 1, 2, 2]]}}


def test_a_replacement_step_says_where_the_copies_went_on_a_line_of_its_own():
    """R = 4 copies over ep4 (one a rank): copy slot i is on ep rank i. The worst layer (0, max/mean
    2.0) copies expert 0 to ranks 1, 2, 3 and expert 3 to rank 0; the progress line follows."""
    from meshfold.train.progress import Progress

    stream = io.StringIO()
    Progress(10, stream=stream).update(REPLACED)
    lines = stream.getvalue().splitlines()
    assert lines[0] == ("step 10: experts re-placed, ep load max/mean 2.00 -> 1.10 (worst moe layer), 4,096 bytes "
                        "moved; copies (moe layer 0): expert 0 on ep ranks 1, 2, 3; expert 3 on ep rank 0")
    assert lines[1].startswith("[") and "ep load max/mean 2.00 (moe layer 0)" in lines[1]


def test_the_expert_load_plot_marks_each_replacement_with_its_copies(tmp_path):
    """The plot's re-placement marks: step and where the first MoE layer's copies are (two copy
    slots a rank over ep2: slots 0, 1 on rank 0, slots 2, 3 on rank 1)."""
    import json

    from meshfold.train.plots import replacement_marks, write_plots

    rows = [{"step": 1, "loss": 2.0, "tokens_per_expert": [[5, 1, 1, 1]], "ep_rank_rows": [[6, 2]],
             "ep_max_over_mean": [1.5]},
            {"step": 2, "loss": 1.9, "tokens_per_expert": [[5, 1, 1, 1]], "ep_rank_rows": [[6, 2]],
             "ep_max_over_mean": [1.5], "expert_placement": {"copies": [[0, 1, 0, 2]]}},
            {"step": 3, "loss": 1.8, "tokens_per_expert": [[5, 1, 1, 1]], "ep_rank_rows": [[4, 4]],
             "ep_max_over_mean": [1.0], "expert_placement": {}}]
    assert replacement_marks(rows) == [(2, "copies e0: r0 r1; e1: r0; e2: r1")]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths = write_plots(tmp_path)
    assert tmp_path / "expert_load.png" in paths and (tmp_path / "expert_load.png").stat().st_size > 0
