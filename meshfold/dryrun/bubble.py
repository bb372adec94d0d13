"""The pipeline bubble of torch's own schedule orders, to check the planner's formulas against.

:func:`~meshfold.parallel.pipeline.schedule_order` gives every pipeline rank's actions in the
order torch's class runs them. :func:`play` runs that order with a time for each kind of action:
each rank takes its actions one after another, an action starting once its rank is free and its
inputs exist (a forward after the forward of the stage before, an input or whole backward after
its own forward and the backward of the stage after, a weight backward after its input
backward); handing over between stages takes no time, as in the planner's formulas
(:mod:`meshfold.plan.schedules`). The bubble is what the busiest rank waits: the step's span
less that rank's work.

    python -m meshfold.dryrun.check --bubbles     # planner against these, per schedule and pp
"""

from __future__ import annotations

__all__ = ["play", "played_bubble"]


def play(order: dict[int, list[tuple[str, int, int]]], seconds: dict[str, float], stages: int) -> tuple[float, float]:
    """``(span, busiest rank's work)`` of ``order`` (rank -> ``(kind, stage, micro-batch)``) with
    ``seconds[kind]`` per action, over ``stages`` pipeline stages. Raises ``ValueError`` if the
    order can never finish (an action waits for one that waits for it)."""
    done: dict[tuple[str, int, int], float] = {}
    free = dict.fromkeys(order, 0.0)
    work = dict.fromkeys(order, 0.0)
    next_op = dict.fromkeys(order, 0)
    left = sum(map(len, order.values()))
    while left:
        moved = False
        for rank, actions in order.items():
            while next_op[rank] < len(actions):
                kind, s, j = actions[next_op[rank]]
                if kind == "F":
                    needs = [("F", s - 1, j)] if s > 0 else []
                elif kind in ("B", "I"):
                    needs = [("F", s, j)] + ([("back", s + 1, j)] if s < stages - 1 else [])
                else:  # W
                    needs = [("back", s, j)]
                if any(n not in done for n in needs):
                    break
                end = max([free[rank]] + [done[n] for n in needs]) + seconds[kind]
                done[("back" if kind in ("B", "I") else kind, s, j)] = end
                free[rank], work[rank] = end, work[rank] + seconds[kind]
                next_op[rank] += 1
                left -= 1
                moved = True
        if not moved:
            raise ValueError(f"the order cannot finish: each rank's next action waits ({next_op})")
    return max(free.values()), max(work.values())


def played_bubble(schedule: str, pp: int, virtual: int, microbatches: int, f: float, b: float, w: float) -> float:
    """Seconds the busiest rank waits under torch's order of ``schedule``, with ``f``, ``b``,
    ``w``: a rank's forward, input-gradient and weight-gradient seconds per micro-batch over its
    ``virtual`` chunks (a whole backward ``b + w``), as :func:`meshfold.plan.schedules.bubble` takes them."""
    from meshfold.parallel.pipeline import schedule_order

    order = schedule_order(schedule, pp, virtual, microbatches)
    per_chunk = {"F": f / virtual, "I": b / virtual, "W": w / virtual, "B": (b + w) / virtual}
    span, work = play(order, per_chunk, pp * virtual)
    return span - work
