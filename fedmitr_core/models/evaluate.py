"""Evaluating a model (or any callable returning logits) on a split."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fedmitr_core.data.datasets import Split


@torch.no_grad()
def predict_logits(model: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor,
                   device: torch.device, batch_size: int = 512) -> torch.Tensor:
    """Logits (or probabilities) of ``model`` on ``images``, batched, on CPU."""
    outs = [model(images[i: i + batch_size].to(device)).float().cpu()
            for i in range(0, len(images), batch_size)]
    return torch.cat(outs) if outs else torch.zeros(0)


def accuracy(model: Callable[[torch.Tensor], torch.Tensor], data: Split,
             device: torch.device) -> float:
    """Top-1 accuracy in [0, 1]."""
    if len(data) == 0:
        return float("nan")
    if isinstance(model, nn.Module):
        model.eval()
    preds = predict_logits(model, data.images, device).argmax(dim=1)
    return float((preds == data.labels).float().mean())
