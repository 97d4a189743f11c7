"""DENSE (Zhang et al., NeurIPS 2022): a generator against the averaged ensemble, then KD."""

from __future__ import annotations

import torch

from fedmitr_core.methods.base import MethodResult, ServerContext
from fedmitr_core.methods.generator_kd import GeneratorKD, new_generator, run_generator_kd
from fedmitr_core.synthesis.generator_synthesis import GeneratorRecipe, GeneratorSynthesizer
from fedmitr_core.synthesis.losses import DenseGeneratorLoss


def run_dense(ctx: ServerContext) -> MethodResult:
    """DENSE: unconditional generator (kept across rounds), growing pool, KD at T=20.

    The ensemble is the plain mean of the teachers' logits, the generator's
    targets are the ensemble's own predictions, and its adversarial term counts
    only images on which the student agrees with the ensemble. (Where this
    differs from the authors' code: issue 17.) The student is the project's
    (initialised as ``student-init``).
    """
    b = ctx.cfg.baseline
    rng = ctx.rng("dense")
    k = len(ctx.ensemble)

    def uniform_weights(labels: torch.Tensor) -> torch.Tensor:
        return torch.full((k, len(labels)), 1.0 / k, device=ctx.device)

    recipe = GeneratorRecipe(DenseGeneratorLoss(b.dense_oh, b.dense_adv), uniform_weights,
                             optimise_noise=True, reset_each_round=False, label_sampler=None)
    synthesizer = GeneratorSynthesizer(new_generator(ctx, conditional=False, rng=rng),
                                       ctx.ensemble, recipe, b, ctx.cfg.runtime.precision)
    return run_generator_kd(ctx, GeneratorKD("dense", synthesizer, b.dense_temperature), rng)
