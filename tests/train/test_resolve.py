"""Settings are validated once into a Resolved run that nothing rewrites afterwards."""

import dataclasses

import pytest

from meshfold.train.config import TrainConfig, load_config


def test_validate_checks_without_rewriting_the_settings():
    cfg = load_config(None, ["train.dtype=bfloat16"])
    cfg.validate()
    assert cfg.train.master_dtype is None  # unset stays unset: validation is not a setter


def test_resolve_completes_a_copy_and_leaves_the_settings_as_given():
    cfg = load_config(None, ["train.dtype=bfloat16"])
    run = cfg.resolve()
    assert run.train.master_dtype == "float32"  # the default master dtype, resolved
    assert cfg.train.master_dtype is None and run.cfg is not cfg and run.train is not cfg.train
    assert (run.spec, run.model) == cfg.validate()


def test_a_resolved_run_cannot_be_rebound():
    run = TrainConfig().resolve()
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.spec = None


def test_resolve_names_a_bad_setting():
    with pytest.raises(ValueError, match="train.master_dtype = 'bfloat16' is narrower than train.dtype = 'float32'"):
        load_config(None, ["train.master_dtype=bfloat16"]).resolve()
