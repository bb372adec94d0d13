"""What is computed: routers, dispatchers, experts, MoE layers and the MoE transformer, written as
single-device code (a router and experts of the user's own plug into ``MoELayer`` through the
Protocols of :mod:`.interfaces`); their parallel layouts are declared and applied from outside
(:mod:`meshfold.parallel`), Hugging Face checkpoints read and written by :mod:`meshfold.interop`.

Layer: single-device math. Imports torch, ``meshfold.kernels``, ``meshfold.catalog``
and ``meshfold.runtime``; never ``meshfold.placements``, ``torch.distributed`` or ``meshfold.parallel``
(``tests/test_layers.py``).
"""

from meshfold.models.config import MoEConfig
from meshfold.models.interfaces import LocalView, MoEExperts, MoERouter
from meshfold.models.moe import MoELayer
from meshfold.models.router import Router
from meshfold.models.transformer import MoETransformer, TransformerConfig
from meshfold.models.configs import CONFIGS, get_config

__all__ = ["CONFIGS", "LocalView", "MoEConfig", "MoEExperts", "MoELayer", "MoERouter", "MoETransformer", "Router",
           "TransformerConfig", "get_config"]
