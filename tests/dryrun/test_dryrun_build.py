"""The dry run steps the job ``meshfold train`` builds (:func:`meshfold.train.build.build`): every
setting that changes the step is either built as training builds it or refused, naming it,
before any rank starts; an all-reduce job's dry run holds an all-reduce step's state."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.tensor import DTensor

from meshfold.dryrun import dry_run
from meshfold.train.config import TrainConfig

FOLD = {"world_size": 4, "tp": 2, "ep": 2}  # dp 2: FSDP2 would shard what all-reduce replicates


def _cfg(fold=FOLD, sets=(), **train) -> TrainConfig:
    from meshfold.train.config import load_config

    cfg = load_config(None, list(sets))
    cfg.fold = dict(fold)
    cfg.train.batch, cfg.train.seq = 8, 16
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


def _local_bytes(tensors) -> int:
    local = (t.to_local() if isinstance(t, DTensor) else t for t in tensors if t is not None)
    return sum(t.numel() * t.element_size() for t in local)


def _allreduce_step(rank, world_size):
    """An all-reduce step built without the build or the dry run: ``parallelize`` with
    ``data_parallel="allreduce"``, ``build_optimizer``'s AdamW, forward, backward, reduction,
    optimizer step; this rank's parameter, gradient and optimizer bytes and the groups."""
    from meshfold.models.transformer import MoETransformer
    from meshfold.parallel.batch import shard_batch
    from meshfold.parallel.data_parallel import reduce_gradients
    from meshfold.parallel.transformer import parallelize
    from meshfold.testing.worlds import cached_fold
    from meshfold.train.optim import build_optimizer

    cfg = _cfg(data_parallel="allreduce")
    spec, mcfg = cfg.validate()
    model = parallelize(MoETransformer(mcfg, device="meta"), cached_fold(spec), data_parallel="allreduce")
    opt = build_optimizer(model, cfg.train)
    tokens = torch.randint(0, mcfg.vocab, (8, 17), generator=torch.Generator().manual_seed(0))
    lt, pos = shard_batch(tokens[:, :-1].contiguous(), spec, rank)
    ltg, _ = shard_batch(tokens[:, 1:].contiguous(), spec, rank)
    model.loss(lt, ltg, pos).backward()
    reduce_gradients(model)
    grads = _local_bytes(p.grad for p in model.parameters())
    opt.step()
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return _local_bytes(model.parameters()), grads, _local_bytes(state), [g["name"] for g in opt.param_groups]


def test_an_allreduce_dry_run_holds_the_state_of_an_allreduce_step(worlds):
    """train.data_parallel = "allreduce": whole replicas on every dp rank, not FSDP2's shards, and
    build_optimizer's groups (decay / no_decay), not one plain AdamW group."""
    params, grads, optim, groups = worlds(4).run(_allreduce_step)[0]
    (dry,) = dry_run(_cfg(data_parallel="allreduce"), ranks=[0])
    assert (dry.param_bytes, dry.grad_bytes, dry.optimizer_bytes) == (params, grads, optim)
    assert dry.optimizer_groups == groups == ["decay", "no_decay"]


# ---- each setting that changes the step: refused before any rank starts, naming it --------------
REFUSED = {
    "compile": (dict(compile=True), (), "train.compile"),
    "sparsity": ({}, ("sparsity.tile=[16, 16]", "sparsity.schedule=[0.5]"), "[sparsity]"),
    "expert_placement": (dict(expert_placement="balanced"), (), "train.expert_placement"),
}


@pytest.mark.parametrize("setting", list(REFUSED))
def test_a_setting_the_dry_run_cannot_stand_for_is_refused_by_name(setting, monkeypatch):
    from meshfold.dryrun import engine

    train, sets, name = REFUSED[setting]
    monkeypatch.setattr(engine, "dry_run_rank", lambda *a: pytest.fail("a rank started"))
    with pytest.raises(ValueError, match=name.replace("[", r"\[").replace("]", r"\]")):
        dry_run(_cfg(sets=sets, **train), ranks=[0])


# ---- ... or built as training builds it (the dry run's step_report calls the same build) --------
TWO = {"world_size": 2, "ep": 2}  # dp 2
PP2 = {"world_size": 2, "pp": 2}


