"""Tile-sparse grouped GEMM on CPU that skips the pruned tiles, in forward, dX and dW.

Legend: M = token rows (expert-major), K = input dim, N = output dim, E = experts, (bk, bn) = mask
tile. One GEMM here reduces over R rows into C output columns, cut into (br, bc) tiles: R, C = K, N
for the forward and dW, N, K for dX (the transposed mask).

Guo et al. (SC 2020, arXiv 2008.13006, Sec. 4) run a tile-wise sparse GEMM as one smaller dense
GEMM per stripe of output columns, over the reduction rows that stripe keeps, gathered by an
index array. This module does that for every expert:

* A mask [E, Rt, Ct] is compacted into a :class:`Plan`: per expert, adjacent output-tile columns
  whose kept reduction tiles agree merge into one stripe, which holds the index array of its kept
  reduction tiles. A TW stripe of G columns is one stripe (whatever bn), an unpruned expert is
  one stripe over all of C that runs on views, and the tile pattern gives stripes of bc columns.
  A plan depends only on the mask's values and is cached by them (:func:`plan`), so it is built
  once per prune, not once per step.
* forward ``y_e[:, s] = x_e[:, kept_s] @ w_e[kept_s, s]``, and dX ``dx_e[:, s] = dy_e[:, kept_s]
  @ w_e[s, kept_s]^T`` with the plan of the transposed mask (stripes of K columns, each keeping
  its own N tiles), so that every output element is one GEMM's and nothing accumulates across
  stripes. Each stripe's kept weight rows are gathered into a compact copy, and the kept columns
  of x (dy) from each row block, tile by tile (runs of br contiguous elements).
* dW ``dw_e[kept_s, s] = x_e[:, kept_s]^T @ dy_e[:, s]`` per N stripe, or per K stripe of the
  transposed plan (``dw_e[s, kept_s] = x_e[:, s]^T @ dy_e[:, kept_s]``), whichever gathers
  fewer elements, scattered into a zeroed dw: pruned tiles are exact zeros, never computed.
* Every GEMM is one ``mm`` accumulating in fp32 for bf16 / fp16 and rounded once, as the dense
  path. Each (row block or expert, stripe) is a task of the CPU pool (:mod:`.cpu_pool`) writing
  its own outputs, so results do not depend on scheduling.

Whether this pays depends on how much is pruned and on the GEMM shape (narrow stripes and thin
experts run the BLAS far below its best rate), so :func:`choose` picks, per call, the dense masked
GEMM or this one by a rule measured on the CPU (benchmarks/RESULTS.md, "Tile sparsity on CPU").
:func:`execution` forces one of the two.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from meshfold.kernels import cpu_grouped
from meshfold.kernels.cpu_grouped import TASKS_PER_WORKER
from meshfold.kernels.cpu_pool import MAX_WORKERS, blocks, run_tasks
from meshfold.kernels.reference import apply_tile_mask, tile_shape

__all__ = ["EXECUTIONS", "Plan", "Stripe", "choose", "execution", "executions", "plan", "sparse_mm",
           "sparse_mm_dx", "sparse_mm_dw"]

EXECUTIONS = ("auto", "compact", "masked")
# the rule of choose() (benchmarks/RESULTS.md, "Tile sparsity on CPU")
COMPACT_BELOW = 0.6  # kept fraction under which compact beats masked (it does at 0.5, not at 0.75)
MIN_STRIPE_COLUMNS = 16  # narrower pruned stripes run the BLAS far below its rate (masked wins at 8)
MIN_ROWS_PER_EXPERT = 8  # the fewest measured (compact still won there); below it, unmeasured: masked
ROW_BLOCK = 512  # token rows per task of the row GEMMs (cpu_grouped's reasoning)
PLAN_CACHE = 256  # plans kept (two per sparse weight: its mask and the transposed one)

_execution = "auto"
_ran = {"dense": 0, "compact": 0, "masked": 0}  # tile-masked GEMMs run each way since executions()
_plans: OrderedDict[tuple, Plan] = OrderedDict()
_plans_lock = threading.Lock()


# ----------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class Stripe:
    """Output columns [c0, c1) of one expert that keep the same reduction tiles.

    kept: int64 indices of the kept reduction tiles, or None when every tile is kept (the GEMM
    then runs on views); kept_rows: the same as indices of reduction rows. rows: the number of
    kept reduction rows (kept tiles x br)."""

    c0: int
    c1: int
    kept: torch.Tensor | None
    kept_rows: torch.Tensor | None
    rows: int


class Plan:
    """A tile mask [E, Rt, Ct] for R x C weights, compacted into stripes per expert.

    ``kept_fraction`` and ``mean_stripe_columns`` (the mean width of stripes pruned in part; C
    when none is) are computed at once, for :func:`choose`; ``stripes`` (per expert, a tuple of
    :class:`Stripe`) on first use, so a mask that runs masked (e.g. unstructured) never pays for it.
    """

    def __init__(self, mask: torch.Tensor, R: int, C: int):
        E, Rt, Ct = mask.shape
        self.mask, self.R, self.C = mask, R, C
        self.tile = tile_shape(mask, R, C)  # (br, bc)
        self.kept_fraction = float(mask.float().mean()) if mask.numel() else 1.0
        starts = torch.ones(E, Ct, dtype=torch.bool)
        starts[:, 1:] = (mask[:, :, 1:] != mask[:, :, :-1]).any(dim=1)  # a column unlike its left neighbour
        first = starts.flatten().nonzero().flatten()  # flat e * Ct + column of each stripe's first column
        width = torch.diff(first, append=torch.tensor([E * Ct]))  # each expert's first column starts a stripe
        kept = mask.sum(dim=1).flatten()[first]
        partial = (kept > 0) & (kept < Rt)
        self.mean_stripe_columns = float(width[partial].double().mean()) * self.tile[1] if partial.any() else float(C)
        self._starts = starts
        self._stripes: tuple[tuple[Stripe, ...], ...] | None = None

    @property
    def all_kept(self) -> bool:
        return self.kept_fraction == 1.0

    @property
    def stripes(self) -> tuple[tuple[Stripe, ...], ...]:
        if self._stripes is None:
            self._stripes = tuple(self._expert_stripes(e) for e in range(self.mask.shape[0]))
        return self._stripes

    def _expert_stripes(self, e: int) -> tuple[Stripe, ...]:
        (br, bc), Rt, Ct = self.tile, self.mask.shape[1], self.mask.shape[2]
        bounds = self._starts[e].nonzero().flatten().tolist() + [Ct]
        out = []
        for a, b in zip(bounds, bounds[1:]):
            kept = self.mask[e, :, a].nonzero().flatten()
            n = kept.numel()
            if n == Rt:
                out.append(Stripe(a * bc, b * bc, None, None, self.R))
            else:
                kept_rows = (kept[:, None] * br + torch.arange(br)).flatten()
                out.append(Stripe(a * bc, b * bc, kept, kept_rows, n * br))
        return tuple(out)


def plan(tile_mask: torch.Tensor, R: int, C: int) -> Plan:
    """The :class:`Plan` of ``tile_mask`` [E, R // br, C // bc] for weights of R x C, from the
    cache when a mask with the same values was planned before. The cache key is the mask's
    bytes: a pruned mask, whatever tensor holds it, gets a new plan, and a stale one is never
    used; checking costs one pass over the (small) mask per call."""
    # a copy: the plan keeps it (its stripes are built on first use), and the caller's tensor is
    # typically a layer's mask buffer that the pruner rewrites in place
    mask = tile_mask.detach().to("cpu", torch.bool, copy=True).contiguous()
    key = (tuple(mask.shape), R, C, mask.numpy().tobytes())
    with _plans_lock:
        found = _plans.get(key)
        if found is not None:
            _plans.move_to_end(key)
            return found
    built = Plan(mask, R, C)
    with _plans_lock:
        _plans[key] = built
        while len(_plans) > PLAN_CACHE:
            _plans.popitem(last=False)
    return built


# ----------------------------------------------------------------------------- choice


@contextlib.contextmanager
def execution(mode: str):
    """Force how tile-masked CPU GEMMs run in this process: ``"compact"`` (this module),
    ``"masked"`` (the dense GEMM on the masked weight) or ``"auto"`` (:func:`choose`)."""
    global _execution
    if mode not in EXECUTIONS:
        raise ValueError(f"execution={mode!r}; valid: {', '.join(EXECUTIONS)}")
    before, _execution = _execution, mode
    try:
        yield
    finally:
        _execution = before


def executions() -> dict[str, int]:
    """How many tile-masked CPU GEMMs (forward, dX and dW each count) ran ``"dense"``,
    ``"compact"`` and ``"masked"`` in this process since the last call (which resets them)."""
    out = dict(_ran)
    for k in _ran:
        _ran[k] = 0
    return out


def _chosen(p: Plan, rows: int, experts: int) -> str:
    how = choose(p, rows, experts)
    _ran[how] += 1
    return how


def choose(p: Plan, rows: int, experts: int) -> str:
    """``"dense"`` (nothing pruned: the unmasked GEMM, no mask pass), ``"compact"`` or
    ``"masked"`` for a GEMM of ``rows`` token rows over ``experts`` experts with plan ``p``.

    The rule, measured (benchmarks/RESULTS.md, "Tile sparsity on CPU"): compact when the kept
    fraction is below COMPACT_BELOW, the stripes pruned in part are at least MIN_STRIPE_COLUMNS
    wide on average and experts get at least MIN_ROWS_PER_EXPERT rows on average; masked
    otherwise."""
    if p.all_kept:
        return "dense"
    if _execution != "auto":
        return _execution
    pays = (p.kept_fraction < COMPACT_BELOW and p.mean_stripe_columns >= MIN_STRIPE_COLUMNS
            and rows >= MIN_ROWS_PER_EXPERT * experts)
    return "compact" if pays else "masked"


# ----------------------------------------------------------------------------- the three ops


def sparse_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, tile_mask: torch.Tensor) -> torch.Tensor:
    """y [M, N] = x [M, K] @ (w_e * mask_e) per expert row group (rows past offsets[-1]: zero)."""
    E, K, N = w.shape
    p = plan(tile_mask, K, N)
    how = _chosen(p, x.shape[0], E)
    if how == "compact":
        return _rows_mm(x, w, offsets, p, transposed=False)
    return cpu_grouped.rows_mm(x, w if how == "dense" else apply_tile_mask(w, tile_mask), offsets)


def sparse_mm_dx(dy: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, tile_mask: torch.Tensor) -> torch.Tensor:
    """dx [M, K] = dy [M, N] @ (w_e * mask_e)^T per expert row group."""
    E, K, N = w.shape
    p = plan(tile_mask.transpose(1, 2), N, K)
    how = _chosen(p, dy.shape[0], E)
    if how == "compact":
        return _rows_mm(dy, w, offsets, p, transposed=True)
    return cpu_grouped.rows_mm(dy, (w if how == "dense" else apply_tile_mask(w, tile_mask)).transpose(1, 2), offsets)


def sparse_mm_dw(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, tile_mask: torch.Tensor) -> torch.Tensor:
    """dw [E, K, N] = (x_e^T @ dy_e) * mask_e; pruned tiles are exact zeros."""
    K, N = x.shape[1], dy.shape[1]
    p = plan(tile_mask, K, N)
    how = _chosen(p, x.shape[0], offsets.numel())
    if how == "compact":
        return _dw_mm(x, dy, offsets, p, plan(tile_mask.transpose(1, 2), N, K))
    dw = cpu_grouped.dw_mm(x, dy, offsets)
    return dw if how == "dense" else apply_tile_mask(dw, tile_mask)


# ----------------------------------------------------------------------------- compacted GEMMs


def _row_blocks(ends: list[int]) -> list[tuple[int, int, int]]:
    """(expert, r0, r1) blocks of at most ROW_BLOCK rows; experts without rows have none."""
    out, start = [], 0
    for e, end in enumerate(ends):
        if end > start:
            out += [(e, start + s, start + t) for s, t in blocks(end - start, ROW_BLOCK)]
        start = end
    return out


def _chunks(stripes: tuple[Stripe, ...], parts: int) -> list[tuple[Stripe, ...]]:
    """``stripes`` in at most ``parts`` consecutive runs of about equal kept work (one pool task
    each: fewer, longer tasks keep Python's per-task cost small)."""
    parts = max(1, min(parts, len(stripes)))
    total = sum(max(s.rows, 1) * (s.c1 - s.c0) for s in stripes)
    out, run, done = [], [], 0
    for s in stripes:
        run.append(s)
        done += max(s.rows, 1) * (s.c1 - s.c0)
        if done * parts >= total * (len(out) + 1) and len(out) < parts - 1:
            out.append(tuple(run))
            run = []
    return out + [tuple(run)] if run else out


def _gathered(p: Plan) -> int:
    """Rows that running every stripe of plan ``p`` gathers per token row (unpruned stripes
    run on views and gather nothing)."""
    return sum(s.rows for stripes in p.stripes for s in stripes if s.kept is not None)


def _tasks_per(units: int) -> int:
    """Pool tasks to cut each of ``units`` independent pieces of work into, so that every worker
    gets several tasks."""
    return -(-TASKS_PER_WORKER * min(torch.get_num_threads(), MAX_WORKERS) // max(units, 1))


def _kept_columns(a: torch.Tensor, s: Stripe, br: int) -> torch.Tensor:
    """a [m, R] (contiguous rows) -> its columns kept by stripe ``s`` as a contiguous [m, rows]
    tensor, gathered tile by tile (runs of br elements: no transposed copy needed)."""
    return a.view(a.shape[0], -1, br).index_select(1, s.kept).view(a.shape[0], s.rows)


def _compact_weight(w_e: torch.Tensor, s: Stripe, p: Plan, transposed: bool) -> torch.Tensor:
    """Stripe ``s``'s kept rows of B_e as a contiguous [rows, c1 - c0] tensor: B_e = w_e [R, C],
    or w_e^T for ``transposed`` (w_e [C, R]; then the result is a transposed view of a contiguous
    [c1 - c0, rows] tensor). Each gathers contiguous runs of w_e's rows, the fastest of the ways
    measured."""
    if transposed:
        return _kept_columns(w_e[s.c0:s.c1], s, p.tile[0]).t()
    return w_e[:, s.c0:s.c1].index_select(0, s.kept_rows)


def _rows_mm(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, p: Plan, *, transposed: bool) -> torch.Tensor:
    """c [M, C] = a [M, R] @ B_e per expert row group over the kept tiles of plan ``p``, with
    B_e = w_e [R, C], or w_e^T for ``transposed`` (w [E, C, R]: dX with the transposed mask's
    plan). A first pass on the pool gathers each stripe's compact weight; then one GEMM per
    (row block, stripe) over the columns of ``a`` the stripe keeps, gathered from the block."""
    a, w = a.detach().contiguous(), w.detach().contiguous()
    br = p.tile[0]
    ends = offsets.tolist()
    c = a.new_empty((a.shape[0], p.C))
    c[ends[-1]:] = 0
    row_blocks = _row_blocks(ends)
    weights: dict[tuple[int, int], torch.Tensor] = {}

    def compact_weights(e: int) -> None:
        for s in p.stripes[e]:
            if s.kept is not None and s.rows:
                weights[e, s.c0] = _compact_weight(w[e], s, p, transposed)

    run_tasks([functools.partial(compact_weights, e) for e in sorted({e for e, _, _ in row_blocks})])

    def gemms(e: int, r0: int, r1: int, stripes: tuple[Stripe, ...]) -> None:
        for s in stripes:
            out = c[r0:r1, s.c0:s.c1]
            if not s.rows:
                out.zero_()
            elif s.kept is None:
                torch.mm(a[r0:r1], w[e, s.c0:s.c1].t() if transposed else w[e, :, s.c0:s.c1], out=out)
            else:
                torch.mm(_kept_columns(a[r0:r1], s, br), weights[e, s.c0], out=out)

    parts = _tasks_per(len(row_blocks))
    run_tasks([functools.partial(gemms, e, r0, r1, chunk) for e, r0, r1 in row_blocks
               for chunk in _chunks(p.stripes[e], parts)])
    return c


def _dw_mm(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, p: Plan, pT: Plan) -> torch.Tensor:
    """dw [E, K, N] = x_e^T @ dy_e over the kept tiles of plan ``p`` (of the [E, Kt, Nt] mask;
    ``pT``: of its transpose): one GEMM per stripe over the columns it keeps, the reduction over
    the expert's rows inside it (nothing accumulates across GEMMs), its result scattered tile by
    tile into the stripe's block of dw, which the same task zeroes first: pruned tiles and
    experts without rows are exact zeros, never computed.

    Either plan's stripes cover dw: the N stripes of ``p`` (each keeps K tiles: x's kept columns
    are gathered) or the K stripes of ``pT`` (each keeps N tiles: dy's kept columns are gathered).
    The one that gathers fewer elements runs: per expert row, a plan gathers the kept rows of
    every stripe it runs, kept elements / mean stripe width, so the plan of wider stripes wins
    (TW: the N stripes of G columns, not the K stripes of bk rows)."""
    x, dy = x.detach().contiguous(), dy.detach().contiguous()
    K, N, E = x.shape[1], dy.shape[1], offsets.numel()
    ends = offsets.tolist()
    starts = [0] + ends[:-1]
    by_k = _gathered(pT) < _gathered(p)
    q = pT if by_k else p  # q's stripes cut dw's K rows (by_k) or N columns
    dw = x.new_empty((E, K, N))

    def gemms(e: int, stripes: tuple[Stripe, ...]) -> None:
        m0, m1 = starts[e], ends[e]
        for s in stripes:
            out = dw[e, s.c0:s.c1] if by_k else dw[e, :, s.c0:s.c1]
            if m1 == m0 or not s.rows:
                out.zero_()
            elif by_k:  # dw[e, c0:c1, kept N] = x_e[:, c0:c1]^T @ dy_e[:, kept N]
                x_s = x[m0:m1, s.c0:s.c1].t().contiguous()  # the BLAS runs a thin GEMM faster on contiguous operands
                if s.kept is None:
                    torch.mm(x_s, dy[m0:m1], out=out)
                else:
                    part = torch.mm(x_s, _kept_columns(dy[m0:m1], s, q.tile[0]))  # [c1 - c0, rows]
                    out.zero_()
                    out.view(s.c1 - s.c0, -1, q.tile[0]).index_copy_(1, s.kept, part.view(s.c1 - s.c0, -1, q.tile[0]))
            else:  # dw[e, kept K, c0:c1] = x_e[:, kept K]^T @ dy_e[:, c0:c1]
                dy_s = dy[m0:m1, s.c0:s.c1].contiguous()
                if s.kept is None:
                    torch.mm(x[m0:m1].t(), dy_s, out=out)
                else:
                    part = torch.mm(_kept_columns(x[m0:m1], s, q.tile[0]).t(), dy_s)  # [rows, c1 - c0]
                    out.zero_()
                    out.view(-1, q.tile[0], s.c1 - s.c0).index_copy_(0, s.kept, part.view(-1, q.tile[0], s.c1 - s.c0))

    parts = _tasks_per(E)
    run_tasks([functools.partial(gemms, e, chunk) for e in range(E) for chunk in _chunks(q.stripes[e], parts)])
    return dw
