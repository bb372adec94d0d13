"""Triton grouped GEMM over expert-major tokens: forward, dX and dW, tile-mask aware.

Legend: M = token rows (expert-major), K = input dim, N = output dim, E = experts,
BLOCK_* = one kernel tile, MASK_BK x MASK_BN = one tile of the sparsity mask (a multiple of the
kernel tile), Kt = K // MASK_BK, Nt = N // MASK_BN.

Two kernels cover the three GEMMs of one expert layer:

* ``_grouped_rows_kernel``: ``C[o_e:o_{e+1}] = A[o_e:o_{e+1}] @ B_e`` with rows grouped by expert.
  Forward is ``A = x [M, K], B = w [E, K, N]``; dX is the same GEMM with ``A = dy [M, N]`` and
  ``B = w^T`` (a strided view, no copy) with the mask transposed.
* ``_grouped_dw_kernel``: ``dW_e = x_e^T @ dy_e`` for every expert, reducing over its rows.

Offsets stay on the device: each persistent program walks the expert list itself, so no
host sync is needed to learn the token counts. Rows past ``offsets[-1]`` form one more group
whose output tiles are written as zeros (no separate memset). A pruned tile is never loaded: for
every (expert, output column tile) a list of kept reduction tiles is built on the device
(the paper's index array, arXiv 2008.13006) and the inner loop runs over that list only, so the
work scales with density; pruned dW tiles are stored as exact zeros.

The interpreter (``TRITON_INTERPRET=1``, read when triton is imported) runs these kernels on CPU
for the tests; its ``tl.dot`` cannot multiply bf16, so in that mode operands are upcast to fp32
inside the kernel (loads and stores still use the real dtype).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    """True when triton runs kernels on the CPU interpreter (set before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


if interpreting():
    def _bound(x):
        """A loop bound as a Python int. The interpreter runs ``range`` on the host and turns a
        tensor bound into an int with ``int()`` of its data, a 1-element array, which numpy >= 2.4
        refuses in triton 3.6 (triton-lang/triton#9171); the interpreted kernel calls this plain
        function instead (the compiled one, the jit identity below)."""
        return int(x.handle.data.reshape(-1)[0]) if hasattr(x, "handle") else int(x)
else:
    @triton.jit
    def _bound(x):
        """A loop bound, unchanged (see the interpreter's version above)."""
        return x


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _grouped_rows_kernel(
    a_ptr, b_ptr, c_ptr, offs_ptr, kept_idx_ptr, kept_cnt_ptr,
    M, N, K, E,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    NT_MASK, KT_MASK,
    HAS_MASK: tl.constexpr, MASK_BK: tl.constexpr, MASK_BN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """C[M, N] = A[M, K] @ B[E, K, N] per row group; persistent over all (group, tile) pairs.

    kept_idx [E, NT_MASK, KT_MASK] / kept_cnt [E, NT_MASK]: kept K-tiles of each (expert,
    N mask tile), kept first in ascending order. Group E (rows past offsets[-1]) stores zeros.
    """
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    tile = pid  # global tile index this program handles next
    group_first_tile = pid * 0  # int32 zero, loop-carried
    row_start = pid * 0
    for g in range(0, _bound(E + 1)):
        row_end = tl.where(g < E, tl.load(offs_ptr + tl.minimum(g, E - 1)), M)
        num_tiles_m = tl.cdiv(row_end - row_start, BLOCK_M)
        group_last_tile = group_first_tile + num_tiles_m * num_tiles_n
        # tiles of earlier groups are done, so tile >= group_first_tile holds here
        while tile < group_last_tile:
            # GROUP_M consecutive M tiles share one column of B in L2 before moving along N
            local = tile - group_first_tile
            tiles_per_band = GROUP_M * num_tiles_n
            band_first_m = (local // tiles_per_band) * GROUP_M
            band_size = tl.minimum(num_tiles_m - band_first_m, GROUP_M)
            tm = band_first_m + (local % tiles_per_band) % band_size
            tn = (local % tiles_per_band) // band_size

            rows = row_start + tm * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
            cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
            row_ok = rows < row_end
            col_ok = cols < N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if g < E:
                a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_am  # [BLOCK_M, 1]
                b_cols = b_ptr + tl.cast(g, tl.int64) * stride_be + cols[None, :] * stride_bn
                if HAS_MASK:
                    # the whole kernel tile lies inside one mask tile (BLOCK_N divides MASK_BN)
                    slot = g * NT_MASK + (tn * BLOCK_N) // MASK_BN
                    for i in range(0, _bound(tl.load(kept_cnt_ptr + slot))):
                        kt = tl.load(kept_idx_ptr + slot * KT_MASK + i)
                        for sub in tl.static_range(MASK_BK // BLOCK_K):
                            ks = kt * MASK_BK + sub * BLOCK_K + tl.arange(0, BLOCK_K)
                            a = tl.load(a_rows + ks[None, :] * stride_ak, mask=row_ok[:, None], other=0.0)
                            b = tl.load(b_cols + ks[:, None] * stride_bk, mask=col_ok[None, :], other=0.0)
                            if UPCAST:
                                a = a.to(tl.float32)
                                b = b.to(tl.float32)
                            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
                else:
                    for k0 in range(0, _bound(K), BLOCK_K):
                        ks = k0 + tl.arange(0, BLOCK_K)
                        k_ok = ks < K
                        a = tl.load(a_rows + ks[None, :] * stride_ak, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                        b = tl.load(b_cols + ks[:, None] * stride_bk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                        if UPCAST:
                            a = a.to(tl.float32)
                            b = b.to(tl.float32)
                        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            c = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
            tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
            tile += num_programs
        group_first_tile = group_last_tile
        row_start = row_end


@triton.jit
def _grouped_dw_kernel(
    x_ptr, dy_ptr, dw_ptr, offs_ptr, mask_ptr,
    N, K,
    stride_xm, stride_xk, stride_dym, stride_dyn, stride_we, stride_wk, stride_wn,
    NT_MASK, KT_MASK,
    HAS_MASK: tl.constexpr, MASK_BK: tl.constexpr, MASK_BN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """dW[E, K, N]: one program per (expert, K tile, N tile); dW_e = x_e^T [K, M_e] @ dy_e [M_e, N].

    mask [E, KT_MASK, NT_MASK] (uint8): a pruned tile is stored as exact zeros without a load.
    """
    pid = tl.program_id(0)
    num_tiles_k = tl.cdiv(K, BLOCK_K)
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    e = pid // (num_tiles_k * num_tiles_n)
    tk = (pid // num_tiles_n) % num_tiles_k
    tn = pid % num_tiles_n
    row_start = tl.where(e > 0, tl.load(offs_ptr + tl.maximum(e - 1, 0)), 0)
    row_end = tl.load(offs_ptr + e)
    ks = tk * BLOCK_K + tl.arange(0, BLOCK_K)  # [BLOCK_K]
    cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    k_ok = ks < K
    col_ok = cols < N
    keep = True
    if HAS_MASK:
        slot = (e * KT_MASK + (tk * BLOCK_K) // MASK_BK) * NT_MASK + (tn * BLOCK_N) // MASK_BN
        keep = tl.load(mask_ptr + slot) != 0
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    if keep:
        for m0 in range(_bound(row_start), _bound(row_end), BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            row_ok = rows < row_end
            xt = tl.load(x_ptr + rows.to(tl.int64)[None, :] * stride_xm + ks[:, None] * stride_xk,
                         mask=k_ok[:, None] & row_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_M]
            dy = tl.load(dy_ptr + rows.to(tl.int64)[:, None] * stride_dym + cols[None, :] * stride_dyn,
                         mask=row_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_N]
            if UPCAST:
                xt = xt.to(tl.float32)
                dy = dy.to(tl.float32)
            acc = tl.dot(xt, dy, acc, input_precision=INPUT_PRECISION)
    dw = dw_ptr + e.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    tl.store(dw, acc.to(dw_ptr.dtype.element_ty), mask=k_ok[:, None] & col_ok[None, :])


# ----------------------------------------------------------------------------- tile configs

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): Ampere/Hopper bf16 favourites first;
# configs whose shared memory does not fit the device or whose tile does not divide the
# mask tile are pruned before timing. Half precision and fp32 as TF32 run on tensor cores.
_ROWS_CONFIGS = [
    (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
    (128, 128, 32, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 64, 64, 4, 4),
    (64, 128, 32, 4, 5), (64, 64, 32, 2, 5),
]
# dW tiles: (BLOCK_M = reduction over tokens, BLOCK_N, BLOCK_K = output rows).
_DW_CONFIGS = [
    (64, 128, 128, 8, 3), (64, 128, 128, 4, 4), (32, 128, 128, 4, 4), (64, 64, 128, 4, 4),
    (64, 128, 64, 4, 4), (64, 64, 64, 4, 4), (32, 64, 64, 4, 5), (32, 32, 32, 2, 5),
]
# fp32 with input_precision="ieee" (torch's default, TF32 off) multiplies on the FMA units with
# both operand tiles in registers: the tensor-core tiles above spill there, so it has its own
# small tiles (each holds at most 64 x 64 fp32 accumulators per 128 threads).
_ROWS_CONFIGS_IEEE = [(64, 64, 16, 4, 2), (128, 64, 16, 8, 2), (32, 64, 32, 4, 3), (64, 64, 32, 4, 3)]
_DW_CONFIGS_IEEE = [(32, 64, 64, 4, 2), (16, 64, 64, 4, 2), (32, 64, 32, 4, 3), (16, 32, 32, 2, 3)]
# Autotuning compiles and times every config that survives pruning; on a fresh machine each
# compile takes seconds. A cap keeps the first N of them (the tables are in order of preference):
MAX_CONFIGS_ENV = "MESHFOLD_TRITON_MAX_CONFIGS"
INTERPRET_BLOCK = 16  # small tiles keep the interpreter quick; 16 is tl.dot's minimum
# Launch geometry in the interpreter: few programs, so that each walks several tiles and groups as
# on the GPU; a test sets the GPU's own (one program per SM, GROUP_M = 8) to walk its orders too.
INTERPRET_GEOMETRY = {"programs": 3, "group_m": 2}
# Compile options of every GPU launch. FP fusion (contracting a * b + c into one FMA outside
# tl.dot) is stated rather than left to Triton's default, which is on in 3.9 (with a warning when
# unset) and turns off in 3.10; on is what these kernels have always been compiled with.
GPU_OPTIONS = dict(enable_fp_fusion=True)


def _configs(table, group_m: bool):
    extra = {"GROUP_M": 8} if group_m else {}
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, **extra}, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in table
    ]


def _smem_limit() -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return getattr(props, "shared_memory_per_block_optin", 99 * 1024)


def max_configs() -> int | None:
    """The autotune cap from ``MESHFOLD_TRITON_MAX_CONFIGS`` (None: every config that fits)."""
    raw = os.environ.get(MAX_CONFIGS_ENV, "")
    if raw == "":
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{MAX_CONFIGS_ENV} = {raw!r}; valid: a positive integer (or unset for every config)")
    return int(raw)


def _prune_configs(configs, named_args, *, dw=False, smem_limit=None, ieee=None, **kwargs):
    """Keep the configs of the launch's precision (``ieee``: the fp32 FMA table, else the
    tensor-core table) whose tile divides the mask tile and whose pipeline fits in shared
    memory, at most :func:`max_configs` of them.

    With a mask the kernel tile must sit inside one mask tile, so BLOCK_K | MASK_BK and
    BLOCK_N | MASK_BN; if no listed config qualifies, the largest dividing power of two is used.
    Per stage the rows kernel holds A [BM, BK] + B [BK, BN], the dW kernel x^T [BK, BM] + dy [BM, BN];
    the masked rows kernel holds those of every sub-tile of a mask tile.
    """
    mask_bk, mask_bn, has_mask = kwargs["MASK_BK"], kwargs["MASK_BN"], kwargs["HAS_MASK"]
    elem = named_args[next(iter(named_args))].element_size()
    limit = smem_limit or _smem_limit()
    table = ieee[kwargs.get("INPUT_PRECISION") == "ieee"] if ieee else None

    def fits(cfg):
        kw = cfg.kwargs
        divides = not has_mask or (mask_bk % kw["BLOCK_K"] == 0 and mask_bn % kw["BLOCK_N"] == 0)
        inner = kw["BLOCK_M"] if dw else kw["BLOCK_K"]
        tile = (kw["BLOCK_M"] * kw["BLOCK_K"] + inner * kw["BLOCK_N"]) * elem
        smem = cfg.num_stages * tile
        if has_mask and not dw and divides:
            # the masked main loop loads MASK_BK // BLOCK_K sub-tiles per iteration (a static loop),
            # and the pipeliner buffers each of them: up to num_stages - 1 copies of all of them
            # (compiled for sm_90: 128 x 128 x 32 fp32 at 3 or 4 stages takes 262148 bytes)
            smem = max(smem, max(cfg.num_stages - 1, 1) * (mask_bk // kw["BLOCK_K"]) * tile)
        return divides and smem <= limit

    kept = [c for c in configs if (table is None or any(c is t for t in table)) and fits(c)]
    if kept:
        return kept[:max_configs()]
    base = dict(configs[-1].kwargs, BLOCK_M=32, BLOCK_K=32, BLOCK_N=32)
    if has_mask:
        base.update(BLOCK_K=_pow2_divisor(mask_bk, 64), BLOCK_N=_pow2_divisor(mask_bn, 128))
    return [triton.Config(base, num_warps=4, num_stages=2)]


def _pow2_divisor(size: int, cap: int) -> int:
    """Largest power of two <= cap dividing ``size``; tl.dot needs at least 16."""
    p = cap
    while p > 16 and size % p:
        p //= 2
    if size % p:
        raise ValueError(f"mask tile size {size} is not a multiple of 16; the Triton path needs tile "
                         f"sizes that are multiples of 16 (e.g. 64 or 128)")
    return p


_MASK_KEYS = ["N", "K", "HAS_MASK", "MASK_BK", "MASK_BN", "INPUT_PRECISION"]


def _autotuned(kernel, tensor_core_table, ieee_table, key, group_m: bool, dw: bool):
    """``kernel`` autotuned over both tables, each launch timing only its precision's table.

    ``cache_results``: the winner of each key (shapes, dtypes, precision, the configs timed) is
    written to triton's cache directory (``TRITON_CACHE_DIR``, default ``~/.triton/cache``) under a
    hash of triton's version, the GPU architecture and the kernel's source, so the ranks of a
    restarted or later run on the machine read it instead of timing again (the ranks of the first
    run, starting together, each time it once).
    """
    tensor_core, ieee = _configs(tensor_core_table, group_m), _configs(ieee_table, group_m)
    prune = functools.partial(_prune_configs, dw=dw, ieee={False: tensor_core, True: ieee})
    return triton.autotune(tensor_core + ieee, key=key, prune_configs_by={"early_config_prune": prune},
                           cache_results=True)(kernel)


@functools.cache
def _tuned_rows_kernel():
    # stride_bn tells forward (B = w, stride 1) from dX (B = w^T): same sizes can favour other tiles
    return _autotuned(_grouped_rows_kernel, _ROWS_CONFIGS, _ROWS_CONFIGS_IEEE, [*_MASK_KEYS, "stride_bn"],
                      group_m=True, dw=False)


@functools.cache
def _tuned_dw_kernel():
    # autotuning reruns the kernel; every dW element is stored each run, so no reset is needed
    return _autotuned(_grouped_dw_kernel, _DW_CONFIGS, _DW_CONFIGS_IEEE, _MASK_KEYS, group_m=False, dw=True)


@functools.cache
def _num_programs(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _input_precision(dtype: torch.dtype) -> str | None:
    """fp32 follows torch's TF32 switch (off by default), so results match torch.matmul."""
    if dtype != torch.float32 or interpreting():
        return None
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


# ----------------------------------------------------------------------------- launchers


def _kept_lists(mask_ERC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mask [E, R, C] (R = reduction tiles) -> kept_idx [E, C, R] int32, kept_cnt [E, C] int32.

    Built with device ops (a stable sort puts kept tiles first, in order), so no host sync.
    """
    by_col = mask_ERC.transpose(1, 2)  # [E, C, R]
    kept_idx = torch.argsort((~by_col).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    kept_cnt = by_col.sum(-1, dtype=torch.int32)
    return kept_idx.contiguous(), kept_cnt.contiguous()


def _mask_consts(mask: torch.Tensor | None, K: int, N: int, dtype: torch.dtype) -> tuple[int, int, dict]:
    """(Kt, Nt, constexprs) of a launch. Without a mask the mask constexprs are fixed at 1 so that
    a new K or N does not compile a new kernel."""
    kt, nt = (1, 1) if mask is None else (mask.shape[1], mask.shape[2])
    consts = dict(HAS_MASK=mask is not None, MASK_BK=1 if mask is None else K // kt,
                  MASK_BN=1 if mask is None else N // nt,
                  UPCAST=interpreting() and dtype != torch.float32, INPUT_PRECISION=_input_precision(dtype))
    return kt, nt, consts


def _interpret_tile(consts: dict) -> dict:
    """The interpreter's fixed small tile, inside one mask tile."""
    if not consts["HAS_MASK"]:
        return dict(BLOCK_M=INTERPRET_BLOCK, BLOCK_N=INTERPRET_BLOCK, BLOCK_K=INTERPRET_BLOCK)
    return dict(BLOCK_M=INTERPRET_BLOCK, BLOCK_N=_pow2_divisor(consts["MASK_BN"], INTERPRET_BLOCK),
                BLOCK_K=_pow2_divisor(consts["MASK_BK"], INTERPRET_BLOCK))


def _rows_launch(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, mask: torch.Tensor | None):
    """C[M, N] = A[M, K] @ B[E, K, N] per expert row group; mask [E, K//MASK_BK, N//MASK_BN] bool."""
    M, K = a.shape
    E, _, N = b.shape
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if M == 0:
        return c
    kt, nt, consts = _mask_consts(mask, K, N, a.dtype)
    # without a mask the index lists are never read; offsets stands in as a pointer on the device
    kept_idx, kept_cnt = (offsets, offsets) if mask is None else _kept_lists(mask)
    args = (a, b, c, offsets, kept_idx, kept_cnt, M, N, K, E,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
            nt, kt)
    if interpreting():
        geometry = INTERPRET_GEOMETRY
        _grouped_rows_kernel[(geometry["programs"],)](*args, **consts, **_interpret_tile(consts),
                                                     GROUP_M=geometry["group_m"])
        return c
    sms = _num_programs(a.device.index or 0)

    def grid(meta):
        # sum over groups of ceil(rows_g / BLOCK_M) <= ceil(M / BLOCK_M) + E + 1
        max_tiles = (triton.cdiv(M, meta["BLOCK_M"]) + E + 1) * triton.cdiv(N, meta["BLOCK_N"])
        return (min(sms, max_tiles),)

    with torch.cuda.device(a.device):  # triton launches on the current device
        _tuned_rows_kernel()[grid](*args, **consts, **GPU_OPTIONS)
    return c


def triton_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, mask: torch.Tensor | None):
    """Forward: y [M, N] = x [M, K] @ w [E, K, N] per expert; rows past offsets[-1] are zero."""
    return _rows_launch(x, w, offsets, mask)


def triton_grouped_mm_dx(dy: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, mask: torch.Tensor | None):
    """dX [M, K] = dy [M, N] @ w_e^T: the forward kernel on the transposed view of w and mask."""
    return _rows_launch(dy, w.transpose(1, 2), offsets, None if mask is None else mask.transpose(1, 2))


def triton_grouped_mm_dw(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, mask: torch.Tensor | None,
                         out_dtype: torch.dtype):
    """dW [E, K, N] = x_e^T @ dy_e per expert (zero for empty experts and pruned tiles)."""
    K, N, E = x.shape[1], dy.shape[1], offsets.shape[0]
    dw = torch.empty((E, K, N), dtype=out_dtype, device=x.device)
    kt, nt, consts = _mask_consts(mask, K, N, x.dtype)
    mask_u8 = offsets if mask is None else mask.to(torch.uint8).contiguous()
    args = (x, dy, dw, offsets, mask_u8, N, K,
            x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), dw.stride(0), dw.stride(1), dw.stride(2),
            nt, kt)

    def grid(meta):
        return (E * triton.cdiv(K, meta["BLOCK_K"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    if interpreting():
        tile = _interpret_tile(consts)
        _grouped_dw_kernel[grid(tile)](*args, **consts, **tile)
    else:
        with torch.cuda.device(x.device):
            _tuned_dw_kernel()[grid](*args, **consts, **GPU_OPTIONS)
    return dw
