"""Named model configs: the seed paper's models, their Hugging Face families and tiny CPU variants.

Defined once, as plain numbers, in :data:`meshfold.catalog.MODEL_CONFIGS` (which the torch-free
planner reads too, and which names each model's sources); built here as config objects.
"""

from __future__ import annotations

from dataclasses import replace

from meshfold.catalog import MODEL_CONFIGS
from meshfold.models.config import MoEConfig
from meshfold.models.mla import MLAConfig, YaRN
from meshfold.models.transformer import TransformerConfig

__all__ = ["CONFIGS", "build_config", "get_config"]


def build_config(fields: dict) -> TransformerConfig:
    """A :class:`TransformerConfig` from plain fields (:data:`meshfold.catalog.MODEL_CONFIGS`'s
    form: ``moe``, ``mla`` and ``mla["yarn"]`` as nested dicts)."""
    f = dict(fields)
    moe, mla = f.pop("moe", None), f.pop("mla", None)
    if mla is not None:
        mla = dict(mla)
        yarn = mla.pop("yarn", None)
        mla = MLAConfig(**mla, yarn=None if yarn is None else YaRN(**yarn))
    return TransformerConfig(**f, moe=None if moe is None else MoEConfig(**moe), mla=mla)


CONFIGS: dict[str, TransformerConfig] = {name: build_config(f) for name, f in MODEL_CONFIGS.items()}


def get_config(name: str) -> TransformerConfig:
    """A fresh copy of the named config (edit it freely)."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model config {name!r}; valid: {sorted(CONFIGS)}")
    cfg = CONFIGS[name]
    return replace(cfg, moe=replace(cfg.moe) if cfg.moe is not None else None,
                   mla=replace(cfg.mla) if cfg.mla is not None else None)
