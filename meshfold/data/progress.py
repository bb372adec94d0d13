"""A one-line progress display for long data preparation: records, bytes, tokens, rate and ETA.

Shown only on a terminal: a log file or a pipe gets no carriage-return lines, only what the
caller prints when the work is done. The line is redrawn at most every ``every`` seconds so that
drawing costs nothing next to the work.
"""

from __future__ import annotations

import time

__all__ = ["Progress", "format_line"]


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def format_line(records: int, done: int, total: int, tokens: int, seconds: float) -> str:
    """``records``, ``done`` of ``total`` source bytes and ``tokens`` after ``seconds``: the line shown."""
    rate = done / seconds if seconds > 0 else 0.0
    eta = _duration((total - done) / rate) if rate > 0 and total >= done else "?"
    pct = 100 * done / total if total else 100.0
    return (f"{records:,} records  {_size(done)} of {_size(total)} ({pct:.0f}%)  {tokens:,} tokens  "
            f"{_size(rate)}/s  ETA {eta}")


class Progress:
    """Draws :func:`format_line` on ``stream`` when it is a terminal; otherwise does nothing."""

    def __init__(self, stream, total_bytes: int, every: float = 0.2, clock=time.perf_counter):
        self.stream, self.total, self.every, self.clock = stream, total_bytes, every, clock
        self.shown = bool(getattr(stream, "isatty", lambda: False)())
        self.start = self.last = clock()

    def update(self, records: int, done: int, tokens: int, final: bool = False) -> None:
        if not self.shown:
            return
        now = self.clock()
        if not final and now - self.last < self.every:
            return
        self.last = now
        self.stream.write("\r" + format_line(records, done, self.total, tokens, now - self.start) + "\033[K"
                          + ("\n" if final else ""))
        self.stream.flush()
