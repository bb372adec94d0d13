"""``metrics.jsonl``: one JSON row per trained step, and what a resume makes of it.

Rank 0 writes each row whole (one ``write`` of the line with its newline) and flushes it, so a
crash can tear at most the last row. On resume the log is made to say what the model went
through up to the checkpoint it resumes from:

* rows after that step go (those steps are trained again and logged anew);
* a torn or unreadable row goes (a crash during its write, a copy cut short);
* rows the checkpoint covers that are lost that way cannot be written again (their steps are
  not retrained), so the loss is said in one line and recorded as a *gap row* where the rows
  were, ``{"step": last, "gap": [first, last], "note": ...}``, which has no ``loss``: readers of
  the metrics skip it, and a later resume keeps it with the rows before it.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["resume_metrics", "write_row"]


def write_row(file, record: dict) -> None:
    """Append ``record`` as one whole line and flush it: a crash tears at most this row."""
    file.write(json.dumps(record) + "\n")
    file.flush()


def resume_metrics(path: Path, step: int, skipped: int, checkpoint: str = "") -> str | None:
    """Rewrite ``path`` to the rows of steps up to ``step`` (the checkpoint resumed from, which
    counts ``skipped`` non-finite steps that have no row). Returns a one-line note when rows the
    checkpoint covers were torn or lost, after recording them as gap rows where they were; else
    None."""
    if not path.exists():
        return None
    data = path.read_bytes()
    rows, torn = [], []  # torn: (byte offset, index in rows of the row after it)
    offset = 0
    for line in data.split(b"\n"):
        row = _row(line)
        if row is None and line.strip():
            torn.append((offset, len(rows)))
        elif row is not None and row["step"] <= step:
            rows.append(row)
        offset += len(line) + 1
    logged = sum(_last(r) - _first(r) + 1 for r in rows)
    lost = step - skipped - logged
    if lost <= 0:
        gaps = []
    else:  # the steps between whole rows where a row was torn; else those after the last row; else
        # every run of steps without a row (skipped steps among them: which ones is not recorded)
        gaps = (_holes(rows, step, sorted({i for _, i in torn})) or _holes(rows, step, [len(rows)])
                or _holes(rows, step, range(len(rows) + 1)))
    note = None
    if gaps:
        cut = [f"{offset:,}" for offset, i in torn if i in {g[0] for g in gaps}]
        why = (f"a row cut short at byte{'s' * (len(cut) > 1)} {', '.join(cut)} of {len(data):,}" if cut else f"{lost} rows missing")
        steps = ", ".join(f"{first}-{last}" for _, first, last in gaps)
        note = (f"{path}: {why}; steps {steps}, which checkpoint {checkpoint or f'step {step}'} "
                f"covers, have no rows and are not trained again: recorded as a gap row")
        for i, first, last in reversed(gaps):  # in place: the log stays in step order
            rows.insert(i, {"step": last, "gap": [first, last], "note": note})
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if text.encode() != data:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text(text)
        tmp.replace(path)  # a crash here leaves the old log or the new one, never half of each
    return note


def _holes(rows: list[dict], step: int, at) -> list[tuple[int, int, int]]:
    """(index, first step, last step) of the steps without a row before ``rows[index]`` (or up to
    ``step`` at the end), for each index of ``at`` that has any."""
    spans = [(i, _last(rows[i - 1]) + 1 if i else 1, _first(rows[i]) - 1 if i < len(rows) else step) for i in at]
    return [(i, first, last) for i, first, last in spans if first <= last]


def _first(row: dict) -> int:
    """The first step a row (or a gap row) stands for."""
    return row["gap"][0] if "gap" in row else row["step"]


def _last(row: dict) -> int:
    return row["gap"][1] if "gap" in row else row["step"]


def _row(line: bytes) -> dict | None:
    """A metrics row, or None for a line that is not one whole row."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None
