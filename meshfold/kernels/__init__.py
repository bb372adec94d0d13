"""How experts compute: every device-specific execution detail of an MoE layer lives here.

Each op has one entry point for every device, a fast implementation chosen by device (Triton on
CUDA, the CPU pool of :mod:`.cpu_pool` on CPU) and a plain torch reference beside it that the
tests compare it with:

* ``grouped_mm(x [M, K], w [E, K, N], offsets [E] int32, *, tile_mask=None, backend="auto")``:
  the expert GEMM, optionally tile-sparse; reference ``grouped_mm_reference``. A tile mask is
  bool [E, K // bk, N // bn]; the helpers below build and expand it.
* ``expert_ffn``: the routed experts' MLP (grouped GEMM, SwiGLU or GELU, grouped GEMM);
  ``backend="reference"`` is its plain definition. ``swiglu`` / ``gelu``: its activations.
* ``gather_rows`` (permute's gather) and ``combine_topk`` (the dropless combine); references
  ``scatter_rows_reference`` and ``combine_reference``.
* ``serial_graph(fn, *inputs)``: a differentiable chain of small ops (routing scores, sort keys)
  run forward and backward on one thread on CPU; its reference is ``fn(*inputs)`` itself.

Layer: imports torch, triton and ``meshfold.runtime`` only; independent of
``meshfold.placements`` (``tests/test_layers.py``).
"""

from meshfold.kernels.cpu_pool import serial_graph
from meshfold.kernels.combine import (combine_reference, combine_topk, gather_rows, scatter_rows,
                                      scatter_rows_reference)
from meshfold.kernels.ffn import expert_ffn, gelu, swiglu, swiglu_reference
from meshfold.kernels.grouped_mm import grouped_mm
from meshfold.kernels.reference import (
    apply_tile_mask,
    check_etp_alignment,
    dense_tile_mask,
    expand_tile_mask,
    grouped_mm_reference,
    tile_grid,
    tile_shape,
)

__all__ = [
    "apply_tile_mask",
    "check_etp_alignment",
    "combine_reference",
    "combine_topk",
    "dense_tile_mask",
    "expand_tile_mask",
    "expert_ffn",
    "gather_rows",
    "gelu",
    "grouped_mm",
    "grouped_mm_reference",
    "scatter_rows",
    "scatter_rows_reference",
    "serial_graph",
    "swiglu",
    "swiglu_reference",
    "tile_grid",
    "tile_shape",
]
