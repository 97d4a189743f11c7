"""Generator-based data-free distillation, the loop DENSE, Co-Boosting and FedFTG share.

Each round a generator is trained against the ensemble (and adversarially
against the current student) to produce one batch of synthetic images; the
batch joins a pool, and the student is distilled from the ensemble on the pool
for its share of the student steps. The methods differ in the generator's loss,
how the teachers' logits are combined, how labels are drawn, and what happens
around each round (``methods/dense.py``, ``coboosting.py``, ``fedftg.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fedmitr_core.ensemble import TeacherEnsemble
from fedmitr_core.generator import ImageGenerator, reset_generator
from fedmitr_core.losses import soft_kl
from fedmitr_core.progress import Emit, Progress
from fedmitr_core.training import autocast, random_shift

# Per-teacher weights ``(K, B)`` of each image, from its label ``(B,)``.
TeacherWeights = Callable[[torch.Tensor], torch.Tensor]
# ``(images, labels, round) -> images``: a change to each student batch (Co-Boosting's ODS).
BatchPerturbation = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
# ``(images, labels, round)``: called with the whole pool before each round's student steps.
RoundHook = Callable[[torch.Tensor, torch.Tensor, int], None]
# ``(batch size, generator) -> labels``.
LabelSampler = Callable[[int, torch.Generator], torch.Tensor]


def combined_logits(ensemble: TeacherEnsemble, images: torch.Tensor, weights: torch.Tensor,
                    precision: str = "auto") -> torch.Tensor:
    """``Σ_k w_kb · f_k(x_b)``: the teachers' logits combined with weights ``(K, B)``."""
    with autocast(ensemble.device, precision):
        logits, _ = ensemble.teacher_outputs(images)
    return torch.einsum("kb,kbc->bc", weights.to(logits.device), logits.float())


