"""The MoE token dispatch as a placement op: rows in, a RaggedTensor of expert-major rows out.

Legend: E = experts, El = E / ep local experts, N = rows a rank sends (its permuted tokens),
M = rows a rank's experts receive, H = hidden.

Each rank of an ``ep x etp`` block of the MoE mesh holds its own tokens, permuted expert-major
(:func:`meshfold.models.dispatcher.permute`). The experts of ep rank j are ``j*El .. (j+1)*El``,
and every etp rank of an ep rank holds all their rows (each computes its slice of the ffn).
:func:`dispatch` moves the rows there and returns :class:`Routed`, whose ``tokens`` is a
:class:`~meshfold.placements.ragged.RaggedTensor` on the ``(ep, etp)`` mesh with placements
``(RaggedShard(0, rows per ep rank), Replicate())``: its ``full_tensor()`` is the global
expert-major token matrix of the block, the rows single-device ``permute`` gives for the block's
tokens concatenated in the mesh's rank order (ep-major, etp fastest), in the same order. The
experts compute on its local rows; their outputs are summands over etp, a RaggedTensor with
``(RaggedShard(0, sizes), Partial())`` (:meth:`Routed.outputs`), which :func:`combine` sends
back to the ranks the rows came from.

It is not a :func:`~meshfold.placements.redistribute`: sending rank i's rows for expert e to
expert e's rank reorders the global rows (a block transpose), so no layout of one global tensor
describes the input and the output both.

Per dispatch: one host sync, when the per-expert counts of every rank of the block are gathered
(:func:`block_counts`: two small all-gathers, one ``.tolist()``; the gathered tensor stays on the
device for the re-sort, so nothing goes back up); then all-to-all-v over ``ep``, all-gather-v over
``etp``, and a local re-sort so each local expert's rows are contiguous. The combine runs the
reverse: re-sort back, reduce-scatter-v over ``etp`` (summing the partial outputs), all-to-all-v
back over ``ep`` (started and waited for at once, so that under
:func:`meshfold.runtime.overlap.run_in_turns` another micro-batch computes while it travels).
:func:`dispatch_start` returns with the ``ep`` all-to-all still in flight
(``async_op``), so the MoE layer computes its shared expert meanwhile; its ``wait()`` finishes the
dispatch. In backward the gradient's all-to-all likewise overlaps the shared expert's backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import Partial, Replicate

from meshfold.placements.collectives import (_group, all_gather_v, all_to_all_v, all_to_all_v_start, gather_equal,
                                             reduce_scatter_v)
from meshfold.placements.ragged import RaggedShard, RaggedTensor
from meshfold.runtime import spmd

__all__ = ["Routed", "DispatchInFlight", "block_counts", "dispatch", "dispatch_start", "combine"]


@dataclass
class Routed:
    """The result of :func:`dispatch`.

    ``tokens``: RaggedTensor [M, H] on the ``(ep, etp)`` mesh, expert-major rows of this rank's
    experts; ``offsets_E`` [El] int32: cumulative rows per local expert (grouped-GEMM offsets).
    The rest says how the rows moved, for :func:`combine`.
    """

    tokens: RaggedTensor
    offsets_E: torch.Tensor
    send: list[int]  # rows this rank sent to each ep rank
    recv: list[int]  # rows it received from each
    gather_sizes: list[int] | None  # rows each etp rank contributed to the etp gather (None: etp = 1)
    order_M: torch.Tensor  # received rows -> expert-major

    @property
    def rows(self) -> torch.Tensor:
        """This rank's rows [M, H], what its experts compute on."""
        return self.tokens.local

    def outputs(self, y_MH: torch.Tensor) -> RaggedTensor:
        """The experts' outputs [M, H] for these rows, as summands over etp (each etp rank
        computed its slice of the ffn): the RaggedTensor :func:`combine` takes."""
        placements = [Partial() if isinstance(p, Replicate) else p for p in self.tokens.placements]
        return RaggedTensor(y_MH, self.tokens.mesh, placements)


