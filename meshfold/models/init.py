"""Initialization that does not depend on the fold: each rank draws only the shards it keeps.

Every tensor of a model says how it starts (:func:`declared_inits`, the protocol
``docs/models.md`` describes): a declaration made with :func:`normal_`, :func:`uniform_`,
:func:`ones_` or :func:`zeros_` instead of ``nn.init``; else, for a parameter of a module torch
ships whose ``reset_parameters`` is torch's own, that initialization (:data:`TORCH_DEFAULTS`);
for a buffer, the values it was built with (copied) or its module's ``reset_buffers()``
(recomputed). A model built on the meta device (:func:`build`) records those declarations, is
laid out on any fold while still on meta, and then :func:`materialize` fills every tensor -- a
whole tensor, or just the shard of a DTensor this rank holds, whatever its placements (TP / EP /
ETP slices, FSDP2 shards, strided shards) -- with values that depend only on ``(seed,
single-device name, global position)``. So:

* the global parameters equal, bitwise, those of the same model built whole on one device with the
  same seed, on every fold and pipeline split (``full_state_dict`` checks it);
* no rank allocates a whole parameter it does not keep: its shards, plus one slab at a time.

How values are drawn: a tensor of shape ``(d0, ..., dn)`` is cut, in row-major order, into *slabs*
of whole rows of its trailing dims ``(dk, ..., dn)`` (``k`` the first dim whose trailing product
is at most :data:`SLAB` elements), as many rows per slab as fit in SLAB. Slab ``j`` of tensor
``name`` is one ``normal_`` (or ``uniform_``) call of a CPU generator seeded by ``hash(seed, name, j)``. The slab
geometry is a function of the global shape alone, so any rank can redraw any slab and gets the
same numbers; a rank draws each slab its shard touches once and keeps its rows and columns. Values
are drawn in fp32 and rounded to the tensor's dtype (an fp64 model starts from fp32-representable
values, as a bf16 one from rounded ones), and drawn on the CPU, so a GPU run starts from the same
weights as a CPU run.

Example::

    model = MoETransformer(cfg, device="meta", seed=0)     # no memory for weights yet
    parallelize(model, fold(spec))                         # lays out, then materializes shards
    # equals: MoETransformer(cfg, seed=0), built whole, then parallelized

    mine = build(lambda: MyModel(cfg), seed=0, device="meta")   # a user's own model, the same way
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

__all__ = ["Init", "SLAB", "TORCH_DEFAULTS", "normal_", "uniform_", "ones_", "zeros_", "declared_inits", "tied_parameters",
           "draw_seed", "build", "materialize", "whole", "fill_"]

SLAB = 1 << 20  # elements per slab: 4 MiB of fp32 drawn at a time, whatever the tensor's size

_ATTR = "_meshfold_init"


KINDS = ("normal", "uniform", "constant", "copy", "recompute")


@dataclass(frozen=True)
class Init:
    """How a tensor starts. ``kind``: "normal" (mean 0, std ``value``), "uniform" (on
    ``[-value, value]``), "constant" (``value``), "copy" (a buffer's own values, ``data``, the
    same on every rank) or "recompute" (a buffer its module's ``reset_buffers()`` computes).
    ``zero_rows``: indices along dim 0 set to 0 after the draw (``nn.Embedding``'s
    ``padding_idx``)."""

    kind: str
    value: float = 0.0
    zero_rows: tuple[int, ...] = ()
    data: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Init kind {self.kind!r}; valid: {', '.join(map(repr, KINDS))}")
        if (self.kind == "copy") != (self.data is not None):
            raise ValueError(f"Init kind {self.kind!r} with data={'a tensor' if self.data is not None else None}: "
                             f"'copy' and only 'copy' carries the values it copies")


def normal_(t: torch.Tensor, std: float) -> torch.Tensor:
    """Declare ``t ~ N(0, std^2)``. Off the meta device ``t`` is also filled now from the global
    RNG, so a module built on its own behaves as with ``nn.init.normal_``; inside a model built
    with :func:`materialize` the fold-independent draw replaces it."""
    setattr(t, _ATTR, Init("normal", float(std)))
    if not t.is_meta:
        nn.init.normal_(t, std=std)
    return t


def uniform_(t: torch.Tensor, bound: float) -> torch.Tensor:
    """Declare ``t ~ U(-bound, bound)`` (and, off the meta device, fill it now, as :func:`normal_`)."""
    setattr(t, _ATTR, Init("uniform", float(bound)))
    if not t.is_meta:
        nn.init.uniform_(t, -bound, bound)
    return t


def _constant(t: torch.Tensor, value: float) -> torch.Tensor:
    setattr(t, _ATTR, Init("constant", float(value)))
    if not t.is_meta:
        with torch.no_grad():
            t.fill_(value)
    return t


def ones_(t: torch.Tensor) -> torch.Tensor:
    """Declare (and fill) ``t = 1`` (norm weights, tile masks)."""
    return _constant(t, 1.0)


def zeros_(t: torch.Tensor) -> torch.Tensor:
    """Declare (and fill) ``t = 0`` (biases, the expert-bias buffer)."""
    return _constant(t, 0.0)


def _linear(m: nn.Linear) -> dict[str, Init]:
    # nn.Linear.reset_parameters: kaiming_uniform_(a=sqrt(5)) on the weight, whose bound
    # gain * sqrt(3 / fan_in) is 1 / sqrt(fan_in); the bias on the same bound
    fan_in = m.in_features
    bound = 0.0 if fan_in == 0 else nn.init.calculate_gain("leaky_relu", math.sqrt(5)) * math.sqrt(3 / fan_in)
    return {"weight": Init("uniform", bound), "bias": Init("uniform", 0.0 if fan_in == 0 else fan_in ** -0.5)}


def _embedding(m: nn.Embedding) -> dict[str, Init]:
    # nn.Embedding.reset_parameters: N(0, 1), then the padding row zeroed
    return {"weight": Init("normal", 1.0, zero_rows=() if m.padding_idx is None else (m.padding_idx,))}


def _norm(m: nn.Module) -> dict[str, Init]:
    return {"weight": Init("constant", 1.0), "bias": Init("constant", 0.0)}


# torch modules whose parameters start as their own reset_parameters would start them, with the
# same distributions (drawn fold-independently here, so not the same numbers as torch's RNG)
TORCH_DEFAULTS: dict[type, Callable[[nn.Module], dict[str, Init]]] = {
    nn.Linear: _linear,
    nn.Embedding: _embedding,
    nn.LayerNorm: _norm,
    nn.RMSNorm: _norm,
    nn.GroupNorm: _norm,
}


def _torch_default(module: nn.Module) -> dict[str, Init]:
    """The inits of ``module``'s own parameters under :data:`TORCH_DEFAULTS`: for a subclass only
    if it keeps torch's ``reset_parameters`` (one that overrides it initializes differently)."""
    for cls, rule in TORCH_DEFAULTS.items():
        if isinstance(module, cls) and type(module).reset_parameters is cls.reset_parameters:
            return rule(module)
    return {}


def declared_inits(module: nn.Module) -> dict[str, Init]:
    """``{name: Init}`` of every parameter and buffer of ``module`` (built, not yet laid out),
    under the protocol of the module docstring: a tensor's own declaration first; a parameter of
    a torch module in :data:`TORCH_DEFAULTS`; a buffer that holds values ("copy") or on the meta
    device whose module has ``reset_buffers()`` ("recompute"). Raises ``ValueError`` naming every
    tensor (and its module's class) that none of these covers, since it could not be
    materialized."""
    found: dict[int, Init] = {}
    owner: dict[int, nn.Module] = {}
    for _, m in module.named_modules():
        defaults = _torch_default(m)
        for attr, p in m.named_parameters(recurse=False):
            owner.setdefault(id(p), m)
            if attr in defaults:
                found.setdefault(id(p), defaults[attr])
        for attr, b in m.named_buffers(recurse=False):
            owner.setdefault(id(b), m)
            if not b.is_meta:
                found.setdefault(id(b), Init("copy", data=b.detach()))
            elif callable(getattr(m, "reset_buffers", None)):
                found.setdefault(id(b), Init("recompute"))
    out, missing = {}, []
    params = dict(module.named_parameters())
    for name, t in list(params.items()) + list(module.named_buffers()):
        init = getattr(t, _ATTR, None) or found.get(id(t))
        if init is None:
            missing.append(f"{name} ({type(owner[id(t)]).__name__})")
        out[name] = init
    if missing:
        raise ValueError(
            f"tensors {missing} declare no initialization: declare each with meshfold.models.init."
            f"normal_ / uniform_ / ones_ / zeros_ where its module creates it, use a torch module "
            f"meshfold initializes as torch does ({', '.join('nn.' + c.__name__ for c in TORCH_DEFAULTS)}, "
            f"its reset_parameters not overridden), or, for a buffer, build it with values (copied) or "
            f"give its module a reset_buffers() method (recomputed); see docs/models.md. A declaration "
            f"belongs to the tensor it was made on: nn.Parameter(init.normal_(torch.empty(...), std)) is a new "
            f"tensor without it; declare the Parameter itself, init.normal_(nn.Parameter(torch.empty(...)), std)")
    return out


def tied_parameters(module: nn.Module) -> list[list[str]]:
    """The names of each parameter ``module`` holds under more than one name (a tie such as
    ``lm_head.weight = embed.weight``, or a module registered in two places), each list in
    ``named_parameters`` order (its first name is the one ``named_parameters()`` gives); []
    if none."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [n for n in names.values() if len(n) > 1]


def draw_seed() -> int:
    """A model seed from the global CPU generator (so ``torch.manual_seed`` fixes the model)."""
    return int(torch.randint(0, 2 ** 62, (), device="cpu"))


def _slab_seed(seed: int, name: str, j: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{j}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # a non-negative 63-bit seed


def _slabs(shape) -> tuple[int, int, int]:
    """``(k, inner, rows)``: slabs are ``rows`` consecutive rows of the trailing dims
    ``shape[k:]`` (``inner`` elements each), at most SLAB elements when a row fits."""
    k = len(shape)
    while k > 0 and math.prod(shape[k - 1:]) <= SLAB:
        k -= 1
    if k == len(shape) and k > 0:  # even the last dim alone is larger than a slab
        k -= 1
    inner = math.prod(shape[k:])
    return k, inner, max(1, SLAB // max(inner, 1))


@torch.no_grad()
def fill_(local: torch.Tensor, init: Init, seed: int, name: str, shape, indices: list[torch.Tensor]) -> None:
    """Fill ``local`` (the part of global tensor ``name`` of ``shape`` at ``indices``, see
    :func:`meshfold.parallel.materialize.shard_indices`) with its values under ``init``: the same
    numbers whichever rank, fold or device does it."""
    if init.kind == "constant":
        local.fill_(init.value)
    elif init.kind == "copy":
        if tuple(init.data.shape) != tuple(shape):
            raise ValueError(f"{name}: copies values of shape {tuple(init.data.shape)} into a tensor of "
                             f"shape {tuple(shape)}")
        part = init.data[torch.meshgrid(*indices, indexing="ij")] if indices else init.data
        local.copy_(part)
    elif init.kind == "recompute":
        raise ValueError(f"{name}: recomputed by its module's reset_buffers(), not drawn (materialize calls it)")
    else:
        _draw(local, init, seed, name, shape, indices)
    if init.zero_rows and local.numel():
        rows = torch.isin(indices[0], torch.tensor(init.zero_rows, dtype=torch.long)).nonzero().flatten()
        local[rows.to(local.device)] = 0


def _draw(local, init: Init, seed: int, name: str, shape, indices) -> None:
    """The "normal" and "uniform" kinds: each slab one call of a generator seeded by its index."""
    if local.numel() == 0:
        return
    k, inner, rows = _slabs(shape)
    lead = torch.zeros((), dtype=torch.long)  # flat row-major index over dims < k of each local row
    for d in range(k):
        lead = lead.unsqueeze(-1) * shape[d] + indices[d]
    lead = lead.reshape(-1)
    out = local.view(lead.numel(), *local.shape[k:])  # [local rows, local trailing dims]
    n_rows = math.prod(shape[:k])
    slab_of = lead // rows
    for j in torch.unique(slab_of).tolist():
        r0, r1 = j * rows, min((j + 1) * rows, n_rows)
        g = torch.Generator().manual_seed(_slab_seed(seed, name, j))
        slab = torch.empty((r1 - r0) * inner, dtype=torch.float32)
        if init.kind == "normal":
            slab.normal_(0.0, init.value, generator=g)
        else:
            slab.uniform_(-init.value, init.value, generator=g)
        slab = slab.view(r1 - r0, *shape[k:])
        mine = (slab_of == j).nonzero().flatten()  # local rows in this slab
        part = slab[lead[mine] - r0]
        for d in range(k, len(shape)):  # keep this shard's columns of the trailing dims
            if len(indices[d]) != shape[d]:
                part = part.index_select(1 + d - k, indices[d])
        out[mine] = part.to(device=local.device, dtype=local.dtype)


def whole(t: torch.Tensor) -> list[torch.Tensor]:
    """Per dim, every global index: what a tensor held whole (not laid out) covers."""
    return [torch.arange(n) for n in t.shape]


def materialize(module: nn.Module, inits: dict[str, Init], seed: int, device,
                name_of=lambda name: name, local=lambda t: t, indices=whole) -> None:
    """Give every tensor of ``module`` (on the meta device, or a buffer holding its values)
    storage on ``device`` and fill it from ``inits`` (keyed by single-device name; ``name_of``
    maps a tensor's name to it). ``local(t)`` is the storage to fill and ``indices(t)`` the
    global indices it holds per dim (:func:`fill_`): the whole tensor here; for a laid-out
    model, each rank's shard (:func:`meshfold.parallel.materialize.materialize_shards`). Then
    every module with a "recompute" buffer runs its ``reset_buffers()`` (such a buffer must be
    held whole: it is computed whole)."""
    ties = tied_parameters(module)
    module.to_empty(device=device)  # gives each name its own tensor: tie the aliases again
    for source, *aliases in ties:
        for alias in aliases:
            path, _, attr = alias.rpartition(".")
            setattr(module.get_submodule(path), attr, module.get_parameter(source))
    recompute = {}
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        key = name_of(name)
        if key not in inits:
            raise KeyError(f"{name} (single-device name {key!r}) has no declared initialization")
        if inits[key].kind == "recompute":
            if local(t) is not t:
                raise ValueError(f"{key}: a buffer recomputed by reset_buffers() must be held whole on "
                                 f"every rank, but it is laid out as {type(t).__name__}")
            owner = name.rpartition(".")[0]
            recompute[owner] = module.get_submodule(owner)
            continue
        fill_(local(t), inits[key], seed, key, tuple(t.shape), indices(t))
    with torch.no_grad():
        for m in recompute.values():
            m.reset_buffers()


def build(make: Callable[[], nn.Module], seed: int | None = None, device=None) -> nn.Module:
    """``make()`` (a model's constructor, any ``nn.Module``) run on the meta device, its
    declarations recorded (``model.inits``: :func:`declared_inits`, ``model.init_seed``:
    ``seed``, default :func:`draw_seed`), then, unless ``device`` is ``"meta"``, materialized
    whole on ``device`` (default: torch's default device). Built on meta and handed to
    ``parallelize``, each rank materializes only its shards, with the same global values as
    ``build(make, seed)`` on one device: on every fold, bitwise."""
    with torch.device("meta"):
        model = make()
    if not isinstance(model, nn.Module):
        raise TypeError(f"build: make() returned a {type(model).__name__}; valid: an nn.Module")
    model.init_seed = draw_seed() if seed is None else seed
    model.inits = declared_inits(model)
    device = torch.device(device) if device is not None else torch.get_default_device()
    if device.type != "meta":
        materialize(model, model.inits, model.init_seed, device)
    return model
