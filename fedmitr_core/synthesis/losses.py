"""Losses of synthesis: inversion's objective and the generator baselines' losses.

Modules with every coefficient a constructor argument; each ``forward``
returns the total and a dict of its parts for logging.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def total_variation(images: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference between neighbouring pixels."""
    dh = (images[..., 1:, :] - images[..., :-1, :]).abs().mean()
    dw = (images[..., :, 1:] - images[..., :, :-1]).abs().mean()
    return dh + dw


class InversionLoss(nn.Module):
    """Loss of synthetic images against the ensemble, with image priors.

    ``per-teacher``: Σ_k w_{k,y} CE(f_k(x), y), each teacher weighted by its
    share of the target class (well posed under label skew). ``mixture``: CE
    of the weighted ensemble's probabilities.
    """

    def __init__(self, tv_weight: float, l2_weight: float, objective: str) -> None:
        super().__init__()
        self.tv_weight = tv_weight
        self.l2_weight = l2_weight
        self.objective = objective

    def forward(self, teacher_logits: torch.Tensor, mixture_probs: torch.Tensor,
                target_weights: torch.Tensor, labels: torch.Tensor, images: torch.Tensor
                ) -> tuple[torch.Tensor, dict[str, float]]:
        if self.objective == "per-teacher":
            k, b, c = teacher_logits.shape
            ce = F.cross_entropy(teacher_logits.float().reshape(k * b, c),
                                 labels.repeat(k), reduction="none").view(k, b)
            task = (target_weights * ce).sum(dim=0).mean()
        else:
            task = F.nll_loss(mixture_probs.clamp_min(1e-8).log(), labels)
        tv = total_variation(images)
        l2 = images.pow(2).mean()
        total = task + self.tv_weight * tv + self.l2_weight * l2
        parts = {"task": float(task.detach()), "tv": float(tv.detach()),
                 "l2": float(l2.detach())}
        return total, parts


def kl_per_sample(teacher_logits: torch.Tensor, student_logits: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """``KL(softmax(t/T) ‖ softmax(s/T))`` per sample ``(B,)``."""
    log_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    return (log_t.exp() * (log_t - log_s)).sum(dim=-1)


def diversity_loss(noise: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    """``exp(-mean_ij ‖z_i - z_j‖ · ‖x_i - x_j‖)``: low when distinct noises give distinct images.

    Distances are means over dimensions (L2 for the noise, L1 for the images),
    as in FedFTG's and DFAD's diversity term.
    """
    flat = images.flatten(1).float()
    image_dist = (flat.unsqueeze(0) - flat.unsqueeze(1)).abs().mean(dim=-1)
    noise_dist = (noise.unsqueeze(0) - noise.unsqueeze(1)).pow(2).mean(dim=-1)
    return torch.exp(-(noise_dist * image_dist).mean())


class DenseGeneratorLoss(nn.Module):
    """DENSE's generator loss (``AdvSynthesizer.synthesize`` in the authors' code).

    ``oh_weight · CE(t, y) − adv_weight · mean(disagree · KL(t ‖ s))``: images the
    ensemble assigns to the sampled labels ``y``, and, where the student's argmax
    differs from the ensemble's, as far from the student as possible (the
    authors' mask ``s.argmax != t.argmax``). Their BN-statistics term has nothing
    to match in a ViT.
    """

    def __init__(self, oh_weight: float, adv_weight: float) -> None:
        super().__init__()
        self.oh_weight, self.adv_weight = oh_weight, adv_weight

    def forward(self, teacher_logits: torch.Tensor, student_logits: torch.Tensor,
                labels: torch.Tensor, images: torch.Tensor, noise: torch.Tensor
                ) -> tuple[torch.Tensor, dict[str, float]]:
        oh = F.cross_entropy(teacher_logits.float(), labels)
        disagree = (student_logits.argmax(dim=-1) != teacher_logits.argmax(dim=-1)).float()
        adv = -(disagree * kl_per_sample(teacher_logits, student_logits)).mean()
        total = self.oh_weight * oh + self.adv_weight * adv
        return total, {"oh": float(oh.detach()), "adv": float(adv.detach())}


class HardSampleGeneratorLoss(nn.Module):
    """Co-Boosting's generator loss.

    ``oh_weight · mean((1 − p_y)^hard_power · CE(t, y)) − adv_weight · T² · mean(KL_T(t ‖ s))``:
    cross-entropy to the sampled labels, weighted towards samples the ensemble
    finds hard, plus the student–ensemble disagreement at ``T = adv_temperature``,
    scaled by T² as the authors' ``dense_kldiv`` is.
    """

    def __init__(self, oh_weight: float, adv_weight: float, hard_power: float,
                 adv_temperature: float) -> None:
        super().__init__()
        self.oh_weight, self.adv_weight = oh_weight, adv_weight
        self.hard_power, self.adv_temperature = hard_power, adv_temperature

    def forward(self, teacher_logits: torch.Tensor, student_logits: torch.Tensor,
                labels: torch.Tensor, images: torch.Tensor, noise: torch.Tensor
                ) -> tuple[torch.Tensor, dict[str, float]]:
        ce = F.cross_entropy(teacher_logits.float(), labels, reduction="none")
        p_y = torch.softmax(teacher_logits.float(), dim=-1).gather(1, labels[:, None])[:, 0]
        oh = ((1 - p_y.detach()).pow(self.hard_power) * ce).mean()
        t = self.adv_temperature
        adv = -t * t * kl_per_sample(teacher_logits, student_logits, t).mean()
        total = self.oh_weight * oh + self.adv_weight * adv
        return total, {"oh": float(oh.detach()), "adv": float(adv.detach())}


class ConditionalGeneratorLoss(nn.Module):
    """FedFTG's generator loss.

    ``ce_weight · CE(t, y) − adv_weight · mean(KL(t ‖ s)) + div_weight · diversity``,
    where ``t`` is the class-level weighted ensemble for the label each image was
    generated for, and the diversity term keeps distinct noises apart.
    """

    def __init__(self, ce_weight: float, adv_weight: float, div_weight: float) -> None:
        super().__init__()
        self.ce_weight, self.adv_weight, self.div_weight = ce_weight, adv_weight, div_weight

    def forward(self, teacher_logits: torch.Tensor, student_logits: torch.Tensor,
                labels: torch.Tensor, images: torch.Tensor, noise: torch.Tensor
                ) -> tuple[torch.Tensor, dict[str, float]]:
        ce = F.cross_entropy(teacher_logits.float(), labels)
        adv = -kl_per_sample(teacher_logits, student_logits).mean()
        div = diversity_loss(noise, images)
        total = self.ce_weight * ce + self.adv_weight * adv + self.div_weight * div
        return total, {"ce": float(ce.detach()), "adv": float(adv.detach()),
                       "div": float(div.detach())}
