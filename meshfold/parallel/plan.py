"""A layout plan: how any ``nn.Module`` is laid onto a fold, as data.

A :class:`Plan` maps module and parameter *paths* of the single-device model (the dotted names of
``named_modules()`` / ``named_parameters()`` before any layout) to what
:func:`meshfold.parallel.transformer.parallelize` does with them: placements over the attention
mesh, sequence-parallel entry and exit around tp-sharded modules, the context-parallel hook of
attention modules, MoE layers with their layout table over the MoE mesh, FSDP2 groups,
activation recomputation, and parameters that keep their dtype under mixed precision; for
:class:`~meshfold.parallel.pipeline.Pipeline`, the block list and the modules before and after it.

Patterns are globs over dotted paths, matched segment by segment: ``*`` (and ``?``, ``[...]``)
match within one segment, ``**`` matches any number of segments (none included). So
``layers.*.attn.wq`` names the ``wq`` of every block, ``layers.*`` the blocks themselves (not
their submodules), ``**.norm.weight`` every ``norm.weight`` at any depth.

Nothing is silent: a parameter no ``params`` entry matches is an error naming it (unless the plan
gives a ``default``), and so is any pattern that matches nothing in the model
(:func:`check_plan`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import Placement

__all__ = ["Plan", "SequenceParallel", "CONTEXT_HOOKS", "matches", "first_match", "matching", "check_plan",
           "moe_layers", "owner"]

CONTEXT_HOOKS = ("ring", "latent")  # Plan.context values: GQA-style ring, MLA's latent ring


@dataclass(frozen=True)
class SequenceParallel:
    """Tensor parallelism with sequence parallelism around one module, e.g. an attention or a
    dense MLP whose weights the plan shards over ``tp``: before its forward the tp group's
    tokens are all-gathered (``x`` [B, S, H] along S), after it the output [B, S*tp, H] is
    reduce-scattered back to each rank's S tokens (summing the tp ranks' partial products).

    ``positions``: the module is called ``forward(x, positions, *tables)``; the positions [S] or
    [B, S] are all-gathered with the tokens, and per-token ``tables`` computed for the local
    tokens (e.g. RoPE's cos / sin) are passed as None, so the module computes them for the
    gathered ones. False: ``forward(x)``."""

    positions: bool = False


@dataclass(frozen=True)
class Plan:
    """How a model is laid out (see the module docstring for the pattern syntax).

    * ``params``: parameter pattern -> placements over the attention mesh ``(dp, cp, tp)``
      (``Replicate()`` / ``Shard(d)`` each); the first matching entry wins. Parameters of MoE
      layers (``moe``) take their layer's table instead.
    * ``default``: placements of parameters no entry matches; None: such a parameter is an error.
    * ``tp``: module pattern -> :class:`SequenceParallel` (applied when ``tp > 1``).
    * ``context``: attention module pattern -> ``"ring"`` | ``"latent"``, the hook set as the
      module's ``context`` attribute when ``cp > 1``
      (:class:`~meshfold.parallel.context.RingContext`,
      :class:`~meshfold.parallel.mla.LatentContext`).
    * ``moe``: MoE layer pattern -> its layout table (``{name within the layer: (view,
      placements)}``, like :data:`~meshfold.parallel.layouts.MOE_LAYOUT`), applied with
      :func:`~meshfold.parallel.moe.parallelize_moe`.
    * ``fsdp``: module patterns; each match is an FSDP2 group (the root always is one), on the
      mesh its parameters live on: attention weights sharded over ``dp x cp``, expert weights
      over ``edp``.
    * ``tp_summed``: module patterns of modules replicated over ``tp`` whose gradients are sums
      of the tp ranks' shares (norms, latent projections): under mixed precision with ``tp > 1``
      each is an FSDP2 group of its own, all-gathered in the master dtype, so the tp sum runs in
      the master dtype too.
    * ``recompute``: module patterns of the blocks activation checkpointing wraps.
    * ``keep_dtype``: parameter pattern -> the dtype the module sees it in under mixed
      precision (None: the parameter's own), e.g. a router kept in fp32 under bf16 compute.
    * ``blocks`` / ``before`` / ``after``: for :class:`~meshfold.parallel.pipeline.Pipeline`,
      the path of the block list (an ``nn.ModuleList`` or ``nn.ModuleDict``) and the modules
      run before the blocks (first stage) and after them (last stage).
    * ``check``: optional ``check(spec)`` raising ``ValueError`` naming a model size that does
      not divide over a :class:`~meshfold.mesh.FoldSpec` (heads over tp, ...).
    """

    params: Mapping[str, tuple] = field(default_factory=dict)
    default: tuple | None = None
    tp: Mapping[str, SequenceParallel] = field(default_factory=dict)
    context: Mapping[str, str] = field(default_factory=dict)
    moe: Mapping[str, Mapping] = field(default_factory=dict)
    fsdp: tuple[str, ...] = ()
    tp_summed: tuple[str, ...] = ()
    recompute: tuple[str, ...] = ()
    keep_dtype: Mapping[str, torch.dtype | None] = field(default_factory=dict)
    blocks: str | None = None
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    check: Callable | None = None

    def __post_init__(self):
        for name in ("fsdp", "tp_summed", "recompute", "before", "after"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, Iterable):
                raise TypeError(f"Plan.{name} = {value!r}; valid: a tuple of patterns")
            object.__setattr__(self, name, tuple(value))
        for pattern, placements in list(self.params.items()) + ([("default", self.default)] if self.default else []):
            _check_placements(f"Plan.params[{pattern!r}]" if pattern != "default" else "Plan.default", placements)
        for pattern, sp in self.tp.items():
            if not isinstance(sp, SequenceParallel):
                raise TypeError(f"Plan.tp[{pattern!r}] = {sp!r}; valid: a SequenceParallel(...)")
        for pattern, hook in self.context.items():
            if hook not in CONTEXT_HOOKS:
                raise ValueError(f"Plan.context[{pattern!r}] = {hook!r}; valid: {list(CONTEXT_HOOKS)}")
        for pattern, dtype in self.keep_dtype.items():
            if dtype is not None and not isinstance(dtype, torch.dtype):
                raise TypeError(f"Plan.keep_dtype[{pattern!r}] = {dtype!r}; valid: a torch.dtype or None")


def _check_placements(what: str, placements) -> None:
    if not (isinstance(placements, tuple) and len(placements) == 3 and all(isinstance(p, Placement) for p in placements)):
        raise ValueError(f"{what} = {placements!r}; valid: three placements over attn (dp, cp, tp), "
                         f"e.g. (Replicate(), Replicate(), Shard(1))")


def matches(pattern: str, name: str) -> bool:
    """Whether dotted path ``name`` matches ``pattern`` (segment-wise globs, ``**`` any segments)."""
    return _match(pattern.split("."), name.split(".") if name else [])


def _match(pat: list[str], parts: list[str]) -> bool:
    if not pat:
        return not parts
    if pat[0] == "**":
        return any(_match(pat[1:], parts[i:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pat[0]) and _match(pat[1:], parts[1:])


def first_match(patterns: Iterable[str], name: str) -> str | None:
    """The first of ``patterns`` that ``name`` matches, else None."""
    return next((p for p in patterns if matches(p, name)), None)


def matching(patterns: Iterable[str], names: Iterable[str]) -> dict[str, list[str]]:
    """``{pattern: [the names it matches, in order]}``."""
    names = list(names)
    return {p: [n for n in names if matches(p, n)] for p in patterns}


def owner(name: str) -> tuple[str, str]:
    """``("a.b", "w")`` for parameter ``"a.b.w"`` (the module path, "" for the root)."""
    module, _, attr = name.rpartition(".")
    return module, attr


def moe_layers(model: nn.Module, plan: Plan) -> dict[str, str]:
    """``{MoE layer path: its pattern in plan.moe}`` (the first that matches)."""
    return {n: p for n, _ in model.named_modules() if (p := first_match(plan.moe, n)) is not None}


def _under(name: str, prefixes: Iterable[str]) -> str | None:
    return next((p for p in prefixes if name.startswith(p + ".")), None)


def check_plan(model: nn.Module, plan: Plan, partial: bool = False) -> None:
    """Raise ``ValueError`` for anything of ``plan`` that does not fit ``model``: a pattern that
    matches nothing (``partial``: allowed, the model being one pipeline chunk of the model the
    plan was checked against), a parameter no entry places and no ``default`` covers, an MoE
    layer inside another, a ``context`` module without a ``context`` attribute, a ``blocks``
    path that is not a module list."""
    modules = dict(model.named_modules())
    params = [n for n, _ in model.named_parameters()]
    layers = moe_layers(model, plan)
    dense = [n for n in params if _under(n, layers) is None]
    where = "the model's modules"
    module_rules = [("tp", list(plan.tp)), ("context", list(plan.context)), ("moe", list(plan.moe)),
                    ("fsdp", plan.fsdp), ("tp_summed", plan.tp_summed), ("recompute", plan.recompute),
                    ("before", plan.before), ("after", plan.after)]
    if not partial:
        for field_name, patterns in module_rules:
            for pattern, found in matching(patterns, modules).items():
                if not found:
                    raise ValueError(f"Plan.{field_name} pattern {pattern!r} matches none of {where} "
                                     f"({_sample(modules)})")
        for pattern, found in matching(plan.params, dense).items():
            if not found:
                raise ValueError(f"Plan.params pattern {pattern!r} matches no parameter outside the MoE "
                                 f"layers ({_sample(dense)})")
        for pattern, found in matching(plan.keep_dtype, params).items():
            if not found:
                raise ValueError(f"Plan.keep_dtype pattern {pattern!r} matches no parameter ({_sample(params)})")
        if plan.blocks is not None and not isinstance(modules.get(plan.blocks), (nn.ModuleList, nn.ModuleDict)):
            found = type(modules[plan.blocks]).__name__ if plan.blocks in modules else "no such module"
            raise ValueError(f"Plan.blocks = {plan.blocks!r} is {found}; valid: the path of an nn.ModuleList or "
                             f"nn.ModuleDict of the model")
    if plan.default is None:
        for n in dense:
            if first_match(plan.params, n) is None:
                raise ValueError(f"parameter {n!r} matches no Plan.params entry and the plan has no default; "
                                 f"add an entry (e.g. {n!r}: (Replicate(), Replicate(), Replicate())) or "
                                 f"Plan(default=...)")
    for layer in layers:
        if (outer := _under(layer, layers)) is not None:
            raise ValueError(f"MoE layer {layer!r} lies inside MoE layer {outer!r}; Plan.moe patterns must "
                             f"name disjoint modules")
    for pattern in plan.context:
        for n in matching([pattern], modules)[pattern]:
            if not hasattr(modules[n], "context"):
                raise ValueError(f"Plan.context[{pattern!r}] matches {n!r} ({type(modules[n]).__name__}), which "
                                 f"has no 'context' hook attribute; valid: attention modules that call "
                                 f"self.context(...) when it is set")


def _sample(names, n: int = 8) -> str:
    names = [x or "<root>" for x in names]
    return ", ".join(names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")
