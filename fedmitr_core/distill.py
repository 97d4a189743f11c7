"""Training the global student on a synthetic pool."""

from __future__ import annotations

from pathlib import Path

import torch

from fedmitr_core.checkpoint import load_checkpoint, save_checkpoint
from fedmitr_core.ensemble import TeacherEnsemble
from fedmitr_core.inversion import SyntheticPool
from fedmitr_core.losses import TokenRelabelLoss, soft_kl
from fedmitr_core.models import StudentViT
from fedmitr_core.progress import Emit, Progress
from fedmitr_core.training import autocast, iterate_batches, random_shift


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

    def augment(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Mix and shift a batch of pool images."""
        if float(torch.rand(1, generator=generator)) < self.mix_prob:
            perm = torch.randperm(images.shape[0], generator=generator).to(images.device)
            lam = torch.rand(images.shape[0], 1, 1, 1, generator=generator).to(images.device)
            images = lam * images + (1 - lam) * images[perm]
        return random_shift(images, self.max_shift, generator)

    def loss(self, student: StudentViT, images: torch.Tensor, generator: torch.Generator,
             keep_idx: torch.Tensor | None = None) -> torch.Tensor:
        """KD of the student to the ensemble on augmented ``images``.

        With ``keep_idx`` both see only those patches (token-gather forward).
        """
        x = self.augment(images, generator)
        target = self.ensemble.predict(x, self.temperature, keep_idx=keep_idx)
        logits = student(x) if keep_idx is None else student.forward_tokens(x, keep_idx)[0]
        return self.weight * soft_kl(logits, target, self.temperature)


def distill_student(student: StudentViT, pool: SyntheticPool, loss_fn: TokenRelabelLoss,
                    epochs: int, batch_size: int, lr: float, device: torch.device,
                    generator: torch.Generator, label: str, emit: Emit | None,
                    live: LiveRelabel | None = None, kept_tokens_only: bool = True,
                    live_kept_tokens: bool = False, checkpoint: Path | None = None,
                    checkpoint_every: int = 0, precision: str = "auto") -> StudentViT:
    """Train ``student`` in place on ``pool`` with ``loss_fn``; return it in eval mode.

    With ``live``, each step also distils on augmented pool images that the
    ensemble labels on the fly. With ``kept_tokens_only`` the student sees only
    the patches kept to the end of inversion; otherwise every patch, the
    pruned (blank) ones counting as low-attention. With ``checkpoint`` and
    ``checkpoint_every > 0`` the student, optimiser, schedule and ``generator``
    are saved atomically every that many epochs, and training resumes from
    that file when it exists.
    """
    student.to(device).train()
    opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.05)
    steps_per_epoch = max(1, -(-len(pool) // batch_size))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * steps_per_epoch)
    tensors = {k: getattr(pool, k).to(device) for k in SyntheticPool.__dataclass_fields__}
    kept = pool.kept_indices() if kept_tokens_only else None
    if kept is not None:
        kept = kept.to(device)
    first_epoch = 0
    saved = load_checkpoint(checkpoint) if checkpoint is not None else None
    if saved is not None:
        student.load_state_dict(saved["student"])
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        generator.set_state(saved["generator"])
        first_epoch = int(saved["epoch"])
        if emit is not None:
            emit(f"{label}: resumed from the checkpoint after epoch {first_epoch}")
    progress = Progress(label, epochs - first_epoch, emit)
    for epoch in range(first_epoch, epochs):
        total, seen = 0.0, 0
        for idx in iterate_batches(len(pool), batch_size, generator):
            idx = idx.to(device)
            batch = {k: v[idx] for k, v in tensors.items()}
            keep = None if kept is None else kept[idx]
            high = batch["high_mask"] if keep is None else torch.gather(batch["high_mask"], 1, keep)
            with autocast(device, precision):
                cls_logits, token_logits = student.forward_tokens(batch["images"], keep)
            if not loss_fn.uses_tokens:
                token_logits = None
            loss, _ = loss_fn(cls_logits, token_logits, batch["soft_labels"],
                              batch["labels"], high, batch["low_labels"])
            if live is not None:
                with autocast(device, precision):
                    loss = loss + live.loss(student, batch["images"], generator,
                                            keep if live_kept_tokens else None)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach()) * len(idx)
            seen += len(idx)
        progress.step(loss=total / max(1, seen))
        if checkpoint is not None and checkpoint_every > 0 and (epoch + 1) % checkpoint_every == 0:
            save_checkpoint(checkpoint, {
                "student": student.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "generator": generator.get_state(),
                "epoch": epoch + 1})
    return student.eval()
