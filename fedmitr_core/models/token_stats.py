"""Token statistics: what a client reports of its data for the inversion prior.

A ViT has no BatchNorm running statistics for inversion to match (the "BN
loss" of DeepInversion and DENSE). Their analogue here is per-channel mean and
variance of the patch tokens at every layer (after the embedding, after each
block), computed by the client over its own training images with its trained
model, and sent beside the weights: ``mean`` and ``var``, each ``(depth + 1, D)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from timm.models.vision_transformer import VisionTransformer

from fedmitr_core.config import LAYER_SPEC
from fedmitr_core.models.tokens import forward_gathered_stats

STATS_NAMES = ("mean", "var")


@dataclass(frozen=True)
class TokenStats:
    """Per-layer, per-channel patch-token moments of one client's data.

    ``mean`` and ``var`` are ``(depth + 1, D)``; layer 0 is the embedding
    (patch + position), layer ``i + 1`` the output of block ``i``.
    ``num_images`` is how many images they come from.
    """

    mean: torch.Tensor
    var: torch.Tensor
    num_images: int

    def arrays(self) -> dict[str, np.ndarray]:
        """``{"mean": ..., "var": ...}`` as float32 numpy arrays (what is uploaded)."""
        return {"mean": self.mean.float().numpy(), "var": self.var.float().numpy()}


def stats_shape(vit: VisionTransformer) -> tuple[int, int]:
    """``(depth + 1, D)``: the shape of ``mean`` and ``var`` for ``vit``."""
    return len(vit.blocks) + 1, int(vit.embed_dim)


@torch.no_grad()
def token_statistics(vit: VisionTransformer, images: torch.Tensor, batch_size: int = 256,
                     device: torch.device | str = "cpu") -> TokenStats:
    """Patch-token moments of ``vit`` over ``images`` (eval mode, every patch).

    Batches are combined exactly (in float64): the mean of the batch means and
    the variance from the pooled second moments.
    """
    was_training = vit.training
    vit.eval()
    first = second = None
    for start in range(0, len(images), batch_size):
        batch = images[start:start + batch_size].to(device)
        _, _, mean, var = forward_gathered_stats(vit, batch)
        share = len(batch) / len(images)
        m, v = mean.double().cpu(), var.double().cpu()
        first = share * m if first is None else first + share * m
        second = share * (v + m * m) if second is None else second + share * (v + m * m)
    vit.train(was_training)
    if first is None or second is None:
        raise ValueError("token statistics need at least one image")
    var = (second - first * first).clamp_min(0.0)
    return TokenStats(mean=first.float(), var=var.float(), num_images=len(images))


def prior_layers(spec: str, depth: int) -> list[int]:
    """The layer indices (0 = embedding, ``i + 1`` = block ``i``) the prior matches.

    ``all-but-last`` (the embedding and every block but the last, whose patch
    tokens the head never reads), ``all``, or comma-separated indices in
    ``[0, depth]``.
    """
    if spec == "all-but-last":
        return list(range(depth))
    if spec == "all":
        return list(range(depth + 1))
    if not LAYER_SPEC.match(spec):
        raise ValueError(f"run config key 'feature-stats-layers': expected 'all-but-last', "
                         f"'all' or comma-separated layer indices, got {spec!r}")
    layers = sorted({int(v) for v in spec.split(",")})
    if layers[-1] > depth:
        raise ValueError(f"run config key 'feature-stats-layers': layer {layers[-1]} does not "
                         f"exist (0 is the embedding, 1..{depth} the blocks)")
    return layers
