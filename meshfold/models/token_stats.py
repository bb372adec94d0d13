"""Token statistics of one MoE forward: how many (token, expert) pairs each expert got.

Legend: B = sequences, S = sequence length (this rank's slice), T = B*S tokens on this rank,
E = experts, k = top-k.

The balancing losses need the counts of a whole balancing group (a sequence, a DP rank's
micro-batch, the global batch), the metrics and the aux-loss-free bias the global ones. A rank
counts its own tokens, then the counts are summed over the attention dims that hold the rest of
the group: ``(cp, tp)`` for one sequence group's tokens, then ``dp`` for every token. Each stage
travels as one fused vector: one small all-reduce per attention dim of size > 1, three at most
per layer, besides the dispatch's own count exchange.
Counts are of the routing map *before* dropping (Megatron-LM#2767: the losses must see the map
that dispatch uses); ``kept`` after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshfold.kernels import serial_graph

__all__ = ["TokenStats", "token_stats", "routing_metrics"]


@dataclass
class TokenStats:
    """Counts summed over their balancing groups (host-free: all on the tokens' device).

    ``routed_seq`` [E], ``T_seq``, ``S_seq``: this rank's (cp, tp) group (one DP rank's slice of
    its sequences); ``seq_BE`` [B, E] per sequence (only with a seq-aux loss); ``routed_all`` /
    ``kept_all`` [E], ``T_all``, ``B_all``: every rank's tokens (summed over dp x cp x tp).
    """

    routed_seq: torch.Tensor
    T_seq: torch.Tensor
    S_seq: torch.Tensor
    seq_BE: torch.Tensor | None
    routed_all: torch.Tensor
    kept_all: torch.Tensor
    T_all: torch.Tensor
    B_all: torch.Tensor


def _host_ints(values: list[int], device) -> torch.Tensor:
    """int64 [len(values)] on ``device``, each filled by a kernel from a scalar argument: no
    host-to-device copy (``torch.tensor(values, device=...)`` would copy, and wait on CUDA)."""
    return torch.cat([torch.full((1,), v, dtype=torch.int64, device=device) for v in values])


def _local_counts(experts_TK, keep_TK, B: int, S: int, E: int, per_sequence: bool) -> torch.Tensor:
    """This rank's [routed_E, kept_E, T, S, (seq_BE flattened)] as one int64 vector."""
    T, k = experts_TK.shape
    dev = experts_TK.device
    e = experts_TK.reshape(-1)
    routed_E = torch.zeros(E, dtype=torch.int64, device=dev).scatter_add_(0, e, torch.ones_like(e))
    kept_E = routed_E if keep_TK is None else torch.zeros_like(routed_E).scatter_add_(
        0, e, keep_TK.reshape(-1).to(torch.int64))
    parts = [routed_E, kept_E, _host_ints([T, S], dev)]
    if per_sequence:
        seq_of = torch.arange(T, device=dev).div(S, rounding_mode="floor").repeat_interleave(k)
        seq_BE = torch.zeros(B, E, dtype=torch.int64, device=dev).index_put_(
            (seq_of, e), torch.ones_like(e), accumulate=True)
        parts.append(seq_BE.reshape(-1))
    return torch.cat(parts)


@torch.no_grad()
def token_stats(experts_TK: torch.Tensor, keep_TK: torch.Tensor | None, B: int, S: int, num_experts: int,
                per_sequence: bool, comm) -> TokenStats:
    """The statistics of routing ``experts_TK`` [T, k] (``keep_TK`` [T, k] bool: pairs kept
    after dropping, None = all), summed with ``comm.sum`` over the attention dims."""
    E, (T, k) = num_experts, experts_TK.shape
    dev = experts_TK.device
    # [T*k] scatter-adds: small ops, on one thread (serial_graph)
    (local,) = serial_graph(lambda e, keep: (_local_counts(e, keep, B, S, E, per_sequence),), experts_TK, keep_TK)
    seq_part = comm.sum(local, ("cp", "tp"))  # one sequence group's totals
    routed_seq, kept_seq, (T_seq, S_seq) = seq_part[:E], seq_part[E:2 * E], seq_part[2 * E:2 * E + 2]
    every = comm.sum(torch.cat([routed_seq, kept_seq, T_seq.reshape(1), _host_ints([B], dev)]), ("dp",))
    return TokenStats(routed_seq=routed_seq, T_seq=T_seq.double(), S_seq=S_seq.double(),
                      seq_BE=seq_part[2 * E + 2:].reshape(B, E) if per_sequence else None,
                      routed_all=every[:E], kept_all=every[E:2 * E],
                      T_all=every[2 * E].double(), B_all=every[2 * E + 1].double())


@torch.no_grad()
def routing_metrics(st: TokenStats) -> dict[str, torch.Tensor]:
    """Tokens per expert [E], dropped fraction and load imbalance (max / mean) of the batch."""
    total_E, kept_E = st.routed_all, st.kept_all
    return {
        "tokens_per_expert": total_E,
        "dropped_fraction": 1.0 - kept_E.sum() / total_E.sum().clamp(min=1),
        "load_imbalance": total_E.max() / total_E.float().mean().clamp(min=1e-9),
    }
