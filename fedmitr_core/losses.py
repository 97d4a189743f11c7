"""Losses as modules: every coefficient a constructor argument.

Each ``forward`` returns the total and a dict of its parts for logging.
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


def soft_kl(student_logits: torch.Tensor, target_probs: torch.Tensor,
            temperature: float) -> torch.Tensor:
    """``T² · KL(target ‖ softmax(student / T))`` averaged over the leading dims."""
    log_p = F.log_softmax(student_logits.float() / temperature, dim=-1)
    target = target_probs.float().clamp_min(1e-8)
    kl = (target * (target.log() - log_p)).sum(dim=-1)
    return kl.mean() * temperature**2


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


class TokenRelabelLoss(nn.Module):
    """FedMITR's distillation loss.

    ``kd_weight · T² · KL(p_E^T ‖ softmax(h_cls/T))``
    ``+ hi_weight · mean_{i∈H} CE(h_tok(t_i), y)``
    ``+ lo_weight · T² · mean_{i∈L} KL(q_L^T ‖ softmax(h_tok(t_i)/T))``.
    With ``hi_weight = lo_weight = 0`` it is plain KD (DeepInversion's student loss).
    With ``hi_agreed_only`` the H term counts only images whose ensemble
    prediction agrees with the synthetic label: an image the ensemble puts in
    another class does not teach its H tokens a label the teachers reject.
    """

    def __init__(self, kd_weight: float, hi_weight: float, lo_weight: float,
                 temperature: float, hi_agreed_only: bool = False) -> None:
        super().__init__()
        self.kd_weight = kd_weight
        self.hi_weight = hi_weight
        self.lo_weight = lo_weight
        self.temperature = temperature
        self.hi_agreed_only = hi_agreed_only

    @property
    def uses_tokens(self) -> bool:
        """Whether the token head takes part."""
        return self.hi_weight > 0 or self.lo_weight > 0

    def forward(self, cls_logits: torch.Tensor, token_logits: torch.Tensor | None,
                soft_labels: torch.Tensor, labels: torch.Tensor, high_mask: torch.Tensor,
                low_labels: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """Total loss and its parts.

        Parameters
        ----------
        cls_logits
            ``(B, C)`` student CLS logits.
        token_logits
            ``(B, N, C)`` token-head logits, or ``None`` when tokens are unused.
        soft_labels
            ``(B, C)`` ensemble probabilities at temperature T.
        labels
            ``(B,)`` synthetic target labels.
        high_mask
            ``(B, N)`` True for high-attention tokens (H), False for L.
        low_labels
            ``(B, C)`` ensemble relabelling of the low tokens at temperature T.
        """
        kd = soft_kl(cls_logits, soft_labels, self.temperature)
        parts = {"kd": float(kd.detach())}
        total = self.kd_weight * kd
        if token_logits is None or not self.uses_tokens:
            return total, parts
        b, n, c = token_logits.shape
        high = high_mask.float()
        low = 1.0 - high
        if self.hi_agreed_only:
            high = high * (soft_labels.argmax(dim=-1) == labels).float().unsqueeze(1)
        ce = F.cross_entropy(token_logits.float().reshape(b * n, c),
                             labels.repeat_interleave(n), reduction="none").view(b, n)
        hi = (ce * high).sum() / high.sum().clamp_min(1.0)
        log_p = F.log_softmax(token_logits.float() / self.temperature, dim=-1)
        target = low_labels.float().clamp_min(1e-8).unsqueeze(1)
        kl = (target * (target.log() - log_p)).sum(dim=-1) * self.temperature**2
        lo = (kl * low).sum() / low.sum().clamp_min(1.0)
        total = total + self.hi_weight * hi + self.lo_weight * lo
        parts.update(hi=float(hi.detach()), lo=float(lo.detach()))
        return total, parts


def _kl_per_sample(teacher_logits: torch.Tensor, student_logits: torch.Tensor,
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
    """DENSE's generator loss.

    ``oh_weight · CE(t, argmax t) − adv_weight · mean(agree · KL(t ‖ s))``: images
    the ensemble classifies confidently, on which the student still agrees with
    the ensemble but as far from it as possible (the adversarial term counts
    only samples whose argmax the student shares).
    """

    def __init__(self, oh_weight: float, adv_weight: float) -> None:
        super().__init__()
        self.oh_weight, self.adv_weight = oh_weight, adv_weight

    def forward(self, teacher_logits: torch.Tensor, student_logits: torch.Tensor,
                labels: torch.Tensor, images: torch.Tensor, noise: torch.Tensor
                ) -> tuple[torch.Tensor, dict[str, float]]:
        pseudo = teacher_logits.argmax(dim=-1)
        oh = F.cross_entropy(teacher_logits.float(), pseudo)
        agree = (student_logits.argmax(dim=-1) == pseudo).float()
        adv = -(agree * _kl_per_sample(teacher_logits, student_logits)).mean()
        total = self.oh_weight * oh + self.adv_weight * adv
        return total, {"oh": float(oh.detach()), "adv": float(adv.detach())}


class HardSampleGeneratorLoss(nn.Module):
    """Co-Boosting's generator loss.

    ``oh_weight · mean((1 − p_y)^hard_power · CE(t, y)) − adv_weight · mean(KL_T(t ‖ s))``:
    cross-entropy to the sampled labels, weighted towards samples the ensemble
    finds hard, plus the student–ensemble disagreement at ``adv_temperature``.
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
        adv = -_kl_per_sample(teacher_logits, student_logits, self.adv_temperature).mean()
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
        adv = -_kl_per_sample(teacher_logits, student_logits).mean()
        div = diversity_loss(noise, images)
        total = self.ce_weight * ce + self.adv_weight * adv + self.div_weight * div
        return total, {"ce": float(ce.detach()), "adv": float(adv.detach()),
                       "div": float(div.detach())}
