"""``grouped_mm``: the expert GEMM of an MoE layer, one entry point for every device.

Legend: M = token rows (expert-major), K = input dim, N = output dim, E = experts.

``grouped_mm(x [M, K], w [E, K, N], offsets [E] int32)`` returns y [M, N] with
``y[o_{e-1}:o_e] = x[o_{e-1}:o_e] @ w_e`` (see :mod:`meshfold.kernels.reference` for the exact
contract and the tile-mask format). Backends:

* ``"triton"``: the Triton kernels (CUDA, or the CPU interpreter under ``TRITON_INTERPRET=1``);
  offsets stay on the device, nothing syncs with the host.
* ``"torch"``: on CPU, :mod:`.cpu_grouped` (one ``mm`` per expert block, shared among a few
  threads; it reads the offsets on the host, as every CPU path does). On CUDA, ``F.grouped_mm``
  where its rules hold (bf16, every row stride a multiple of 16 bytes), else a per-expert loop
  that reads the offsets on the host.
* ``"reference"``: the plain loop of :mod:`.reference`, differentiated by autograd.
* ``"auto"``: ``"triton"`` for CUDA tensors of fp32/fp16/bf16 (and mask tiles in multiples of
  16), ``"torch"`` otherwise.

The triton and torch backends are the custom ops ``meshfold::grouped_mm`` (forward),
``meshfold::grouped_mm_dx`` and ``meshfold::grouped_mm_dw`` (its two backward GEMMs), each with a
fake implementation and autograd formula, so ``torch.compile`` treats them as opaque nodes and
double backward works (the three ops are linear and differentiate into each other).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshfold.kernels import cpu_grouped, cpu_sparse
from meshfold.kernels.reference import apply_tile_mask, grouped_mm_reference, tile_shape

BACKENDS = ("auto", "triton", "torch", "reference")
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, *,
               tile_mask: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """y [M, N] = x [M, K] @ w [E, K, N] per expert row group, in x.dtype with fp32 accumulation.

    offsets [E] int32: cumulative end row per expert (``F.grouped_mm``'s ``offs``); offsets[-1]
    may be < M and rows past it get zeros. tile_mask [E, K // bk, N // bn] bool (tile size implied
    by its shape): ``False`` prunes that bk x bn block of w_e, in forward and in both gradients.
    Differentiable w.r.t. x and w. Offset values are checked only when offsets live on the CPU:
    on CUDA a check would cost a host sync, so invalid offsets there give undefined rows.
    """
    _check_args(x, w, offsets, tile_mask, backend)
    if backend == "reference":
        return grouped_mm_reference(x, w, offsets, tile_mask)
    return torch.ops.meshfold.grouped_mm(x, w, offsets, tile_mask, _resolve_backend(x, w, tile_mask, backend))


def _check_args(x, w, offsets, tile_mask, backend) -> None:
    """Shape/dtype checks (no sync); offset values too when they are on the CPU."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; valid: {', '.join(BACKENDS)}")
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"expected x [M, K] and w [E, K, N], got x {tuple(x.shape)} and w {tuple(w.shape)}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"w.shape[1] = {w.shape[1]} but x.shape[1] = {x.shape[1]}: w must be [E, K={x.shape[1]}, N]")
    if x.dtype != w.dtype or x.dtype not in DTYPES:
        raise ValueError(f"x.dtype = {x.dtype}, w.dtype = {w.dtype}; both must be one of "
                         f"{', '.join(str(d) for d in DTYPES)}")
    if offsets.dtype != torch.int32 or offsets.dim() != 1 or offsets.numel() != w.shape[0] or w.shape[0] == 0:
        fewer = offsets.dim() == 1 and 1 <= offsets.numel() < w.shape[0]
        raise ValueError(f"offsets must be int32 [E={w.shape[0]}] (E >= 1), got {offsets.dtype} "
                         f"{tuple(offsets.shape)}" + (
                             f": w holds {w.shape[0]} experts but offsets counts {offsets.numel()}; under expert "
                             f"parallelism a rank holds only its own experts, so an MoE layer's experts read "
                             f"their weights through local(name, param) (this rank's shard, e.g. "
                             f"local('experts.w1', self.w1)), never the parameter itself" if fewer else ""))
    if not (x.device == w.device == offsets.device):
        raise ValueError(f"x, w, offsets on {x.device}, {w.device}, {offsets.device}; they must share one device")
    if tile_mask is not None:
        if tile_mask.dtype != torch.bool or tile_mask.device != x.device:
            raise ValueError(f"tile_mask must be bool on {x.device}, got {tile_mask.dtype} on {tile_mask.device}")
        if tile_mask.dim() != 3 or tile_mask.shape[0] != w.shape[0]:
            raise ValueError(f"tile_mask shape {tuple(tile_mask.shape)}; expected [E={w.shape[0]}, K // bk, N // bn]")
        tile_shape(tile_mask, w.shape[1], w.shape[2])
    if offsets.device.type == "cpu" and not torch.compiler.is_compiling():
        _check_offset_values(offsets, x.shape[0])


