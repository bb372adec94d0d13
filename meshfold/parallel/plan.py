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

import dataclasses
import fnmatch
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import Placement

from meshfold.models.init import tied_parameters

__all__ = ["Plan", "SequenceParallel", "VocabParallel", "VOCAB_KINDS", "Resolved", "CONTEXT_HOOKS", "matches", "first_match", "matching", "check_plan", "resolve", "restrict",
           "moe_layers", "owner", "register_plan", "model_plan", "check_fold_fit", "tied_parameters"]

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


VOCAB_KINDS = ("embedding", "head")


@dataclass(frozen=True)
class VocabParallel:
    """Vocabulary parallelism of an embedding or an output head whose weight [V, H] the plan
    shards over ``tp`` along the vocabulary (``Shard(0)`` on tp), with sequence parallelism
    around it, so each tp rank stores and computes V / tp rows:

    * ``"embedding"``: ``forward(ids [B, S]) -> [B, S, H]``, a lookup of the weight's rows
      (``F.embedding``, no ``padding_idx``). The tp group's ids are all-gathered, each rank looks
      up the ids of its own rows (the others give zero rows) and the sum over tp is
      reduce-scattered back to each rank's tokens.
    * ``"head"``: ``forward(x [B, S, H]) -> logits [B, S, V]`` with the weight as nn.Linear's.
      The tp group's tokens are all-gathered, each rank computes its V / tp logits of all of
      them, and the logits are all-gathered over the vocabulary, each rank keeping its own
      tokens' rows [B, S, V] (a transient [B, S * tp, V] per rank), so the loss is computed as
      without it."""

    kind: str

    def __post_init__(self):
        if self.kind not in VOCAB_KINDS:
            raise ValueError(f"VocabParallel(kind={self.kind!r}); valid: {list(VOCAB_KINDS)}")


@dataclass(frozen=True)
class Plan:
    """How a model is laid out (see the module docstring for the pattern syntax).

    * ``params``: parameter pattern -> placements over the attention mesh ``(dp, cp, tp)``
      (``Replicate()`` / ``Shard(d)`` each); the first matching entry wins. Parameters of MoE
      layers (``moe``) take their layer's table instead.
    * ``default``: placements of parameters no entry matches; None: such a parameter is an error.
    * ``tp``: module pattern -> :class:`SequenceParallel` or :class:`VocabParallel` (applied
      when ``tp > 1``).
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
      the path of the block list (an ``nn.ModuleList`` or ``nn.ModuleDict``) and the paths of
      the modules run before the blocks (first stage) and after them (last stage), in order
      (paths, not patterns).
    * ``token_ids``: for :class:`~meshfold.parallel.pipeline.Pipeline`, the keyword under which
      each block gets the ids [b, s] of its tokens (e.g. for a hash router: ``block(x, positions,
      token_ids=...)``); None: blocks are called ``block(x, positions)``.
    * ``per_token``: keyword names of the model's other per-token inputs (a segment or language
      id per token, say): tensors [B, S, ...] laid out like the tokens (``shard_batch`` each),
      which the model's ``loss`` takes as keywords and passes to its blocks. ``Pipeline.step``
      takes them under these names and hands every stage's blocks their microbatch's slice
      (``block(x, positions, name=[b, s, ...])``); an ``MoELayer`` given them as keywords
      flattens them to [T, ...] for its router.
    * ``check``: optional ``check(spec)`` raising ``ValueError`` naming a model size that does
      not divide over a :class:`~meshfold.mesh.FoldSpec` (heads over tp, ...).
    * ``whole``: the plan lays out a whole model that runs with ``pp > 1`` only as a
      :class:`~meshfold.parallel.pipeline.Pipeline` of its blocks, so
      :func:`~meshfold.parallel.transformer.parallelize` refuses it on a fold with pp != 1 rather
      than lay every layer out on every stage. A chunk's plan (:func:`restrict`) has it False.
    """

    params: Mapping[str, tuple] = field(default_factory=dict)
    default: tuple | None = None
    tp: Mapping[str, SequenceParallel | VocabParallel] = field(default_factory=dict)
    context: Mapping[str, str] = field(default_factory=dict)
    moe: Mapping[str, Mapping] = field(default_factory=dict)
    fsdp: tuple[str, ...] = ()
    tp_summed: tuple[str, ...] = ()
    recompute: tuple[str, ...] = ()
    keep_dtype: Mapping[str, torch.dtype | None] = field(default_factory=dict)
    blocks: str | None = None
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    token_ids: str | None = None
    per_token: tuple[str, ...] = ()
    check: Callable | None = None
    whole: bool = False

    def __post_init__(self):
        for name in ("fsdp", "tp_summed", "recompute", "before", "after", "per_token"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, Iterable):
                raise TypeError(f"Plan.{name} = {value!r}; valid: a tuple of patterns")
            object.__setattr__(self, name, tuple(value))
        for name in self.per_token:
            if not (isinstance(name, str) and name.isidentifier()) or name in ("positions", self.token_ids):
                raise ValueError(f"Plan.per_token names {name!r}; valid: keyword names other than 'positions' "
                                 f"and Plan.token_ids ({self.token_ids!r})")
        for pattern, placements in list(self.params.items()) + ([("default", self.default)] if self.default else []):
            _check_placements(f"Plan.params[{pattern!r}]" if pattern != "default" else "Plan.default", placements)
        for pattern, sp in self.tp.items():
            if not isinstance(sp, (SequenceParallel, VocabParallel)):
                raise TypeError(f"Plan.tp[{pattern!r}] = {sp!r}; valid: a SequenceParallel(...) or a "
                                f"VocabParallel(...)")
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


