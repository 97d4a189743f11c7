"""Image generators for the generator-based baselines (DENSE, Co-Boosting, FedFTG)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fedmitr_core.data.datasets import normalise


def _upsamplings(image_size: int) -> int:
    """How many ×2 upsamplings lead from a small seed map (side ≥ 4) to ``image_size``."""
    ups, side = 0, image_size
    while side % 2 == 0 and side // 2 >= 4:
        side //= 2
        ups += 1
    return ups


class ImageGenerator(nn.Module):
    """DCGAN-style generator of images in the models' normalised input space.

    A linear layer maps the noise to a small feature map, then ×2 upsampling,
    3×3 convolutions, batch norm and LeakyReLU grow it to the image size. Two
    endings, after the authors' generators:

    - ``pixels`` given (DENSE, Co-Boosting): a Sigmoid makes pixels in [0, 1], and
      :meth:`to_inputs` normalises them with the dataset's fixed mean and std;
    - ``pixels=None`` (FedFTG, conditional): a Tanh and an affine-free batch norm
      leave every channel standardised over the batch (the conditional generator
      of the Co-Boosting/DFAD code); :meth:`to_inputs` is the identity.

    Parameters
    ----------
    nz
        Noise dimension.
    image_shape
        ``(C, H, W)`` with ``H == W``.
    width
        Channels of the last hidden layer (``ngf``); the earlier ones have twice as many.
    num_classes
        When > 0 the generator is conditional (FedFTG): a learned embedding of the
        label is concatenated to the noise.
    rng
        Seeds the initial weights (the global random state when ``None``).
    pixels
        ``(mean, std)`` per channel of the models' input normalisation: the
        generator then outputs pixels in [0, 1].
    """

    def __init__(self, nz: int, image_shape: tuple[int, int, int], width: int = 64,
                 num_classes: int = 0, rng: torch.Generator | None = None,
                 pixels: tuple[Sequence[float], Sequence[float]] | None = None) -> None:
        super().__init__()
        channels, size, _ = image_shape
        ups = _upsamplings(size)
        self.nz, self.num_classes = nz, num_classes
        self.seed_side = size // 2**ups
        self.seed_channels = 2 * width
        self.embed = nn.Embedding(num_classes, nz) if num_classes > 0 else None
        in_dim = 2 * nz if num_classes > 0 else nz
        self.project = nn.Linear(in_dim, self.seed_channels * self.seed_side**2)
        blocks: list[nn.Module] = [nn.BatchNorm2d(self.seed_channels)]
        c = self.seed_channels
        for i in range(ups):
            out = width if i == ups - 1 else self.seed_channels
            blocks += [nn.Upsample(scale_factor=2), nn.Conv2d(c, out, 3, padding=1, bias=False),
                       nn.BatchNorm2d(out), nn.LeakyReLU(0.2, inplace=True)]
            c = out
        blocks.append(nn.Conv2d(c, channels, 3, padding=1))
        if pixels is None:
            blocks += [nn.Tanh(), nn.BatchNorm2d(channels, affine=False)]
        else:
            blocks.append(nn.Sigmoid())
        self.body = nn.Sequential(*blocks)
        self.outputs_pixels = pixels is not None
        mean, std = pixels if pixels is not None else ((0.0,) * channels, (1.0,) * channels)
        # Not in the state dict: a checkpoint holds the trained weights only.
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32), persistent=False)
        reset_weights(self, rng)

    def forward(self, z: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.embed is not None:
            if labels is None:
                raise ValueError("a conditional generator needs the labels")
            z = torch.cat([z, self.embed(labels)], dim=1)
        h = self.project(z).view(z.shape[0], self.seed_channels, self.seed_side, self.seed_side)
        return self.body(h)

    def to_inputs(self, raw: torch.Tensor) -> torch.Tensor:
        """The models' inputs from :meth:`forward`'s output (normalised pixels, or as is)."""
        return normalise(raw, self.mean, self.std) if self.outputs_pixels else raw


def reset_weights(net: nn.Module, rng: torch.Generator | None = None) -> None:
    """DCGAN initialisation: weights N(0, 0.02), BN scales N(1, 0.02), biases 0.

    A label embedding starts N(0, 1), on the scale of the noise it joins.
    ``rng`` makes the draw reproducible whatever ran before.
    """
    for m in net.modules():
        if isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, generator=rng)
        elif isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.normal_(m.weight, 0.0, 0.02, generator=rng)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d) and m.affine:
            nn.init.normal_(m.weight, 1.0, 0.02, generator=rng)
            nn.init.zeros_(m.bias)
