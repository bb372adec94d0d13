"""Re-placing experts on a folded MoE layer: moving their weights and optimizer state between slots.

Legend: E = experts, n = E / ep slots per ep rank, m = slots this rank holds (n, or n / edp when
FSDP2 shards the expert dim over edp), X = the rest of a weight's (local) shape.

An *expert placement* is a tuple ``slots`` of length E, a permutation of ``range(E)``: slot
``s = r * n + j`` is local expert ``j`` of ep rank ``r`` and holds expert ``slots[s]``
(single-device id). The static placement is the identity. Routing stays in single-device ids;
the layer's comm maps each routed expert to its slot (:meth:`FoldedComm.slot_ids`), so an
expert's rows reach the rank that holds it, in the same order as under the static placement:
the layer computes the same numbers, only on another rank.

:func:`replace_experts` changes a layer's placement: every parameter of the layer laid out over
``ep`` on dim 0 (the routed experts' weights) and its AdamW state (``exp_avg``, ``exp_avg_sq``)
travel to their new slots in place, with all-to-alls over ``ep`` (and, when FSDP2 shards the
expert dim over ``edp``, a second one over ``edp``). Every other dim (``etp`` shards, an
``edp`` shard of a non-expert dim) is cut the same way for every expert, so each rank exchanges
with the ranks of its own ``(edp, etp)`` coordinates. AdamW's ``step`` counts one tensor of
experts together and is the same for all of them: it stays. Which placement to choose (from
measured loads) is decided above this layer (``meshfold.plan.placement.balanced``, applied by the
training loop); this file is the mechanism, given a plain tuple.

The DTensor of a re-placed expert weight holds the slots in order: its ``full_tensor()`` is in
slot order, and :func:`expert_order` puts such a tensor back into single-device order
(checkpoints and exports are in single-device order).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor, Shard

from meshfold.parallel.moe import FoldedComm, slot_of_expert
from meshfold.placements import all_to_all_v

__all__ = ["expert_params", "replace_experts", "expert_order", "slot_order", "placement_of", "in_expert_order", "folded_moe_layers"]


def placement_of(layer) -> tuple[int, ...]:
    """The layer's current placement (the identity when it is static)."""
    comm = layer.comm
    return comm.slots if comm.slots is not None else tuple(range(layer.cfg.num_experts))


def expert_params(layer) -> dict[str, torch.Tensor]:
    """``{name: parameter}`` of the layer's parameters laid out over ``ep`` on dim 0 (experts)."""
    comm = layer.comm
    names = comm.moe.mesh_dim_names
    out = {}
    for name, p in layer.named_parameters():
        # by dim names, not identity: DTensor's op cache may hand a parameter an equal mesh of
        # another fold built in the same process
        if isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == names:
            q = p.placements[names.index("ep")]
            if isinstance(q, Shard) and q.dim == 0:
                out[name] = p
    return out


def expert_order(t_E: torch.Tensor, slots: Sequence[int] | None) -> torch.Tensor:
    """A tensor in slot order (dim 0 = slots) -> single-device expert order."""
    if slots is None:
        return t_E
    return t_E[slot_of_expert(slots).to(t_E.device)]


def slot_order(t_E: torch.Tensor, slots: Sequence[int] | None) -> torch.Tensor:
    """A tensor in single-device expert order (dim 0 = experts) -> slot order under ``slots``."""
    return t_E if slots is None else t_E[torch.tensor(list(slots), device=t_E.device)]


def _held(slots, r: int, q: int, n: int, m: int) -> list[int]:
    """The experts rank (edp q, ep r) holds, in its local order."""
    return [slots[r * n + q * m + i] for i in range(m)]


def _exchange(x_MX, held: list[int], dest_of, me: int, group: int, peers_held, mesh, dim: str):
    """One all-to-all over mesh dim ``dim``: rows ``x_MX`` (experts ``held``) go to the rank
    ``dest_of(e)`` of the dim; returns (rows received, their experts, rows sent to others)."""
    order = sorted(range(len(held)), key=lambda i: dest_of(held[i]))  # stable: local order within a peer
    sends = [sum(1 for e in held if dest_of(e) == j) for j in range(group)]
    got = [[e for e in peers_held[j] if dest_of(e) == me] for j in range(group)]
    x = x_MX[torch.tensor(order, dtype=torch.int64, device=x_MX.device)]
    y = all_to_all_v(x, sends, [len(g) for g in got], mesh, dim)
    return y, [e for g in got for e in g], len(held) - sends[me]