TIE_ADVICE = ("a layout places each parameter under one name, so one parameter under two names would "
              "become two copies whose gradients are never summed; tie by reading the embedding's weight "
              "where the head is computed, with no second Parameter (e.g. logits = F.linear(x, "
              "self.embed.weight) in the model's own code, as MoETransformer(tie_embeddings=True) does; "
              "pp = 1 only), or untie them")


def check_plan(model: nn.Module, plan: Plan) -> None:
    """Raise ``ValueError`` for anything of ``plan`` that does not fit ``model``: a pattern that
    matches nothing (for a piece of a model, check the whole and :func:`restrict` the plan), a
    parameter no entry places and no ``default`` covers, a parameter held under two names
    (tied, :func:`~meshfold.models.init.tied_parameters`), an MoE
    layer inside another, a ``context`` module without a ``context`` attribute, a ``blocks``
    path that is not a module list."""
    if tied := tied_parameters(model):
        raise ValueError(f"parameters {tied[0]} of {type(model).__name__} are one tensor (tied): {TIE_ADVICE}")
    modules = dict(model.named_modules())
    params = [n for n, _ in model.named_parameters()]
    layers = moe_layers(model, plan)
    dense = [n for n in params if _under(n, layers) is None]
    where = "the model's modules"
    module_rules = [("tp", list(plan.tp)), ("context", list(plan.context)), ("moe", list(plan.moe)),
                    ("fsdp", plan.fsdp), ("tp_summed", plan.tp_summed), ("recompute", plan.recompute)]
    for field_name, patterns in module_rules:
        for pattern, found in matching(patterns, modules).items():
            if not found:
                raise ValueError(f"Plan.{field_name} pattern {pattern!r} matches none of {where} "
                                 f"({_sample(modules)})")
    for path, pattern in layers.items():  # else its parameters would be blamed on Plan.params
        own = [n for n, _ in modules[path].named_parameters()]
        if not any(n in plan.moe[pattern] for n in own):
            raise ValueError(f"Plan.moe pattern {pattern!r} matches {path!r}, a {type(modules[path]).__name__} "
                             f"that is not an MoE layer: none of its parameters ({', '.join(own[:4]) or 'none'}) "
                             f"is in the pattern's layout table ({', '.join(list(plan.moe[pattern])[:4])}); valid: "
                             f"patterns of MoE layers only")
    for pattern, found in matching(plan.params, dense).items():
        if not found:
            raise ValueError(f"Plan.params pattern {pattern!r} matches no parameter outside the MoE "
                             f"layers ({_sample(dense)})")
    for pattern, found in matching(plan.keep_dtype, params).items():
        if not found:
            raise ValueError(f"Plan.keep_dtype pattern {pattern!r} matches no parameter ({_sample(params)})")
    for field_name in ("before", "after"):
        for path in getattr(plan, field_name):
            if path not in modules:
                raise ValueError(f"Plan.{field_name} names {path!r}, which is no module of the model "
                                 f"({_sample(modules)}); valid: module paths (not patterns)")
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


