import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from fedmitr_core.config import ConfigError, DataConfig
from fedmitr_core.data import load_dataset
from fedmitr_core.models import build_vit, load_pretrained


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
    assert splits.hflip_ok is False


def test_imagefolder_tree_loads_with_classes_from_folders(tmp_path):
    rng = np.random.default_rng(0)
    for cls in ("cat", "dog", "emu"):
        (tmp_path / cls).mkdir()
        for i in range(10):
            arr = (rng.random((20, 24, 3)) * 255).astype(np.uint8)
            Image.fromarray(arr).save(tmp_path / cls / f"{i}.png")
    splits = load_dataset(DataConfig(dataset="imagefolder", data_dir=str(tmp_path),
                                     image_size=16))
    assert splits.num_classes == 3 and splits.in_chans == 3
    assert len(splits.train) + len(splits.val) + len(splits.test) == 30
    assert splits.test.images.shape[1:] == (3, 16, 16)


def test_missing_data_folder_names_the_key_and_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match="data-dir") as err:
        load_dataset(DataConfig(dataset="imagefolder", data_dir=str(missing)))
    assert str(missing) in str(err.value)
    with pytest.raises(ConfigError, match="data-dir"):
        load_dataset(DataConfig(dataset="cifar10", data_dir=str(missing), image_size=32))


def test_pretrained_local_checkpoint_loads_and_skips_the_other_head(tmp_path):
    torch.manual_seed(1)
    source = build_vit("vit-micro", 100, 16, 1, 4)
    path = tmp_path / "backbone.safetensors"
    save_file(source.state_dict(), str(path))
    target = build_vit("vit-micro", 10, 16, 1, 4)
    skipped = load_pretrained(target, str(path))
    assert skipped == ["head.bias", "head.weight"]
    torch.testing.assert_close(target.pos_embed, source.pos_embed)
    with pytest.raises(FileNotFoundError, match="pretrained"):
        load_pretrained(target, str(tmp_path / "missing.pt"))
