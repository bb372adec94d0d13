"""What is computed: routers, dispatchers, experts and MoE layers, written as single-device code
with their parallel layout declared beside them (``moe_parallel.MOE_LAYOUT``)."""

from meshfold.models.config import MoEConfig
from meshfold.models.moe import MoELayer
from meshfold.models.moe_parallel import MOE_LAYOUT, parallelize_moe
from meshfold.models.router import Router

__all__ = ["MOE_LAYOUT", "MoEConfig", "MoELayer", "Router", "parallelize_moe"]