@dataclass
class Resolved:
    """A plan resolved against one model: concrete single-device paths for every rule."""

    placements: dict[str, tuple]  # parameter outside the MoE layers -> placements over attn
    moe: dict[str, dict]  # MoE layer path -> its layout table
    tp: dict[str, SequenceParallel | VocabParallel]
    context: dict[str, str]
    fsdp: list[str]
    tp_summed: list[str]
    recompute: list[str]
    keep: dict[str, torch.dtype | None]  # every kept parameter (MoE layers' too) -> its dtype

    def layer_of(self, name: str) -> str | None:
        """The MoE layer parameter ``name`` belongs to, else None."""
        return _under(name, self.moe)


def resolve(model: nn.Module, plan: Plan) -> Resolved:
    """``plan`` applied to ``model``'s paths (after :func:`check_plan`, which raises for what
    does not fit). Module rules name modules, in ``named_modules()`` order."""
    check_plan(model, plan)
    modules = [n for n, _ in model.named_modules()]
    layers = moe_layers(model, plan)

    def select(patterns):
        return [n for n in modules if first_match(patterns, n) is not None]

    placements = {}
    for n, _ in model.named_parameters():
        if _under(n, layers) is None:
            pattern = first_match(plan.params, n)
            placements[n] = plan.default if pattern is None else plan.params[pattern]
    return Resolved(
        placements=placements,
        moe={n: dict(plan.moe[p]) for n, p in layers.items()},
        tp={n: plan.tp[first_match(plan.tp, n)] for n in select(plan.tp)},
        context={n: plan.context[first_match(plan.context, n)] for n in select(plan.context)},
        fsdp=select(plan.fsdp), tp_summed=select(plan.tp_summed), recompute=select(plan.recompute),
        keep={n: plan.keep_dtype[p] for n, _ in model.named_parameters()
              if (p := first_match(plan.keep_dtype, n)) is not None})


def check_fold_fit(model: nn.Module, resolved: Resolved, spec) -> None:
    """Raise ``ValueError`` for a plan that fits ``model`` but would compute other numbers than
    one device on a fold of ``spec`` (a :class:`~meshfold.mesh.FoldSpec`), naming the module or
    parameter and the plan entry missing or wrong: with ``cp > 1`` a module with a ``context`` hook (attribute None) no ``context`` entry sets,
    whose attention would see only its rank's tokens; a ``SequenceParallel`` module holding an
    MoE layer, whose routed output the tp group would sum tp times; with ``tp > 1`` a parameter
    sharded over ``tp`` outside every ``tp`` entry, whose module would compute with its shard of
    the weight on its own tokens only."""
    modules = dict(model.named_modules())
    if spec.cp > 1:
        for path, m in modules.items():
            if getattr(m, "context", False) is None and path not in resolved.context:
                raise ValueError(f"cp = {spec.cp}: {path or '<root>'!r} ({type(m).__name__}) has a context hook "
                                 f"('context' attribute None) but no Plan.context entry matches it, so its "
                                 f"attention would see only this rank's tokens; add Plan(context={{{path!r}: "
                                 f"'ring'}}) (or 'latent' for MLA)")
    for path, entry in resolved.tp.items():
        if isinstance(entry, SequenceParallel):
            inner = [n for n in resolved.moe if n == path or n.startswith(path + ".")]
            if inner:
                raise ValueError(f"Plan.tp[{path!r}] = {entry!r} holds the MoE layer {inner[0]!r}: the tp group's "
                                 f"tokens would all reach each tp rank's copy of it and its output be summed tp "
                                 f"times; put SequenceParallel on the attention / dense modules only (MoE "
                                 f"layers run on the local tokens)")
    if spec.tp > 1:
        tp_dim = 2  # placements over (dp, cp, tp)
        for name, placements in resolved.placements.items():
            module = owner(name)[0]
            covered = any(module == p or module.startswith(p + ".") for p in resolved.tp)
            if not covered and not placements[tp_dim].is_replicate():
                raise ValueError(f"tp = {spec.tp}: parameter {name!r} is laid out {placements[tp_dim]} over tp "
                                 f"(Plan.params) but no Plan.tp entry covers {module or '<root>'!r} or a module "
                                 f"above it, so it would compute on this rank's shard of the weight with this "
                                 f"rank's tokens only; add Plan(tp={{{module!r}: SequenceParallel(...)}}) "
                                 f"around the module that reads it, or replicate it over tp")


