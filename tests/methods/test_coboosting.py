"""Co-Boosting's own parts: the ensemble re-weighting and ODS."""

import pytest
import torch

from fedmitr_core.methods.coboosting import EnsembleReweighting, ods_perturbation
from fedmitr_core.server.ensemble import TeacherEnsemble, TeacherSet
from fedmitr_core.synthesis.generator_synthesis import combined_logits, weighted_logits


def test_reweighting_moves_weight_to_the_teacher_that_is_right_on_the_pool(right_and_wrong):
    rw = EnsembleReweighting(right_and_wrong, mu=0.05, decay=0.5, batch_size=4)
    images, labels = torch.randn(8, 1, 16, 16), torch.zeros(8, dtype=torch.long)
    rw.update(images, labels, round_index=0)
    assert torch.equal(rw.weights, rw.start)  # no step in the first round
    rw.update(images, labels, round_index=1)  # two batches, step 0.05 · 0.5 each
    assert rw.weights.tolist() == pytest.approx([0.5 + 0.05, 0.5 - 0.05])
    for _ in range(60):
        rw.update(images, labels, round_index=1)
    assert 0.0 <= float(rw.weights.min()) and float(rw.weights.max()) <= 1.0


def test_ods_moves_every_pixel_by_eps_along_a_sign(micro_vit):
    teachers = TeacherSet([micro_vit(num_classes=4) for _ in range(2)], torch.ones(2, 4).numpy())
    ens = TeacherEnsemble(teachers, "uniform", "loop", torch.device("cpu"))
    rw = EnsembleReweighting(ens, mu=0.0, decay=1.0, batch_size=4)
    perturb = ods_perturbation(ens, rw, eps=0.1, rng=torch.Generator().manual_seed(0))
    x = torch.randn(3, 1, 16, 16)
    moved = perturb(x, torch.zeros(3, dtype=torch.long), 0)
    step = (moved - x).abs()
    assert float(step.max()) == pytest.approx(0.1, abs=1e-6)
    assert float((step > 0).float().mean()) > 0.9  # almost every pixel has a gradient


def test_reweighting_state_round_trips(right_and_wrong):
    rw = EnsembleReweighting(right_and_wrong, mu=0.05, decay=0.5, batch_size=4)
    rw.update(torch.randn(8, 1, 16, 16), torch.zeros(8, dtype=torch.long), round_index=1)
    again = EnsembleReweighting(right_and_wrong, mu=0.05, decay=0.5, batch_size=4)
    again.load_state_dict(rw.state_dict())
    assert torch.equal(again.weights, rw.weights) and not torch.equal(again.weights, again.start)


def test_the_weighted_ensemble_is_invariant_to_scaling_every_weight(right_and_wrong):
    x = torch.randn(5, 1, 16, 16)
    w = torch.tensor([0.7, 0.2])[:, None].expand(-1, 5)
    once = combined_logits(right_and_wrong, x, w)
    assert torch.allclose(combined_logits(right_and_wrong, x, 3.5 * w), once)
    per_teacher = torch.randn(2, 5, 4)
    assert torch.allclose(weighted_logits(per_teacher, w), weighted_logits(per_teacher, 0.01 * w))
    # and it is a weighted mean: equal weights give the mean of the teachers' logits
    assert torch.allclose(weighted_logits(per_teacher, torch.ones(2, 5)), per_teacher.mean(0))


def test_reweighting_cannot_lower_the_loss_by_scaling_every_weight_up(right_and_wrong):
    # Label 2, which neither teacher votes for: without the division, shrinking both
    # weights flattens the logits and lowers the CE, so both fell together. With it the
    # gradient is orthogonal to w (the loss is scale-free): the two signed steps cancel.
    rw = EnsembleReweighting(right_and_wrong, mu=0.05, decay=1.0, batch_size=4,
                             rng=torch.Generator().manual_seed(0))
    images = torch.randn(8, 1, 16, 16)
    for _ in range(5):
        rw.update(images, torch.full((8,), 2, dtype=torch.long), round_index=1)
    assert float(rw.weights.sum()) == pytest.approx(1.0, abs=1e-6)
