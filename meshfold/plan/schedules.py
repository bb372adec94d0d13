"""The pipeline bubble of each schedule, from the times of a micro-batch's forward and backward.

A pipeline rank's step is its ``m`` micro-batches' work plus the time it waits (the bubble). With
``f``, ``b`` and ``w`` the seconds pipeline rank's layers take per micro-batch for the forward, the
backward's input gradients and its weight gradients (``b + w`` is the whole backward), and chunk
times ``F = f / v``, ``B = b / v``, ``W = w / v`` for ``v`` chunks a rank:

=====================  ==========================================  ===========================
``schedule``           bubble                                      against torch's order
=====================  ==========================================  ===========================
``gpipe``, ``1f1b``    ``(pp - 1) (f + b + w)``                    exact
``interleaved-1f1b``   ``(pp - 1) (F + B + W)``                    exact
``interleaved-zb``     ``(pp - 1) max(F + B - W, F, B)``           exact
``zbv``                ``(pp - 1) max(B, 2 (B - W), F + W - B)``   see below
                       ``+ max(0, 2 pp - 1 - m) w``
``dualpipev``          ``(pp - 1) max(F + B - W, B)``              see below
=====================  ==========================================  ===========================

1F1B's is Narayanan et al. 2021's; interleaving divides it by v (the same paper). The zero-bubble
schedules (Qi et al. 2024, arXiv 2401.10241; DualPipeV from DeepSeek-V3, arXiv 2412.19437) fill
the bubble with deferred weight gradients, so it shrinks by the ``W`` that fits: ZB-H1's
``(pp - 1)(F + B - W)``, and no less than one forward or input backward per stage, which is what
torch's ``ScheduleInterleavedZeroBubble`` order gives. torch's ``ScheduleZBVZeroBubble`` and
``ScheduleDualPipeV`` orders give bubbles that are piecewise in ``F, B, W`` and depend on pp beyond
``pp - 1``; the forms above are the closest of simple ones, off by the amounts
``benchmarks/RESULTS.md`` (*Pipeline bubbles*) measures: ``meshfold.dryrun.bubble`` plays torch's
own orders with the same times, and ``python -m meshfold.dryrun.check --bubbles`` puts the two side
by side. Communication is left out (stages hand over at once), as in the papers.

:func:`overlapped_pairs` counts what ``train.a2a_overlap`` runs in turns on a rank: each
accumulated micro-batch's forward beside the previous one's backward without pp, combined 1F1B's
and DualPipeV's overlapped forward-beside-backward actions with pp.
"""

from __future__ import annotations

from meshfold.catalog import SCHEDULES

__all__ = ["bubble", "overlapped_pairs"]


def bubble(schedule: str, pp: int, vpp: int, m: int, f: float, b: float, w: float) -> float:
    """Seconds pipeline rank's step waits under ``schedule`` (module docstring) with ``m``
    micro-batches: ``f``, ``b``, ``w`` the rank's forward, input-gradient and weight-gradient
    seconds per micro-batch, over its ``vpp`` chunks."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule = {schedule!r}; valid: {list(SCHEDULES)}")
    F, B, W = f / vpp, b / vpp, w / vpp
    per_stage = {"gpipe": F + B + W, "1f1b": F + B + W, "interleaved-1f1b": F + B + W,
                 "interleaved-zb": max(F + B - W, F, B), "zbv": max(B, 2 * (B - W), F + W - B),
                 "dualpipev": max(F + B - W, B)}[schedule]
    # ZB-V reaches its steady state with 2 pp - 1 micro-batches; each one fewer leaves one more
    # weight pass (both chunks') without a bubble to fill
    short = max(0, 2 * pp - 1 - m) * w if schedule == "zbv" else 0.0
    return (pp - 1) * per_stage + short


def overlapped_pairs(pp: int, m: int, rank: int, schedule: str = "dualpipev") -> int:
    """Pairs pipeline rank ``rank`` runs in turns under ``train.a2a_overlap`` in a step of ``m``
    micro-batches. Without pp (``pp = 1``): ``m - 1`` pairs, each micro-batch's forward beside the
    previous one's backward (``parallel.pipeline.accumulate``). With pp, DualPipeV (m >= 2 pp): torch's
    ``ScheduleDualPipeV`` order gives rank r ``2 m - 2 pp - max(1, pp - 1 - r)`` ``OVERLAP_F_B``
    actions, each one micro-batch's forward on one of the rank's two chunks beside another's whole
    backward on the other (its warm-up and cool-down run forwards and backwards alone; a test
    counts torch's order). 1F1B, run as combined 1F1B (``parallel.pipeline.combined_1f1b_order``,
    m >= pp): ``m - min(pp - r, m)`` pairs, each a forward beside another micro-batch's backward
    of the rank's one chunk."""
    if schedule not in ("1f1b", "dualpipev"):
        raise ValueError(f"a2a_overlap with schedule {schedule!r}: valid: '1f1b', 'dualpipev'")
    if pp == 1:
        return max(m - 1, 0)
    if schedule == "1f1b":
        if m < pp or not 0 <= rank < pp:
            raise ValueError(f"1f1b with pp={pp}: needs micro-batches={m} >= pp and rank={rank} in 0..{pp - 1}")
        return m - min(pp - rank, m)
    if m < 2 * pp or not 0 <= rank < pp:
        raise ValueError(f"dualpipev with pp={pp}: needs micro-batches={m} >= 2 pp and rank={rank} in 0..{pp - 1}")
    return 2 * m - 2 * pp - max(1, pp - 1 - rank)
