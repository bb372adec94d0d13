"""What an MoE layer asks of the ranks around it, and the answer on one device.

Legend: T = this rank's tokens, H = hidden, E = experts, N = rows this rank sends (its permuted
token-expert pairs), M = rows its experts receive.

:class:`~meshfold.models.moe.MoELayer` is single-device code. The few places where a folded layer
differs from one device (a parameter's local shard, sums of token statistics over attention
dims, the token dispatch around the experts, the shared expert's tensor-parallel entry and exit)
go through one object, the layer's ``comm``, that satisfies :class:`MoEComm`. A layer starts
with :class:`LocalComm`, whose every answer is what one device computes (identities, no
collective); :func:`meshfold.parallel.moe.parallelize_moe` swaps in
:class:`meshfold.parallel.moe.FoldedComm`, which answers with the folded mesh's collectives.
So the layer's code never names a process group, and a layer of a user's own (a new router, a
new expert kind) gets the folded path by calling the same methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["MoEComm", "CountsRead", "Dispatched", "Arrived", "LocalComm", "LocalRoute", "LocalCounts"]


class CountsRead(Protocol):
    """Per-expert counts read on the host by :meth:`MoEComm.read_counts`: ``rows_sent`` is how
    many rows this rank sends; the rest is the comm's own (what its dispatch of the same counts
    needs, so that it does not read them again)."""

    rows_sent: int


class Dispatched(Protocol):
    """A dispatch whose rows may still travel: ``wait()`` returns the routed rows, an object
    with ``rows`` [M, H] (this rank's experts' rows, expert-major) and ``offsets_E`` [E_local]
    int32 (cumulative rows per local expert, the grouped GEMM's offsets)."""

    def wait(self): ...


class MoEComm(Protocol):
    """The MoE layer's view of the ranks it runs on (one device: :class:`LocalComm`).

    ``dp``: data-parallel ranks the batch is split over (the balancing losses' DP mean).
    """

    dp: int

    def local(self, name: str, p: torch.Tensor) -> torch.Tensor:
        """This rank's view of parameter ``name`` (named within the layer, e.g.
        ``"experts.w_down"``), in the dtype the layer computes in; every parameter of the layer's
        router in its own dtype (:class:`~meshfold.models.interfaces.LocalView`)."""

    def local_mask(self, name: str, mask: torch.Tensor) -> torch.Tensor:
        """This rank's slice of tile mask buffer ``name`` (``"experts.mask_gate_up"``)."""

    def sum(self, t: torch.Tensor, dims: tuple[str, ...]) -> torch.Tensor:
        """A (non-differentiable) statistic summed over the attention dims ``dims`` (of
        ``("dp", "cp", "tp")``) that hold the rest of its tokens."""

    def gather_tokens(self, t: torch.Tensor, dims: tuple[str, ...]) -> tuple[torch.Tensor, int]:
        """Per-token rows [T, ...] concatenated over the attention dims ``dims`` (rank-major), and
        the offset of this rank's rows in the result (full-sequence dropping)."""

    def slot_ids(self, experts_TK: torch.Tensor) -> torch.Tensor:
        """The dispatch order of the routed experts [T, k]: each expert's slot under the expert
        placement (one device, and the static placement: ``experts_TK`` itself). Rows are
        permuted by slot, so the experts of one rank are contiguous whatever their ids."""

    def num_slots(self, num_experts: int) -> int:
        """How many slots :meth:`slot_ids` routes to: ``num_experts`` (one device), plus the
        copy slots of hot experts on a fold that has them."""

    def read_counts(self, counts_E: torch.Tensor) -> CountsRead:
        """This rank's per-expert counts [E] read on the host (the forward's one host read), with
        how many rows it sends."""

    def dispatch_start(self, x_NH: torch.Tensor, counts_E: torch.Tensor,
                       read: CountsRead | None = None) -> Dispatched:
        """Start sending this rank's expert-major rows x_NH [N, H] (``counts_E`` [E] per expert)
        to their experts' ranks; the caller may compute before it waits. ``read``: what
        :meth:`read_counts` returned for these same ``counts_E`` (None: the dispatch reads them)."""

    def combine(self, routed, y_MH: torch.Tensor) -> torch.Tensor:
        """The experts' outputs y_MH [M, H] for ``routed``'s rows, back where the rows came
        from, in dispatch order: [N, H]."""

    def shared_in(self, x_TH: torch.Tensor) -> torch.Tensor:
        """The tokens the shared expert computes on (under tensor parallelism: the tp group's)."""

    def shared_out(self, y_TH: torch.Tensor) -> torch.Tensor:
        """The shared expert's output back on this rank's tokens (summed over tp shards)."""


@dataclass
class LocalRoute:
    """One device's dispatch: the rows stay where they are."""

    rows: torch.Tensor
    offsets_E: torch.Tensor


@dataclass
class LocalCounts:
    """One device's counts read: only the number of rows, which the dispatch does not need."""

    rows_sent: int


@dataclass
class Arrived:
    """A dispatch that has already arrived: ``wait()`` returns it."""

    routed: object

    def wait(self):
        return self.routed


class LocalComm:
    """:class:`MoEComm` on one device: every collective is the identity."""

    dp = 1

    def local(self, name: str, p: torch.Tensor) -> torch.Tensor:
        return p

    def local_mask(self, name: str, mask: torch.Tensor) -> torch.Tensor:
        return mask

    def sum(self, t: torch.Tensor, dims: tuple[str, ...]) -> torch.Tensor:
        return t

    def gather_tokens(self, t: torch.Tensor, dims: tuple[str, ...]) -> tuple[torch.Tensor, int]:
        return t, 0

    def slot_ids(self, experts_TK):
        return experts_TK

    def num_slots(self, num_experts: int) -> int:
        return num_experts

    def read_counts(self, counts_E):
        """The rows kept when dropping, read on the host (the forward's one host read)."""
        return LocalCounts(int(counts_E.sum()))

    def dispatch(self, x_NH, counts_E, read=None):
        return LocalRoute(x_NH, torch.cumsum(counts_E, 0).to(torch.int32))

    def dispatch_start(self, x_NH, counts_E, read=None):
        return Arrived(self.dispatch(x_NH, counts_E))

    def combine(self, routed, y_NH):
        return y_NH

    def shared_in(self, x_TH):
        return x_TH

    def shared_out(self, y_TH):
        return y_TH
