"""What is computed: routers, dispatchers, experts, MoE layers and the MoE transformer, written as
single-device code with their parallel layout declared beside them (``moe_parallel.MOE_LAYOUT``);
Hugging Face checkpoints in and out (``hf``)."""

from meshfold.models.config import MoEConfig
from meshfold.models.moe import MoELayer
from meshfold.models.moe_parallel import MOE_LAYOUT, parallelize_moe
from meshfold.models.router import Router
from meshfold.models.transformer import MoETransformer, TransformerConfig
from meshfold.models.configs import CONFIGS, get_config
from meshfold.models.hf import from_pretrained, save_pretrained

__all__ = ["CONFIGS", "MOE_LAYOUT", "MoEConfig", "MoELayer", "MoETransformer", "Router", "TransformerConfig",
           "from_pretrained", "get_config", "parallelize_moe", "save_pretrained"]
