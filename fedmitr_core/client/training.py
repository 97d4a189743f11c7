"""What a client does: take its partition, train the local ViT, describe the upload."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedmitr_core.config import ClientConfig, FedMITRConfig
from fedmitr_core.data.batches import batches_per_epoch, iterate_batches, random_shift
from fedmitr_core.data.datasets import DatasetSplits, DataSpec, Split, load_dataset
from fedmitr_core.data.partition import label_counts, partition_indices
from fedmitr_core.models.evaluate import accuracy
from fedmitr_core.models.token_stats import TokenStats, token_statistics
from fedmitr_core.models.vit import PretrainedLoad, load_pretrained, vit_factory
from fedmitr_core.privacy.dp import (
    PrivacySpent,
    private_label_counts,
    private_token_statistics,
    release_steps,
    train_local_private,
)
from fedmitr_core.runtime import resolve_device, set_seed


@dataclass
class ClientUpdate:
    """A trained local model and what the client reports with it."""

    state: dict[str, torch.Tensor]
    num_examples: int
    label_counts: np.ndarray
    metrics: dict[str, Any]
    token_stats: TokenStats | None = None
    privacy: PrivacySpent | None = None


def initial_model(cfg: FedMITRConfig, spec: DataSpec) -> nn.Module:
    """The common starting point every client trains from (seeded, maybe pretrained)."""
    return initial_model_load(cfg, spec)[0]


def initial_model_load(cfg: FedMITRConfig, spec: DataSpec) -> tuple[nn.Module, PretrainedLoad]:
    """:func:`initial_model` and what loading its pretrained weights did."""
    set_seed(cfg.seed)
    model = vit_factory(cfg.model, spec)()
    return model, load_pretrained(model, cfg.model.pretrained)


def client_seed(seed: int, client: int, server_round: int = 1) -> int:
    """The seed client ``client`` trains with in ``server_round``.

    Round 1, the one-shot round, gives every client of the run its own seed;
    later rounds (the ``fedavg-rounds`` reference) shift it, so a client does not
    repeat its round-1 shuffling and augmentation.
    """
    return seed * 1000 + client + 7919 * (server_round - 1)


def client_partition(cfg: FedMITRConfig, splits: DatasetSplits, partition_id: int,
                     num_partitions: int, partitions: Sequence[np.ndarray] | None = None
                     ) -> Split:
    """This client's share of the training split.

    ``partitions`` (every client's indices, from :func:`partition_indices`) can be
    passed in by a process that serves many clients, so the split is drawn once.
    """
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"node config 'partition-id': expected 0..{num_partitions - 1}, "
                         f"got {partition_id}")
    if partitions is None:
        partitions = partition_indices(splits.train.labels.numpy(), cfg.partition,
                                       num_partitions, cfg.seed)
    return splits.train.subset(partitions[partition_id])


def train_local(model: nn.Module, data: Split, cfg: ClientConfig, device: torch.device,
                seed: int) -> float:
    """Train ``model`` in place on a client's data; return its final train accuracy."""
    rng = set_seed(seed)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.local_lr,
                            weight_decay=cfg.local_weight_decay)
    steps = cfg.local_epochs * batches_per_epoch(len(data), cfg.local_batch_size)
    if steps >= 4:
        # At least two warm-up steps: OneCycleLR divides by zero on shorter phases
        # (a tiny partition trained for a few epochs).
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=cfg.local_lr, total_steps=steps, pct_start=max(0.1, 2.0 / steps))
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _step: 1.0)
    images, labels = data.images.to(device), data.labels.to(device)
    for _ in range(cfg.local_epochs):
        for idx in iterate_batches(len(data), cfg.local_batch_size, rng):
            x = random_shift(images[idx], cfg.local_shift, rng)
            loss = F.cross_entropy(model(x), labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    model.eval()
    return accuracy(model, data, device)


def train_client(cfg: FedMITRConfig, data: Split, spec: DataSpec,
                 initial_state: dict[str, torch.Tensor], seed: int,
                 share_stats: bool | None = None) -> ClientUpdate:
    """Train a local ViT from ``initial_state`` on ``data``.

    With ``share_stats`` (default: run-config key ``client-stats``) the update
    also carries the trained model's token statistics over ``data``
    (:func:`~fedmitr_core.models.token_stats.token_statistics`). Under
    ``cfg.privacy`` (:class:`~fedmitr_core.config.PrivacyConfig`) the client trains
    with DP-SGD and releases its label counts and statistics with the Gaussian
    mechanism (:mod:`fedmitr_core.privacy.dp`); the update says what it spent.
    """
    model = vit_factory(cfg.model, spec)()
    model.load_state_dict(initial_state)
    share = cfg.client.client_stats if share_stats is None else share_stats
    if len(data) == 0:
        return ClientUpdate(state=_cpu_state(model), num_examples=0,
                            label_counts=label_counts(data.labels.numpy(), spec.num_classes),
                            metrics={"local-train-accuracy": float("nan")})
    device = resolve_device("cpu" if cfg.runtime.device == "cpu" else "auto")
    if cfg.privacy.private:
        return _train_private(cfg, model, data, spec, device, seed, share)
    acc = train_local(model, data, cfg.client, device, seed)
    stats = token_statistics(model, data.images, device=device) if share else None
    return ClientUpdate(state=_cpu_state(model), num_examples=int(len(data)),
                        label_counts=label_counts(data.labels.numpy(), spec.num_classes),
                        metrics={"local-train-accuracy": acc}, token_stats=stats)


def _cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _train_private(cfg: FedMITRConfig, model: nn.Module, data: Split, spec: DataSpec,
                   device: torch.device, seed: int, share_stats: bool) -> ClientUpdate:
    """DP-SGD training and Gaussian releases, all under one accountant."""
    privacy = cfg.privacy
    with_stats = share_stats and privacy.dp_stats == "gaussian"
    spent = train_local_private(model, data, cfg.client, privacy, device, seed,
                                release_steps(privacy, with_stats))
    noise_rng = torch.Generator().manual_seed(seed + 1)
    counts = private_label_counts(data.labels.numpy(), spec.num_classes,
                                  privacy.dp_release_noise, noise_rng)
    released = max(int(counts.sum()), 1)
    stats = private_token_statistics(
        model, data.images, released, privacy.dp_stats_clip, privacy.dp_release_noise,
        noise_rng, device=device) if with_stats else None
    # No train accuracy: it would be computed on the private data, outside the accountant.
    return ClientUpdate(state=_cpu_state(model), num_examples=released, label_counts=counts,
                        metrics={"local-train-accuracy": float("nan"), **spent.metrics()},
                        token_stats=stats, privacy=spent)


def simulate_clients(cfg: FedMITRConfig, num_clients: int, splits: DatasetSplits | None = None
                     ) -> tuple[DatasetSplits, list[ClientUpdate]]:
    """Train every client in this process (what the ClientApps do, without Flower)."""
    splits = splits or load_dataset(cfg.data, cfg.seed)
    init = initial_model(cfg, splits.spec).state_dict()
    partitions = partition_indices(splits.train.labels.numpy(), cfg.partition, num_clients,
                                   cfg.seed)
    updates = []
    for pid in range(num_clients):
        data = client_partition(cfg, splits, pid, num_clients, partitions)
        updates.append(train_client(cfg, data, splits.spec, init,
                                    seed=client_seed(cfg.seed, pid)))
    return splits, updates
