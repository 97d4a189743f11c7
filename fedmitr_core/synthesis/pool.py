"""The synthetic pool: what inversion makes and the student learns from."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class SyntheticPool:
    """Synthetic images with everything the student needs, on CPU.

    ``kept_mask`` (B, N) marks the patches kept to the end of inversion (all
    of them for dense inversion; every row keeps the same number);
    ``high_mask`` the high-attention ones among them (H; kept and not high is
    L); ``soft_labels`` is p_E^T on the kept tokens and ``low_labels`` q_L^T.
    """

    images: torch.Tensor
    labels: torch.Tensor
    high_mask: torch.Tensor
    kept_mask: torch.Tensor
    soft_labels: torch.Tensor
    low_labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every field by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def kept_indices(self) -> torch.Tensor | None:
        """Kept patch indices ``(B, n_kept)``, or None when every patch is kept."""
        if bool(self.kept_mask.all()):
            return None
        return self.kept_mask.nonzero()[:, 1].view(len(self), -1)

    @staticmethod
    def concat(pools: list[SyntheticPool]) -> SyntheticPool:
        """One pool from several batches (tensors copied, never aliased)."""
        names = [f.name for f in fields(SyntheticPool)]
        return SyntheticPool(**{n: torch.cat([getattr(p, n) for p in pools]).clone()
                                for n in names})

    def on_target_rate(self) -> float:
        """Share of images the ensemble assigns to their target label."""
        return float((self.soft_labels.argmax(dim=1) == self.labels).float().mean())
