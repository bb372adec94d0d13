"""A trained model on one process: the newest checkpoint of a run folder, or a checkpoint folder,
as a single-device :class:`~meshfold.models.transformer.MoETransformer` (for sampling and export)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["load_trained"]


def load_trained(run_or_checkpoint: str):
    """(model, trainer state) from a run folder (its newest checkpoint) or a checkpoint folder."""
    from meshfold.models.transformer import MoETransformer
    from meshfold.train import checkpoint
    from meshfold.train.config import TrainConfig
    from meshfold.train.build import DTYPES

    path = Path(run_or_checkpoint)
    if (path / "checkpoints").is_dir():
        intact, damaged, note = checkpoint.newest_intact(path / "checkpoints")  # verified, checksums too
        if damaged is not None:  # the newest is damaged: name it, and the one that would do
            use = f"pass {intact} to use the newest intact one" if intact else "no checkpoint is intact"
            raise ValueError(f"{damaged}; {use}")
        if intact is None:
            raise ValueError(f"{path}/checkpoints has no complete checkpoint")
        path = intact
    elif not (path / "trainer.json").exists():
        raise ValueError(f"{path} is neither a run folder nor a checkpoint (no trainer.json)")
    else:
        note = checkpoint.verify(path)  # names a damaged trainer.json or shard before torch reads it
    if note:
        print(note, file=sys.stderr)
    state = json.loads((path / "trainer.json").read_text())
    cfg = TrainConfig(model=state["model"], moe=state.get("moe", {}), sparsity=state.get("sparsity", {}))
    cfg.train.init_from = state.get("init_from")  # the model's shape is that checkpoint's config.json
    cfg.train.dtype = state.get("dtype", "float32")  # checkpoints before train.master_dtype: float32, as then
    cfg.train.master_dtype = state.get("master_dtype", "float32")
    model = MoETransformer(cfg.model_config(), dtype=DTYPES[cfg.train.master_dtype])  # the master weights
    checkpoint.load(path, model, None, restore_rng=False)
    return model.eval(), state
