"""FedFTG (Zhang et al., CVPR 2022), one-shot: a conditional generator fine-tunes FedAvg."""

from __future__ import annotations

import torch

from fedmitr_core.adversarial import GeneratorSynthesizer
from fedmitr_core.losses import ConditionalGeneratorLoss
from fedmitr_core.methods.base import MethodResult, ServerContext
from fedmitr_core.methods.generative import class_prior_sampler, new_generator, run_generative


def run_fedftg(ctx: ServerContext) -> MethodResult:
    """FedFTG: a conditional generator and class-level weights fine-tune the FedAvg model.

    Labels are drawn in proportion to the global class counts, the teachers are
    weighted per class ``w_{k,y} = n_{k,y} / n_y``, a diversity term keeps the
    images apart, and the student starts from the one-shot FedAvg model whatever
    ``student-init`` says (FedFTG fine-tunes the aggregated model).

    In one shot there is one fine-tuning phase; its generated images accumulate in a
    pool of ``syn-images`` like the other methods', so every method sees the same number.
    """
    b = ctx.cfg.baseline
    gen = ctx.generator(6)
    counts = torch.as_tensor(ctx.teachers.label_counts)
    synthesizer = GeneratorSynthesizer(
        new_generator(ctx, conditional=True, gen=gen), ctx.ensemble, ctx.ensemble.target_weights,
        ConditionalGeneratorLoss(b.fedftg_ce, b.fedftg_adv, b.fedftg_div),
        steps=b.gen_steps, lr=b.gen_lr, betas=(0.5, 0.999), optimise_noise=False,
        reset_each_batch=False, label_sampler=class_prior_sampler(counts),
        precision=ctx.cfg.server.precision,
    )
    return run_generative(ctx, "fedftg", synthesizer, ctx.ensemble.target_weights,
                          b.fedftg_temperature, gen, student_init="fedavg")
