"""How an MoE layer runs on a FoldedMesh: its layout applied, and the collectives it needs.

The layer itself (:mod:`meshfold.models.moe`) is single-device code that asks a *comm* object
(:class:`meshfold.models.comm.MoEComm`) for five things: the local shard of each parameter, sums
of token statistics over attention dims, gathering routing over ``(cp, tp)`` for full-sequence
dropping, the dispatch / combine pair around the experts, and the TP entry / exit of the shared
expert. :class:`~meshfold.models.comm.LocalComm` answers them on one device (identities);
:class:`FoldedComm` answers them on the folded mesh with meshfold's ragged collectives. Model
files make no process-group calls.

Layout (one pipeline stage; the MoE view's ``pp`` dim is sliced away), as
:data:`meshfold.parallel.layouts.MOE_LAYOUT` declares it:

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

Dispatch (the paper's token dispatcher): :func:`meshfold.placements.dispatch` over the ``(ep, etp)``
block of the MoE mesh, which returns the routed rows as a RaggedTensor there (one host sync for
the counts, all-to-all-v over ``ep``, all-gather-v over ``etp``), and
:func:`meshfold.placements.combine`, which takes the experts' outputs back. The layer calls
:meth:`FoldedComm.dispatch_start`, which returns with the ``ep`` all-to-all in flight
(``async_op=True``), computes its shared expert, then waits; in backward the gradient's
all-to-all likewise travels during the shared expert's backward (``FoldedComm.overlap = False``
dispatches synchronously instead, for A/B measurements). The shared expert's own ``tp``
collectives run on another process group meanwhile, issued in the same order on every rank.

Host syncs: one device-to-host read per layer forward, dropless or dropping, folded or not (one
device, dropless or pad-to-capacity: none). Folded, it is the block's counts; when dropping
without padding they are read before the permute cuts the kept rows
(:meth:`FoldedComm.read_counts`), and the dispatch is handed what that read returned. Dropping
selects the kept pairs by sorting them first (no boolean mask), and token statistics build
host-known sizes with fill kernels instead of uploading them. ``tests/parallel/test_host_syncs.py`` counts them. With pad-to-capacity every
expert gets the same number of rows, but the counts are still exchanged (a rank's capacity
depends on its own token count): a static-split path is a possible optimisation.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import torch
from torch.distributed.tensor import DTensor

from meshfold.kernels import check_etp_alignment
from meshfold.models.comm import Arrived
from meshfold.parallel.layouts import MASK_LAYOUT, MOE_LAYOUT
from meshfold.placements import (Routed, all_gather_v, all_to_all_v, combine, dispatch, gather_equal, local_view,
                                  reduce_scatter_v, sum_statistic)
from meshfold.placements.collectives import debug_checks_enabled
from meshfold.placements.token_dispatch import block_counts, dispatch_start, rows_sent
from meshfold.runtime import spmd

__all__ = ["FoldedComm", "BlockCounts", "parallelize_moe", "place", "local_slices", "moe_param_layout", "check_moe_fold"]

ATTN = ("dp", "cp", "tp")
MOE = ("edp", "ep", "etp")


def slot_of_expert(slots) -> torch.Tensor:
    """The inverse of an expert placement: ``[E]`` int64, expert id -> the slot holding it."""
    slot_of_E = torch.empty(len(slots), dtype=torch.int64)
    slot_of_E[list(slots)] = torch.arange(len(slots))
    return slot_of_E


@dataclasses.dataclass
class BlockCounts:
    """The dispatch block's counts read on the host (:meth:`FoldedComm.read_counts`):
    ``rows_sent`` this rank's rows, ``block`` the ``(C_QIE, C)`` of
    :func:`meshfold.placements.token_dispatch.block_counts`."""

    rows_sent: int
    block: tuple[torch.Tensor, list]


@dataclasses.dataclass(frozen=True)
class _Routes:
    """Where a placement with copies sends rows and fetches weights, for one ep rank:
    ``slot_EC`` [E, c] each expert's instances' dispatch slots (own first; padded with it),
    ``cut_EC`` [E, c] the split rule's cuts of its rows over them (padded with the last, the
    whole); ``send_rows`` the local experts to send for other ranks'
    copies (grouped by rank), ``send_sizes`` / ``recv_sizes`` per ep rank, and ``arrived`` the
    received rows in this rank's copy order."""

    slot_EC: torch.Tensor
    cut_EC: torch.Tensor
    send_rows: torch.Tensor
    send_sizes: list[int]
    recv_sizes: list[int]
    arrived: torch.Tensor

    @staticmethod
    def of(slots, copies, cuts, ep: int, me: int) -> "_Routes":
        E = len(slots)
        n, r = E // ep, len(copies) // ep
        slot_of = {e: s for s, e in enumerate(slots)}
        instances = [[] for _ in range(E)]
        for s, e in enumerate(slots):
            instances[e].append((s // n) * (n + r) + s % n)
        for i, e in enumerate(copies):
            instances[e].append((i // r) * (n + r) + n + i % r)
        c = max(len(x) for x in instances)
        slot_EC = torch.tensor([x + [x[0]] * (c - len(x)) for x in instances], dtype=torch.int64)
        if cuts is None:  # even: (1, 2, .., c) of c
            cuts = [range(1, len(x) + 1) for x in instances]
        cut_EC = torch.tensor([[*k] + [k[-1]] * (c - len(k)) for k in cuts], dtype=torch.int64)
        home = [slot_of[e] // n for e in copies]  # ep rank holding copy i's expert
        send = [[slot_of[e] % n for i, e in enumerate(copies[d * r:(d + 1) * r]) if home[d * r + i] == me]
                for d in range(ep)]
        mine = range(me * r, (me + 1) * r)
        by_source = sorted(range(r), key=lambda i: home[mine[i]])  # the order the rows arrive in
        arrived = torch.empty(r, dtype=torch.int64)
        arrived[torch.tensor(by_source, dtype=torch.int64)] = torch.arange(r)
        return _Routes(slot_EC, cut_EC,
                       torch.tensor([i for rows in send for i in rows], dtype=torch.int64),
                       [len(rows) for rows in send], [sum(1 for i in mine if home[i] == j) for j in range(ep)],
                       arrived)


class FoldedComm:
    """The folded mesh: ``attn`` = (dp, cp, tp) and ``moe`` = (edp, ep, etp) of this pp stage."""

    def __init__(self, folded, compute_dtype: torch.dtype | None = None,
                 keep_dtype: Mapping[str, torch.dtype | None] | None = None):
        self.compute_dtype = compute_dtype  # None: the parameters' own
        # parameter name (within the layer) -> the dtype it is used in instead (None: its own)
        self.keep_dtype = dict(keep_dtype or {})
        self.attn = folded.stage("attn")
        self.moe = folded.stage("moe")
        spec = folded.spec
        self.dp, self.cp, self.tp = spec.dp, spec.cp, spec.tp
        self.ep, self.etp = spec.ep, spec.etp
        self.ep_rank = self.moe.get_local_rank("ep")
        self.overlap = True  # dispatch_start leaves the all-to-all in flight (False: waits at once)
        # the expert placement (meshfold.parallel.expert_placement): None is the static one, where
        # ep rank r holds experts r * E / ep ..; else slots[s] is the expert held in slot s
        self.slots: tuple[int, ...] | None = None
        self._slot_of_E: torch.Tensor | None = None  # the inverse of slots: expert id -> slot
        # hot-expert copies (set_copies): None, or copies[i] is the expert in copy slot i of ep
        # rank i // (R / ep); ``copied`` names the expert weights local() extends with them
        self.copies: tuple[int, ...] | None = None
        self.cuts: tuple[tuple[int, ...], ...] | None = None  # the split rule's (None: even)
        self.copied: frozenset[str] = frozenset()
        self._num_experts = 0
        self._routes: _Routes | None = None  # built from (slots, copies) when first needed

    # ---- parameters ----
    def local(self, name: str, p: torch.Tensor) -> torch.Tensor:
        """This rank's shard of parameter ``name``, in the compute dtype, or as ``keep_dtype``
        says for ``name`` (every parameter of the layer's router keeps its own dtype: see
        :func:`parallelize_moe`); the cast's backward returns the gradient in the parameter's dtype."""
        v = local_view(p)
        if self.compute_dtype is not None:
            dtype = self.keep_dtype[name] if name in self.keep_dtype else self.compute_dtype
            v = v if dtype is None else v.to(dtype)
        if self.copies is not None and name in self.copied:
            v = torch.cat([v, self._fetch_copies(v)])
        return v

    def _fetch_copies(self, v_nX: torch.Tensor) -> torch.Tensor:
        """This rank's copies' rows of an expert weight [n, X...] -> [r, X...], fetched from the
        ranks holding them with one all-to-all over ``ep`` (differentiable: in backward each
        copy's gradient returns to its expert's rank and is summed into its gradient there)."""
        routes = self._routing(v_nX.device)
        if v_nX.shape[0] != self._num_experts // self.ep:
            raise ValueError(f"expert weight with {v_nX.shape[0]} local experts; copies need the whole "
                             f"{self._num_experts // self.ep} of the ep rank")
        x = v_nX[routes.send_rows]
        y = all_to_all_v(x, routes.send_sizes, routes.recv_sizes, self.moe, "ep")
        return y[routes.arrived]

    def local_mask(self, name: str, mask: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a tile mask: experts over ep, ffn tiles over etp (dim 3 of the
        gate_up mask, dim 1 of the down mask, as MASK_LAYOUT says)."""
        e0, e1 = self.expert_range(mask.shape[0])
        dim = MASK_LAYOUT[name]
        n = mask.shape[dim] // self.etp
        q = self.moe.get_local_rank("etp")
        held = mask[e0:e1] if self.slots is None else mask[list(self.slots[e0:e1])]
        return held.narrow(dim, q * n, n)

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
        """The slots this ep rank holds, ``[e0, e1)``: under the static placement, its experts."""
        n = num_experts // self.ep
        return self.ep_rank * n, (self.ep_rank + 1) * n

    def slot_ids(self, experts_TK: torch.Tensor) -> torch.Tensor:
        """The slots of the routed experts: the dispatch sends slot ``s``'s rows to ep rank
        ``s // (E / ep)``, local expert ``s % (E / ep)``. The static placement returns
        ``experts_TK`` itself (the same tensor, the same path)."""
        if self.copies is not None:
            return self._split_over_copies(experts_TK)
        if self._slot_of_E is None:
            return experts_TK
        if self._slot_of_E.device != experts_TK.device:
            self._slot_of_E = self._slot_of_E.to(experts_TK.device)
        return self._slot_of_E[experts_TK]

    def num_slots(self, num_experts: int) -> int:
        """How many slots the dispatch routes to: ``E``, plus the copy slots when there are copies."""
        return num_experts + (len(self.copies) if self.copies is not None else 0)

    def _split_over_copies(self, experts_TK: torch.Tensor) -> torch.Tensor:
        """The split rule (:func:`meshfold.plan.placement.split_counts` counts it on the host):
        this rank's ``j``-th pair (in token order) of the ``x`` routed to an expert has the key
        ``((2 j + 1) U) // (2 x)`` and goes to the instance whose cuts hold it (the expert's
        cuts: ``c`` increasing integers, the last the whole ``U``; instance 0 is the expert's own
        slot, then its copies in rank order), so each instance gets its share of the rank's rows
        to within one row. Slots run ``E / ep + R / ep`` per ep rank (its own, then its copy
        slots). No host read."""
        routes = self._routing(experts_TK.device)
        e_P = experts_TK.reshape(-1)  # pairs in token order
        order = torch.argsort(e_P, stable=True)
        seen_E = torch.zeros(self._num_experts, dtype=e_P.dtype, device=e_P.device).scatter_add_(
            0, e_P, torch.ones_like(e_P))  # not bincount, whose output size is read on the host
        first_E = torch.cumsum(seen_E, 0) - seen_E
        j_P = torch.empty_like(e_P)
        j_P[order] = torch.arange(e_P.numel(), device=e_P.device) - first_E[e_P[order]]
        cut_PC = routes.cut_EC[e_P]
        key_P = (2 * j_P + 1) * cut_PC[:, -1] // (2 * seen_E[e_P])
        pick_P = (key_P[:, None] >= cut_PC[:, :-1]).sum(1)
        return routes.slot_EC[e_P, pick_P].view_as(experts_TK)

    def set_copies(self, copies, num_experts: int, names, cuts=None) -> None:
        """Give ep rank ``k`` copy slots holding experts ``copies[k * R / ep ..]`` (None or empty:
        no copies), and split each expert's rows over its instances by ``cuts`` (per expert, one
        increasing integer per instance, the last the whole:
        :func:`meshfold.plan.placement.split_cuts`; None: evenly) (:meth:`slot_ids`).
        ``names``: the layer's expert weights (dim 0 over ep) whose local views :meth:`local`
        extends with the copies' rows. Only routing: the copies hold no state of their own."""
        if not copies:
            self.copies, self.cuts, self.copied, self._routes = None, None, frozenset(), None
            return
        copies = tuple(int(e) for e in copies)
        if (self.ep < 2 or len(copies) % self.ep or num_experts % self.ep
                or any(not 0 <= e < num_experts for e in copies)):
            raise ValueError(f"copies {list(copies)} of {num_experts} experts over ep = {self.ep}; valid: a "
                             f"multiple of ep >= 2 copy slots, each an expert id in 0 .. {num_experts - 1}")
        if cuts is not None:
            cuts = tuple(tuple(int(v) for v in k) for k in cuts)
            want = [1 + copies.count(e) for e in range(num_experts)]
            if ([len(k) for k in cuts] != want or any(k[0] < 0 or k[-1] <= 0 for k in cuts)
                    or any(b < a for k in cuts for a, b in zip(k, k[1:]))):
                raise ValueError(f"split cuts {[list(k) for k in cuts]}; valid: per expert one non-decreasing "
                                 f"integer >= 0 per instance ({want}), the last > 0")
        self.copies, self.cuts, self.copied, self._num_experts = copies, cuts, frozenset(names), num_experts
        self._routes = None

    def _routing(self, device) -> "_Routes":
        """The routes of the current (slots, copies) on ``device``, built and moved there once."""
        if self._routes is None:
            self._routes = _Routes.of(self.slots or tuple(range(self._num_experts)), self.copies, self.cuts,
                                      self.ep, self.ep_rank)
        if self._routes.slot_EC.device != torch.device(device):
            fields = (getattr(self._routes, f.name) for f in dataclasses.fields(_Routes))
            self._routes = _Routes(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in fields))
        return self._routes

    def set_slots(self, slots) -> None:
        """Route by placement ``slots`` (a permutation of the experts; None or the identity: the
        static placement). Only the routing: moving the weights is
        :func:`meshfold.parallel.expert_placement.replace_experts`."""
        if slots is None or list(slots) == list(range(len(slots))):
            self.slots, self._slot_of_E, self._routes = None, None, None
            return
        slots = tuple(int(e) for e in slots)
        if sorted(slots) != list(range(len(slots))) or len(slots) % self.ep:
            raise ValueError(f"expert placement {list(slots)}; valid: a permutation of range(E) with ep = "
                             f"{self.ep} dividing E")
        self.slots, self._slot_of_E = slots, slot_of_expert(slots)
        self._routes = None

    @functools.cached_property
    def experts_mesh(self):
        """The ``(ep, etp)`` block of the MoE mesh that one dispatch spans."""
        return self.moe["ep", "etp"]

    def read_counts(self, counts_E) -> BlockCounts:
        """The counts of the whole dispatch block read on the host, with the rows this rank sends
        (its kept pairs when dropping): the forward's one host read, which :meth:`dispatch` of
        these same counts takes as ``read`` instead of reading again."""
        block = block_counts(counts_E, self.experts_mesh)
        return BlockCounts(rows_sent(block[1], self.experts_mesh), block)

    def dispatch(self, x_NH, counts_E, read: "BlockCounts | None" = None) -> Routed:
        """This rank's expert-major rows to their experts: ``routed.tokens`` is a RaggedTensor on
        the ``(ep, etp)`` mesh (:func:`meshfold.placements.dispatch`). ``read``:
        :meth:`read_counts` of these same ``counts_E`` (None: read here)."""
        return dispatch(x_NH, counts_E, self.experts_mesh, block=None if read is None else read.block)

    def dispatch_start(self, x_NH, counts_E, read: "BlockCounts | None" = None):
        """:meth:`dispatch` with its all-to-all over ``ep`` left in flight: ``.wait()`` gives the
        Routed rows (:func:`meshfold.placements.token_dispatch.dispatch_start`). With
        ``overlap = False``: the synchronous :meth:`dispatch` (the same result; for A/B tests)."""
        if not self.overlap:
            return Arrived(self.dispatch(x_NH, counts_E, read))
        return dispatch_start(x_NH, counts_E, self.experts_mesh, block=None if read is None else read.block)

    def combine(self, routed: Routed, y_MH):
        """The experts' outputs (summands over etp) back to the rows' ranks, in permute order."""
        return combine(routed.outputs(y_MH), routed)

    # ---- shared expert: a TP MLP with sequence parallelism ----
    def shared_in(self, x_TH):
        if self.tp == 1:
            return x_TH
        sizes = self._even_sizes(x_TH.shape[0], "tp", x_TH.device)  # even sequence-parallel split
        return all_gather_v(x_TH, sizes, self.attn, "tp")

    def shared_out(self, y_TH):
        """The tp group's rows [tp * T, H] back to this rank's T: the split is even (shared_in
        checked it), so the sizes follow from the rows."""
        if self.tp == 1:
            return y_TH
        return reduce_scatter_v(y_TH, [y_TH.shape[0] // self.tp] * self.tp, self.attn, "tp")


def place(param: torch.Tensor, mesh, placements, local: torch.Tensor | None = None) -> torch.nn.Parameter:
    """``param`` as a DTensor parameter laid out as ``placements`` on ``mesh``: sliced from the
    full tensor every rank holds, or, given ``local`` (this rank's shard, e.g. read from a
    checkpoint), assembled from the shards without any rank holding the whole (``param`` may then
    be on the meta device).

    When to use it: whenever code of your own lays a parameter out on a fold's mesh (a module
    the layout functions do not place, a hand-written layout), instead of ``distribute_tensor``
    or ``DTensor.from_local``. The parameter is guaranteed to live on the very ``mesh`` object
    passed in: DTensor caches its ops by mesh *equality*, so once several folds have been built in
    one process (tests, a notebook, a sweep) a DTensor made the plain way may carry an equal mesh
    of an earlier fold, and FSDP2, which groups parameters by mesh identity, then fails in
    ``fully_shard`` with "Expected param's DTensor mesh to be the same mesh passed to
    fully_shard". Pass a pipeline stage's mesh (``folded.stage("attn")`` / ``"moe"``), the
    object ``fully_shard`` will be given."""
    if local is None:
        sl = local_slices(param.shape, mesh, placements)
        local = _shard(param.detach(), [s.start for s in sl], [s.stop for s in sl])
    stride = torch.empty(param.shape, device="meta").stride()
    dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=param.shape, stride=stride)
    out = torch.nn.Parameter(dt, requires_grad=param.requires_grad)
    if out.device_mesh is not mesh:
        # DTensor's op cache treats equal meshes as one and may return an equal mesh of an
        # earlier fold; FSDP2 groups parameters by mesh identity, so pin ours
        out._spec = dataclasses.replace(out._spec, mesh=mesh)
    return out


@spmd.per_rank  # under LocalTensorMode the slices differ by simulated rank
def _shard(full: torch.Tensor, starts: list[int], stops: list[int]) -> torch.Tensor:
    return full[tuple(slice(a, b) for a, b in zip(starts, stops))].clone()


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
        check_etp_alignment(cfg.hidden, cfg.ffn, cfg.expert_sparsity.tile, etp, "N")
        check_etp_alignment(cfg.ffn, cfg.hidden, cfg.expert_sparsity.tile, etp, "K")


def parallelize_moe(layer, folded, local_state: dict | None = None, *, layout: dict | None = None,
                    compute_dtype: torch.dtype | None = None,
                    keep_dtype: Mapping[str, torch.dtype | None] | None = None) -> None:
    """Apply ``layout`` (default :data:`MOE_LAYOUT`): turn ``layer``'s parameters into DTensors
    on the folded mesh (from the full weights every rank holds, e.g. after seeding identically, or
    from this rank's shards in ``local_state``, keyed by parameter name within the layer) and give
    the layer a :class:`FoldedComm`. A layer with parameters of its own passes a layout that
    extends MOE_LAYOUT (``{**MOE_LAYOUT, name: (view, placements)}``) rather than editing the
    library table. ``compute_dtype``: the dtype the layer computes in (None: its parameters').
    ``keep_dtype``: parameter name within the layer -> the dtype the layer sees it in instead
    under ``compute_dtype`` (None: its own); by default every parameter of the ``layer.router``
    module keeps its own dtype (a router of the user's own with several parameters too: routing
    runs in the router's precision, e.g. fp32 under bf16); a mapping given replaces that default.
    Raises if the layer's sizes do not divide over the mesh or ``keep_dtype`` names no parameter
    of the layer."""
    if keep_dtype is None:
        keep_dtype = {f"router.{name}": None for name, _ in layer.router.named_parameters()}
    names = [name for name, _ in layer.named_parameters()]
    unknown = [name for name in keep_dtype if name not in names]
    if unknown:
        raise ValueError(f"keep_dtype names {unknown}, which are not parameters of the layer ({names})")
    comm = FoldedComm(folded, compute_dtype, keep_dtype)
    check_moe_fold(layer.cfg, comm.ep, comm.etp, comm.tp)
    for name, param in list(layer.named_parameters()):
        mesh, placements = moe_param_layout(name, comm, layout)
        module_name, _, attr = name.rpartition(".")
        module = layer.get_submodule(module_name)
        setattr(module, attr, place(param, mesh, placements, None if local_state is None else local_state[name]))
    layer.comm = comm