def _facts(rank, world_size, variants):
    """For each (fold, sets, train settings) of ``variants``, what :func:`build` makes of them on
    this rank, the dry run's way (``init_from``: its shapes, not its values), after one step."""
    from torch.distributed.fsdp import FSDPModule

    from meshfold.parallel.batch import shard_batch
    from meshfold.parallel.recompute import Checkpointed
    from meshfold.testing.worlds import cached_fold
    from meshfold.train.build import build

    out = []
    for fold, sets, train in variants:
        run = _cfg(fold, sets, **train).resolve()
        built = build(run, cached_fold(run.spec), init_from=False)
        model, opt = built.model, built.optimizer
        seen = []
        hooks = [layer.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
                 for layer in model.moe_layers()]
        tokens = torch.randint(0, run.model.vocab, (8, 16), generator=torch.Generator().manual_seed(0))
        lt, pos = shard_batch(tokens, run.spec, rank)
        model.step(lt, lt, pos)
        for hook in hooks:
            hook.remove()
        out.append({"data_parallel": any(isinstance(m, FSDPModule) for c in model.chunks for m in c.modules()),
                    "dtype": str(seen[0]), "master_dtype": str(next(model.parameters()).dtype),
                    "recompute": any(isinstance(m.__dict__.get("forward"), Checkpointed)
                                     for c in model.chunks for m in c.modules()),
                    "microbatches": model.microbatches, "schedule": type(model.schedule).__name__,
                    "no_weight_decay": [g["name"] for g in opt.param_groups],
                    "betas": list(opt.param_groups[0]["betas"]),
                    "init_from": sum(p.numel() for p in model.parameters())})
    return out


HONOURED = {  # setting: (fold, its value, what build makes of it, what it makes of the default)
    "data_parallel": (TWO, dict(data_parallel="allreduce"), False, True),  # FSDP2 modules or none
    "dtype": (TWO, dict(dtype="bfloat16"), "torch.bfloat16", "torch.float32"),
    "master_dtype": (TWO, dict(master_dtype="float64"), "torch.float64", "torch.float32"),
    "recompute": (TWO, dict(recompute="full"), True, False),
    "microbatches": (TWO, dict(microbatches=2), 2, 1),
    "schedule": (PP2, dict(schedule="gpipe", microbatches=2), "ScheduleGPipe", "Schedule1F1B"),
    "no_weight_decay": (TWO, dict(no_weight_decay=[]), ["decay"], ["decay", "no_decay"]),
    "betas": (TWO, dict(betas=[0.8, 0.9]), [0.8, 0.9], None),
}


@pytest.mark.parametrize("setting", list(HONOURED))
def test_a_setting_that_changes_the_step_is_built_as_training_builds_it(worlds, setting):
    fold, value, want, default = HONOURED[setting]
    base = {"microbatches": 2} if setting == "schedule" else {}
    got, got_default = (f[setting] for f in worlds(2).run(_facts, [(fold, (), value), (fold, (), base)])[0])
    if default is None:  # the default's value, from the settings themselves
        default = list(TrainConfig().train.betas)
    assert (got, got_default) == (want, default)


def test_init_from_builds_the_checkpoints_shapes(worlds, tmp_path):
    """train.init_from: the model the checkpoint's config.json describes (3 layers here, where
    the named model has 2); the dry run reads no weights."""
    from meshfold.interop.hf import save_pretrained
    from meshfold.models.transformer import MoETransformer

    deeper = _cfg(TWO, ("model.layers=3",)).resolve().model
    save_pretrained(MoETransformer(deeper), tmp_path / "hf")
    loaded, direct = worlds(2).run(_facts, [(TWO, (), dict(init_from=str(tmp_path / "hf"))),
                                            (TWO, ("model.layers=3",), {})])[0]
    assert loaded["init_from"] == direct["init_from"]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_hidden_layers"] == 3


# ---- meshfold dryrun reads meshfold train's settings ---------------------------------------------
def _error_line(argv, capsys) -> str:
    from meshfold.cli import main as cli_main

    assert cli_main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0].split(": error: ", 1)[1]


def test_dryrun_reads_a_train_config_file_and_names_its_settings(tmp_path, capsys):
    config = tmp_path / "job.toml"
    config.write_text('[fold]\nworld_size = 4\ntp = 2\nep = 2\n[train]\nbatch = 5\n')
    line = _error_line(["dryrun", "--config", str(config)], capsys)
    assert line == _error_line(["train", "--config", str(config)], capsys)
    assert line.startswith("train.batch = 5 is not divisible by dp = 2"), line


def test_dryrun_set_refuses_what_it_cannot_stand_for_before_any_rank(capsys, monkeypatch):
    from meshfold.dryrun import engine

    monkeypatch.setattr(engine, "dry_run_rank", lambda *a: pytest.fail("a rank started"))
    line = _error_line(["dryrun", "--set", "train.compile=true"], capsys)
    assert line.startswith("train.compile = true:"), line


def test_dryrun_model_keeps_the_model_settings_given_with_it(capsys, monkeypatch):
    """--model names the model; a --set model.KEY given beside it still applies (it was dropped,
    and the dry run ran without it): a value meshfold train refuses is refused here too."""
    from meshfold.dryrun import engine

    monkeypatch.setattr(engine, "dry_run_rank", lambda *a: pytest.fail("a rank started"))
    line = _error_line(["dryrun", "--model", "tiny-deepseek-v3", "--set", "model.mtp_depth=-1",
                        "--set", "fold.ep=2"], capsys)
    assert "mtp_depth must be an integer >= 0" in line, line
