"""Differentially private clients: DP-SGD with Opacus, Gaussian releases, one accountant.

A private client's whole reply is covered by one Rényi-DP accountant (Opacus's
``RDPAccountant``), under add/remove-one-image adjacency:

- the weights, trained with DP-SGD (Poisson sampling at rate ``batch / n``, every
  per-sample gradient clipped to ``dp-clip``, Gaussian noise ``σ · dp-clip``);
- the label counts, each count plus Gaussian noise ``dp-release-noise`` (one image
  changes one count by 1), rounded and clamped at 0;
- the token statistics (unless ``dp-stats=off``): each image's per-layer token mean
  and second moment, concatenated and clipped to L2 norm ``dp-stats-clip``, summed,
  plus Gaussian noise ``dp-release-noise · dp-stats-clip``, divided by the released
  image count; the variance follows as second moment minus squared mean.

Each Gaussian release is one full-batch step (sampling rate 1) in the accountant's
history, so ε composes exactly as Opacus composes its own steps. With a target ε,
the DP-SGD noise multiplier is the smallest that keeps the total within it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from opacus import PrivacyEngine
from opacus.accountants import RDPAccountant
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedmitr_core.config import ClientConfig, ConfigError, PrivacyConfig
from fedmitr_core.data.batches import random_shift
from fedmitr_core.data.datasets import Split
from fedmitr_core.models.token_stats import TokenStats
from fedmitr_core.models.tokens import forward_gathered_layers
from fedmitr_core.runtime import set_seed

# One accountant step: (noise multiplier, sampling rate, number of steps).
Step = tuple[float, float, int]


@dataclass(frozen=True)
class PrivacySpent:
    """What a private client's release cost: ε at δ, and the mechanisms composed."""

    epsilon: float
    delta: float
    noise_multiplier: float
    sample_rate: float
    steps: int
    history: tuple[Step, ...]

    def metrics(self) -> dict[str, float | int]:
        """The figures a client reports beside its upload."""
        return {"dp-epsilon": self.epsilon, "dp-delta": self.delta,
                "dp-noise-multiplier": self.noise_multiplier, "dp-steps": self.steps}


def epsilon_of(history: list[Step] | tuple[Step, ...], delta: float) -> float:
    """ε at ``delta`` of the composed ``history``, by Opacus's RDP accountant."""
    accountant = RDPAccountant()
    accountant.history = list(history)
    return float(accountant.get_epsilon(delta))


def release_steps(privacy: PrivacyConfig, with_stats: bool) -> list[Step]:
    """The Gaussian releases beside the weights: the label counts and maybe the statistics."""
    return [(privacy.dp_release_noise, 1.0, 1)] * (2 if with_stats else 1)


def calibrate_noise(target_epsilon: float, delta: float, sample_rate: float, steps: int,
                    releases: list[Step], tolerance: float = 0.005) -> float:
    """The smallest DP-SGD noise multiplier whose total ε (with ``releases``) is within target.

    Raises
    ------
    ConfigError
        When the releases alone spend more than ``target_epsilon``.
    """
    floor = epsilon_of(releases, delta) if releases else 0.0
    if floor >= target_epsilon:
        raise ConfigError(
            f"run config key 'dp-epsilon': {target_epsilon:g} is spent by the label counts "
            f"and token statistics alone ({floor:.3g} at dp-release-noise); raise "
            "'dp-release-noise', set 'dp-stats=off' or raise 'dp-epsilon'")

    def total(sigma: float) -> float:
        return epsilon_of([(sigma, sample_rate, steps), *releases], delta)

    low, high = 0.1, 1.0
    while total(high) > target_epsilon:
        low, high = high, high * 2
        if high > 1e4:
            raise ConfigError(f"run config key 'dp-epsilon': {target_epsilon:g} cannot be met")
    while high - low > tolerance * high:
        mid = (low + high) / 2
        low, high = (mid, high) if total(mid) > target_epsilon else (low, mid)
    return high


