"""One ``torch.compile`` of each plain function, shared by every caller.

Compiled with static shapes (``dynamic=False``): a training run's shapes do not change from step
to step, so each function traces one graph per distinct shape at its first call and reuses it
after. Cached per function, so every module or kernel that asks for the same plain function gets
the same compiled one (one code object, not one per layer). Used by the CPU kernels' compiled row
loops (:mod:`.combine`) and by ``train.compile`` (:mod:`meshfold.parallel.compile`).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["compiled"]


@functools.cache
def compiled(fn):
    """``torch.compile(fn, dynamic=False)``, once per ``fn``."""
    return torch.compile(fn, dynamic=False)