def restrict(plan: Plan, part: nn.Module) -> Plan:
    """``plan`` without the entries that match nothing in ``part``, a piece of the model ``plan``
    was checked against (:func:`check_plan`), e.g. one pipeline chunk, whose parameters and modules
    keep the whole model's names."""
    modules = [n for n, _ in part.named_modules()]
    params = [n for n, _ in part.named_parameters()]

    def keep(patterns, names):
        return [p for p in patterns if any(matches(p, n) for n in names)]

    def keep_map(table, names):
        return {p: table[p] for p in keep(table, names)}

    layers = {n for n in modules if first_match(plan.moe, n) is not None}
    dense = [n for n in params if _under(n, layers) is None]
    return dataclasses.replace(
        plan, params=keep_map(plan.params, dense), tp=keep_map(plan.tp, modules),
        context=keep_map(plan.context, modules), moe=keep_map(plan.moe, modules),
        fsdp=tuple(keep(plan.fsdp, modules)), tp_summed=tuple(keep(plan.tp_summed, modules)),
        recompute=tuple(keep(plan.recompute, modules)), keep_dtype=keep_map(plan.keep_dtype, params),
        before=tuple(p for p in plan.before if p in modules), after=tuple(p for p in plan.after if p in modules),
        whole=False)


# model class -> the function giving its plan: for classes that cannot declare ``plan()`` themselves
_DEFAULT_PLANS: dict[type, Callable[[nn.Module], Plan]] = {}


def register_plan(cls: type, make: Callable[[nn.Module], Plan]) -> None:
    """Make ``make(model)`` the plan of every ``cls`` model (subclasses included) that declares no
    ``plan()`` method of its own: for a model class defined where the parallel package may not be
    imported (meshfold's own models are single-device code: :mod:`meshfold.parallel.transformer_plan`
    registers theirs)."""
    if not isinstance(cls, type) or not callable(make):
        raise TypeError(f"register_plan({cls!r}, {make!r}); valid: a class and a function model -> Plan")
    _DEFAULT_PLANS[cls] = make


def model_plan(model: nn.Module) -> Plan:
    """``model``'s own plan: ``model.plan()`` if it declares one, else the plan registered for its
    class (:func:`register_plan`; the nearest base class's), else ``ValueError``."""
    if callable(getattr(model, "plan", None)):
        return model.plan()
    make = next((_DEFAULT_PLANS[c] for c in type(model).__mro__ if c in _DEFAULT_PLANS), None)
    if make is None:
        raise ValueError(f"{type(model).__name__} declares no layout plan (no plan() method, none registered); "
                         f"pass one: parallelize(model, folded, Plan(params=..., ...)) (meshfold.parallel.plan.Plan)")
    return make(model)
