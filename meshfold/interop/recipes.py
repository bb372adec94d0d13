"""How a meshfold parameter is made of checkpoint tensors: a recipe, read or written slice by slice.

A recipe is a :class:`Leaf` (one checkpoint tensor, maybe transposed) or a :class:`Stack` of
recipes along a dim (experts along 0, gate and up along the ``2`` axis of ``w_gate_up``). Each
architecture's name map (:func:`meshfold.interop.hf.checkpoint_map`,
:func:`meshfold.interop.hf_deepseek.checkpoint_map`) gives one per parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Leaf", "Stack", "linear", "gate_up", "leaves"]


@dataclass(frozen=True)
class Leaf:
    """One checkpoint tensor; ``transpose``: stored [out, in] (nn.Linear), used as [in, out]."""

    key: str
    transpose: bool = False


@dataclass(frozen=True)
class Stack:
    """``torch.stack(parts, dim)``: e.g. experts along 0, or (gate, up) along the 2-axis."""

    parts: tuple
    dim: int


def linear(key: str) -> Leaf:
    """An ``nn.Linear`` weight of the checkpoint ([out, in]), used as [in, out]."""
    return Leaf(key, transpose=True)


def gate_up(prefix: str, gate: str, up: str) -> Stack:
    """A fused ``w_gate_up`` [H, 2, F] from the gate and up projections [F, H] under ``prefix``."""
    return Stack((linear(f"{prefix}.{gate}.weight"), linear(f"{prefix}.{up}.weight")), dim=1)


def leaves(recipe):
    """Every :class:`Leaf` of ``recipe``, in order."""
    if isinstance(recipe, Leaf):
        yield recipe
    else:
        for p in recipe.parts:
            yield from leaves(p)
