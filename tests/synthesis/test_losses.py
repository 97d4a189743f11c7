"""Synthesis losses: inversion's objective and the generator baselines' losses."""

import math

import pytest
import torch

from fedmitr_core.synthesis.losses import (
    ConditionalGeneratorLoss,
    DenseGeneratorLoss,
    HardSampleGeneratorLoss,
    InversionLoss,
    diversity_loss,
    kl_per_sample,
    total_variation,
)


def test_total_variation_and_inversion_loss():
    flat = torch.zeros(1, 1, 4, 4)
    noisy = torch.randn(1, 1, 4, 4)
    assert float(total_variation(flat)) == 0.0 and float(total_variation(noisy)) > 0.0
    logits = torch.zeros(2, 1, 3)
    logits[0, 0, 1] = 10.0  # teacher 0 is sure of class 1, teacher 1 is uniform
    labels = torch.tensor([1])
    only_first = torch.tensor([[1.0], [0.0]])
    only_second = torch.tensor([[0.0], [1.0]])
    loss = InversionLoss(0.0, 0.0, "per-teacher")
    low, _ = loss(logits, torch.full((1, 3), 1 / 3), only_first, labels, flat)
    high, _ = loss(logits, torch.full((1, 3), 1 / 3), only_second, labels, flat)
    assert float(low) < 1e-3 and abs(float(high) - math.log(3)) < 1e-4
    mixture = InversionLoss(0.0, 0.0, "mixture")
    value, _ = mixture(logits, torch.tensor([[0.2, 0.6, 0.2]]), only_first, labels, flat)
    assert abs(float(value) + math.log(0.6)) < 1e-5


def _logits(rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_dense_adversarial_term_vanishes_where_the_student_agrees_with_the_ensemble():
    teacher = _logits([[5.0, 0.0], [0.0, 5.0]])
    labels = torch.tensor([0, 1])
    loss = DenseGeneratorLoss(oh_weight=0.0, adv_weight=1.0)
    agree_softer = _logits([[1.0, 0.0], [0.0, 1.0]])  # same argmax on every image, far in KL
    total, parts = loss(teacher, agree_softer, labels, torch.zeros(2, 1), torch.zeros(2, 1))
    assert float(total) == 0.0 and parts["adv"] == 0.0
    disagree = _logits([[0.0, 5.0], [0.0, 5.0]])  # the first image is argued, the second not
    total, _ = loss(teacher, disagree, labels, torch.zeros(2, 1), torch.zeros(2, 1))
    kl_first = float(kl_per_sample(teacher[:1], disagree[:1]))
    assert float(total) == pytest.approx(-kl_first / 2)  # mean over both, only the first counts


def test_dense_cross_entropy_pulls_towards_the_sampled_labels_not_the_ensembles_argmax():
    teacher = _logits([[5.0, 0.0]])
    loss = DenseGeneratorLoss(oh_weight=1.0, adv_weight=0.0)
    towards_argmax, _ = loss(teacher, teacher, torch.tensor([0]), torch.zeros(1, 1),
                             torch.zeros(1, 1))
    towards_other, _ = loss(teacher, teacher, torch.tensor([1]), torch.zeros(1, 1),
                            torch.zeros(1, 1))
    assert float(towards_other) > 4.0 > float(towards_argmax)


def test_coboosting_adversarial_kl_is_scaled_by_the_temperature_squared():
    teacher, student = _logits([[3.0, 0.0, 1.0]]), _logits([[0.0, 2.0, 0.0]])
    y = torch.zeros(1, dtype=torch.long)
    loss = HardSampleGeneratorLoss(oh_weight=0.0, adv_weight=1.0, hard_power=1.0,
                                   adv_temperature=3.0)
    total, _ = loss(teacher, student, y, torch.zeros(1, 1), torch.zeros(1, 1))
    assert float(total) == pytest.approx(-9.0 * float(kl_per_sample(teacher, student, 3.0)))


def test_hard_sample_weighting_ignores_easy_samples():
    loss = HardSampleGeneratorLoss(oh_weight=1.0, adv_weight=0.0, hard_power=1.0,
                                   adv_temperature=3.0)
    easy = _logits([[20.0, 0.0]])
    hard = _logits([[0.0, 0.0]])
    y = torch.zeros(1, dtype=torch.long)
    e, _ = loss(easy, easy, y, torch.zeros(1, 1), torch.zeros(1, 1))
    h, _ = loss(hard, hard, y, torch.zeros(1, 1), torch.zeros(1, 1))
    assert float(e) < 1e-8 and float(h) == pytest.approx(0.5 * torch.log(torch.tensor(2.0)))


def test_diversity_loss_is_one_for_collapsed_images_and_lower_for_distinct_ones():
    z = torch.randn(5, 8)
    same = torch.ones(5, 1, 4, 4)
    assert float(diversity_loss(z, same)) == pytest.approx(1.0)
    assert float(diversity_loss(z, torch.randn(5, 1, 4, 4))) < 0.9
    total, parts = ConditionalGeneratorLoss(0.0, 0.0, 2.0)(
        _logits([[1.0, 0.0]] * 5), _logits([[1.0, 0.0]] * 5), torch.zeros(5, dtype=torch.long),
        same, z)
    assert float(total) == pytest.approx(2.0) and parts["div"] == pytest.approx(1.0)