def _check_offset_values(offsets: torch.Tensor, M: int) -> None:
    ends = offsets.tolist()
    starts = [0] + ends[:-1]
    for e, (start, end) in enumerate(zip(starts, ends)):
        if end < start:
            raise ValueError(f"offsets must be non-decreasing from 0: offsets[{e}] = {end} < {start} "
                             f"(offsets = {ends})")
    if ends[-1] > M:
        raise ValueError(f"offsets[-1] = {ends[-1]} > M = {M} rows of x (valid: offsets[-1] <= {M})")


def _resolve_backend(x: torch.Tensor, w: torch.Tensor, tile_mask: torch.Tensor | None, backend: str) -> str:
    """"auto" -> "triton" when the kernels can run it (CUDA, fp32/fp16/bf16, mask tiles that hold
    whole tl.dot blocks), else "torch"; an explicit "triton" that cannot run raises."""
    from meshfold.kernels import triton_grouped

    fast_dtype = x.dtype in triton_grouped.SUPPORTED_DTYPES
    tile = None if tile_mask is None else tile_shape(tile_mask, w.shape[1], w.shape[2])
    tile_ok = tile is None or (tile[0] % 16 == 0 and tile[1] % 16 == 0)
    if backend == "auto":
        return "triton" if x.is_cuda and fast_dtype and tile_ok else "torch"
    if backend == "triton":
        if not fast_dtype:
            raise ValueError(f"backend='triton' supports fp32/fp16/bf16, got {x.dtype} (use backend='torch')")
        if not tile_ok:
            raise ValueError(f"backend='triton' needs mask tiles bk x bn in multiples of 16 (tl.dot's smallest "
                             f"block), got {tile[0]} x {tile[1]} (use backend='torch' or larger tiles)")
        if not x.is_cuda and not triton_grouped.interpreting():
            raise ValueError(f"backend='triton' needs CUDA tensors or TRITON_INTERPRET=1 set before triton is "
                             f"imported; x is on {x.device} (use backend='torch' or 'auto')")
    return backend


# ----------------------------------------------------------------------------- torch path


def _f_grouped_mm_ok(*tensors: torch.Tensor) -> bool:
    """Whether F.grouped_mm accepts these CUDA operands: bf16, a unit stride in one of the last
    two dims, and every other stride (and the base address) a multiple of 16 bytes."""
    if tensors[0].dtype != torch.bfloat16:
        return False
    for t in tensors:
        es = t.element_size()
        if 1 not in t.stride()[-2:] or t.data_ptr() % 16:
            return False
        if any((s * es) % 16 for s in t.stride() if s != 1):
            return False
    return True


def _masked(w: torch.Tensor, tile_mask: torch.Tensor | None) -> torch.Tensor:
    return w if tile_mask is None else apply_tile_mask(w, tile_mask)


