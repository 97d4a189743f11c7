"""DENSE (Zhang et al., NeurIPS 2022): a generator against the averaged ensemble, then KD."""

from __future__ import annotations

import torch

from fedmitr_core.adversarial import GeneratorSynthesizer
from fedmitr_core.losses import DenseGeneratorLoss
from fedmitr_core.methods.base import MethodResult, ServerContext
from fedmitr_core.methods.generative import new_generator, run_generative


def run_dense(ctx: ServerContext) -> MethodResult:
    """DENSE: unconditional generator (kept across rounds), growing pool, KD at T=20.

    As in the authors' code the ensemble is the plain mean of the teachers'
    logits, the generator's targets are the ensemble's own predictions, and its
    adversarial term counts only images on which the student agrees with the
    ensemble. The student is the project's (initialised as ``student-init``).
    """
    b = ctx.cfg.baseline
    gen = ctx.generator(4)
    k = len(ctx.ensemble)

    def mean_logits(labels: torch.Tensor) -> torch.Tensor:
        return torch.full((k, len(labels)), 1.0 / k, device=ctx.device)

    synthesizer = GeneratorSynthesizer(
        new_generator(ctx, conditional=False, gen=gen), ctx.ensemble, mean_logits,
        DenseGeneratorLoss(b.dense_oh, b.dense_adv), steps=b.gen_steps, lr=b.gen_lr,
        betas=(0.5, 0.999), optimise_noise=True, reset_each_batch=False, label_sampler=None,
        precision=ctx.cfg.server.precision,
    )
    return run_generative(ctx, "dense", synthesizer, mean_logits, b.dense_temperature,
                          gen)
