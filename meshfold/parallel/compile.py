"""``torch.compile`` of a model's dense elementwise work, applied from outside (``train.compile``).

Shapes: T = tokens, H = hidden, F = ffn (its tp slice), B / n / S / d = attention's batch, heads,
tokens, head dim.

What is compiled, and why only that: the pieces of a block whose cost is many passes over the
activations rather than matrix products, each a pure function of tensors, so that the compiled
graphs hold no parameter access (parameters are DTensors read through the layout's
parametrization, and FSDP2 unshards them in module hooks), no collective (sequence-parallel
gathers, the MoE dispatch, FSDP2) and no host read (the ragged dispatch's counts):

* the RMSNorms (``RMSNorm.norm``: fp32 statistics, a cast, a scale: one fused pass instead of
  five);
* RoPE on q and k (``Attention.rotate``: the half rotation, two products and a sum, for both);
* the dense SwiGLU MLP (``MLP.ffn``: both projections, with ``silu(gate) * up`` fused between
  them and into their backward).

SDPA is one fused kernel already. The MoE layers (router, dispatch, experts, combine) have
ragged, data-dependent shapes and collectives between their parts, so they are not compiled
whole; on CPU their dropless row passes (the combine, forward and backward, and the permute's
backward: memory-bound passes over the [T * k, H] rows) become compiled one-pass loops
(``MoELayer.fused_rows``, :mod:`meshfold.kernels.combine`), whose shapes are static too (T * k
rows per rank). Measured in benchmarks/RESULTS.md ("Issue 32").

Each hook is set per instance (the model's classes and parameter names are unchanged), and every
module of a kind gets the same compiled function, so a model of identical blocks compiles one graph
per distinct shape (one code object, reused by every layer), not one per layer. Shapes are static
(``dynamic=False``): a training run's shapes do not change from step to step, so after the first
step no graph is traced again (evaluation, without autograd, traces its own once, at the first
evaluation).
"""

from __future__ import annotations

import torch
from torch import nn

from meshfold.kernels import swiglu_reference
from meshfold.kernels.compiled import compiled
from meshfold.models.attention import Attention, apply_rope_qk
from meshfold.models.layers import MLP, RMSNorm, rms_norm
from meshfold.models.moe import MoELayer

__all__ = ["COMPILED_KINDS", "swiglu_mlp", "compile_model", "uncompile_model", "compiled_hooks"]


def swiglu_mlp(x_TH: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Dense SwiGLU ``down(silu(gate x) * up x)``, w_gate_up [H, 2, F], w_down [F, H], in plain
    torch ops (:func:`~meshfold.kernels.swiglu_reference`), for the compiler to fuse: the eager
    MLP's :func:`~meshfold.models.experts.shared_expert_ffn` computes the same with a hand-written
    backward that a compiler cannot trace."""
    H, _, F = w_gate_up.shape
    return swiglu_reference((x_TH @ w_gate_up.reshape(H, 2 * F)).view(-1, 2, F)) @ w_down


# module class -> (hook attribute, the plain function the compiled one replaces); None: the
# attribute is a flag set to True, the module's own compiled loops (MoELayer.fused_rows)
COMPILED_KINDS: dict[type, tuple[str, object]] = {
    RMSNorm: ("norm", rms_norm),
    Attention: ("rotate", apply_rope_qk),
    MLP: ("ffn", swiglu_mlp),
    MoELayer: ("fused_rows", None),
}


def _kind(module: nn.Module):
    for cls, hook in COMPILED_KINDS.items():
        if isinstance(module, cls):
            return hook
    return None


def compile_model(model: nn.Module) -> list[str]:
    """Set the compiled hooks on every module of ``model`` (any ``nn.Module``; for a Pipeline, call
    it on each of its ``chunks``) that :data:`COMPILED_KINDS` names; returns their names. Nothing else
    changes: parameters, names, module hooks (FSDP2, sequence parallelism, recompute) stay as
    they are. Compilation itself happens at the first call of each shape."""
    names = []
    for name, module in model.named_modules():
        hook = _kind(module)
        if hook is not None:
            attr, fn = hook
            setattr(module, attr, True if fn is None else compiled(fn))
            names.append(name)
    return names


def uncompile_model(model: nn.Module) -> None:
    """Remove the hooks :func:`compile_model` set: every module computes eagerly again."""
    for module in model.modules():
        hook = _kind(module)
        if hook is not None and hook[0] in module.__dict__:
            delattr(module, hook[0])


def compiled_hooks(model: nn.Module) -> list[str]:
    """Names of ``model``'s modules that compute through a compiled hook now."""
    return [name for name, m in model.named_modules()
            if (hook := _kind(m)) is not None and hook[0] in m.__dict__]
