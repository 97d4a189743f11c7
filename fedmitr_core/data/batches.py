"""Batches over in-memory tensors and the shift augmentation every trainer uses."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F


def random_shift(images: torch.Tensor, max_shift: int, rng: torch.Generator) -> torch.Tensor:
    """Shift the whole batch by up to ``max_shift`` pixels (zero padding)."""
    if max_shift <= 0:
        return images
    dy, dx = (int(v) for v in torch.randint(-max_shift, max_shift + 1, (2,), generator=rng))
    padded = F.pad(images, (max_shift,) * 4)
    h, w = images.shape[-2:]
    return padded[..., max_shift + dy: max_shift + dy + h, max_shift + dx: max_shift + dx + w]


def random_crop_and_flip(images: torch.Tensor, padding: int, flip: bool,
                         rng: torch.Generator) -> torch.Tensor:
    """Per image: a random crop of the zero-padded image and, if ``flip``, a coin-flip mirror.

    Kornia's ``RandomCrop(size, padding)`` and ``RandomHorizontalFlip()``, as
    DENSE augments its generated images; differentiable in ``images``.
    """
    n, _, h, w = images.shape
    out = images
    if padding > 0:
        padded = F.pad(images, (padding,) * 4)
        dy, dx = torch.randint(0, 2 * padding + 1, (2, n), generator=rng).to(images.device)
        rows = (dy[:, None] + torch.arange(h, device=images.device))[:, None, :, None]
        cols = (dx[:, None] + torch.arange(w, device=images.device))[:, None, None, :]
        out = padded[torch.arange(n, device=images.device)[:, None, None, None],
                     torch.arange(images.shape[1], device=images.device)[None, :, None, None],
                     rows, cols]
    if flip:
        mirror = (torch.rand(n, generator=rng) < 0.5).to(images.device)[:, None, None, None]
        out = torch.where(mirror, out.flip(-1), out)
    return out


def batches_per_epoch(n: int, batch_size: int) -> int:
    """Batches in one pass over ``n`` items (at least one)."""
    return max(1, -(-n // batch_size))


def iterate_batches(n: int, batch_size: int, rng: torch.Generator | None
                    ) -> Iterator[torch.Tensor]:
    """Index batches over ``n`` items, shuffled when a random generator is given."""
    order = torch.randperm(n, generator=rng) if rng is not None else torch.arange(n)
    for start in range(0, n, batch_size):
        yield order[start: start + batch_size]
