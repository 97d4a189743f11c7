"""The one student trainer: every method's student learns through it.

:class:`StudentTrainer` owns the optimiser (AdamW, ``distill-lr``,
``distill-weight-decay``), the cosine schedule over all of a method's student
steps, and crash-safe checkpoints: every ``checkpoint-every`` epochs' worth of
steps, at the end of the next unit of work (an epoch over the pool, or a
generator round), it saves the student, optimiser, schedule, random state and
whatever the method adds, and a restarted run resumes from there with the same
result as an uninterrupted one. :func:`train_on_pool` is the loop of the
inversion methods (epochs over a fixed pool); the generator baselines' loop
(``methods/generator_kd.py``) alternates synthesis and steps of the same trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedmitr_core.config import DistillConfig
from fedmitr_core.data.batches import batches_per_epoch, iterate_batches, random_shift
from fedmitr_core.distill.losses import TokenRelabelLoss, soft_kl
from fedmitr_core.models.student import StudentViT
from fedmitr_core.progress import Emit, Progress
from fedmitr_core.runtime import autocast, check_finite
from fedmitr_core.server.ensemble import TeacherEnsemble
from fedmitr_core.server.state import load_checkpoint, save_checkpoint
from fedmitr_core.synthesis.pool import SyntheticPool


@dataclass(frozen=True)
class TrainingSetup:
    """Where a student trains and where its checkpoints go.

    ``checkpoint`` is the file (``None``: no checkpoints); ``checkpoint_every``
    counts epochs' worth of steps between two (0: none).
    """

    device: torch.device
    precision: str = "auto"
    checkpoint: Path | None = None
    checkpoint_every: int = 0
    emit: Emit | None = None


class StudentTrainer:
    """AdamW and a cosine schedule over ``total_steps``, with checkpoint and resume.

    Parameters
    ----------
    student
        The model to train (moved to the device, put in train mode).
    settings
        ``distill-lr`` and ``distill-weight-decay``.
    setup
        Device, precision and checkpoints.
    total_steps
        Student updates in all (the schedule's length).
    steps_per_epoch
        Updates in one epoch's worth of work (turns ``checkpoint-every`` into steps).
    """

    def __init__(self, student: nn.Module, settings: DistillConfig, setup: TrainingSetup,
                 total_steps: int, steps_per_epoch: int) -> None:
        self.student, self.setup = student.to(setup.device).train(), setup
        self.opt = torch.optim.AdamW(student.parameters(), lr=settings.distill_lr,
                                     weight_decay=settings.distill_weight_decay)
        self.sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt,
                                                                T_max=max(1, total_steps))
        self.steps = 0
        self._saved_at = 0
        self._every = setup.checkpoint_every * max(1, steps_per_epoch)

    def step(self, loss: torch.Tensor) -> None:
        """One update of the student from ``loss`` (a NaN or Inf loss stops the method)."""
        check_finite(loss, f"student step {self.steps + 1}")
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.steps += 1

    def resume(self, rng: torch.Generator, label: str) -> tuple[int, dict[str, Any]]:
        """Units done and the method's extra state of the last checkpoint; ``(0, {})`` if none.

        ``rng`` is set to the random state saved with it.
        """
        path = self.setup.checkpoint
        saved = load_checkpoint(path) if path is not None else None
        if saved is None:
            return 0, {}
        self.student.load_state_dict(saved["student"])
        self.opt.load_state_dict(saved["optimizer"])
        self.sched.load_state_dict(saved["scheduler"])
        rng.set_state(saved["rng"])
        self.steps = self._saved_at = int(saved["steps"])
        if self.setup.emit is not None:
            self.setup.emit(f"{label} {saved['done']}: resumed from the checkpoint after it "
                            f"({self.steps} student steps done)")
        return int(saved["done"]), saved["extra"]

    def checkpoint_if_due(self, done: int, rng: torch.Generator,
                          extra: Callable[[], dict[str, Any]] | None = None) -> bool:
        """Save a checkpoint after ``done`` units when a multiple of the interval was passed.

        ``extra`` gives the method's own state to save beside the student's.
        """
        path = self.setup.checkpoint
        if path is None or self._every <= 0 or self.steps // self._every <= \
                self._saved_at // self._every:
            return False
        save_checkpoint(path, {
            "student": self.student.state_dict(), "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(), "rng": rng.get_state(),
            "steps": self.steps, "done": done, "extra": extra() if extra else {}})
        self._saved_at = self.steps
        return True


class LiveRelabel:
    """Extra KD on augmented pool images, labelled by the ensemble as they are made.

    Each batch is mixed with a shuffled copy of itself (mixup, λ ~ U(0, 1)) with
    probability ``mix_prob`` and shifted by up to ``max_shift`` pixels; since the
    ensemble labels the result, the augmentation never corrupts the targets.

    Parameters
    ----------
    ensemble
        The client ensemble that labels the augmented images.
    mix_prob
        Probability of mixing a batch; 0 turns live relabelling off.
    max_shift
        Random shift in pixels.
    temperature
        KD temperature.
    weight
        Weight of this KD term.
    """

    def __init__(self, ensemble: TeacherEnsemble, mix_prob: float, max_shift: int,
                 temperature: float, weight: float) -> None:
        self.ensemble = ensemble
        self.mix_prob, self.max_shift = mix_prob, max_shift
        self.temperature, self.weight = temperature, weight

    def augment(self, images: torch.Tensor, rng: torch.Generator) -> torch.Tensor:
        """Mix and shift a batch of pool images."""
        if float(torch.rand(1, generator=rng)) < self.mix_prob:
            perm = torch.randperm(images.shape[0], generator=rng).to(images.device)
            lam = torch.rand(images.shape[0], 1, 1, 1, generator=rng).to(images.device)
            images = lam * images + (1 - lam) * images[perm]
        return random_shift(images, self.max_shift, rng)

    def loss(self, student: StudentViT, images: torch.Tensor, rng: torch.Generator,
             keep_idx: torch.Tensor | None = None) -> torch.Tensor:
        """KD of the student to the ensemble on augmented ``images``.

        With ``keep_idx`` both see only those patches (token-gather forward).
        """
        x = self.augment(images, rng)
        target = self.ensemble.predict(x, self.temperature, keep_idx=keep_idx)
        logits = student(x) if keep_idx is None else student.forward_tokens(x, keep_idx)[0]
        return self.weight * soft_kl(logits, target, self.temperature)


def train_on_pool(student: StudentViT, pool: SyntheticPool, loss_fn: TokenRelabelLoss,
                  settings: DistillConfig, setup: TrainingSetup, rng: torch.Generator,
                  label: str, live: LiveRelabel | None = None) -> StudentViT:
    """Train ``student`` in place for ``distill-epochs`` epochs over ``pool``; return it (eval).

    With ``live``, every ``live-every``-th step also distils on augmented pool
    images that the ensemble labels on the fly (the ensemble's forward is most of
    a step's cost). ``student-tokens`` decides which patches the
    student sees: the patches kept to the end of inversion (``kept``; in live
    relabelling too with ``kept-live``), or every patch (``all``), the pruned
    (blank) ones counting as low-attention.
    """
    device, precision = setup.device, setup.precision
    steps_per_epoch = batches_per_epoch(len(pool), settings.distill_batch_size)
    trainer = StudentTrainer(student, settings, setup, settings.distill_epochs * steps_per_epoch,
                             steps_per_epoch)
    tensors = {k: v.to(device) for k, v in pool.tensors().items()}
    kept = pool.kept_indices() if settings.student_tokens != "all" else None
    kept = None if kept is None else kept.to(device)
    live_kept = settings.student_tokens == "kept-live"
    first_epoch, _ = trainer.resume(rng, label)
    progress = Progress(label, settings.distill_epochs - first_epoch, setup.emit)
    for epoch in range(first_epoch, settings.distill_epochs):
        total, seen = 0.0, 0
        for idx in iterate_batches(len(pool), settings.distill_batch_size, rng):
            idx = idx.to(device)
            batch = {k: v[idx] for k, v in tensors.items()}
            keep = None if kept is None else kept[idx]
            high = batch["high_mask"] if keep is None else torch.gather(batch["high_mask"], 1, keep)
            with autocast(device, precision):
                cls_logits, token_logits = student.forward_tokens(batch["images"], keep)
            loss, _ = loss_fn(cls_logits, token_logits if loss_fn.uses_tokens else None,
                              batch["soft_labels"], batch["labels"], high, batch["low_labels"])
            if live is not None and trainer.steps % settings.live_every == 0:
                with autocast(device, precision):
                    loss = loss + live.loss(student, batch["images"], rng,
                                            keep if live_kept else None)
            trainer.step(loss)
            total += float(loss.detach()) * len(idx)
            seen += len(idx)
        progress.step(loss=total / max(1, seen))
        trainer.checkpoint_if_due(epoch + 1, rng)
    return student.eval()
