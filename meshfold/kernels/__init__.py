"""How experts compute: grouped GEMM over expert-major tokens, optionally tile-sparse.

``grouped_mm(x [M, K], w [E, K, N], offsets [E] int32, *, tile_mask=None, backend="auto")`` is the
entry point (Triton on CUDA, torch on CPU); ``grouped_mm_reference`` is the plain loop it is
tested against. A tile mask is bool [E, K // bk, N // bn]; the helpers below build and expand it.
"""

from meshfold.kernels.grouped_mm import grouped_mm
from meshfold.kernels.reference import (
    apply_tile_mask,
    dense_tile_mask,
    expand_tile_mask,
    grouped_mm_reference,
    tile_grid,
    tile_shape,
)

__all__ = [
    "apply_tile_mask",
    "dense_tile_mask",
    "expand_tile_mask",
    "grouped_mm",
    "grouped_mm_reference",
    "tile_grid",
    "tile_shape",
]
