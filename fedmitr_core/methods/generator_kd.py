"""What the generator-based baselines share: the generator, the budget and their KD loop.

Each round the baseline's :class:`GeneratorSynthesizer` makes one batch of
images against the ensemble and the current student; the batch joins a pool,
and the student is distilled from the ensemble on the pool for its share of
the student steps, through the one :class:`StudentTrainer`. DENSE and
Co-Boosting make shuffled passes over the pool, their rounds' steps in
proportion to the pool's size (the authors make one pass per round); FedFTG
draws its batches with replacement, an even share per round. DENSE, Co-Boosting
and FedFTG (``dense.py``, ``coboosting.py``, ``fedftg.py``) differ in their
:class:`GeneratorRecipe` and in what happens around each round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from fedmitr_core.data.batches import batches_per_epoch, iterate_batches, random_shift
from fedmitr_core.distill.losses import soft_kl
from fedmitr_core.distill.trainer import StudentTrainer
from fedmitr_core.methods.base import MethodResult, ServerContext, make_student, training_setup
from fedmitr_core.progress import Progress
from fedmitr_core.runtime import autocast
from fedmitr_core.synthesis.generator import ImageGenerator
from fedmitr_core.synthesis.generator_synthesis import (
    GeneratorSynthesizer,
    LabelSampler,
    combined_logits,
)

# ``(images, labels, round) -> images``: a change to each student batch (Co-Boosting's ODS).
BatchPerturbation = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
# ``(images, labels, round)``: called with the pool before the round's new batch joins it.
RoundHook = Callable[[torch.Tensor, torch.Tensor, int], None]


class Stateful(Protocol):
    """Something whose state a checkpoint must hold (``state_dict`` / ``load_state_dict``)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


@dataclass
class GeneratorKD:
    """One generator-based baseline, ready to run.

    ``temperature`` is its KD temperature; ``perturbation`` changes each student
    batch, ``before_joining`` sees the pool after each round's synthesis and
    before the new batch joins it (Co-Boosting re-weights the ensemble there),
    and ``state`` names what else a checkpoint must hold (the generator always
    is). ``student_init`` overrides ``student-init`` (FedFTG fine-tunes FedAvg) and
    ``distill_lr`` overrides ``distill-lr`` (FedFTG's own rate, ``fedftg-lr``).
    ``passes_over_pool``: shuffled passes over the pool, each round's steps in
    proportion to its pool size; otherwise batches drawn with replacement, an
    even share of the steps per round.
    """

    name: str
    synthesizer: GeneratorSynthesizer
    temperature: float
    perturbation: BatchPerturbation | None = None
    before_joining: RoundHook | None = None
    state: dict[str, Stateful] = field(default_factory=dict)
    student_init: str | None = None
    distill_lr: float | None = None
    passes_over_pool: bool = False


def new_generator(ctx: ServerContext, conditional: bool, rng: torch.Generator
                  ) -> ImageGenerator:
    """The generator of the configured size, initialised from ``rng``.

    Unconditional (DENSE, Co-Boosting): pixels in [0, 1] through a Sigmoid, then the
    dataset's normalisation, as the authors' ``Generator`` and ``Normalizer``.
    Conditional (FedFTG): standardised channels (Tanh and affine-free batch norm).
    """
    b = ctx.cfg.baseline
    pixels = None if conditional else (ctx.spec.mean, ctx.spec.std)
    return ImageGenerator(b.gen_nz, ctx.spec.image_shape, b.gen_width,
                          num_classes=ctx.spec.num_classes if conditional else 0, rng=rng,
                          pixels=pixels)


def steps_per_epoch(ctx: ServerContext) -> int:
    """Student steps in one epoch over ``syn-images`` images (the inversion methods' unit)."""
    return batches_per_epoch(ctx.cfg.inversion.syn_images, ctx.cfg.distill.distill_batch_size)


def split_evenly(total: int, parts: int) -> list[int]:
    """``total`` as ``parts`` integers that differ by at most one, larger first."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def split_in_proportion(total: int, weights: list[int]) -> list[int]:
    """``total`` split in proportion to ``weights``.

    The parts with the largest remainders round up (on ties, the later ones).
    """
    whole = sum(weights)
    parts = [total * w // whole for w in weights]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(total * weights[i] % whole), -i))
    for i in by_remainder[: total - sum(parts)]:
        parts[i] += 1
    return parts


def student_steps(total: int, sizes: list[int], passes_over_pool: bool) -> list[int]:
    """Each round's student steps: in proportion to the pool so far, or evenly."""
    if not passes_over_pool:
        return split_evenly(total, len(sizes))
    pools = [sum(sizes[: r + 1]) for r in range(len(sizes))]
    return split_in_proportion(total, pools)


