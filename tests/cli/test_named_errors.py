"""Errors that name the setting, file or argument at fault, before any work is done: each command
runs in this process and must end before a rank, the dry run or a tokenizer starts."""

import pytest

from tests.train.test_train import SMALL, meshfold_before_spawning

DRYRUN = ["dryrun", "--model", "tiny-mixtral", "--gpus", "2", "--seq", "32", "--gbs", "2"]


def test_init_from_with_a_config_json_that_is_not_json_names_the_file(tmp_path, monkeypatch, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "mixtral",\n')
    rc, _, err = meshfold_before_spawning(monkeypatch, capsys, "train", "--steps", "1", "--out-dir",
                                          str(tmp_path / "run"), "--set", f"train.init_from={tmp_path}")
    assert rc == 2 and f"{tmp_path / 'config.json'} is not valid JSON" in err, err
    assert "train.init_from" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("line, named", [('tile = "64x64"', "sparsity.tile = '64x64'"),
                                         ("schedule = 0.5", "sparsity.schedule = 0.5")])
def test_a_sparsity_list_given_as_a_scalar_names_the_setting(tmp_path, monkeypatch, capsys, line, named):
    (tmp_path / "run.toml").write_text(f'[model]\nname = "tiny-mixtral"\n[sparsity]\n{line}\n')
    rc, _, err = meshfold_before_spawning(monkeypatch, capsys, "train", "--config", str(tmp_path / "run.toml"),
                                          *SMALL, "--out-dir", str(tmp_path / "run"))
    assert rc == 2 and named in err and "valid: a list" in err, err
    assert "('6', '4'" not in err


def test_dryrun_checks_its_json_folder_before_the_dry_run(tmp_path, monkeypatch, capsys):
    from meshfold.dryrun import engine

    monkeypatch.setattr(engine, "dry_run", lambda *a, **k: pytest.fail("the dry run started"))
    target = tmp_path / "no" / "such" / "out.json"
    rc, _, err = meshfold_before_spawning(monkeypatch, capsys, *DRYRUN, "--fold", "1/1/2/1", "--json", str(target))
    assert rc == 2 and f"--json {target}: the folder {target.parent} does not exist" in err, err


def test_dryrun_refuses_a_balanced_placement_with_ep_1_as_train_does(monkeypatch, capsys):
    from meshfold.dryrun import engine

    monkeypatch.setattr(engine, "dry_run", lambda *a, **k: pytest.fail("the dry run started"))
    rc, _, err = meshfold_before_spawning(monkeypatch, capsys, *DRYRUN, "--fold", "1/2/1/1", "--placement", "balanced")
    assert rc == 2 and "--placement balanced with ep = 1" in err and "valid: --placement static" in err, err


def test_tokenize_names_its_file_arguments_not_an_option_it_lacks(tmp_path, monkeypatch, capsys):
    missing = tmp_path / "nosuch.txt"
    rc, _, err = meshfold_before_spawning(monkeypatch, capsys, "tokenize", "--train-tokenizer", "300",
                                          "--out", str(tmp_path / "tok"), str(missing))
    assert rc == 2 and f"meshfold tokenize file argument {missing}: no such file or folder" in err, err
    assert "--data" not in err
