import numpy as np
import pytest
from PIL import Image

from fedmitr_core.config import ConfigError, DataConfig
from fedmitr_core.data.datasets import DataSpec, DataSpecError, load_dataset


def test_digits_splits_are_disjoint_stratified_and_normalised():
    splits = load_dataset(DataConfig(image_size=16))
    n = len(splits.train) + len(splits.val) + len(splits.test)
    assert n == 1797
    assert splits.train.images.shape[1:] == (1, 16, 16)
    assert abs(len(splits.test) / n - 0.2) < 0.01
    assert abs(len(splits.val) / (len(splits.train) + len(splits.val)) - 0.1) < 0.01
    for split in (splits.train, splits.val, splits.test):
        assert set(np.unique(split.labels.numpy())) == set(range(10))
    assert abs(float(splits.train.images.mean())) < 0.05
    assert splits.spec.hflip_ok is False


def test_imagefolder_tree_loads_with_classes_from_folders(tmp_path):
    rng = np.random.default_rng(0)
    for cls in ("cat", "dog", "emu"):
        (tmp_path / cls).mkdir()
        for i in range(10):
            arr = (rng.random((20, 24, 3)) * 255).astype(np.uint8)
            Image.fromarray(arr).save(tmp_path / cls / f"{i}.png")
    splits = load_dataset(DataConfig(dataset="imagefolder", data_dir=str(tmp_path),
                                     image_size=16))
    assert splits.spec.num_classes == 3 and splits.spec.in_chans == 3
    assert splits.spec.class_names == ("cat", "dog", "emu") and splits.spec.hflip_ok
    assert len(splits.train) + len(splits.val) + len(splits.test) == 30
    assert splits.test.images.shape[1:] == (3, 16, 16)


def test_missing_data_folder_names_the_key_and_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match="data-dir") as err:
        load_dataset(DataConfig(dataset="imagefolder", data_dir=str(missing)))
    assert str(missing) in str(err.value)
    with pytest.raises(ConfigError, match="data-dir"):
        load_dataset(DataConfig(dataset="cifar10", data_dir=str(missing), image_size=32))


def test_data_spec_round_trips_through_a_record_and_names_missing_fields():
    spec = load_dataset(DataConfig(image_size=16)).spec
    assert DataSpec.from_record(spec.to_record()) == spec
    assert spec.image_shape == (1, 16, 16)
    record = spec.to_record()
    del record["mean"]
    with pytest.raises(DataSpecError, match=r"\['mean'\]"):
        DataSpec.from_record(record)
