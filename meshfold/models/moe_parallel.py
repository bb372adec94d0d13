"""How an MoE layer runs on a FoldedMesh: its layout as data, and the collectives it needs.

The layer itself (:mod:`meshfold.models.moe`) is single-device code that asks a *comm* object for
five things: the local shard of each parameter, sums of token statistics over attention dims,
gathering routing over ``(cp, tp)`` for full-sequence dropping, the dispatch / combine pair around
the experts, and the TP entry / exit of the shared expert. :class:`LocalComm` answers them on one
device (identities); :class:`FoldedComm` answers them on the folded mesh with meshfold's ragged
collectives. Model files make no process-group calls.

Layout (one pipeline stage; the MoE view's ``pp`` dim is sliced away):

===================  ======  ===============================  ==================================
parameter            view    placements (dp|edp, cp|ep, tp|etp)  why
===================  ======  ===============================  ==================================
router.weight        attn    R, R, R                          every rank routes its own tokens
experts.w_gate_up    moe     R, Shard(0), Shard(3)            experts over ep, ffn over etp
experts.w_down       moe     R, Shard(0), Shard(1)            experts over ep, ffn over etp
shared.w_gate_up     attn    R, R, Shard(2)                   column-parallel over tp
shared.w_down        attn    R, R, Shard(0)                   row-parallel over tp
shared.gate          attn    R, R, R                          applied to each rank's tokens
===================  ======  ===============================  ==================================

Every rank holds different tokens along every non-pp dim (batch over dp, sequence over cp, sequence
over tp with sequence parallelism), so a parameter replicated along a dim gets a *partial*
gradient there: the local views are taken with ``to_local(grad_placements=...)`` marking those dims
``Partial()``, and ``param.grad.full_tensor()`` (or a DP reduction) sums them.

Token counts: every rank of an attention (cp, tp) group holds the same number of tokens (sequence
parallelism splits evenly), which the shared expert's TP all-gather and full-sequence dropping rely
on instead of exchanging sizes; ``MESHFOLD_DEBUG_SPLITS=1`` checks it.

Dispatch (the paper's token dispatcher), per layer: one host sync, when the per-expert counts of
every rank in this rank's ``ep x etp`` block are gathered (two small all-gathers, one
``.tolist()``); then all-to-all-v over ``ep``, all-gather-v over ``etp``, a local re-sort so each
local expert's rows are contiguous; the reverse after the experts (re-sort back, reduce-scatter-v
over ``etp``, all-to-all-v back over ``ep``). With pad-to-capacity every expert gets the same
number of rows, but the counts are still exchanged this way (and, on CUDA, dropping selects the
kept pairs with a boolean mask, a second sync): a static-split path is a possible optimisation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshfold.kernels import gather_rows
from meshfold.placements import (all_gather_v, all_to_all_v, gather_equal, local_view, reduce_scatter_v,
                                  sum_statistic)
from meshfold.placements.collectives import debug_checks_enabled

__all__ = ["MOE_LAYOUT", "LocalComm", "FoldedComm", "parallelize_moe"]

ATTN = ("dp", "cp", "tp")
MOE = ("edp", "ep", "etp")

MOE_LAYOUT = {
    "router.weight": ("attn", (Replicate(), Replicate(), Replicate())),
    "experts.w_gate_up": ("moe", (Replicate(), Shard(0), Shard(3))),
    "experts.w_down": ("moe", (Replicate(), Shard(0), Shard(1))),
    "shared.w_gate_up": ("attn", (Replicate(), Replicate(), Shard(2))),
    "shared.w_down": ("attn", (Replicate(), Replicate(), Shard(0))),
    "shared.gate": ("attn", (Replicate(), Replicate(), Replicate())),
}


# tile masks are buffers, sliced like their weights: experts over ep, this dim over etp
MASK_LAYOUT = {"experts.mask_gate_up": 3, "experts.mask_down": 1}


@dataclass
class _Dispatched:
    send: list
    recv: list
    gather_sizes: list | None
    order: torch.Tensor | None  # received (etp, ep, expert) chunk order -> expert-major


def _expert_major_order(C, j: int, El: int, M: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(order_M, offsets_El) for the M rows a rank receives, stored as chunks (q, i, e) in that
    order (chunk (q, i, e) holds C[q][i][j*El + e] rows): ``rows[order_M]`` lists the same chunks
    expert-major (e, q, i), and offsets_El are the cumulative row counts per local expert (int32).
    Built with tensor arithmetic (no per-chunk loop); M is passed in so that nothing syncs."""
    size_QIE = torch.tensor(C, dtype=torch.int64, device=device)[:, :, j * El:(j + 1) * El]
    start_QIE = (size_QIE.flatten().cumsum(0) - size_QIE.flatten()).view_as(size_QIE)
    size_K = size_QIE.permute(2, 0, 1).flatten()  # chunks in expert-major order (e, q, i)
    start_K = start_QIE.permute(2, 0, 1).flatten()  # where each sits in the received rows
    # row n of chunk k goes to output position out_start_K[k] + n and comes from start_K[k] + n
    out_start_K = size_K.cumsum(0) - size_K
    order_M = torch.arange(M, device=device) + torch.repeat_interleave(
        start_K - out_start_K, size_K, output_size=M)
    offsets_El = size_QIE.sum((0, 1)).cumsum(0).to(torch.int32)
    return order_M, offsets_El


