import numpy as np
import pytest

from fedmitr_core.config import DataConfig, PartitionConfig
from fedmitr_core.data.datasets import load_dataset
from fedmitr_core.data.partition import label_counts, partition_indices


@pytest.fixture(scope="module")
def labels():
    return load_dataset(DataConfig()).train.labels.numpy()


def _skew(parts, labels):
    """Mean share of each client's largest class."""
    return float(np.mean([label_counts(labels[p], 10).max() / max(1, len(p)) for p in parts]))


def test_dirichlet_partitions_cover_the_data_once(labels):
    parts = partition_indices(labels, PartitionConfig(alpha=0.5), 10, seed=0)
    joined = np.concatenate(parts)
    assert len(joined) == len(labels)
    assert len(np.unique(joined)) == len(labels)


def test_label_skew_grows_as_alpha_shrinks(labels):
    skews = [_skew(partition_indices(labels, PartitionConfig(alpha=a), 10, seed=0), labels)
             for a in (100.0, 0.5, 0.1)]
    assert skews[0] < skews[1] < skews[2]
    assert skews[0] < 0.25  # near-uniform over 10 classes
    assert skews[2] > 0.5


def test_same_seed_same_partitions_other_seed_other(labels):
    a = partition_indices(labels, PartitionConfig(alpha=0.3), 10, seed=3)
    b = partition_indices(labels, PartitionConfig(alpha=0.3), 10, seed=3)
    c = partition_indices(labels, PartitionConfig(alpha=0.3), 10, seed=4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=False))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=False))


def test_pathological_limits_classes_per_client(labels):
    cfg = PartitionConfig(partitioner="pathological", classes_per_client=2)
    parts = partition_indices(labels, cfg, 10, seed=0)
    assert all(len(np.unique(labels[p])) <= 2 for p in parts)
    assert sum(len(p) for p in parts) == len(labels)


def test_iid_is_balanced(labels):
    parts = partition_indices(labels, PartitionConfig(partitioner="iid"), 5, seed=0)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert _skew(parts, labels) < 0.2


def test_hundreds_of_clients_on_a_small_dataset_partition_without_crashing():
    # 300 Dirichlet partitions of ~1.1k digits cannot all hold 'min-partition-size'
    # examples: the partitioner draws without the floor, warns naming the key, and
    # every example still goes to exactly one client.
    labels = np.random.default_rng(0).integers(0, 10, size=1100)
    cfg = PartitionConfig(alpha=0.1, min_partition_size=2)
    with pytest.warns(RuntimeWarning, match="'min-partition-size'"):
        parts = partition_indices(labels, cfg, 300, seed=0)
    assert len(parts) == 300
    joined = np.sort(np.concatenate(parts))
    assert np.array_equal(joined, np.arange(1100))
    assert min(len(p) for p in parts) == 0  # some are empty: the server reports them
