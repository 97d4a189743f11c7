"""What a client does: load its partition, train the local ViT, describe the upload."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedmitr_core.config import FedMITRConfig
from fedmitr_core.data import DatasetSplits, Split, load_dataset
from fedmitr_core.models import build_vit, load_pretrained, vit_factory
from fedmitr_core.partition import label_counts, partition_indices
from fedmitr_core.training import resolve_device, set_seed, train_local


@dataclass
class ClientUpdate:
    """A trained local model and what the client reports with it."""

    state: dict[str, torch.Tensor]
    num_examples: int
    label_counts: np.ndarray
    metrics: dict[str, Any]


def initial_model(cfg: FedMITRConfig, splits: DatasetSplits) -> torch.nn.Module:
    """The common starting point every client trains from (seeded, maybe pretrained)."""
    set_seed(cfg.seed)
    model = vit_factory(cfg, splits)()
    load_pretrained(model, cfg.model.pretrained)
    return model


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


def train_client(cfg: FedMITRConfig, data: Split, num_classes: int,
                 initial_state: dict[str, torch.Tensor], seed: int,
                 image_size: int, in_chans: int) -> ClientUpdate:
    """Train a local ViT from ``initial_state`` on ``data``."""
    model = build_vit(cfg.model.model, num_classes, image_size, in_chans, cfg.model.patch_size)
    model.load_state_dict(initial_state)
    counts = label_counts(data.labels.numpy(), num_classes)
    if len(data) == 0:
        acc = float("nan")
    else:
        acc = train_local(model, data, cfg.client, resolve_device("cpu" if cfg.server.device
                                                                  == "cpu" else "auto"), seed)
    return ClientUpdate(
        state={k: v.detach().cpu() for k, v in model.state_dict().items()},
        num_examples=int(len(data)), label_counts=counts,
        metrics={"local-train-accuracy": acc},
    )


def simulate_clients(cfg: FedMITRConfig, num_clients: int, splits: DatasetSplits | None = None
                     ) -> tuple[DatasetSplits, list[ClientUpdate]]:
    """Train every client in this process (what the ClientApps do, without Flower)."""
    splits = splits or load_dataset(cfg.data, cfg.seed)
    init = initial_model(cfg, splits).state_dict()
    partitions = partition_indices(splits.train.labels.numpy(), cfg.partition, num_clients,
                                   cfg.seed)
    updates = []
    for pid in range(num_clients):
        data = client_partition(cfg, splits, pid, num_clients, partitions)
        updates.append(train_client(cfg, data, splits.num_classes, init,
                                    seed=client_seed(cfg.seed, pid), image_size=splits.image_size,
                                    in_chans=splits.in_chans))
    return splits, updates
