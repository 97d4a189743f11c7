"""Cell formatting shared by the benchmarks' markdown tables."""

from __future__ import annotations

from collections.abc import Sequence

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
