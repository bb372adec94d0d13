"""``meshfold train``: folded-parallel training of a MoE transformer, with checkpoints and metrics."""

from meshfold.train.config import TrainConfig, load_config

__all__ = ["TrainConfig", "load_config"]
