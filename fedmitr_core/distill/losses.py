"""Losses of the student: KD and FedMITR's token relabelling.

Modules with every coefficient a constructor argument; each ``forward``
returns the total and a dict of its parts for logging.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def soft_kl(student_logits: torch.Tensor, target_probs: torch.Tensor,
            temperature: float) -> torch.Tensor:
    """``T² · KL(target ‖ softmax(student / T))`` averaged over the leading dims."""
    log_p = F.log_softmax(student_logits.float() / temperature, dim=-1)
    target = target_probs.float().clamp_min(1e-8)
    kl = (target * (target.log() - log_p)).sum(dim=-1)
    return kl.mean() * temperature**2


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
