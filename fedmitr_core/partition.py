"""Client partitions of the training split, made by flwr-datasets partitioners."""

from __future__ import annotations

import numpy as np

from fedmitr_core.config import ConfigError, PartitionConfig


def _make_partitioner(cfg: PartitionConfig, num_partitions: int, seed: int):  # noqa: ANN202
    from flwr_datasets.partitioner import (
        DirichletPartitioner,
        IidPartitioner,
        PathologicalPartitioner,
    )

    if cfg.partitioner == "dirichlet":
        return DirichletPartitioner(
            num_partitions=num_partitions, partition_by="label", alpha=cfg.alpha,
            min_partition_size=cfg.min_partition_size, self_balancing=False, seed=seed,
        )
    if cfg.partitioner == "pathological":
        return PathologicalPartitioner(
            num_partitions=num_partitions, partition_by="label",
            num_classes_per_partition=cfg.classes_per_client,
            class_assignment_mode="first-deterministic", seed=seed,
        )
    return IidPartitioner(num_partitions=num_partitions)


def partition_indices(labels: np.ndarray, cfg: PartitionConfig, num_partitions: int,
                      seed: int) -> list[np.ndarray]:
    """Indices into ``labels`` held by each of ``num_partitions`` clients.

    Parameters
    ----------
    labels
        Training labels, ``(n,)`` integers.
    cfg
        Partitioner and its settings (``alpha``, ``classes-per-client``).
    num_partitions
        Number of clients (from the node config's ``num-partitions``).
    seed
        Seeds the partitioner: every client computes the same split.
    """
    from datasets import Dataset

    if num_partitions < 1:
        raise ConfigError(f"node config 'num-partitions': expected >= 1, got {num_partitions}")
    if cfg.partitioner == "pathological" and cfg.classes_per_client > len(np.unique(labels)):
        raise ConfigError(
            f"run config key 'classes-per-client': expected <= {len(np.unique(labels))} "
            f"(classes in the data), got {cfg.classes_per_client}"
        )
    ds = Dataset.from_dict({"label": labels.astype(np.int64), "index": np.arange(len(labels))})
    partitioner = _make_partitioner(cfg, num_partitions, seed)
    partitioner.dataset = ds
    return [np.asarray(partitioner.load_partition(pid)["index"], dtype=np.int64)
            for pid in range(num_partitions)]


def label_counts(labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Per-class example counts ``(num_classes,)``."""
    return np.bincount(labels.astype(np.int64), minlength=num_classes)
