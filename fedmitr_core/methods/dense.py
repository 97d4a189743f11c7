"""DENSE (Zhang et al., NeurIPS 2022): a generator against the averaged ensemble, then KD."""

from __future__ import annotations

import torch

from fedmitr_core.data.batches import random_crop_and_flip
from fedmitr_core.methods.base import MethodResult, ServerContext
from fedmitr_core.methods.generator_kd import (
    GeneratorKD,
    new_generator,
    run_generator_kd,
    uniform_sampler,
)
from fedmitr_core.synthesis.generator_synthesis import GeneratorRecipe, GeneratorSynthesizer
from fedmitr_core.synthesis.losses import DenseGeneratorLoss
from fedmitr_core.synthesis.prior import synthesis_prior


def run_dense(ctx: ServerContext) -> MethodResult:
    """DENSE: a generator re-initialised per round, a growing pool, KD at T=20.

    As the authors' ``AdvSynthesizer``: the ensemble is the plain mean of the
    teachers' logits; labels are drawn uniformly (sorted) and the generator
    learns towards them; the teachers and the student see the generated images
    randomly cropped (zero padding of 1/8 of the side, 4 px at 32 px) and, where
    the dataset allows it, flipped; the adversarial term counts the images on
    which the student disagrees with the ensemble; no gradient clipping. Where
    this differs from the authors' code, and why: docs/baselines.md.
    """
    b = ctx.cfg.baseline
    rng = ctx.rng("dense")
    k = len(ctx.ensemble)
    padding, flip = ctx.spec.image_size // 8, ctx.spec.hflip_ok

    def uniform_weights(labels: torch.Tensor) -> torch.Tensor:
        return torch.full((k, len(labels)), 1.0 / k, device=ctx.device)

    def global_view(images: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        return random_crop_and_flip(images, padding, flip, gen)

    recipe = GeneratorRecipe(DenseGeneratorLoss(b.dense_oh, b.dense_adv), uniform_weights,
                             optimise_noise=True, reset_each_round=True,
                             label_sampler=uniform_sampler(ctx.spec.num_classes, sort=True),
                             augment=global_view, grad_clip=None)
    synthesizer = GeneratorSynthesizer(new_generator(ctx, conditional=False, rng=rng),
                                       ctx.ensemble, recipe, b, ctx.cfg.runtime.precision,
                                       synthesis_prior(ctx.ensemble, ctx.cfg.prior,
                                                       b.dense_stats))
    return run_generator_kd(ctx, GeneratorKD("dense", synthesizer, b.dense_temperature,
                                             passes_over_pool=True), rng)