def pool_batches(n: int, batch_size: int, steps: int, passes_over_pool: bool,
                 rng: torch.Generator) -> Iterator[torch.Tensor]:
    """``steps`` index batches into a pool of ``n``: shuffled passes, or draws with replacement."""
    batch_size = min(batch_size, n)
    if not passes_over_pool:
        for _ in range(steps):
            yield torch.randint(n, (batch_size,), generator=rng)
        return
    made = 0
    while made < steps:
        for idx in iterate_batches(n, batch_size, rng):
            if made == steps:
                return
            made += 1
            yield idx


def run_generator_kd(ctx: ServerContext, method: GeneratorKD, rng: torch.Generator
                     ) -> MethodResult:
    """Distil the project's student with a generator-based synthesizer, at the shared budget.

    ``syn-images`` images in ``gen-rounds`` rounds, and as many student steps as
    ``distill-epochs`` epochs over ``syn-images`` images, split over the rounds
    by :func:`student_steps`; batches come from the pool so far by :func:`pool_batches`.
    """
    cfg, synth = ctx.cfg, method.synthesizer
    rounds = max(1, min(cfg.baseline.gen_rounds, cfg.inversion.syn_images))
    per_epoch = steps_per_epoch(ctx)
    student = make_student(ctx, method.student_init)
    settings = cfg.distill if method.distill_lr is None else replace(
        cfg.distill, distill_lr=method.distill_lr)
    trainer = StudentTrainer(student, settings, training_setup(ctx, method.name),
                             cfg.distill.distill_epochs * per_epoch, per_epoch)
    state = {"generator": synth.net, **method.state}
    done, saved = trainer.resume(rng, f"{method.name}: generator round")
    pool_x, pool_y = [], []
    if saved:
        pool_x = [saved["pool-images"].to(ctx.device)]
        pool_y = [saved["pool-labels"].to(ctx.device)]
        for key, part in state.items():
            part.load_state_dict(saved[key])
    progress = Progress(f"{method.name}: generator round", rounds - done, ctx.emit)
    sizes = split_evenly(cfg.inversion.syn_images, rounds)
    steps = student_steps(cfg.distill.distill_epochs * per_epoch, sizes, method.passes_over_pool)
    for r in range(done, rounds):
        images, labels, parts = synth.synthesize(sizes[r], student, rng)
        if method.before_joining is not None and pool_y:
            method.before_joining(torch.cat(pool_x), torch.cat(pool_y), r)
        pool_x.append(images)
        pool_y.append(labels)
        x_all, y_all = torch.cat(pool_x), torch.cat(pool_y)
        batches = pool_batches(len(y_all), cfg.distill.distill_batch_size, steps[r],
                               method.passes_over_pool, rng)
        kd = sum(_student_step(ctx, method, trainer, x_all[idx.to(ctx.device)],
                               y_all[idx.to(ctx.device)], r, rng) for idx in batches)
        progress.step(kd=kd / max(1, steps[r]), pool=float(len(y_all)), **parts)
        trainer.checkpoint_if_due(r + 1, rng, lambda x=x_all, y=y_all: {
            "pool-images": x, "pool-labels": y,
            **{key: part.state_dict() for key, part in state.items()}})
    images, labels = torch.cat(pool_x).cpu(), torch.cat(pool_y).cpu()
    with torch.no_grad():
        agree = ctx.ensemble.predict(images).argmax(dim=1).cpu() == labels
    return MethodResult(model=student.eval().vit, details={
        "pool-size": len(labels), "pool-on-target": float(agree.float().mean())})


def _student_step(ctx: ServerContext, method: GeneratorKD, trainer: StudentTrainer,
                  x: torch.Tensor, y: torch.Tensor, round_index: int,
                  rng: torch.Generator) -> float:
    """One KD step on a batch from the pool; its loss."""
    synth, precision = method.synthesizer, ctx.cfg.runtime.precision
    x = random_shift(x, ctx.cfg.distill.live_shift, rng)
    if method.perturbation is not None:
        x = method.perturbation(x, y, round_index)
    with torch.no_grad():
        target = torch.softmax(combined_logits(
            synth.ensemble, x, synth.recipe.teacher_weights(y), precision)
            / method.temperature, dim=-1)
    with autocast(ctx.device, precision):
        logits = trainer.student(x)
    loss = soft_kl(logits, target, method.temperature)
    trainer.step(loss)
    return float(loss.detach())


def class_prior_sampler(label_counts: torch.Tensor) -> LabelSampler:
    """Labels drawn in proportion to the clients' summed label counts."""
    prior = label_counts.float().sum(dim=0).clamp_min(0)
    prior = prior / prior.sum() if float(prior.sum()) > 0 else torch.ones_like(prior) / len(prior)

    def sample(n: int, rng: torch.Generator) -> torch.Tensor:
        return torch.multinomial(prior, n, replacement=True, generator=rng)

    return sample


def uniform_sampler(num_classes: int, sort: bool = False) -> LabelSampler:
    """Labels drawn uniformly over the classes (sorted, as DENSE's authors do, if ``sort``)."""

    def sample(n: int, rng: torch.Generator) -> torch.Tensor:
        labels = torch.randint(num_classes, (n,), generator=rng)
        return labels.sort().values if sort else labels

    return sample