@torch.no_grad()
def replace_experts(layer, new_slots: Sequence[int], optimizer: torch.optim.Optimizer | None = None) -> int:
    """Move the layer's experts to placement ``new_slots``: their weights and, when given, their
    AdamW state in ``optimizer`` (``exp_avg``, ``exp_avg_sq``), then route by it. A collective
    over the MoE mesh: every rank calls it with the same ``new_slots``, between steps (no
    gradients held). Returns the bytes this rank sent to other ranks.

    The move is exact (rows are copied, never recomputed): training after it computes what the
    static placement computes."""
    comm = layer.comm
    E = layer.cfg.num_experts
    new = tuple(int(e) for e in new_slots)
    if sorted(new) != list(range(E)) or E % comm.ep:
        raise ValueError(f"expert placement {list(new_slots)}; valid: a permutation of range({E}) "
                         f"(ep = {comm.ep} dividing it)")
    old = placement_of(layer)
    if new == old:
        return 0
    params = expert_params(layer)
    if not params:
        raise ValueError(f"the layer has no parameter laid out over ep on dim 0 to move "
                         f"(parameters: {[n for n, _ in layer.named_parameters()]})")
    tensors = []  # local views of every tensor that moves, dim 0 = this rank's slots
    for p in params.values():
        tensors.append(p.to_local())
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for key in sorted(state):
            v = state[key]
            if isinstance(v, torch.Tensor) and v.shape == p.shape:
                tensors.append(v.to_local() if isinstance(v, DTensor) else v)
            elif isinstance(v, torch.Tensor) and v.numel() > 1:
                raise ValueError(f"optimizer state {key!r} of shape {tuple(v.shape)} is neither the "
                                 f"parameter's shape {tuple(p.shape)} nor a scalar: cannot move it with the experts")
    n = E // comm.ep
    m = tensors[0].shape[0]
    if any(t.shape[0] != m for t in tensors) or n % m:
        raise ValueError(f"expert weights hold {[t.shape[0] for t in tensors]} local experts; valid: "
                         f"all alike, dividing the {n} slots of an ep rank")
    edp = n // m  # > 1: FSDP2 shards the expert dim over edp, rank q holds slots q * m ..
    r = comm.ep_rank
    q = comm.moe.get_local_rank("edp") if edp > 1 else 0
    if edp > 1 and edp != comm.moe.size(comm.moe.mesh_dim_names.index("edp")):
        raise ValueError(f"{m} of {n} local experts per rank, but edp = "
                         f"{comm.moe.size(comm.moe.mesh_dim_names.index('edp'))}; valid: the expert dim "
                         f"whole or split evenly over edp")
    new_slot_of = {e: s for s, e in enumerate(new)}
    sent = 0
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for idx in by_dtype.values():
        x = torch.cat([tensors[i].reshape(m, -1) for i in idx], dim=1)  # [m, X...] of every tensor
        held = _held(old, r, q, n, m)
        # hop 1, over ep: each expert to its new ep rank, keeping its edp coordinate
        x, held, rows = _exchange(x, held, lambda e: new_slot_of[e] // n, r, comm.ep,
                                  [_held(old, j, q, n, m) for j in range(comm.ep)], comm.moe, "ep")
        sent += rows * x.shape[1] * x.element_size()
        if edp > 1:  # hop 2, over edp: to its new edp coordinate within the ep rank
            after_hop1 = [[e for j in range(comm.ep) for e in _held(old, j, g, n, m) if new_slot_of[e] // n == r]
                          for g in range(edp)]
            x, held, rows = _exchange(x, held, lambda e: (new_slot_of[e] % n) // m, q, edp, after_hop1,
                                      comm.moe, "edp")
            sent += rows * x.shape[1] * x.element_size()
        want = _held(new, r, q, n, m)
        at = {e: i for i, e in enumerate(held)}
        x = x[torch.tensor([at[e] for e in want], dtype=torch.int64, device=x.device)]
        offset = 0
        for i in idx:
            width = tensors[i][0].numel() if m else 0
            tensors[i].copy_(x[:, offset:offset + width].reshape(tensors[i].shape))
            offset += width
    comm.set_slots(new)
    return sent


def folded_moe_layers(model) -> list:
    """The MoE layers of ``model`` (a parallelized model or a Pipeline) laid out on a fold."""
    layers = model.moe_layers() if hasattr(model, "moe_layers") else model.modules()
    return [m for m in layers if isinstance(getattr(m, "comm", None), FoldedComm)]


@contextmanager
def in_expert_order(model, optimizer: torch.optim.Optimizer | None = None):
    """Inside the block every MoE layer of ``model`` (a parallelized model or a Pipeline) holds
    its experts in the static placement, so the DTensors of their weights and AdamW state are in
    single-device expert order (a checkpoint's order, which any fold and either placement can
    read); on leaving, each layer's placement is restored. Moves weights only for layers that are
    re-placed (a collective over the MoE mesh, on every rank)."""
    placed = [(layer, layer.comm.slots) for layer in folded_moe_layers(model) if layer.comm.slots is not None]
    for layer, _ in placed:
        replace_experts(layer, range(layer.cfg.num_experts), optimizer)
    try:
        yield
    finally:
        for layer, slots in placed:
            replace_experts(layer, slots, optimizer)
