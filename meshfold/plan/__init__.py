"""meshfold plan: choose a folded layout for a cluster with a cost and memory model.

Given a model shape, a sequence length and global batch, a GPU count and a hardware description,
:func:`plan` enumerates every valid fold (tp, cp, dp, pp, ep, etp, edp, micro-batch, virtual
pipeline, pipeline schedule, DP sharding: the knobs meshfold runs) and :func:`estimate` gives
each its memory per GPU, step-time breakdown and MFU. Formulas and their sources: ``docs/plan.md``.

    >>> from meshfold.plan import plan
    >>> best = plan("mixtral-8x22b", gpus=128, hw="h100")[0]
    >>> best.layout.paper_config(), round(best.mfu, 2)  # doctest: +SKIP

Layer: pure Python: imports ``meshfold.mesh`` and ``meshfold.catalog``, never torch or a
layer built on it (``tests/test_layers.py``).
"""

from meshfold.plan.baselines import (MEGATRON_STRATEGIES, PAPER_TABLE1, STRATEGIES, STRATEGY_NAMES, PaperRow,
                                     paper_spec)
from meshfold.plan.cost import (MEGATRON_SHARDINGS, MEMORY_TERMS, RECOMPUTE, SCHEDULES, SHARDINGS, TIME_TERMS,
                                Estimate, Layout, check_layout, estimate)
from meshfold.plan.hardware import HARDWARE, Hardware, hardware
from meshfold.plan.models import MODELS, ModelShape, model_shape
from meshfold.plan.search import candidates, plan

__all__ = [
    "Estimate", "HARDWARE", "Hardware", "Layout", "MEGATRON_SHARDINGS", "MEGATRON_STRATEGIES", "MEMORY_TERMS",
    "MODELS", "ModelShape", "PAPER_TABLE1", "PaperRow", "RECOMPUTE", "SCHEDULES", "SHARDINGS",
    "STRATEGIES", "STRATEGY_NAMES", "TIME_TERMS", "candidates", "check_layout", "estimate", "hardware",
    "model_shape", "paper_spec", "plan",
]
