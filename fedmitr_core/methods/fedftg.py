"""FedFTG (Zhang et al., CVPR 2022), one-shot: a conditional generator fine-tunes FedAvg."""

from __future__ import annotations

import torch

from fedmitr_core.methods.base import MethodResult, ServerContext
from fedmitr_core.methods.generator_kd import (
    GeneratorKD,
    class_prior_sampler,
    new_generator,
    run_generator_kd,
)
from fedmitr_core.synthesis.generator_synthesis import GeneratorRecipe, GeneratorSynthesizer
from fedmitr_core.synthesis.losses import ConditionalGeneratorLoss
from fedmitr_core.synthesis.prior import synthesis_prior


def run_fedftg(ctx: ServerContext) -> MethodResult:
    """FedFTG: a conditional generator and class-level weights fine-tune the FedAvg model.

    Labels are drawn in proportion to the global class counts, the teachers are
    weighted per class ``w_{k,y} = n_{k,y} / n_y``, a diversity term keeps the
    images apart, and the student starts from the one-shot FedAvg model whatever
    ``student-init`` says (FedFTG fine-tunes the aggregated model), at its own rate
    ``fedftg-lr``: fine-tuning a trained start prefers a lower rate than distilling
    (chosen on the validation split, docs/tuning.md t37).

    In one shot there is one fine-tuning phase; its generated images accumulate in a
    pool of ``syn-images`` like the other methods', so every method sees the same number.
    """
    b = ctx.cfg.baseline
    rng = ctx.rng("fedftg")
    counts = torch.as_tensor(ctx.teachers.label_counts)
    recipe = GeneratorRecipe(ConditionalGeneratorLoss(b.fedftg_ce, b.fedftg_adv, b.fedftg_div),
                             ctx.ensemble.target_weights, optimise_noise=False,
                             reset_each_round=False, label_sampler=class_prior_sampler(counts))
    synthesizer = GeneratorSynthesizer(new_generator(ctx, conditional=True, rng=rng),
                                       ctx.ensemble, recipe, b, ctx.cfg.runtime.precision,
                                       synthesis_prior(ctx.ensemble, ctx.cfg.prior,
                                                       b.fedftg_stats))
    method = GeneratorKD("fedftg", synthesizer, b.fedftg_temperature, student_init="fedavg",
                         distill_lr=b.fedftg_lr)
    return run_generator_kd(ctx, method, rng)
