"""Cell formatting and markdown tables shared by the benchmarks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def mean_std(values: Sequence[float], digits: int = 2, scale: float = 1.0) -> str:
    """``"mean ± std"`` of ``values`` times ``scale`` (population std).

    One value gives the value alone (no spread to report); none gives ``""``.
    """
    if len(values) == 0:
        return ""
    arr = scale * np.asarray(values, dtype=float)
    if len(arr) == 1:
        return f"{arr[0]:.{digits}f}"
    return f"{arr.mean():.{digits}f} ± {arr.std():.{digits}f}"


def markdown_table(rows: Sequence[dict[str, Any]], cols: Sequence[tuple[str, str]]) -> str:
    """A markdown table: one row per dict, ``cols`` as (heading, key) pairs.

    Floats get three decimals; a missing key or ``None`` is an empty cell.
    """
    head = "| " + " | ".join(c for c, _ in cols) + " |\n|" + "---|" * len(cols) + "\n"
    cells = [["" if r.get(k) is None else f"{r[k]:.3f}" if isinstance(r[k], float)
              else str(r[k]) for _, k in cols] for r in rows]
    return head + "\n".join("| " + " | ".join(c) + " |" for c in cells) + "\n"
