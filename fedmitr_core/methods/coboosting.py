"""Co-Boosting (Dai et al., ICLR 2024): hard samples and ensemble weights boosted together."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fedmitr_core.data.batches import iterate_batches
from fedmitr_core.methods.base import MethodResult, ServerContext
from fedmitr_core.methods.generator_kd import (
    BatchPerturbation,
    GeneratorKD,
    new_generator,
    run_generator_kd,
    uniform_sampler,
)
from fedmitr_core.server.ensemble import TeacherEnsemble
from fedmitr_core.synthesis.generator_synthesis import (
    GeneratorRecipe,
    GeneratorSynthesizer,
    combined_logits,
    weighted_logits,
)
from fedmitr_core.synthesis.losses import HardSampleGeneratorLoss
from fedmitr_core.synthesis.prior import synthesis_prior


class EnsembleReweighting:
    """Co-Boosting's per-client ensemble weights, learned on the synthetic pool.

    The ensemble's logits are ``Σ_k w_k f_k(x) / Σ_k w_k``, ``w`` starting at
    ``1/K``. In every round but the first, after the round's synthesis and
    before its batch joins the pool, one signed-gradient step per batch of a
    shuffled pass over the pool lowers the ensemble's cross-entropy on it:
    ``w ← clip(w − μ · decay^round · sign(∇_w CE))``, within ±1 of the start and
    in [0, 1] (``WEnsemble`` and ``COBOOSTSynthesizer.synthesize`` in the authors' code).

    Parameters
    ----------
    ensemble
        The teachers.
    mu, decay
        Step size and its per-round decay.
    batch_size
        Pool images per step.
    rng
        Shuffles the pool.
    """

    def __init__(self, ensemble: TeacherEnsemble, mu: float, decay: float,
                 batch_size: int, rng: torch.Generator | None = None) -> None:
        self.ensemble = ensemble
        self.start = torch.full((len(ensemble),), 1.0 / len(ensemble), device=ensemble.device)
        self.weights = self.start.clone()
        self.mu, self.decay, self.batch_size = mu, decay, batch_size
        self.rng = rng

    def state_dict(self) -> dict[str, Any]:
        """The current weights (what a checkpoint holds)."""
        return {"weights": self.weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s weights."""
        self.weights = state["weights"].to(self.start.device)

    def per_image(self, labels: torch.Tensor) -> torch.Tensor:
        """The weights as ``(K, B)`` for a batch."""
        return self.weights[:, None].expand(-1, len(labels))

    def update(self, images: torch.Tensor, labels: torch.Tensor, round_index: int) -> None:
        """One pass of signed-gradient steps over the pool (none in round 0)."""
        if round_index == 0 or self.mu == 0:
            return
        step = self.mu * self.decay**round_index
        for idx in iterate_batches(len(labels), self.batch_size, self.rng):
            idx = idx.to(labels.device)
            x, y = images[idx], labels[idx]
            with torch.no_grad():
                per_teacher, _ = self.ensemble.teacher_outputs(x)
            w = self.weights.clone().requires_grad_(True)
            loss = F.cross_entropy(weighted_logits(per_teacher, w[:, None].expand(-1, len(y))), y)
            (grad,) = torch.autograd.grad(loss, w)
            moved = self.weights - step * grad.sign()
            self.weights = (self.start + (moved - self.start).clamp(-1, 1)).clamp(0, 1)


def ods_perturbation(ensemble: TeacherEnsemble, weights: EnsembleReweighting, eps: float,
                     rng: torch.Generator, temperature: float = 4.0) -> BatchPerturbation:
    """Output-diversified sampling: move each image ``eps`` along a random output direction.

    ``x ← x + eps · sign(∇_x Σ r · softmax(t(x) / T))`` with ``r ~ U(-1, 1)`` per
    image and class, as Co-Boosting does to each student batch (``eps`` in the
    normalised input space, as in the authors' code).
    """

    def perturb(images: torch.Tensor, labels: torch.Tensor, round_index: int) -> torch.Tensor:
        if eps == 0:
            return images
        x = images.detach().requires_grad_(True)
        probs = torch.softmax(combined_logits(ensemble, x, weights.per_image(labels))
                              / temperature, dim=-1)
        direction = (torch.rand(probs.shape, generator=rng) * 2 - 1).to(probs.device)
        (grad,) = torch.autograd.grad((direction * probs).sum(), x)
        return (images + eps * grad.sign()).detach()

    return perturb


def run_coboosting(ctx: ServerContext) -> MethodResult:
    """Co-Boosting: hard samples, a re-weighted ensemble, ODS, KD at T=4.

    A freshly initialised generator per round makes hard samples for the
    re-weighted ensemble; each student batch is ODS-perturbed. Where this differs
    from the authors' code, and why: docs/baselines.md.
    """
    b = ctx.cfg.baseline
    rng = ctx.rng("coboosting")
    reweighting = EnsembleReweighting(ctx.ensemble, b.coboost_mu, b.coboost_mu_decay,
                                      ctx.cfg.distill.distill_batch_size, rng)
    loss = HardSampleGeneratorLoss(b.coboost_oh, b.coboost_adv, b.coboost_hard_power,
                                   b.coboost_adv_temperature)
    recipe = GeneratorRecipe(loss, reweighting.per_image, optimise_noise=True,
                             reset_each_round=True,
                             label_sampler=uniform_sampler(ctx.spec.num_classes))
    synthesizer = GeneratorSynthesizer(new_generator(ctx, conditional=False, rng=rng),
                                       ctx.ensemble, recipe, b, ctx.cfg.runtime.precision,
                                       synthesis_prior(ctx.ensemble, ctx.cfg.prior,
                                                       b.coboost_stats))
    method = GeneratorKD(
        "coboosting", synthesizer, b.coboost_temperature,
        perturbation=ods_perturbation(ctx.ensemble, reweighting, b.coboost_ods_eps, rng),
        before_joining=reweighting.update, state={"ensemble-weights": reweighting},
        passes_over_pool=True)
    result = run_generator_kd(ctx, method, rng)
    result.details["ensemble-weights"] = [round(float(w), 4) for w in reweighting.weights]
    return result