def train_local_private(model: nn.Module, data: Split, cfg: ClientConfig,
                        privacy: PrivacyConfig, device: torch.device, seed: int,
                        releases: list[Step]) -> PrivacySpent:
    """Train ``model`` in place with DP-SGD; the privacy spent.

    ``releases`` (:func:`release_steps`) are composed into the reported ε and, with
    a target ``dp-epsilon``, into the noise calibration.
    """
    rng = set_seed(seed)
    model.to(device).train()
    batch = min(cfg.local_batch_size, len(data))
    sample_rate = batch / len(data)
    steps_per_epoch = math.ceil(len(data) / batch)  # what Opacus's Poisson loader yields
    steps = cfg.local_epochs * steps_per_epoch
    sigma = privacy.dp_noise_multiplier or calibrate_noise(
        privacy.dp_epsilon, privacy.dp_delta, sample_rate, steps, releases)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.local_lr,
                            weight_decay=cfg.local_weight_decay)
    loader = DataLoader(TensorDataset(data.images, data.labels), batch_size=batch,
                        generator=torch.Generator().manual_seed(seed))
    # Opacus takes per-sample gradients of the ViT's own parameters (class token,
    # position embedding) with torch.func over the whole model, and the fused CPU
    # attention kernel has no batching rule: 6x slower than timm's plain attention.
    fused = [m for m in model.modules() if getattr(m, "fused_attn", False)]
    for module in fused:
        module.fused_attn = False
    engine = PrivacyEngine(accountant="rdp")
    private, opt, loader = engine.make_private(
        module=model, optimizer=opt, data_loader=loader, noise_multiplier=sigma,
        max_grad_norm=privacy.dp_clip, poisson_sampling=True,
        noise_generator=torch.Generator(device=device).manual_seed(seed))
    for _ in range(cfg.local_epochs):
        for x, y in loader:
            if len(x) == 0:  # Poisson sampling drew no image: nothing to step on
                continue
            x = random_shift(x.to(device), cfg.local_shift, rng)
            loss = F.cross_entropy(private(x), y.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    private.remove_hooks()
    for module in fused:
        module.fused_attn = True
    model.eval()
    # ε over every planned step (an empty draw still counts: it was sampled).
    history = ((sigma, sample_rate, steps), *releases)
    return PrivacySpent(epsilon_of(history, privacy.dp_delta), privacy.dp_delta, sigma,
                        sample_rate, steps, history)


def private_label_counts(labels: np.ndarray, num_classes: int, noise: float,
                         generator: torch.Generator) -> np.ndarray:
    """Per-class counts plus Gaussian noise of std ``noise``, rounded and clamped at 0."""
    counts = torch.bincount(torch.as_tensor(labels, dtype=torch.long),
                            minlength=num_classes).double()
    noisy = counts + noise * torch.randn(num_classes, generator=generator, dtype=torch.float64)
    return noisy.round().clamp_min(0).long().numpy()


@torch.no_grad()
def private_token_statistics(vit: nn.Module, images: torch.Tensor, num_images: int,
                             clip: float, noise: float, generator: torch.Generator,
                             batch_size: int = 256, device: torch.device | str = "cpu"
                             ) -> TokenStats:
    """Token statistics released with the Gaussian mechanism.

    Each image's per-layer token mean and second moment, ``(depth + 1, D)`` each,
    are clipped jointly to L2 norm ``clip`` and summed; the sum gets Gaussian noise
    of std ``noise * clip`` (the sensitivity of the sum to one image) and is divided
    by ``num_images``, the released (noisy) count.
    """
    vit.eval()
    total = None
    for start in range(0, len(images), batch_size):
        batch = images[start:start + batch_size].to(device)
        _, _, (mean, second) = forward_gathered_layers(
            vit, batch, None, lambda t: (t.mean(1), t.pow(2).mean(1)))
        per_image = torch.cat([mean, second]).transpose(0, 1).flatten(1).double().cpu()
        scale = (clip / per_image.norm(dim=1).clamp_min(1e-12)).clamp(max=1.0)
        part = (per_image * scale[:, None]).sum(0)
        total = part if total is None else total + part
    if total is None:
        raise ValueError("token statistics need at least one image")
    total = total + noise * clip * torch.randn(total.shape, generator=generator,
                                               dtype=torch.float64)
    layers = mean.shape[0]
    moments = (total / max(num_images, 1)).view(2, layers, -1)
    first, second_moment = moments[0], moments[1]
    var = (second_moment - first * first).clamp_min(0.0)
    return TokenStats(mean=first.float(), var=var.float(), num_images=num_images)
