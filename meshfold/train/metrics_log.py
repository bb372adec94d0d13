"""``metrics.jsonl``: one JSON row per trained step, and what a resume makes of it.

Rank 0 writes each row whole (one ``write`` of the line with its newline) and flushes it, so a
crash can tear at most the last row. On resume the log is made to say what the model went
through up to the checkpoint it resumes from:

* rows after that step go (those steps are trained again and logged anew);
* a torn or unreadable row goes (a crash during its write, a copy cut short);
* rows the checkpoint covers that are lost that way cannot be written again (their steps are
  not retrained), so the loss is said in one line and recorded as a *gap row*,
  ``{"step": S, "gap": [first, last], "note": ...}``, which has no ``loss``: readers of the
  metrics skip it, and a later resume keeps it with the rows before it.
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
    checkpoint covers were torn or lost, after recording them as a gap row; else None."""
    if not path.exists():
        return None
    data = path.read_bytes()
    rows, torn = [], []
    offset = 0
    for line in data.split(b"\n"):
        row = _row(line)
        if row is None and line.strip():
            torn.append(offset)
        elif row is not None and row["step"] <= step:
            rows.append(row)
        offset += len(line) + 1
    logged = sum(1 for r in rows if "gap" not in r) + sum(r["gap"][1] - r["gap"][0] + 1 for r in rows if "gap" in r)
    lost = step - skipped - logged
    note = None
    if lost > 0:
        first = max((r["gap"][1] if "gap" in r else r["step"] for r in rows), default=0) + 1
        why = (f"a row cut short at byte {torn[-1]:,} of {len(data):,}" if torn
               else f"{lost} rows missing")
        note = (f"{path}: {why}; steps {first}-{step}, which checkpoint {checkpoint or f'step {step}'} "
                f"covers, have no rows and are not trained again: recorded as a gap row")
        rows.append({"step": step, "gap": [first, step], "note": note})
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if text.encode() != data:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text(text)
        tmp.replace(path)  # a crash here leaves the old log or the new one, never half of each
    return note


def _row(line: bytes) -> dict | None:
    """A metrics row, or None for a line that is not one whole row."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None