class GeneratorSynthesizer:
    """Trains a generator against the ensemble and the student, one batch at a time.

    Parameters
    ----------
    generator
        The image generator (conditional when it has ``num_classes > 0``).
    ensemble
        The frozen client ensemble.
    teacher_weights
        Per-teacher weights ``(K, B)`` from the batch's labels.
    loss
        ``loss(teacher_logits, student_logits, labels, images, noise) -> (total, parts)``.
    steps
        Generator updates per batch.
    lr, betas
        Adam on the generator (and on the noise when ``optimise_noise``).
    optimise_noise
        Keep one noise batch and optimise it with the generator (DENSE,
        Co-Boosting) instead of drawing fresh noise every step (FedFTG).
    reset_each_batch
        Re-initialise the generator before every batch (Co-Boosting).
    label_sampler
        Draws the batch's target labels; ``None``: the labels are the weighted ensemble's
        predictions on the kept images (DENSE's unconditional generator).
    grad_clip
        Max gradient norm of the generator's parameters.
    precision
        Autocast setting of the teachers' forwards.
    """

    def __init__(self, generator: ImageGenerator, ensemble: TeacherEnsemble,
                 teacher_weights: TeacherWeights, loss: nn.Module, steps: int, lr: float,
                 betas: tuple[float, float], optimise_noise: bool, reset_each_batch: bool,
                 label_sampler: LabelSampler | None, grad_clip: float = 10.0,
                 precision: str = "auto") -> None:
        self.generator = generator.to(ensemble.device)
        self.ensemble = ensemble
        self.teacher_weights = teacher_weights
        self.loss = loss
        self.steps, self.lr, self.betas = steps, lr, betas
        self.optimise_noise, self.reset_each_batch = optimise_noise, reset_each_batch
        self.label_sampler = label_sampler
        self.grad_clip = grad_clip
        self.precision = precision

    def _labels(self, batch_size: int, gen: torch.Generator) -> torch.Tensor:
        if self.label_sampler is None:  # placeholders; replaced by the ensemble's predictions
            return torch.zeros(batch_size, dtype=torch.long)
        return self.label_sampler(batch_size, gen)

    def synthesize(self, batch_size: int, student: nn.Module, gen: torch.Generator
                   ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """One batch: the images of the lowest-loss step, their labels and loss parts."""
        device = self.ensemble.device
        g = self.generator
        if self.reset_each_batch:
            reset_generator(g, gen)
        g.train()
        labels = self._labels(batch_size, gen).to(device)
        noise = torch.randn(batch_size, g.nz, generator=gen).to(device)
        params: list[torch.Tensor] = list(g.parameters())
        if self.optimise_noise:
            noise.requires_grad_(True)
            params.append(noise)
        opt = torch.optim.Adam(params, lr=self.lr, betas=self.betas)
        student_was_training = student.training
        student.eval().requires_grad_(False)
        best, best_images, best_teacher, best_parts = float("inf"), None, None, {}
        try:
            for _ in range(self.steps):
                z = noise if self.optimise_noise else torch.randn(
                    batch_size, g.nz, generator=gen).to(device)
                images = g(z, labels if g.num_classes > 0 else None)
                teacher = combined_logits(self.ensemble, images, self.teacher_weights(labels),
                                          self.precision)
                loss, parts = self.loss(teacher, student(images), labels, images, z)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(g.parameters(), self.grad_clip)
                opt.step()
                if float(loss.detach()) < best:
                    best, best_parts = float(loss.detach()), parts
                    best_images, best_teacher = images.detach(), teacher.detach()
        finally:
            student.requires_grad_(True).train(student_was_training)
        assert best_images is not None and best_teacher is not None
        if self.label_sampler is None:  # the ensemble's prediction on the kept images
            labels = best_teacher.argmax(dim=-1)
        return best_images, labels, best_parts


class AdversarialDistiller:
    """Alternates synthesis and distillation for a fixed budget.

    Parameters
    ----------
    synthesizer
        Makes each round's batch.
    teacher_weights
        Per-teacher weights of the distillation targets (as the synthesizer's).
    rounds
        Synthesis rounds; the ``num_images`` images are split evenly across them.
    num_images
        Synthetic images in all (the pool's final size).
    student_steps
        Student updates in all, split evenly across the rounds.
    batch_size, lr
        Student batches and AdamW learning rate (cosine schedule over all steps).
    temperature
        KD temperature.
    max_shift
        Random shift (pixels) of each student batch.
    perturbation
        Optional change to each student batch before it is labelled.
    before_round
        Optional hook on the pool before each round's student steps.
    precision
        Autocast setting of the forwards.
    """

    def __init__(self, synthesizer: GeneratorSynthesizer, teacher_weights: TeacherWeights,
                 rounds: int, num_images: int, student_steps: int, batch_size: int, lr: float,
                 temperature: float, max_shift: int,
                 perturbation: BatchPerturbation | None = None,
                 before_round: RoundHook | None = None, precision: str = "auto") -> None:
        self.synthesizer = synthesizer
        self.teacher_weights = teacher_weights
        self.rounds = max(1, min(rounds, num_images))
        self.num_images, self.student_steps = num_images, student_steps
        self.batch_size, self.lr = batch_size, lr
        self.temperature, self.max_shift = temperature, max_shift
        self.perturbation, self.before_round = perturbation, before_round
        self.precision = precision

    @staticmethod
    def _split(total: int, parts: int) -> list[int]:
        return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]

    def run(self, student: nn.Module, gen: torch.Generator, label: str, emit: Emit | None
            ) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
        """Train ``student`` in place; return it (eval mode) with the pool's images and labels."""
        device = self.synthesizer.ensemble.device
        student.to(device).train()
        opt = torch.optim.AdamW(student.parameters(), lr=self.lr, weight_decay=0.05)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, self.student_steps))
        pool_x: list[torch.Tensor] = []
        pool_y: list[torch.Tensor] = []
        progress = Progress(label, self.rounds, emit)
        sizes = self._split(self.num_images, self.rounds)
        steps = self._split(self.student_steps, self.rounds)
        for r, (size, n_steps) in enumerate(zip(sizes, steps, strict=True)):
            images, labels, parts = self.synthesizer.synthesize(size, student, gen)
            pool_x.append(images)
            pool_y.append(labels)
            x_all, y_all = torch.cat(pool_x), torch.cat(pool_y)
            if self.before_round is not None:
                self.before_round(x_all, y_all, r)
            kd_total = 0.0
            for _ in range(n_steps):
                idx = torch.randint(len(y_all), (min(self.batch_size, len(y_all)),),
                                    generator=gen).to(device)
                x = random_shift(x_all[idx], self.max_shift, gen)
                y = y_all[idx]
                if self.perturbation is not None:
                    x = self.perturbation(x, y, r)
                with torch.no_grad():
                    target = torch.softmax(combined_logits(
                        self.synthesizer.ensemble, x, self.teacher_weights(y), self.precision)
                        / self.temperature, dim=-1)
                with autocast(device, self.precision):
                    logits = student(x)
                loss = soft_kl(logits, target, self.temperature)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                kd_total += float(loss.detach())
            progress.step(kd=kd_total / max(1, n_steps), pool=float(len(y_all)), **parts)
        return student.eval(), torch.cat(pool_x).cpu(), torch.cat(pool_y).cpu()
