"""Bounded influence: no single upload may take over the ensemble or the FedAvg reference.

Validation (``server.uploads``) refuses what is malformed or implausible on its
own. What a client could still do is look plausible alone and win by
comparison: send weights unlike everyone else's, or claim far more data than
anyone. Two screens run on the accepted uploads before the server's work, in
this order, and both are recomputed from the persisted uploads on resume:

1. :func:`weight_outliers`: a teacher whose weights lie much further from the
   coordinate-wise median of all teachers than the typical teacher does is
   dropped (run-config key ``outlier-ratio``).
2. :func:`cap_counts`: claimed label counts are scaled down so that no client
   claims more than ``count-cap`` times the (lower) median client's number of
   examples; the class and sample weights of the ensemble and of FedAvg then
   rest on at most that.

Both use the lower median, so with two clients the smaller one is the
reference, and a majority of honest clients fixes it whatever one client sends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedmitr_core.server.ensemble import TeacherSet

MIN_FOR_OUTLIERS = 3  # with two teachers there is no majority to tell the odd one out


def lower_median(values: np.ndarray) -> float:
    """The lower median: the middle value, the smaller of the two middle ones for even n."""
    ordered = np.sort(np.asarray(values, dtype=np.float64))
    return float(ordered[(len(ordered) - 1) // 2])


def median_distances(models: list[torch.nn.Module]) -> np.ndarray:
    """Each model's L2 distance ``(K,)`` to the coordinate-wise (lower) median of all of them.

    One tensor name at a time, so memory holds ``K`` copies of the largest tensor.
    """
    states = [m.state_dict() for m in models]
    squared = torch.zeros(len(models), dtype=torch.float64)
    for name in states[0]:
        stacked = torch.stack([s[name].detach().double().cpu() for s in states])
        median = stacked.median(dim=0).values  # the lower median for an even count
        squared += (stacked - median).flatten(1).pow(2).sum(dim=1)
    return squared.sqrt().numpy()


def weight_outliers(models: list[torch.nn.Module], ratio: float) -> dict[int, float]:
    """Indices of the models further than ``ratio`` × the median distance, with their ratio.

    Empty when ``ratio`` is 0, with fewer than :data:`MIN_FOR_OUTLIERS` models,
    or when the median model sits at distance 0 (most uploads identical).
    """
    if ratio <= 0 or len(models) < MIN_FOR_OUTLIERS:
        return {}
    distances = median_distances(models)
    typical = lower_median(distances)
    if typical <= 0:
        return {}
    return {k: float(d / typical) for k, d in enumerate(distances) if d > ratio * typical}


def cap_counts(label_counts: np.ndarray, cap: float) -> np.ndarray:
    """Label counts ``(K, C)`` scaled so no row sums to more than ``cap`` × the lower median.

    A capped row keeps its class proportions (rounded down, at least 1 where
    it claimed any). ``cap`` 0 returns the counts unchanged.
    """
    counts = np.asarray(label_counts, dtype=np.int64)
    totals = counts.sum(axis=1)
    if cap <= 0 or len(counts) < 2:
        return counts
    limit = cap * lower_median(totals)
    capped = counts.copy()
    for k in np.flatnonzero(totals > limit):
        scaled = np.floor(counts[k] * (limit / totals[k])).astype(np.int64)
        capped[k] = np.where(counts[k] > 0, np.maximum(scaled, 1), 0)
    return capped


@dataclass
class Screening:
    """The teachers kept, and what was dropped or capped and why."""

    teachers: TeacherSet
    dropped: list[dict[str, Any]] = field(default_factory=list)
    capped: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        """What ``metrics.json`` keeps under ``screening``."""
        return {"dropped": self.dropped, "capped": self.capped, "notes": self.notes}


def screen_teachers(teachers: TeacherSet, outlier_ratio: float, count_cap: float) -> Screening:
    """Drop weight outliers, then cap the claimed counts of the rest (see the module doc)."""
    ids = teachers.client_ids or [f"teacher-{k}" for k in range(len(teachers))]
    notes = []
    if outlier_ratio > 0 and len(teachers) < MIN_FOR_OUTLIERS:
        notes.append(f"{len(teachers)} teachers: the weight-outlier screen needs at least "
                     f"{MIN_FOR_OUTLIERS} and was skipped")
    outliers = weight_outliers(teachers.models, outlier_ratio)
    dropped = [{"client-id": ids[k], "reason": f"weights {r:.1f}x further from the median "
                f"teacher than the typical teacher (run config key 'outlier-ratio' "
                f"allows {outlier_ratio:g}x)"} for k, r in sorted(outliers.items())]
    keep = [k for k in range(len(teachers)) if k not in outliers]
    kept_counts = np.asarray(teachers.label_counts)[keep]
    counts = cap_counts(kept_counts, count_cap)
    capped = [{"client-id": ids[k], "claimed": int(kept_counts[i].sum()),
               "used": int(counts[i].sum())}
              for i, k in enumerate(keep) if counts[i].sum() != kept_counts[i].sum()]
    kept = TeacherSet(models=[teachers.models[k] for k in keep], label_counts=counts,
                      client_ids=[ids[k] for k in keep],
                      token_stats=[teachers.token_stats[k] for k in keep]
                      if teachers.token_stats else [])
    return Screening(teachers=kept, dropped=dropped, capped=capped, notes=notes)
