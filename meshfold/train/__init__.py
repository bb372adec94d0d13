"""``meshfold train``: folded-parallel training of a MoE transformer, with checkpoints and metrics.

Layer: above ``meshfold.plan``, ``meshfold.data.corpus``, ``meshfold.interop`` and
``meshfold.parallel``; never dryrun, testing or cli (``tests/test_layers.py``).
"""

from meshfold.train.config import TrainConfig, load_config

__all__ = ["TrainConfig", "load_config"]
