"""Fault injection for testing ``meshfold train``'s failure handling; never a user setting.

The tests set ``MESHFOLD_FAULTS`` in the environment of the command they run, a comma-separated
list of ``name=value`` items (steps counted from 1, as in logs and checkpoints)::

    MESHFOLD_FAULTS="nan_at=3"            the loss of step 3 is NaN on every rank
    MESHFOLD_FAULTS="kill=2@3"            rank 2 kills itself (SIGKILL) at step 3
    MESHFOLD_FAULTS="stop=1@3"            rank 1 stops itself (SIGSTOP) at step 3: a stalled rank
    MESHFOLD_FAULTS="crash_in_save_at=6"  rank 0 dies after writing checkpoint 6, before it is complete
    MESHFOLD_FAULTS="step_sleep=0.05"     every step sleeps this long: a run slow enough to signal

Keeping these out of the settings means the documented settings are only real ones, and a TOML
file can never switch a fault on by accident.
"""

from __future__ import annotations

import os
import signal
import time

__all__ = ["ENV", "parse", "before_step", "loss_is_nan", "crash_in_save"]

ENV = "MESHFOLD_FAULTS"
_KINDS = {"nan_at": int, "crash_in_save_at": int, "step_sleep": float, "kill": "rank@step",
          "stop": "rank@step"}


def parse(text: str | None = None) -> dict:
    """``{"kill": (2, 3), "nan_at": 3, ...}`` from ``MESHFOLD_FAULTS`` (or ``text``)."""
    text = os.environ.get(ENV, "") if text is None else text
    out: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        kind = _KINDS.get(name)
        try:
            if kind == "rank@step":
                rank, step = value.split("@")
                out[name] = (int(rank), int(step))
            elif kind is not None:
                out[name] = kind(value)
        except ValueError:
            kind = None
        if kind is None:
            raise ValueError(f"{ENV}: cannot read {item!r}; valid: nan_at=STEP, kill=RANK@STEP, "
                             f"stop=RANK@STEP, crash_in_save_at=STEP, step_sleep=SECONDS")
    return out


def before_step(faults: dict, rank: int, step: int) -> None:
    """Kill or stop this rank, or sleep, as asked for ``step``."""
    if faults.get("kill") == (rank, step):
        os.kill(os.getpid(), signal.SIGKILL)
    if faults.get("stop") == (rank, step):
        os.kill(os.getpid(), signal.SIGSTOP)
    if "step_sleep" in faults:
        time.sleep(faults["step_sleep"])


def loss_is_nan(faults: dict, step: int) -> bool:
    return faults.get("nan_at") == step


def crash_in_save(faults: dict, step: int) -> bool:
    return faults.get("crash_in_save_at") == step
