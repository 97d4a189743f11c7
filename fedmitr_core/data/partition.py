"""Client partitions of the training split, made by flwr-datasets partitioners."""

from __future__ import annotations

import warnings
from dataclasses import replace

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
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # one per failed Dirichlet draw
            return _load_all(_make_partitioner(cfg, num_partitions, seed), ds, num_partitions)
    except ValueError as err:
        if cfg.partitioner != "dirichlet" or "max number of attempts" not in str(err):
            raise
    # Hundreds of clients on a small dataset: no Dirichlet draw gives every client
    # 'min-partition-size' examples. Draw without the floor; the clients left with
    # no data reply with num-examples 0 and the server records them as rejected.
    warnings.warn(
        f"run config key 'min-partition-size' ({cfg.min_partition_size}) cannot be met by "
        f"{num_partitions} Dirichlet partitions of {len(labels)} examples (alpha "
        f"{cfg.alpha}); partitioning without it: some partitions are tiny or empty",
        RuntimeWarning, stacklevel=2)
    no_floor = _make_partitioner(replace(cfg, min_partition_size=0), num_partitions, seed)
    return _load_all(no_floor, ds, num_partitions)


def _load_all(partitioner, ds, num_partitions: int) -> list[np.ndarray]:  # noqa: ANN001
    partitioner.dataset = ds
    return [np.asarray(partitioner.load_partition(pid)["index"], dtype=np.int64)
            for pid in range(num_partitions)]


def label_counts(labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Per-class example counts ``(num_classes,)``."""
    return np.bincount(labels.astype(np.int64), minlength=num_classes)
