"""What the generator-based baselines share: budget, generator and the distillation run."""

from __future__ import annotations

import torch

from fedmitr_core.adversarial import (
    AdversarialDistiller,
    BatchPerturbation,
    GeneratorSynthesizer,
    LabelSampler,
    RoundHook,
    TeacherWeights,
)
from fedmitr_core.generator import ImageGenerator
from fedmitr_core.methods.base import MethodResult, ServerContext, make_student


def new_generator(ctx: ServerContext, conditional: bool, gen: torch.Generator
                  ) -> ImageGenerator:
    """The generator of the configured size (conditional: FedFTG), initialised from ``gen``."""
    b = ctx.cfg.baseline
    return ImageGenerator(b.gen_nz, ctx.image_shape, b.gen_width,
                          num_classes=ctx.num_classes if conditional else 0, generator=gen)


def student_steps(ctx: ServerContext) -> int:
    """The inversion methods' student budget: ``distill-epochs`` passes over ``syn-images``."""
    d, n = ctx.cfg.distill, ctx.cfg.inversion.syn_images
    return d.distill_epochs * max(1, -(-n // d.distill_batch_size))


def run_generative(ctx: ServerContext, name: str, synthesizer: GeneratorSynthesizer,
                   teacher_weights: TeacherWeights, temperature: float, gen: torch.Generator,
                   perturbation: BatchPerturbation | None = None,
                   before_round: RoundHook | None = None,
                   student_init: str | None = None) -> MethodResult:
    """Distil the project's student with a generator-based synthesizer, at the shared budget.

    The student starts as ``student-init`` says, or as ``student_init`` when given.
    """
    cfg = ctx.cfg
    distiller = AdversarialDistiller(
        synthesizer, teacher_weights, rounds=cfg.baseline.gen_rounds,
        num_images=cfg.inversion.syn_images, student_steps=student_steps(ctx),
        batch_size=cfg.distill.distill_batch_size, lr=cfg.distill.distill_lr,
        temperature=temperature, max_shift=cfg.distill.live_shift,
        perturbation=perturbation, before_round=before_round,
        precision=cfg.server.precision,
    )
    student, images, labels = distiller.run(make_student(ctx, student_init), gen,
                                            label=f"{name}: generator round", emit=ctx.emit)
    with torch.no_grad():
        agree = ctx.ensemble.predict(images).argmax(dim=1).cpu() == labels
    return MethodResult(model=student.vit, details={
        "pool-size": len(labels), "pool-on-target": float(agree.float().mean())})


def class_prior_sampler(label_counts: torch.Tensor) -> LabelSampler:
    """Labels drawn in proportion to the clients' summed label counts."""
    prior = label_counts.float().sum(dim=0).clamp_min(0)
    prior = prior / prior.sum() if float(prior.sum()) > 0 else torch.ones_like(prior) / len(prior)

    def sample(n: int, gen: torch.Generator) -> torch.Tensor:
        return torch.multinomial(prior, n, replacement=True, generator=gen)

    return sample


def uniform_sampler(num_classes: int) -> LabelSampler:
    """Labels drawn uniformly over the classes."""

    def sample(n: int, gen: torch.Generator) -> torch.Tensor:
        return torch.randint(num_classes, (n,), generator=gen)

    return sample