@spmd.per_rank  # i_me and M differ by rank under LocalTensorMode
def _expert_major_order(C_QIE: torch.Tensor, i_me: int, El: int, M: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order_M, offsets_El) for the M rows ep rank ``i_me`` receives, stored as chunks (q, i, e)
    (etp rank q's all-gathered piece, holding the chunks (i, e) of its all-to-all), where chunk
    (q, i, e) holds ``C_QIE[q, i, i_me*El + e]`` rows (the block's counts, on the device):
    ``rows[order_M]`` lists the same chunks expert-major, then in source rank order (e, i, q);
    offsets_El are the cumulative row counts per local expert (int32). Built with tensor
    arithmetic (no per-chunk loop); M is passed in so that nothing syncs."""
    device = C_QIE.device
    size_QIE = C_QIE[:, :, i_me * El:(i_me + 1) * El]
    start_QIE = (size_QIE.flatten().cumsum(0) - size_QIE.flatten()).view_as(size_QIE)
    size_K = size_QIE.permute(2, 1, 0).flatten()  # chunks in output order (e, i, q)
    start_K = start_QIE.permute(2, 1, 0).flatten()  # where each sits in the received rows
    # row n of chunk k goes to output position out_start_K[k] + n and comes from start_K[k] + n
    out_start_K = size_K.cumsum(0) - size_K
    order_M = torch.arange(M, device=device) + torch.repeat_interleave(
        start_K - out_start_K, size_K, output_size=M)
    offsets_El = size_QIE.sum((0, 1)).cumsum(0).to(torch.int32)
    return order_M, offsets_El


class _PermuteRows(torch.autograd.Function):
    """``x[order]`` for a permutation ``order``: the backward puts each row's gradient back in
    its place (an ``index_copy``, no accumulation needed)."""

    @staticmethod
    def forward(ctx, x, order):
        ctx.save_for_backward(order)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return torch.empty_like(grad).index_copy_(0, order, grad), None


def block_counts(counts_E: torch.Tensor, mesh, ep: str = "ep", etp: str = "etp") -> tuple[torch.Tensor, list]:
    """The per-expert counts of every rank of the ``(ep, etp)`` block, as ``(C_QIE, C)``:
    C_QIE [etp, ep, E] int64 on the counts' device and C the same as host ints (``C[q][i][e]``),
    read with one ``.tolist()``: the dispatch's one host sync. Every rank of the mesh calls it."""
    C_QIE = gather_equal(gather_equal(counts_E.to(torch.int64), mesh, ep), mesh, etp)
    return C_QIE, C_QIE.tolist()


def rows_sent(C: list, mesh, ep: str = "ep", etp: str = "etp") -> int:
    """How many rows this rank sends, from the host counts C of :func:`block_counts`."""
    return _rows_sent(C, _group(mesh, etp)[2], _group(mesh, ep)[2])


# The host arithmetic on the block counts C[q][i][e], with this rank's coordinates (q_me, i_me)
# as arguments: under LocalTensorMode (simulated ranks) both differ by rank, so each runs once
# per rank (per_rank); in a real run it is a plain call.
@spmd.per_rank
def _rows_sent(C, q_me, i_me):
    return sum(C[q_me][i_me])


@spmd.per_rank
def _a2a_splits(C, q_me, i_me, El, n_ep):
    """(rows this rank sends to each ep rank, rows it receives from each)."""
    mine = C[q_me]  # my etp slice of the block: mine[i] = ep rank i's counts
    send = [sum(mine[i_me][d * El:(d + 1) * El]) for d in range(n_ep)]
    recv = [sum(mine[i][i_me * El:(i_me + 1) * El]) for i in range(n_ep)]
    return send, recv


@spmd.per_rank
def _etp_sizes(C, i_me, El, n_ep, n_etp):
    """(rows each etp rank contributes to the etp gather, rows each ep rank's experts get)."""
    gather = [sum(sum(C[q][i][i_me * El:(i_me + 1) * El]) for i in range(n_ep)) for q in range(n_etp)]
    per_ep_rank = [sum(sum(C[q][i][d * El:(d + 1) * El]) for q in range(n_etp) for i in range(n_ep))
                   for d in range(n_ep)]
    return gather, per_ep_rank


def dispatch(x_NH: torch.Tensor, counts_E: torch.Tensor, mesh, ep: str = "ep", etp: str = "etp",
             block: tuple[torch.Tensor, list] | None = None) -> Routed:
    """Send this rank's expert-major rows ``x_NH`` [N, H] (``counts_E`` [E] rows per expert, in
    order) to their experts' ranks over ``mesh``'s dims ``ep`` and ``etp``. Every rank of the
    mesh calls it. ``block``: :func:`block_counts` of these counts when the caller already read
    them (None: read here). Differentiable in x_NH."""
    return dispatch_start(x_NH, counts_E, mesh, ep, etp, block, asynchronous=False).wait()


@dataclass
class _Arrived:
    rows: torch.Tensor

    def wait(self) -> torch.Tensor:
        return self.rows


class DispatchInFlight:
    """A :func:`dispatch` whose all-to-all over ``ep`` is still travelling: ``wait()`` waits for
    it, then runs the rest (the etp all-gather, the re-sort) and returns the :class:`Routed`."""

    def __init__(self, flight, mesh, ep, etp, C_QIE, C, send, recv):
        self.flight, self.mesh, self.dims = flight, mesh, (ep, etp)
        self.C_QIE, self.C, self.send, self.recv = C_QIE, C, send, recv

    def wait(self) -> Routed:
        mesh, (ep, etp), C = self.mesh, self.dims, self.C
        x = self.flight.wait()  # rows ordered (source i, local e)
        _, n_ep, i_me = _group(mesh, ep)
        _, n_etp, _ = _group(mesh, etp)
        El = self.C_QIE.shape[2] // n_ep
        gather_sizes, per_ep_rank = _etp_sizes(C, i_me, El, n_ep, n_etp)
        if n_etp > 1:
            x = all_gather_v(x, gather_sizes, mesh, etp)  # rows ordered (q, i, e)
        else:
            gather_sizes = None
        order_M, offsets_El = _expert_major_order(self.C_QIE, i_me, El, x.shape[0])
        rows_MH = _PermuteRows.apply(x, order_M)
        placements = [None, None]
        placements[mesh.mesh_dim_names.index(ep)] = RaggedShard(0, per_ep_rank)
        placements[mesh.mesh_dim_names.index(etp)] = Replicate()
        tokens = RaggedTensor(rows_MH, mesh, placements)
        return Routed(tokens, offsets_El, self.send, self.recv, gather_sizes, order_M)


def dispatch_start(x_NH: torch.Tensor, counts_E: torch.Tensor, mesh, ep: str = "ep", etp: str = "etp",
                   block: tuple[torch.Tensor, list] | None = None, asynchronous: bool = True) -> DispatchInFlight:
    """:func:`dispatch` up to its all-to-all over ``ep``, which it starts and does not wait for
    (the counts are read first, as in dispatch: the one host sync). The caller computes
    something else (the shared expert), then ``.wait()`` gives the Routed rows.
    ``asynchronous=False``: the all-to-all runs synchronously here (what :func:`dispatch` does)."""
    _, n_ep, i_me = _group(mesh, ep)
    _, n_etp, q_me = _group(mesh, etp)
    El = counts_E.numel() // n_ep
    # counts of every rank in the block: C[q][i][e] host ints (the one sync)
    C_QIE, C = block_counts(counts_E, mesh, ep, etp) if block is None else block
    send, recv = _a2a_splits(C, q_me, i_me, El, n_ep)
    if asynchronous:
        flight = all_to_all_v_start(x_NH, send, recv, mesh, ep)
    else:
        flight = _Arrived(all_to_all_v(x_NH, send, recv, mesh, ep))
    return DispatchInFlight(flight, mesh, ep, etp, C_QIE, C, send, recv)


def combine(y: RaggedTensor, routed: Routed, ep: str = "ep", etp: str = "etp") -> torch.Tensor:
    """The experts' outputs ``y`` (:meth:`Routed.outputs`: the rows of ``routed.tokens``,
    summands over etp) back to the ranks and the order the rows were dispatched from: [N, H] in
    the input order of :func:`dispatch`. Differentiable."""
    expected = tuple(Partial() if isinstance(p, Replicate) else p for p in routed.tokens.placements)
    same_rows = y.local.shape[0] == routed.rows.shape[0]
    if y.mesh is not routed.tokens.mesh or tuple(y.placements) != expected or not same_rows:
        raise ValueError(f"combine: {y} does not hold the expert outputs of this dispatch: expected "
                         f"{tuple(routed.rows.shape)[:1]} rows with placements {expected} (Routed.outputs)")
    y_MH = y.local
    if y_MH.shape[0]:
        y_MH = torch.empty_like(y_MH).index_copy(0, routed.order_M, y_MH)  # back to received order
    if routed.gather_sizes is not None:
        y_MH = reduce_scatter_v(y_MH, routed.gather_sizes, y.mesh, etp)  # sums the etp summands
    # started and waited for at once: under run_in_turns (meshfold.runtime.overlap) the wait lets
    # the other micro-batch compute while the rows travel; otherwise it is all_to_all_v
    return all_to_all_v_start(y_MH, routed.recv, routed.send, y.mesh, ep).wait()
