"""A checkpoint is resumed, exported or sampled only if its files are what was saved: each file's
checksum is written with it and checked before any rank starts; a full disk names the folder and
the space a save needs, and leaves no partial save behind. One process, a tiny model: no ranks."""

import errno
import hashlib
import json

import pytest
import torch
import xxhash

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
    del state["checksums"], state["checksum_algorithm"]
    (step2 / "trainer.json").write_text(json.dumps(state))
    notes = preflight.check_resume(tmp_path, resume=True)
    assert len(notes) == 1 and "step_000002 carries no checksums" in notes[0] and "\n" not in notes[0]
    for given in (step2, tmp_path):  # a checkpoint, or the run folder of its newest one
        loaded, _ = load_trained(str(given))
        assert capsys.readouterr().err.count("carries no checksums") == 1, given
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_save_records_each_file_s_xxh3_128_and_names_the_hash(tmp_path):
    saved_run(tmp_path, steps=(2,))
    step2 = tmp_path / "checkpoints" / "step_000002"
    state = json.loads((step2 / "trainer.json").read_text())
    files = sorted(p.name for p in step2.iterdir() if p.name != "trainer.json")
    assert state["checksum_algorithm"] == "xxh3-128" and sorted(state["checksums"]) == files
    for name in files:
        assert state["checksums"][name] == xxhash.xxh3_128((step2 / name).read_bytes()).hexdigest(), name


def rewrite_state(folder, change):
    """trainer.json of checkpoint ``folder`` after ``change(state)``."""
    state = json.loads((folder / "trainer.json").read_text())
    change(state)
    (folder / "trainer.json").write_text(json.dumps(state))


def test_a_checkpoint_with_blake2b_checksums_and_no_hash_name_is_verified_by_blake2b(tmp_path):
    saved_run(tmp_path, steps=(2, 4))
    step4 = tmp_path / "checkpoints" / "step_000004"

    def as_blake2b(state):  # what checkpoints recorded before they named the hash
        del state["checksum_algorithm"]
        state["checksums"] = {name: hashlib.blake2b((step4 / name).read_bytes(), digest_size=16).hexdigest()
                              for name in state["checksums"]}

    rewrite_state(step4, as_blake2b)
    assert checkpoint.verify(step4) is None and preflight.check_resume(tmp_path, resume=True) == []
    shard = next(step4.glob("*.safetensors"))
    flip_a_tensor_byte(shard)
    with pytest.raises(ValueError, match=f"{shard.name} is damaged .*blake2b-128.*newest intact checkpoint is "
                                         f"step_000002"):
        preflight.check_resume(tmp_path, resume=True)


def test_an_unknown_hash_name_is_an_error_naming_it_and_the_known_ones(tmp_path):
    saved_run(tmp_path, steps=(2,))
    step2 = tmp_path / "checkpoints" / "step_000002"
    rewrite_state(step2, lambda state: state.update(checksum_algorithm="sha3-512"))
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.verify(step2)
    assert "checksum_algorithm 'sha3-512'" in str(err.value) and "known: blake2b-128, xxh3-128" in str(err.value)
    with pytest.raises(ValueError, match="'sha3-512'.*no earlier checkpoint is intact"):
        preflight.check_resume(tmp_path, resume=True)


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


def test_a_full_disk_on_a_rank_failing_alone_removes_the_partial_save_and_moves_no_experts(tmp_path, monkeypatch):
    """Rank 1 of 2 runs out of space writing its own RNG file while rank 0 waits at the barrier
    after it: rank 1 must remove the partial save itself, and must not enter a collective (moving
    re-placed experts back is one) that rank 0 is not in."""
    import contextlib

    model, opt = saved_run(tmp_path, steps=(2,))
    tmp = tmp_path / "checkpoints" / "step_000004.tmp"
    moves = []

    @contextlib.contextmanager
    def counted(model, optimizer):  # a collective on a run with re-placed experts
        moves.append(1)
        yield

    def shard_written(state, storage_writer):
        tmp.mkdir()  # (rank 0 made the folder before the first barrier)
        (tmp / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"\0" * 1000)

    def full_disk(obj, f, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(checkpoint.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(checkpoint.dist, "barrier", lambda: None)
    monkeypatch.setattr(checkpoint, "in_expert_order", counted)
    monkeypatch.setattr(checkpoint.dcp, "save", shard_written)
    monkeypatch.setattr(checkpoint.json, "dump", full_disk)  # rank 1's rng_rank1.json
    with pytest.raises(checkpoint.CheckpointError, match="step_000004.tmp: No space left on device; a checkpoint"):
        checkpoint.save(tmp_path / "checkpoints", 4, model, opt, {"step": 4})
    assert not tmp.exists()
    assert len(moves) == 1  # around the shard's write only, which every rank enters
