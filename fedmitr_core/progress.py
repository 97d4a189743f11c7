"""Periodic progress lines with elapsed time and ETA."""

from __future__ import annotations

import time
from collections.abc import Callable

Emit = Callable[[str], None]


def _fmt(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    """Counts steps of one long job and emits a line every ``every_s`` seconds.

    Parameters
    ----------
    label
        What is running, e.g. ``"fedmitr: sparse inversion"``.
    total
        Number of steps the job takes.
    emit
        Where lines go (a logger call); ``None`` keeps quiet.
    every_s
        Minimum seconds between two lines (the first and last step always emit).
    """

    def __init__(self, label: str, total: int, emit: Emit | None, every_s: float = 10.0
                 ) -> None:
        self.label, self.total, self.emit, self.every_s = label, max(1, total), emit, every_s
        self.start = time.perf_counter()
        self.done = 0
        self._last = -float("inf")

    def step(self, n: int = 1, **stats: float) -> None:
        """Mark ``n`` more steps done; ``stats`` are shown in the line."""
        self.done += n
        now = time.perf_counter()
        if self.emit is None:
            return
        if self.done < self.total and self.done > n and now - self._last < self.every_s:
            return
        self._last = now
        elapsed = now - self.start
        eta = elapsed / self.done * (self.total - self.done)
        shown = " ".join(f"{k}={v:.3g}" for k, v in stats.items())
        self.emit(f"{self.label}: {self.done}/{self.total} "
                  f"({100 * self.done / self.total:.0f}%) {shown} "
                  f"elapsed {_fmt(elapsed)} ETA {_fmt(eta)}")
