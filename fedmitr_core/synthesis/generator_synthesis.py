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

# Per-teacher weights ``(K, B)`` of each image, from its label ``(B,)``.
TeacherWeights = Callable[[torch.Tensor], torch.Tensor]
# ``(batch size, rng) -> labels``.
LabelSampler = Callable[[int, torch.Generator], torch.Tensor]


def combined_logits(ensemble: TeacherEnsemble, images: torch.Tensor, weights: torch.Tensor,
                    precision: str = "auto") -> torch.Tensor:
    """``Σ_k w_kb · f_k(x_b)``: the teachers' logits combined with weights ``(K, B)``."""
    with autocast(ensemble.device, precision):
        logits, _ = ensemble.teacher_outputs(images)
    return torch.einsum("kb,kbc->bc", weights.to(logits.device), logits.float())


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
        Re-initialise the generator before every batch (Co-Boosting).
    label_sampler
        Draws the batch's target labels; ``None``: the labels are the weighted
        ensemble's predictions on the kept images (DENSE's unconditional generator).
    betas
        Adam's betas on the generator (and the noise).
    grad_clip
        Max gradient norm of the generator's parameters.
    """

    loss: nn.Module
    teacher_weights: TeacherWeights
    optimise_noise: bool
    reset_each_round: bool
    label_sampler: LabelSampler | None
    betas: tuple[float, float] = (0.5, 0.999)
    grad_clip: float = 10.0


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
    """

    def __init__(self, net: ImageGenerator, ensemble: TeacherEnsemble, recipe: GeneratorRecipe,
                 settings: BaselineConfig, precision: str = "auto") -> None:
        self.net = net.to(ensemble.device)
        self.ensemble = ensemble
        self.recipe = recipe
        self.steps, self.lr = settings.gen_steps, settings.gen_lr
        self.precision = precision

    def _labels(self, batch_size: int, rng: torch.Generator) -> torch.Tensor:
        if self.recipe.label_sampler is None:  # placeholders: the ensemble's predictions follow
            return torch.zeros(batch_size, dtype=torch.long)
        return self.recipe.label_sampler(batch_size, rng)

    def synthesize(self, batch_size: int, student: nn.Module, rng: torch.Generator
                   ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """One batch: the images of the lowest-loss step, their labels and loss parts."""
        device, g, recipe = self.ensemble.device, self.net, self.recipe
        if recipe.reset_each_round:
            reset_weights(g, rng)
        g.train()
        labels = self._labels(batch_size, rng).to(device)
        noise = torch.randn(batch_size, g.nz, generator=rng).to(device)
        params: list[torch.Tensor] = list(g.parameters())
        if recipe.optimise_noise:
            noise.requires_grad_(True)
            params.append(noise)
        opt = torch.optim.Adam(params, lr=self.lr, betas=recipe.betas)
        student_was_training = student.training
        student.eval().requires_grad_(False)
        best, best_images, best_teacher, best_parts = float("inf"), None, None, {}
        try:
            for _ in range(self.steps):
                z = noise if recipe.optimise_noise else torch.randn(
                    batch_size, g.nz, generator=rng).to(device)
                images = g(z, labels if g.num_classes > 0 else None)
                teacher = combined_logits(self.ensemble, images, recipe.teacher_weights(labels),
                                          self.precision)
                loss, parts = recipe.loss(teacher, student(images), labels, images, z)
                check_finite(loss, "generator step")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(g.parameters(), recipe.grad_clip)
                opt.step()
                if float(loss.detach()) < best:
                    best, best_parts = float(loss.detach()), parts
                    best_images, best_teacher = images.detach(), teacher.detach()
        finally:
            student.requires_grad_(True).train(student_was_training)
        assert best_images is not None and best_teacher is not None
        if recipe.label_sampler is None:  # the ensemble's prediction on the kept images
            labels = best_teacher.argmax(dim=-1)
        return best_images, labels, best_parts
