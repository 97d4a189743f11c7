"""Bounded influence: weight outliers are dropped, claimed counts are capped."""

import numpy as np
import pytest
import torch

from fedmitr_core.server.ensemble import TeacherSet
from fedmitr_core.server.screening import (
    cap_counts,
    lower_median,
    median_distances,
    screen_teachers,
    weight_outliers,
)


def _near(micro_vit, scale: float, seed: int) -> torch.nn.Module:
    """Seed 0's micro ViT moved by Gaussian noise of ``scale``: a stand-in for local training."""
    model = micro_vit(seed=0)
    g = torch.Generator().manual_seed(seed)
    model.load_state_dict({k: v + scale * torch.randn(v.shape, generator=g)
                           for k, v in model.state_dict().items()})
    return model


@pytest.fixture
def honest(micro_vit):
    return [_near(micro_vit, 0.01 * (1 + k % 3), seed=k) for k in range(6)]


def test_lower_median_takes_the_smaller_middle_value():
    assert lower_median(np.array([5, 1, 3])) == 3
    assert lower_median(np.array([1, 1000])) == 1
    assert lower_median(np.array([4, 1, 3, 2])) == 2


def _boosted(micro_vit, update_of: torch.nn.Module, factor: float) -> torch.nn.Module:
    """Seed 0's micro ViT plus ``factor`` times ``update_of``'s update: a boosted upload."""
    model = micro_vit(seed=0)
    start, moved = model.state_dict(), update_of.state_dict()
    model.load_state_dict({k: v + factor * (moved[k] - v) for k, v in start.items()})
    return model


def test_a_boosted_update_among_honest_ones_is_the_outlier(honest, micro_vit):
    attacker = _boosted(micro_vit, honest[0], 20.0)
    models = honest[:3] + [attacker] + honest[3:]
    distances = median_distances(models)
    assert distances.argmax() == 3
    assert set(weight_outliers(models, 5.0)) == {3}
    # Honest spread (noise scales 1-3x) stays well inside the default ratio of 5.
    assert weight_outliers(honest, 5.0) == {}
    assert weight_outliers(models, 0.0) == {}  # off
    assert weight_outliers(models[2:4], 5.0) == {}  # two teachers: no majority to judge by


def test_claims_are_capped_at_the_ratio_times_the_lower_median_keeping_proportions():
    counts = np.array([[10, 10, 0], [30, 0, 10], [5, 5, 10], [6 * 10**12, 2 * 10**12, 0]])
    capped = cap_counts(counts, 10.0)
    np.testing.assert_array_equal(capped[:3], counts[:3])
    assert capped[3].sum() <= 10 * 20 and capped[3].sum() >= 10 * 20 - 2
    assert capped[3, 0] == 3 * capped[3, 1] and capped[3, 2] == 0
    np.testing.assert_array_equal(cap_counts(counts, 0.0), counts)
    # Two clients: the lower median is the smaller one, so the larger claim is what is capped.
    two = cap_counts(np.array([[50, 50], [10**9, 10**9]]), 4.0)
    assert two[1].sum() == 400


def test_screening_drops_then_caps_and_says_so(honest, micro_vit):
    models = honest + [_boosted(micro_vit, honest[1], 20.0)]
    counts = np.full((7, 10), 10)
    counts[0] *= 1000  # an honest-looking model claiming 1000x the data
    teachers = TeacherSet(models, counts, [f"c{k}" for k in range(7)])
    out = screen_teachers(teachers, outlier_ratio=5.0, count_cap=10.0)
    assert out.teachers.client_ids == [f"c{k}" for k in range(6)]
    assert [d["client-id"] for d in out.dropped] == ["c6"]
    assert "outlier-ratio" in out.dropped[0]["reason"]
    assert out.capped == [{"client-id": "c0", "claimed": 100_000, "used": 1000}]
    assert out.teachers.label_counts[0].sum() == 1000
    record = out.record()
    assert record["dropped"] == out.dropped and record["capped"] == out.capped
    # Off: the teacher set is unchanged.
    off = screen_teachers(teachers, outlier_ratio=0.0, count_cap=0.0)
    assert len(off.teachers) == 7 and off.dropped == off.capped == []
    np.testing.assert_array_equal(off.teachers.label_counts, counts)
