"""Local training of a client's ViT, evaluation, seeding and device choice."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedmitr_core.config import ClientConfig
from fedmitr_core.data import Split


def set_seed(seed: int) -> torch.Generator:
    """Seed python, numpy and torch; return a torch generator with the same seed."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when it is there, CPU otherwise."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("run config key 'device': 'cuda' asked for, but CUDA is not available")
    return torch.device(name)


def uses_bf16(device: torch.device, precision: str = "auto") -> bool:
    """Whether forwards run under bf16 autocast: ``auto`` means on CUDA only."""
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def autocast(device: torch.device, precision: str = "auto") -> contextlib.AbstractContextManager:
    """bf16 autocast for model forwards when :func:`uses_bf16` says so.

    Only forwards run under it: the losses, the optimiser and the weights stay
    in float32.
    """
    if uses_bf16(device, precision):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def random_shift(images: torch.Tensor, max_shift: int, generator: torch.Generator
                 ) -> torch.Tensor:
    """Shift the whole batch by up to ``max_shift`` pixels (zero padding)."""
    if max_shift <= 0:
        return images
    dy, dx = (int(v) for v in torch.randint(-max_shift, max_shift + 1, (2,),
                                             generator=generator))
    padded = F.pad(images, (max_shift,) * 4)
    h, w = images.shape[-2:]
    return padded[..., max_shift + dy: max_shift + dy + h, max_shift + dx: max_shift + dx + w]


def iterate_batches(n: int, batch_size: int, generator: torch.Generator | None
                    ) -> Iterator[torch.Tensor]:
    """Index batches over ``n`` items, shuffled when a generator is given."""
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    for start in range(0, n, batch_size):
        yield order[start: start + batch_size]


def train_local(model: nn.Module, data: Split, cfg: ClientConfig, device: torch.device,
                seed: int, max_shift: int = 1,
                progress: Callable[[int, float], None] | None = None) -> float:
    """Train ``model`` in place on a client's data; return its final train accuracy."""
    generator = set_seed(seed)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.local_lr,
                            weight_decay=cfg.local_weight_decay)
    steps = cfg.local_epochs * max(1, -(-len(data) // cfg.local_batch_size))
    if steps >= 4:
        # At least two warm-up steps: OneCycleLR divides by zero on shorter phases
        # (a tiny partition trained for a few epochs).
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=cfg.local_lr, total_steps=steps, pct_start=max(0.1, 2.0 / steps))
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _step: 1.0)
    images, labels = data.images.to(device), data.labels.to(device)
    for epoch in range(cfg.local_epochs):
        total = 0.0
        for idx in iterate_batches(len(data), cfg.local_batch_size, generator):
            x = random_shift(images[idx], max_shift, generator)
            loss = F.cross_entropy(model(x), labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach()) * len(idx)
        if progress is not None:
            progress(epoch + 1, total / max(1, len(data)))
    model.eval()
    return accuracy(model, data, device)


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
