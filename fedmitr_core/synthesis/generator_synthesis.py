"""Generator-based synthesis, as DENSE, Co-Boosting and FedFTG make their images.

Each round a generator network is trained against the ensemble (and
adversarially against the current student) to produce one batch of synthetic
images. The baselines differ in a :class:`GeneratorRecipe`: the generator's
loss, how the teachers' logits are combined, how labels are drawn, whether the
noise is optimised and whether the network starts afresh every round.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fedmitr_core.config import BaselineConfig
from fedmitr_core.runtime import autocast, check_finite
from fedmitr_core.server.ensemble import TeacherEnsemble
from fedmitr_core.synthesis.generator import ImageGenerator, reset_weights
from fedmitr_core.synthesis.prior import SynthesisPrior

# Per-teacher weights ``(K, B)`` of each image, from its label ``(B,)``.
TeacherWeights = Callable[[torch.Tensor], torch.Tensor]
# ``(batch size, rng) -> labels``.
LabelSampler = Callable[[int, torch.Generator], torch.Tensor]
# ``(generator output, rng) -> augmented output``: what the teachers see (DENSE's crop and flip).
Augmentation = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


def weighted_logits(per_teacher: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``Σ_k w_kb f_k(x_b) / Σ_k w_kb``: logits ``(K, B, C)`` combined with weights ``(K, B)``.

    Dividing by the weights' sum (as Co-Boosting's ``WEnsemble`` does) makes the
    result invariant to scaling every weight, so a weight update cannot lower a
    loss by sharpening the logits.
    """
    w = weights.to(per_teacher.device, torch.float32)
    total = w.sum(dim=0).clamp_min(1e-12)
    return torch.einsum("kb,kbc->bc", w, per_teacher.float()) / total[:, None]


def combined_logits(ensemble: TeacherEnsemble, images: torch.Tensor, weights: torch.Tensor,
                    precision: str = "auto") -> torch.Tensor:
    """The teachers' logits on ``images`` combined by :func:`weighted_logits`."""
    with autocast(ensemble.device, precision):
        logits, _ = ensemble.teacher_outputs(images)
    return weighted_logits(logits, weights)


def eight_bit(pixels: torch.Tensor) -> torch.Tensor:
    """Pixels in [0, 1] truncated to 8 bits, as DENSE's and Co-Boosting's PNG pool stores them."""
    return torch.floor(pixels.clamp(0, 1) * 255) / 255


@dataclass(frozen=True)
class GeneratorRecipe:
    """What one generator-based baseline does differently from the others.

    Parameters
    ----------
    loss
        ``loss(teacher_logits, student_logits, labels, images, noise) -> (total, parts)``.
    teacher_weights
        Per-teacher weights ``(K, B)`` from the batch's labels, for the generator's
        targets and the student's KD targets alike.
    optimise_noise
        Keep one noise batch and optimise it with the generator (DENSE,
        Co-Boosting) instead of drawing fresh noise every step (FedFTG).
    reset_each_round
        Re-initialise the generator before every batch (DENSE, Co-Boosting).
    label_sampler
        Draws the batch's target labels.
    augment
        Applied to the generator's output before the teachers and the student
        see it (DENSE's crop and flip); the pool keeps the images unaugmented.
    betas
        Adam's betas on the generator (and the noise).
    grad_clip
        Max gradient norm of the generator's parameters (``None``: no clipping, DENSE).
    """

    loss: nn.Module
    teacher_weights: TeacherWeights
    optimise_noise: bool
    reset_each_round: bool
    label_sampler: LabelSampler
    augment: Augmentation | None = None
    betas: tuple[float, float] = (0.5, 0.999)
    grad_clip: float | None = 10.0


class GeneratorSynthesizer:
    """Trains a generator against the ensemble and the student, one batch at a time.

    Parameters
    ----------
    net
        The image generator (conditional when it has ``num_classes > 0``).
    ensemble
        The frozen client ensemble.
    recipe
        What the baseline does differently (loss, weights, labels, noise, resets).
    settings
        ``gen-steps`` generator updates per batch at learning rate ``gen-lr``.
    precision
        Autocast setting of the teachers' forwards.
    prior
        Added to the generator's loss (``None``: none;
        ``fedmitr_core.synthesis.prior``), where the authors' code has its
        BN-statistics term; read from the images the teachers see.
    """

    def __init__(self, net: ImageGenerator, ensemble: TeacherEnsemble, recipe: GeneratorRecipe,
                 settings: BaselineConfig, precision: str = "auto",
                 prior: SynthesisPrior | None = None) -> None:
        self.net = net.to(ensemble.device)
        self.ensemble = ensemble
        self.recipe = recipe
        self.steps, self.lr = settings.gen_steps, settings.gen_lr
        self.precision = precision
        self.prior = prior

    def _teacher_loss(self, seen: torch.Tensor, student: nn.Module, labels: torch.Tensor,
                      z: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """The recipe's loss on ``seen`` (plus the prior, if any)."""
        weights = self.recipe.teacher_weights(labels)
        if self.prior is None:
            teacher = combined_logits(self.ensemble, seen, weights, self.precision)
            return self.recipe.loss(teacher, student(seen), labels, seen, z)
        with autocast(self.ensemble.device, self.precision):
            per_teacher, _, reduced = self.ensemble.teacher_outputs_layers(seen, None,
                                                                           self.prior.reduce)
        loss, parts = self.recipe.loss(weighted_logits(per_teacher, weights), student(seen),
                                       labels, seen, z)
        prior_loss, prior_parts = self.prior(reduced, self.ensemble.target_weights(labels))
        return loss + prior_loss, {**parts, **prior_parts}

    def synthesize(self, batch_size: int, student: nn.Module, rng: torch.Generator
                   ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """One batch: the images of the lowest-loss step, their labels and loss parts.

        The images are the models' inputs; a pixel generator's are first truncated
        to 8 bits, as the authors' pool stores them.
        """
        device, g, recipe = self.ensemble.device, self.net, self.recipe
        if recipe.reset_each_round:
            reset_weights(g, rng)
        g.train()
        labels = recipe.label_sampler(batch_size, rng).to(device)
        noise = torch.randn(batch_size, g.nz, generator=rng).to(device)
        params: list[torch.Tensor] = list(g.parameters())
        if recipe.optimise_noise:
            noise.requires_grad_(True)
            params.append(noise)
        opt = torch.optim.Adam(params, lr=self.lr, betas=recipe.betas)
        student_was_training = student.training
        student.eval().requires_grad_(False)
        best, best_raw, best_parts = float("inf"), None, {}
        try:
            for _ in range(self.steps):
                z = noise if recipe.optimise_noise else torch.randn(
                    batch_size, g.nz, generator=rng).to(device)
                raw = g(z, labels if g.num_classes > 0 else None)
                seen = g.to_inputs(recipe.augment(raw, rng) if recipe.augment else raw)
                loss, parts = self._teacher_loss(seen, student, labels, z)
                check_finite(loss, "generator step")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if recipe.grad_clip is not None:
                    nn.utils.clip_grad_norm_(g.parameters(), recipe.grad_clip)
                opt.step()
                if float(loss.detach()) < best:
                    best, best_parts, best_raw = float(loss.detach()), parts, raw.detach()
        finally:
            student.requires_grad_(True).train(student_was_training)
        assert best_raw is not None
        images = g.to_inputs(eight_bit(best_raw) if g.outputs_pixels else best_raw)
        return images, labels, best_parts
