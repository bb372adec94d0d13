"""What ``train.a2a_overlap`` hides of the MoE dispatch and combine all-to-alls: the planner's model.

Two micro-batches of a rank take turns (:mod:`meshfold.runtime.overlap`): a turn passes where the
running one would wait for an all-to-all it started, and the other computes until it waits too.
The hand-overs cut one MoE layer's forward into two compute phases:

    Ca  the attention side: attention GEMMs and core, the shared expert, their memory-bound kernels
    Ce  the expert side: the expert GEMMs and the token dispatcher's memory-bound kernels

and its backward into the same two at about twice the time (2 Ca, 2 Ce). With ``t`` the seconds of
one micro-batch's dispatch + combine in one layer's forward (the backward sends the same bytes back,
``t`` again), follow a pair A, B through a layer's forward: A's dispatch travels during B's
attention side, B's dispatch during A's expert side, A's combine during B's expert side, B's
combine during A's attention side. Each all-to-all (``t / 2``) is hidden up to the phase beside it:

    a forward's pair, beside forward phases     min(t/2, Ca) + min(t/2, Ce)      per micro-batch,
    a backward's pair, beside backward phases   min(t/2, 2 Ca) + min(t/2, 2 Ce)  per MoE layer

Without pp (``overlapped_pairs``: ``m // 2`` pairs) both micro-batches of a pair run their forwards
side by side, then their backwards; the odd one out hides nothing. Under DualPipeV an overlapped
action runs one micro-batch's forward of a chunk (half the rank's layers) beside another's backward
of the other chunk: the forward's all-to-alls travel beside backward phases, the backward's beside
forward phases, so an action hides the same two terms for half the rank's MoE layers. 1F1B runs
as combined 1F1B (``parallel.pipeline.combined_1f1b_order``): a forward beside another micro-batch's
backward of the rank's one chunk, all its MoE layers. The recomputation's re-run forward all-to-alls are taken as not hidden.
"""

from __future__ import annotations

from meshfold.plan.schedules import overlapped_pairs

__all__ = ["hidden_per_layer", "a2a_hidden"]


def hidden_per_layer(t: float, attn_side: float, expert_side: float) -> tuple[float, float]:
    """Seconds of one MoE layer's dispatch + combine (``t`` seconds, one micro-batch, one pass)
    hidden (beside a partner's forward phases, beside its backward phases); ``attn_side``,
    ``expert_side`` = Ca, Ce of the module docstring."""
    half = t / 2
    return (min(half, attn_side) + min(half, expert_side),
            min(half, 2 * attn_side) + min(half, 2 * expert_side))


def a2a_hidden(pp: int, m: int, rank: int, moe_layers: int, t: float, attn_side: float, expert_side: float,
               schedule: str = "dualpipev") -> float:
    """Seconds per step of pipeline rank ``rank``'s dispatch + combine all-to-alls that its
    ``moe_layers`` MoE layers hide under ``train.a2a_overlap`` with ``m`` micro-batches (without
    pp: accumulated pairs; with pp: dualpipev's or combined 1F1B's overlapped actions; module
    docstring)."""
    beside_forward, beside_backward = hidden_per_layer(t, attn_side, expert_side)
    pairs = overlapped_pairs(pp, m, rank, schedule)
    if pp == 1:   # two micro-batches a pair, each forward beside forward and backward beside backward
        return pairs * 2 * moe_layers * (beside_forward + beside_backward)
    # a forward beside backward phases, a backward beside forward phases: under dualpipev each of
    # the rank's two chunks (half its layers), under combined 1F1B its one chunk (all of them)
    chunk = moe_layers / 2 if schedule == "dualpipev" else moe_layers
    return pairs * chunk * (beside_backward + beside_forward)
