"""What a grouped GEMM computes, written as a plain per-expert loop, and what a tile mask means.

Legend: M = token rows sorted by expert (expert-major), K = input dim, N = output dim, E = experts.

``offsets`` [E] int32 holds the cumulative end row of each expert (torch's ``F.grouped_mm``
``offs``): expert e owns rows ``offsets[e-1]:offsets[e]`` (``0:offsets[0]`` for e = 0). Rows past
``offsets[-1]`` belong to no expert and get zero output.

A tile mask is a bool tensor [E, K // bk, N // bn]; the tile size (bk, bn) is implied by its shape
(bk = K // mask.shape[1], bn = N // mask.shape[2]) and must divide K and N exactly. ``False``
prunes the whole bk x bn block of that expert's weight: the GEMM behaves as if those weights
were zero, so their gradient is zero too. This file is the definition the fast paths are tested
against; it favours obviousness over speed and differentiates through plain autograd.
"""

from __future__ import annotations

import torch


def tile_shape(tile_mask: torch.Tensor, K: int, N: int) -> tuple[int, int]:
    """(bk, bn) implied by ``tile_mask`` [E, K // bk, N // bn] for a weight of K x N.

    Raises ValueError naming the mask shape when it does not tile K x N exactly.
    """
    if tile_mask.dim() != 3:
        raise ValueError(f"tile_mask must be [E, K // bk, N // bn], got shape {tuple(tile_mask.shape)}")
    kt, nt = tile_mask.shape[1], tile_mask.shape[2]
    if kt == 0 or nt == 0 or K % kt or N % nt:
        raise ValueError(
            f"tile_mask shape {tuple(tile_mask.shape)} does not tile the weight K x N = {K} x {N}: "
            f"K must be divisible by {kt} and N by {nt} (valid: mask [E, K // bk, N // bn] with bk | K, bn | N)")
    return K // kt, N // nt


def tile_grid(K: int, N: int, tile: tuple[int, int]) -> tuple[int, int]:
    """Number of tiles (K // bk, N // bn) of a K x N weight; ValueError if the tile does not divide it."""
    bk, bn = tile
    if bk <= 0 or bn <= 0 or K % bk or N % bn:
        raise ValueError(f"tile {bk} x {bn} does not divide the weight K x N = {K} x {N} "
                         f"(valid: bk divides {K} and bn divides {N})")
    return K // bk, N // bn


def check_etp_alignment(K: int, N: int, tile: tuple[int, int], etp: int, etp_dim: str) -> None:
    """Raise ValueError unless ``tile`` divides K x N and every ETP shard boundary on ``etp_dim``.

    Under ETP an expert weight is split over ``etp`` ranks along N (fc1, column parallel) or K
    (fc2, row parallel); a tile across a shard boundary would live on two ranks, so the masks
    (and the kernel's skip) could not be applied locally.
    """
    tile_grid(K, N, tile)
    if etp_dim not in ("K", "N"):
        raise ValueError(f"etp_dim={etp_dim!r}; valid: 'K' or 'N'")
    size, t = (K, tile[0]) if etp_dim == "K" else (N, tile[1])
    if size % etp:
        raise ValueError(f"{etp_dim} = {size} does not split over etp = {etp} ranks")
    shard = size // etp
    if shard % t:
        valid = [d for d in range(1, shard + 1) if shard % d == 0 and size % d == 0][-4:]
        raise ValueError(f"ETP shard of {etp_dim} = {size} / etp {etp} = {shard} is not a multiple of the tile's "
                         f"{etp_dim}-size {t}: tiles would straddle ranks (valid sizes dividing {shard}: e.g. {valid})")


def dense_tile_mask(E: int, K: int, N: int, tile: tuple[int, int], device=None) -> torch.Tensor:
    """All-kept mask [E, K // bk, N // bn] for E expert weights of K x N cut into bk x bn tiles."""
    kt, nt = tile_grid(K, N, tile)
    return torch.ones((E, kt, nt), dtype=torch.bool, device=device)


def expand_tile_mask(tile_mask: torch.Tensor, K: int, N: int) -> torch.Tensor:
    """Element mask [E, K, N] of a tile mask [E, K // bk, N // bn] (every tile entry repeated bk x bn)."""
    bk, bn = tile_shape(tile_mask, K, N)
    return tile_mask.repeat_interleave(bk, dim=1).repeat_interleave(bn, dim=2)


def apply_tile_mask(w: torch.Tensor, tile_mask: torch.Tensor) -> torch.Tensor:
    """w [E, K, N] with every pruned bk x bn tile set to zero (one broadcast multiply, no [E, K, N] mask)."""
    E, K, N = w.shape
    bk, bn = tile_shape(tile_mask, K, N)
    blocks = w.reshape(E, K // bk, bk, N // bn, bn)
    return (blocks * tile_mask[:, :, None, :, None].to(w.dtype)).reshape(E, K, N)


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                         tile_mask: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] with ``y[o_{e-1}:o_e] = x[o_{e-1}:o_e] @ (w_e * mask_e)``; rows past offsets[-1] are 0.

    x [M, K], w [E, K, N], offsets [E] int (cumulative end rows), tile_mask [E, K//bk, N//bn] bool.
    Low precision inputs are multiplied in fp32 (fp64 stays fp64) and the result is cast to
    x.dtype, the accumulation contract of the fast paths.
    """
    M, K = x.shape
    N = w.shape[2]
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    w_acc = w.to(acc_dtype)
    if tile_mask is not None:  # deliberately the plain element mask, not apply_tile_mask's broadcast
        w_acc = w_acc * expand_tile_mask(tile_mask, K, N).to(acc_dtype)
    pieces, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        pieces.append(x[start:end].to(acc_dtype) @ w_acc[e])  # [rows_e, N]
        start = end
    pieces.append(x.new_zeros((M - start, N), dtype=acc_dtype))  # rows owned by no expert
    return torch.cat(pieces).to(x.dtype)
