"""A checkpoint is resumed, exported or sampled only if its files are what was saved: each file's
checksum is written with it and checked before any rank starts; a full disk names the folder and
the space a save needs, and leaves no partial save behind. One process, a tiny model: no ranks."""

import errno
import json

import pytest
import torch

from meshfold.models.transformer import MoETransformer
from meshfold.train import checkpoint, preflight
from meshfold.train.config import TrainConfig
from meshfold.train.trained import load_trained

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def saved_run(out, steps=(2, 4)):
    """A run folder with a checkpoint of a tiny model at each of ``steps``."""
    cfg = TrainConfig(model={"name": "tiny-mixtral"})
    model = MoETransformer(cfg.model_config(), dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters())
    for step in steps:
        checkpoint.save(out / "checkpoints", step, model, opt, {"step": step, "model": cfg.model})
    return model, opt


def flip_a_tensor_byte(shard):
    """One bit flipped in the tensor data: size and safetensors header stay intact."""
    data = bytearray(shard.read_bytes())
    header = int.from_bytes(data[:8], "little")
    data[8 + header + (len(data) - 8 - header) // 2] ^= 0x10
    shard.write_bytes(bytes(data))


def test_a_flipped_byte_in_a_shard_is_named_with_the_newest_intact_checkpoint(tmp_path, capsys):
    saved_run(tmp_path)
    shard = next((tmp_path / "checkpoints" / "step_000004").glob("*.safetensors"))
    flip_a_tensor_byte(shard)
    with pytest.raises(ValueError) as resume:
        preflight.check_resume(tmp_path, resume=True)
    message = str(resume.value)
    assert f"{shard.name} is damaged" in message and "newest intact checkpoint is step_000002" in message
    assert "\n" not in message
    with pytest.raises(ValueError, match=f"{shard.name} is damaged.*step_000002 to use the newest intact"):
        load_trained(str(tmp_path))  # what meshfold generate and export read
    with pytest.raises(checkpoint.CheckpointError, match=f"{shard.name} is damaged"):
        load_trained(str(tmp_path / "checkpoints" / "step_000004"))


def test_a_checkpoint_without_checksums_loads_with_a_one_line_note(tmp_path, capsys):
    model, _ = saved_run(tmp_path, steps=(2,))
    step2 = tmp_path / "checkpoints" / "step_000002"
    state = json.loads((step2 / "trainer.json").read_text())
    del state["checksums"]
    (step2 / "trainer.json").write_text(json.dumps(state))
    notes = preflight.check_resume(tmp_path, resume=True)
    assert len(notes) == 1 and "step_000002 carries no checksums" in notes[0] and "\n" not in notes[0]
    for given in (step2, tmp_path):  # a checkpoint, or the run folder of its newest one
        loaded, _ = load_trained(str(given))
        assert capsys.readouterr().err.count("carries no checksums") == 1, given
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


def test_an_intact_checkpoint_passes_without_a_note(tmp_path):
    saved_run(tmp_path, steps=(2,))
    assert preflight.check_resume(tmp_path, resume=True) == []


def test_a_full_disk_names_the_folder_and_the_space_needed_and_removes_the_partial_save(tmp_path, monkeypatch):
    model, opt = saved_run(tmp_path, steps=(2,))
    written = []

    def full_disk(state, storage_writer):  # a shard half written, then the disk is full
        partial = tmp_path / "checkpoints" / "step_000004.tmp" / "shard-00001-model-00001-of-00001.safetensors"
        partial.write_bytes(b"\0" * 1000)
        written.append(partial)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.dcp, "save", full_disk)
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.save(tmp_path / "checkpoints", 4, model, opt, {"step": 4})
    needed = sum(t.numel() * t.element_size() for t in checkpoint._tensors(model, opt).values())
    assert written and f"step_000004.tmp: No space left on device" in str(err.value)
    assert f"needs about {needed:,} bytes" in str(err.value) and "are free there" in str(err.value)
    assert not (tmp_path / "checkpoints" / "step_000004.tmp").exists()
    assert checkpoint.latest(tmp_path / "checkpoints").name == "step_000002"
