"""Initialization that does not depend on the fold: each rank draws only the shards it keeps.

Every module declares how each of its tensors starts, with :func:`normal_`, :func:`ones_` or
:func:`zeros_` instead of ``nn.init``. A model built on the meta device records those
declarations (:func:`declared_inits`), is laid out on any fold while still on meta, and then
:func:`materialize` fills every tensor -- a whole tensor, or just the shard of a DTensor this rank
holds, whatever its placements (TP / EP / ETP slices, FSDP2 shards, strided shards) -- with values
that depend only on ``(seed, single-device name, global position)``. So:

* the global parameters equal, bitwise, those of the same model built whole on one device with the
  same seed, on every fold and pipeline split (``full_state_dict`` checks it);
* no rank allocates a whole parameter it does not keep: its shards, plus one slab at a time.

How values are drawn: a tensor of shape ``(d0, ..., dn)`` is cut, in row-major order, into *slabs*
of whole rows of its trailing dims ``(dk, ..., dn)`` (``k`` the first dim whose trailing product
is at most :data:`SLAB` elements), as many rows per slab as fit in SLAB. Slab ``j`` of tensor
``name`` is one ``normal_`` call of a CPU generator seeded by ``hash(seed, name, j)``. The slab
geometry is a function of the global shape alone, so any rank can redraw any slab and gets the
same numbers; a rank draws each slab its shard touches once and keeps its rows and columns. Values
are drawn in fp32 and rounded to the tensor's dtype (an fp64 model starts from fp32-representable
values, as a bf16 one from rounded ones), and drawn on the CPU, so a GPU run starts from the same
weights as a CPU run.

Example::

    model = MoETransformer(cfg, device="meta", seed=0)     # no memory for weights yet
    parallelize(model, fold(spec))                         # lays out, then materializes shards
    # equals: MoETransformer(cfg, seed=0), built whole, then parallelized
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Init", "SLAB", "normal_", "ones_", "zeros_", "declared_inits", "draw_seed", "materialize",
           "whole", "fill_"]

SLAB = 1 << 20  # elements per slab: 4 MiB of fp32 drawn at a time, whatever the tensor's size

_ATTR = "_meshfold_init"


@dataclass(frozen=True)
class Init:
    """How a tensor starts: ``kind`` "normal" (mean 0, std ``value``) or "constant" (``value``)."""

    kind: str
    value: float


def normal_(t: torch.Tensor, std: float) -> torch.Tensor:
    """Declare ``t ~ N(0, std^2)``. Off the meta device ``t`` is also filled now from the global
    RNG, so a module built on its own behaves as with ``nn.init.normal_``; inside a model built
    with :func:`materialize` the fold-independent draw replaces it."""
    setattr(t, _ATTR, Init("normal", float(std)))
    if not t.is_meta:
        nn.init.normal_(t, std=std)
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


def declared_inits(module: nn.Module) -> dict[str, Init]:
    """``{name: Init}`` of every parameter and buffer of ``module`` (built, not yet laid out).
    Raises ``ValueError`` naming any tensor that declared nothing, since it could not be
    materialized."""
    out, missing = {}, []
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        init = getattr(t, _ATTR, None)
        if init is None:
            missing.append(name)
        out[name] = init
    if missing:
        raise ValueError(f"tensors {missing} declare no initialization; create them with "
                         f"meshfold.models.init.normal_ / ones_ / zeros_")
    return out


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
        return
    if init.kind != "normal":
        raise ValueError(f"{name}: init kind {init.kind!r}; valid: 'normal', 'constant'")
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
        slab = torch.empty((r1 - r0) * inner, dtype=torch.float32).normal_(0.0, init.value, generator=g)
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
    """Give every tensor of ``module`` (all on the meta device) storage on ``device`` and fill it
    from ``inits`` (keyed by single-device name; ``name_of`` maps a tensor's name to it).
    ``local(t)`` is the storage to fill and ``indices(t)`` the global indices it holds per dim
    (:func:`fill_`): the whole tensor here; for a laid-out model, each rank's shard
    (:func:`meshfold.parallel.materialize.materialize_shards`)."""
    module.to_empty(device=device)
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        key = name_of(name)
        if key not in inits:
            raise KeyError(f"{name} (single-device name {key!r}) has no declared initialization")
        fill_(local(t), inits[key], seed, key, tuple(t.shape), indices(t))
