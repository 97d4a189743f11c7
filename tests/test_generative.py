"""The pieces of the generator-based baselines: generator, losses, reweighting, ODS, budget."""

import pytest
import torch
from conftest import TINY

from fedmitr_core.adversarial import AdversarialDistiller, GeneratorSynthesizer
from fedmitr_core.config import parse_config
from fedmitr_core.ensemble import TeacherEnsemble, TeacherSet
from fedmitr_core.generator import ImageGenerator
from fedmitr_core.losses import (
    ConditionalGeneratorLoss,
    DenseGeneratorLoss,
    HardSampleGeneratorLoss,
    diversity_loss,
)
from fedmitr_core.methods.coboosting import EnsembleReweighting, ods_perturbation
from fedmitr_core.models import StudentViT, build_vit


@pytest.mark.parametrize("size", [16, 28, 32, 224])
def test_generator_makes_standardised_images_of_the_model_size(size):
    g = ImageGenerator(nz=32, image_shape=(3, size, size), width=8).train()
    x = g(torch.randn(6, 32))
    assert x.shape == (6, 3, size, size)
    # The last affine-free batch norm standardises every channel over the batch.
    assert torch.allclose(x.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-4)
    assert torch.allclose(x.std(dim=(0, 2, 3)), torch.ones(3), atol=1e-2)


def test_conditional_generator_depends_on_the_label_and_needs_it():
    g = ImageGenerator(nz=16, image_shape=(1, 16, 16), width=8, num_classes=10).eval()
    z = torch.randn(4, 16)
    a, b = g(z, torch.zeros(4, dtype=torch.long)), g(z, torch.ones(4, dtype=torch.long))
    assert not torch.allclose(a, b)
    with pytest.raises(ValueError, match="labels"):
        g(z)


def _logits(rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_dense_adversarial_term_counts_only_agreeing_samples():
    teacher = _logits([[5.0, 0.0], [0.0, 5.0]])
    disagree = _logits([[0.0, 5.0], [5.0, 0.0]])
    labels = torch.zeros(2, dtype=torch.long)
    loss = DenseGeneratorLoss(oh_weight=0.0, adv_weight=1.0)
    total, parts = loss(teacher, disagree, labels, torch.zeros(2, 1), torch.zeros(2, 1))
    assert float(total) == 0.0 and parts["adv"] == 0.0
    agree_far = _logits([[1.0, 0.0], [0.0, 1.0]])  # same argmax, softer
    total, _ = loss(teacher, agree_far, labels, torch.zeros(2, 1), torch.zeros(2, 1))
    assert float(total) < 0  # maximises the KL where student and ensemble agree


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


def _constant_teacher(favoured: int, num_classes: int = 4) -> torch.nn.Module:
    """A real micro ViT whose logits are a constant vote for ``favoured``."""
    vit = build_vit("vit-micro", num_classes, 16, 1, 4)
    with torch.no_grad():
        vit.head.weight.zero_()
        vit.head.bias.fill_(0.0)
        vit.head.bias[favoured] = 3.0
    return vit.eval()


@pytest.fixture
def right_and_wrong():
    teachers = TeacherSet([_constant_teacher(0), _constant_teacher(1)],
                          torch.tensor([[5, 5, 5, 5], [5, 5, 5, 5]]).numpy())
    return TeacherEnsemble(teachers, "uniform", "loop", torch.device("cpu"))


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


def test_ods_moves_every_pixel_by_eps_along_a_sign(right_and_wrong):
    teachers = TeacherSet([build_vit("vit-micro", 4, 16, 1, 4).eval() for _ in range(2)],
                          torch.ones(2, 4).numpy())
    ens = TeacherEnsemble(teachers, "uniform", "loop", torch.device("cpu"))
    rw = EnsembleReweighting(ens, mu=0.0, decay=1.0, batch_size=4)
    perturb = ods_perturbation(ens, rw, eps=0.1, gen=torch.Generator().manual_seed(0))
    x = torch.randn(3, 1, 16, 16)
    moved = perturb(x, torch.zeros(3, dtype=torch.long), 0)
    step = (moved - x).abs()
    assert float(step.max()) == pytest.approx(0.1, abs=1e-6)
    assert float((step > 0).float().mean()) > 0.9  # almost every pixel has a gradient


def test_distiller_spends_exactly_the_budget(right_and_wrong):
    cfg = parse_config(TINY)
    ens = right_and_wrong
    weights = lambda y: torch.full((2, len(y)), 0.5)  # noqa: E731
    synth = GeneratorSynthesizer(
        ImageGenerator(8, (1, 16, 16), 8), ens, weights,
        DenseGeneratorLoss(1.0, 1.0), steps=2, lr=1e-3, betas=(0.5, 0.999),
        optimise_noise=True, reset_each_batch=False, label_sampler=None)
    pool_sizes, student_steps = [], []
    distiller = AdversarialDistiller(
        synth, weights, rounds=3, num_images=10, student_steps=7, batch_size=4, lr=1e-3,
        temperature=cfg.distill.temperature, max_shift=0,
        perturbation=lambda x, y, r: student_steps.append(r) or x,
        before_round=lambda x, y, r: pool_sizes.append(len(y)))
    student = StudentViT(build_vit("vit-micro", 4, 16, 1, 4))
    _, images, labels = distiller.run(student, torch.Generator().manual_seed(0), "t", None)
    assert pool_sizes == [4, 7, 10] and len(images) == 10
    assert student_steps == [0, 0, 0, 1, 1, 2, 2]
    # DENSE's unconditional labels are the ensemble's predictions: both teachers tie at
    # 0.5 · 3 on classes 0 and 1, and argmax takes the first.
    assert labels.tolist() == [0] * 10
    assert all(p.requires_grad for p in student.parameters())
