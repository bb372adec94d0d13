"""How a global batch is cut over a fold: batch rows over ``dp``, sequence positions over ``cp x tp``.

Legend: B = sequences of the global batch, S = sequence length.

With context parallelism each sequence is cut into ``2 * cp`` equal chunks and cp rank ``c``
holds chunks ``c`` and ``2cp - 1 - c`` (causal load balance: every rank gets the same causal
work); that part is split contiguously over tp. Without it, the sequence is split over tp.
"""

from __future__ import annotations

import torch

__all__ = ["local_positions", "shard_batch", "batch_rows"]


def local_positions(S: int, spec, rank: int) -> torch.Tensor:
    """Absolute positions [S / (cp * tp)] of this rank's tokens of a length-S sequence.

    cp rank c holds chunks c and 2cp-1-c of 2cp equal chunks (causal load balance); that part is
    split contiguously over tp.
    """
    c = spec.coords(rank)["attn"]
    split = 2 * spec.cp * spec.tp if spec.cp > 1 else spec.tp
    if S % split:
        raise ValueError(f"sequence length {S} is not divisible by {split} (cp = {spec.cp} gives "
                         f"2*cp load-balanced chunks, each split over tp = {spec.tp})")
    if spec.cp > 1:
        chunk = S // (2 * spec.cp)
        part = torch.cat([torch.arange(c["cp"] * chunk, (c["cp"] + 1) * chunk),
                          torch.arange((2 * spec.cp - 1 - c["cp"]) * chunk, (2 * spec.cp - c["cp"]) * chunk)])
    else:
        part = torch.arange(S)
    n = part.numel() // spec.tp
    return part[c["tp"] * n:(c["tp"] + 1) * n]


def shard_batch(tokens: torch.Tensor, spec, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of a global [B, S, ...] batch (batch over dp, sequence over cp x tp) and the
    positions of its tokens. Trailing dims are per-position data: a per-token input [B, S, ...]
    (``Plan.per_token``) or the side-by-side targets of multi-token prediction
    (:func:`meshfold.models.mtp.mtp_targets`)."""
    B, S = tokens.shape[:2]
    rows = batch_rows(B, spec, rank)
    pos = local_positions(S, spec, rank)
    return tokens[rows.start:rows.stop][:, pos], pos


def batch_rows(batch: int, spec, rank: int) -> range:
    """The rows of a global batch of ``batch`` sequences that ``rank``'s dp rank trains on."""
    if batch % spec.dp:
        raise ValueError(f"batch of {batch} sequences is not divisible by dp = {spec.dp}")
    b, d = batch // spec.dp, spec.coords(rank)["attn"]["dp"]
    return range(d * b, (d + 1) * b)