def _torch_rows(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """c [M, N] = a [M, K] @ b [E, K, N] per row group; rows past offsets[-1] are zero."""
    if a.device.type == "cpu":
        return cpu_grouped.rows_mm(a, b, offsets)
    M, N = a.shape[0], b.shape[2]
    if _f_grouped_mm_ok(a, b):
        c = F.grouped_mm(a, b, offs=offsets)  # leaves rows past offsets[-1] unset
        owned = torch.arange(M, device=a.device) < offsets[-1]  # no host sync on a device
        return torch.where(owned[:, None], c, torch.zeros((), dtype=c.dtype, device=c.device))
    c = a.new_zeros((M, N))
    start = 0
    for e, end in enumerate(offsets.tolist()):
        torch.matmul(a[start:end], b[e], out=c[start:end])
        start = end
    return c


def _torch_dw(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """dw [E, K, N] = x_e^T [K, M_e] @ dy_e [M_e, N] per expert (zero for experts without rows)."""
    if x.device.type == "cpu":
        return cpu_grouped.dw_mm(x, dy, offsets)
    if _f_grouped_mm_ok(x.t(), dy):
        return F.grouped_mm(x.t(), dy, offs=offsets)
    dw = x.new_zeros((offsets.numel(), x.shape[1], dy.shape[1]))
    start = 0
    for e, end in enumerate(offsets.tolist()):
        torch.matmul(x[start:end].t(), dy[start:end], out=dw[e])
        start = end
    return dw


# ----------------------------------------------------------------------------- custom ops


@torch.library.custom_op("meshfold::grouped_mm", mutates_args=())
def _grouped_mm_op(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                   tile_mask: torch.Tensor | None, backend: str) -> torch.Tensor:
    """y [M, N] = x [M, K] @ (w_e * mask_e) per expert row group."""
    if backend == "triton":
        from meshfold.kernels.triton_grouped import triton_grouped_mm

        return triton_grouped_mm(x.contiguous(), w, offsets, tile_mask)
    if tile_mask is not None and x.device.type == "cpu":
        return cpu_sparse.sparse_mm(x, w, offsets, tile_mask)
    return _torch_rows(x, _masked(w, tile_mask), offsets)


@torch.library.custom_op("meshfold::grouped_mm_dx", mutates_args=())
def _grouped_mm_dx_op(dy: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                      tile_mask: torch.Tensor | None, backend: str) -> torch.Tensor:
    """dx [M, K] = dy [M, N] @ (w_e * mask_e)^T per expert row group."""
    if backend == "triton":
        from meshfold.kernels.triton_grouped import triton_grouped_mm_dx

        return triton_grouped_mm_dx(dy.contiguous(), w, offsets, tile_mask)
    if tile_mask is not None and dy.device.type == "cpu":
        return cpu_sparse.sparse_mm_dx(dy.contiguous(), w, offsets, tile_mask)
    return _torch_rows(dy.contiguous(), _masked(w, tile_mask).transpose(1, 2), offsets)


@torch.library.custom_op("meshfold::grouped_mm_dw", mutates_args=())
def _grouped_mm_dw_op(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor,
                      tile_mask: torch.Tensor | None, backend: str) -> torch.Tensor:
    """dw [E, K, N] = (x_e^T @ dy_e) * mask_e; pruned tiles are exactly zero."""
    if backend == "triton":
        from meshfold.kernels.triton_grouped import triton_grouped_mm_dw

        return triton_grouped_mm_dw(x.contiguous(), dy.contiguous(), offsets, tile_mask, x.dtype)
    if tile_mask is not None and x.device.type == "cpu":
        return cpu_sparse.sparse_mm_dw(x.contiguous(), dy.contiguous(), offsets, tile_mask)
    dw = _torch_dw(x.contiguous(), dy.contiguous(), offsets)
    return _masked(dw, tile_mask)


@_grouped_mm_op.register_fake
def _(x, w, offsets, tile_mask, backend):
    return x.new_empty((x.shape[0], w.shape[2]))


@_grouped_mm_dx_op.register_fake
def _(dy, w, offsets, tile_mask, backend):
    return dy.new_empty((dy.shape[0], w.shape[1]))


@_grouped_mm_dw_op.register_fake
def _(x, dy, offsets, tile_mask, backend):
    return x.new_empty((offsets.shape[0], x.shape[1], dy.shape[1]))


# The three ops are bilinear and close under differentiation:
#   y  = fwd(x, w)    -> dx = dX(dy, w),  dw = dW(x, dy)
#   dx = dX(dy, w)    -> d(dy) = fwd(g, w), dw = dW(g, dy)
#   dw = dW(x, dy)    -> dx = dX(dy, g),  d(dy) = fwd(x, g)
# (masking w or the product is the same linear projection, so the mask rides along.)


def _save_all(ctx, inputs, output):
    a, b, offsets, tile_mask, backend = inputs
    ctx.save_for_backward(a, b, offsets, tile_mask)
    ctx.backend = backend


def _fwd_backward(ctx, dy):
    x, w, offsets, tile_mask = ctx.saved_tensors
    dx = _grouped_mm_dx_op(dy, w, offsets, tile_mask, ctx.backend) if ctx.needs_input_grad[0] else None
    dw = _grouped_mm_dw_op(x, dy, offsets, tile_mask, ctx.backend) if ctx.needs_input_grad[1] else None
    return dx, dw, None, None, None


def _dx_backward(ctx, g):
    dy, w, offsets, tile_mask = ctx.saved_tensors
    d_dy = _grouped_mm_op(g, w, offsets, tile_mask, ctx.backend) if ctx.needs_input_grad[0] else None
    dw = _grouped_mm_dw_op(g, dy, offsets, tile_mask, ctx.backend) if ctx.needs_input_grad[1] else None
    return d_dy, dw, None, None, None


def _dw_backward(ctx, g):
    x, dy, offsets, tile_mask = ctx.saved_tensors
    dx = _grouped_mm_dx_op(dy, g, offsets, tile_mask, ctx.backend) if ctx.needs_input_grad[0] else None
    d_dy = _grouped_mm_op(x, g, offsets, tile_mask, ctx.backend) if ctx.needs_input_grad[1] else None
    return dx, d_dy, None, None, None


_grouped_mm_op.register_autograd(_fwd_backward, setup_context=_save_all)
_grouped_mm_dx_op.register_autograd(_dx_backward, setup_context=_save_all)
_grouped_mm_dw_op.register_autograd(_dw_backward, setup_context=_save_all)