class LocalComm:
    """One device: all collectives are identities."""

    dp = 1

    def local(self, name: str, p: torch.Tensor) -> torch.Tensor:
        return p

    def local_mask(self, name: str, mask: torch.Tensor) -> torch.Tensor:
        return mask

    def sum(self, t: torch.Tensor, dims: tuple[str, ...]) -> torch.Tensor:
        return t

    def gather_tokens(self, t: torch.Tensor, dims: tuple[str, ...]) -> tuple[torch.Tensor, int]:
        return t, 0

    def dispatch(self, x_NH, counts_E, num_experts):
        return x_NH, torch.cumsum(counts_E, 0).to(torch.int32), None

    def combine(self, y_NH, handle):
        return y_NH

    def shared_in(self, x_TH):
        return x_TH

    def shared_out(self, y_TH):
        return y_TH


class FoldedComm:
    """The folded mesh: ``attn`` = (dp, cp, tp) and ``moe`` = (edp, ep, etp) of this pp stage."""

    def __init__(self, folded):
        self.attn = folded.stage("attn")
        self.moe = folded.stage("moe")
        spec = folded.spec
        self.dp, self.cp, self.tp = spec.dp, spec.cp, spec.tp
        self.ep, self.etp = spec.ep, spec.etp
        self.ep_rank = self.moe.get_local_rank("ep")

    # ---- parameters ----
    def local(self, name: str, p: torch.Tensor) -> torch.Tensor:
        return local_view(p)

    def local_mask(self, name: str, mask: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a tile mask: experts over ep, ffn tiles over etp (dim 3 of the
        gate_up mask, dim 1 of the down mask, as MASK_LAYOUT says)."""
        e0, e1 = self.expert_range(mask.shape[0])
        dim = MASK_LAYOUT[name]
        n = mask.shape[dim] // self.etp
        q = self.moe.get_local_rank("etp")
        return mask[e0:e1].narrow(dim, q * n, n)

    # ---- token statistics ----
    def sum(self, t: torch.Tensor, dims: tuple[str, ...]) -> torch.Tensor:
        """Sum a (non-differentiable) statistic over attention dims, e.g. ("cp", "tp")."""
        return sum_statistic(t, self.attn, dims)

    def gather_tokens(self, t: torch.Tensor, dims: tuple[str, ...]) -> tuple[torch.Tensor, int]:
        """Concatenate per-token rows over attention dims (rank-major, innermost dim fastest);
        returns (rows of the whole group, offset of this rank's rows). Every rank of the group
        holds the same number of tokens (the attention layout splits sequences evenly), so no
        sizes are exchanged (no host sync); MESHFOLD_DEBUG_SPLITS=1 verifies it."""
        offset = 0
        for d in reversed(dims):  # tp first, then cp: the group's rank order
            if getattr(self, d) == 1:
                continue
            sizes = self._even_sizes(t.shape[0], d, t.device)
            offset += self.attn.get_local_rank(d) * t.shape[0]
            t = all_gather_v(t.detach(), sizes, self.attn, d)
        return t, offset

    def _even_sizes(self, n_local: int, dim: str, device) -> list[int]:
        """[n_local] * group size; with debug checks on, verified across the group first."""
        n = getattr(self, dim)
        if debug_checks_enabled():
            seen = gather_equal(torch.tensor([n_local], device=device), self.attn, dim).flatten().tolist()
            if len(set(seen)) > 1:
                raise ValueError(f"ranks of attn dim {dim!r} hold different token counts "
                                 f"{seen}; the MoE layer needs an even split")
        return [n_local] * n

    # ---- dispatch ----
    def expert_range(self, num_experts: int) -> tuple[int, int]:
        n = num_experts // self.ep
        return self.ep_rank * n, (self.ep_rank + 1) * n

    def dispatch(self, x_NH, counts_E, num_experts):
        E, ep, etp = num_experts, self.ep, self.etp
        El = E // ep
        # counts of every rank in my ep x etp block: [etp][ep][E] host ints (the one sync)
        block = gather_equal(gather_equal(counts_E.to(torch.int64), self.moe, "ep"), self.moe, "etp")
        C = block.tolist()  # C[q][i][e]: the host sync
        j = self.ep_rank
        mine = C[self.moe.get_local_rank("etp")]  # my ep group's counts, mine[j] = this rank's
        send = [sum(mine[j][d * El:(d + 1) * El]) for d in range(ep)]
        recv = [sum(mine[i][j * El:(j + 1) * El]) for i in range(ep)]
        x = all_to_all_v(x_NH, send, recv, self.moe, "ep")  # rows ordered (source i, local e)
        gather_sizes = None
        if etp > 1:
            gather_sizes = [sum(sum(C[q][i][j * El:(j + 1) * El]) for i in range(ep)) for q in range(etp)]
            x = all_gather_v(x, gather_sizes, self.moe, "etp")  # rows ordered (q, i, e)
        # chunk (q, i, e) holds C[q][i][j*El + e] rows; re-sort to expert-major (e, q, i)
        order_M, offsets_El = _expert_major_order(C, j, El, x.shape[0], x.device)
        return gather_rows(x, order_M), offsets_El, _Dispatched(send, recv, gather_sizes, order_M)

    def combine(self, y_MH, h: _Dispatched):
        y = torch.empty_like(y_MH).index_copy(0, h.order, y_MH) if y_MH.shape[0] else y_MH
        if h.gather_sizes is not None:
            y = reduce_scatter_v(y, h.gather_sizes, self.moe, "etp")
        return all_to_all_v(y, h.recv, h.send, self.moe, "ep")

    # ---- shared expert: a TP MLP with sequence parallelism ----
    def shared_in(self, x_TH):
        if self.tp == 1:
            return x_TH
        self._shared_sizes = self._even_sizes(x_TH.shape[0], "tp", x_TH.device)  # even sequence-parallel split
        return all_gather_v(x_TH, self._shared_sizes, self.attn, "tp")

    def shared_out(self, y_TH):
        if self.tp == 1:
            return y_TH
        return reduce_scatter_v(y_TH, self._shared_sizes, self.attn, "tp")


def place(param: torch.Tensor, mesh, placements, local: torch.Tensor | None = None) -> torch.nn.Parameter:
    """``param`` as a DTensor parameter laid out as ``placements`` on ``mesh``: sliced from the
    full tensor every rank holds, or, given ``local`` (this rank's shard, e.g. read from a
    checkpoint), assembled from the shards without any rank holding the whole (``param`` may then
    be on the meta device)."""
    if local is None:
        local = param.detach()[local_slices(param.shape, mesh, placements)].clone()
    stride = torch.empty(param.shape, device="meta").stride()
    dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=param.shape, stride=stride)
    out = torch.nn.Parameter(dt, requires_grad=param.requires_grad)
    if out.device_mesh is not mesh:
        # DTensor's op cache treats equal meshes as one and may return an equal mesh of an
        # earlier fold; FSDP2 groups parameters by mesh identity, so pin ours
        out._spec = dataclasses.replace(out._spec, mesh=mesh)
    return out


def local_slices(shape, mesh, placements) -> tuple[slice, ...]:
    """The region of a tensor of ``shape`` this rank holds under ``placements`` on ``mesh``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, local_shape))


