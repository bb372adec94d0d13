"""What ``train.a2a_overlap`` hides of the MoE dispatch and combine all-to-alls: the planner's model.

Two micro-batches of a rank take turns (:mod:`meshfold.runtime.overlap`): a turn passes where the
running one would wait for an all-to-all it started, and the other computes until it waits too.
The hand-overs cut one MoE layer's forward into two compute phases:

    Ca  the attention side: attention GEMMs and core, the shared expert, their memory-bound kernels
    Ce  the expert side: the expert GEMMs and the token dispatcher's memory-bound kernels

and its backward into the same two at about twice the time (2 Ca, 2 Ce). With ``t`` the seconds of
one micro-batch's dispatch + combine in one layer's forward, each all-to-all (``t / 2``) is hidden
up to the partner's phase beside it. Every pair is a forward of one micro-batch beside a backward
of another, so the forward's dispatch and combine travel beside backward phases:

    hidden per MoE layer and pair    min(t/2, 2 Ca) + min(t/2, 2 Ce)

The backward's own all-to-alls are not counted: on a GPU autograd runs the backward's nodes on its
device thread, which holds no turn, so they wait there as without overlap (on CPU they take turns
too, which the planner does not model). Pairs (``overlapped_pairs``): without pp ``m - 1``
(micro-batch i + 1's forward beside i's backward, ``parallel.pipeline.accumulate``), over all the
rank's MoE layers; combined 1F1B (``parallel.pipeline.combined_1f1b_order``) ``m - min(pp - r, m)``,
over all of them; DualPipeV's overlapped actions, each over one of the rank's two chunks (half
its MoE layers). The recomputation's re-run forward all-to-alls are taken as not hidden.
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
    _, beside_backward = hidden_per_layer(t, attn_side, expert_side)
    pairs = overlapped_pairs(pp, m, rank, schedule)
    # a forward's all-to-alls beside backward phases: under dualpipev over one of the rank's two
    # chunks (half its layers), otherwise over its one chunk (all of them); the backward's own
    # all-to-alls are not hidden on a GPU (its nodes run on autograd's device thread, no turn)
    chunk = moe_layers / 2 if pp > 1 and schedule == "dualpipev" else moe_layers
    return pairs * chunk * beside_backward