def moe_param_layout(name: str, comm: "FoldedComm", layout: dict | None = None):
    """(mesh, placements) of MoE-layer parameter ``name`` (relative to the layer) in ``layout``
    (default :data:`MOE_LAYOUT`)."""
    table = MOE_LAYOUT if layout is None else layout
    if name not in table:
        where = "MOE_LAYOUT" if layout is None else "the given layout"
        raise ValueError(f"parameter {name!r} has no layout in {where} ({list(table)})")
    view, placements = table[name]
    return (comm.attn if view == "attn" else comm.moe), placements


def check_moe_fold(cfg, ep: int, etp: int, tp: int) -> None:
    """Raise ``ValueError`` naming the MoE size that does not divide over the fold: experts over
    ``ep``, expert ffn over ``etp`` (and sparsity tiles within each etp shard), shared-expert ffn
    over attention ``tp``. Needs no mesh: ``meshfold train`` runs it before spawning."""
    if cfg.num_experts % ep:
        raise ValueError(f"num_experts = {cfg.num_experts} is not divisible by ep = {ep} "
                         f"(valid ep: divisors of {cfg.num_experts})")
    if cfg.ffn % etp:
        raise ValueError(f"ffn = {cfg.ffn} is not divisible by etp = {etp}")
    if cfg.shared_ffn and cfg.shared_ffn % tp:
        raise ValueError(f"shared_ffn = {cfg.shared_ffn} is not divisible by tp = {tp}")
    if cfg.expert_sparsity is not None:
        from meshfold.sparsity import check_etp_alignment

        check_etp_alignment(cfg.hidden, cfg.ffn, cfg.expert_sparsity.tile, etp, "N")
        check_etp_alignment(cfg.ffn, cfg.hidden, cfg.expert_sparsity.tile, etp, "K")


def parallelize_moe(layer, folded, local_state: dict | None = None, *, layout: dict | None = None) -> None:
    """Apply ``layout`` (default :data:`MOE_LAYOUT`): turn ``layer``'s parameters into DTensors
    on the folded mesh (from the full weights every rank holds, e.g. after seeding identically, or
    from this rank's shards in ``local_state``, keyed by parameter name within the layer) and give
    the layer a :class:`FoldedComm`. A layer with parameters of its own passes a layout that
    extends MOE_LAYOUT (``{**MOE_LAYOUT, name: (view, placements)}``) rather than editing the
    library table. Raises if the layer's sizes do not divide over the mesh."""
    comm = FoldedComm(folded)
    check_moe_fold(layer.cfg, comm.ep, comm.etp, comm.tp)
    for name, param in list(layer.named_parameters()):
        mesh, placements = moe_param_layout(name, comm, layout)
        module_name, _, attr = name.rpartition(".")
        module = layer.get_submodule(module_name)
        setattr(module, attr, place(param, mesh, placements, None if local_state is None else local_state[name]))
    layer.comm = comm
