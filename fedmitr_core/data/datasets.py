"""Datasets as in-memory tensors, with train / validation / test splits.

``digits`` (scikit-learn's embedded ``load_digits``, upsampled) needs no
download and is the default. ``cifar10`` / ``cifar100`` come through
torchvision (``data-dir``, ``download``); ``imagefolder`` reads a root whose
sub-folders are the classes (OfficeHome, Mini-ImageNet). The validation split is
held out from the training data and is what defaults are tuned on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedmitr_core.config import ConfigError, DataConfig


@dataclass(frozen=True)
class Split:
    """Normalised images ``(n, c, h, w)`` float32 and labels ``(n,)`` int64."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def subset(self, indices: np.ndarray | torch.Tensor) -> Split:
        """The examples at ``indices``."""
        idx = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        return Split(self.images[idx], self.labels[idx])


class DataSpecError(ValueError):
    """A data spec record lacks a field."""


_SPEC_KEYS = ("num-classes", "image-size", "in-chans", "mean", "std", "class-names", "hflip-ok")


@dataclass(frozen=True)
class DataSpec:
    """What every model input looks like; the server sends it to deployed clients.

    ``mean`` / ``std`` are the per-channel statistics the images were
    normalised with; ``hflip_ok`` says whether a horizontal flip keeps the
    label (not for digits).
    """

    num_classes: int
    image_size: int
    in_chans: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    class_names: tuple[str, ...]
    hflip_ok: bool = False

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of the models' input."""
        return (self.in_chans, self.image_size, self.image_size)

    def to_record(self) -> dict[str, Any]:
        """Plain values for a Flower ConfigRecord."""
        return {"num-classes": self.num_classes, "image-size": self.image_size,
                "in-chans": self.in_chans, "mean": list(self.mean), "std": list(self.std),
                "class-names": list(self.class_names), "hflip-ok": self.hflip_ok}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> DataSpec:
        """Read back :meth:`to_record`'s values, naming any that is missing."""
        missing = [k for k in _SPEC_KEYS if k not in record]
        if missing:
            raise DataSpecError(f"the server's train message lacks {missing}: the ServerApp "
                                "must send the data spec to clients that use 'data-path'")
        return cls(int(record["num-classes"]), int(record["image-size"]),
                   int(record["in-chans"]), tuple(float(v) for v in record["mean"]),
                   tuple(float(v) for v in record["std"]),
                   tuple(str(v) for v in record["class-names"]), bool(record["hflip-ok"]))


@dataclass(frozen=True)
class DatasetSplits:
    """Train, validation and test splits of one dataset, and what its images look like."""

    train: Split
    val: Split
    test: Split
    spec: DataSpec


def _stratified_split(labels: np.ndarray, fraction: float, seed: int
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Indices (kept, held_out) with ``fraction`` of each class held out."""
    rng = np.random.default_rng(seed)
    held: list[np.ndarray] = []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        held.append(idx[: int(round(fraction * len(idx)))])
    held_out = np.sort(np.concatenate(held)) if held else np.zeros(0, dtype=np.int64)
    kept = np.setdiff1d(np.arange(len(labels)), held_out)
    return kept, held_out


def normalise(images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``(images - mean) / std`` per channel, for ``(n, c, h, w)`` images."""
    return (images - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)


def resize(images: torch.Tensor, size: int) -> torch.Tensor:
    """Bilinear resize of ``(n, c, h, w)`` images to ``size`` x ``size`` (no-op if already)."""
    if images.shape[-1] == size and images.shape[-2] == size:
        return images
    return F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)


Loaded = tuple[torch.Tensor, np.ndarray, "tuple[torch.Tensor, np.ndarray] | None", list[str]]


def _load_digits(cfg: DataConfig) -> Loaded:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return (resize(images, cfg.image_size), bunch.target.astype(np.int64), None,
            [str(c) for c in bunch.target_names])


def _load_cifar(cfg: DataConfig, num_classes: int) -> Loaded:
    from torchvision import datasets

    cls = datasets.CIFAR10 if num_classes == 10 else datasets.CIFAR100
    root = Path(cfg.data_dir).expanduser()
    try:
        train = cls(str(root), train=True, download=cfg.download)
        test = cls(str(root), train=False, download=cfg.download)
    except RuntimeError as err:
        raise ConfigError(
            f"run config key 'data-dir': no {cls.__name__} data under '{root}' "
            f"(set download=true to fetch it): {err}"
        ) from err

    def to_tensor(ds: datasets.VisionDataset) -> tuple[torch.Tensor, np.ndarray]:
        x = torch.tensor(np.asarray(ds.data), dtype=torch.float32).permute(0, 3, 1, 2) / 255
        return resize(x, cfg.image_size), np.asarray(ds.targets, dtype=np.int64)

    x_train, y_train = to_tensor(train)
    return x_train, y_train, to_tensor(test), list(train.classes)


def _load_imagefolder(cfg: DataConfig) -> Loaded:
    from torchvision import datasets, transforms

    root = Path(cfg.data_dir).expanduser()
    if not root.is_dir():
        raise ConfigError(
            f"run config key 'data-dir': expected a folder with one sub-folder per class, "
            f"'{root}' does not exist"
        )
    tf = transforms.Compose([
        transforms.Resize((cfg.image_size, cfg.image_size)), transforms.ToTensor(),
    ])
    try:
        ds = datasets.ImageFolder(str(root), transform=tf)
    except (FileNotFoundError, RuntimeError) as err:
        raise ConfigError(f"run config key 'data-dir': '{root}': {err}") from err
    images = torch.stack([ds[i][0] for i in range(len(ds))])
    if images.shape[1] == 1:
        images = images.expand(-1, 3, -1, -1).contiguous()
    return images, np.asarray(ds.targets, dtype=np.int64), None, list(ds.classes)


def load_dataset(cfg: DataConfig, seed: int = 0) -> DatasetSplits:
    """Load a dataset and split it into train / validation / test.

    The splits depend only on the data and ``seed`` (not on the partition), so
    every client and the server see the same ones.
    """
    if cfg.dataset == "digits":
        images, labels, test, class_names = _load_digits(cfg)
        hflip_ok = False
    elif cfg.dataset in ("cifar10", "cifar100"):
        images, labels, test, class_names = _load_cifar(
            cfg, 10 if cfg.dataset == "cifar10" else 100)
        hflip_ok = True
    elif cfg.dataset == "imagefolder":
        images, labels, test, class_names = _load_imagefolder(cfg)
        hflip_ok = True
    else:  # pragma: no cover - the config's Literal rejects it first
        raise ConfigError(f"run config key 'dataset': unknown dataset {cfg.dataset!r}")

    if test is None:
        train_idx, test_idx = _stratified_split(labels, cfg.test_fraction, seed)
        test = (images[test_idx], labels[test_idx])
        images, labels = images[train_idx], labels[train_idx]
    train_idx, val_idx = _stratified_split(labels, cfg.val_fraction, seed + 1)

    mean = images[train_idx].mean(dim=(0, 2, 3))
    std = images[train_idx].std(dim=(0, 2, 3)).clamp_min(1e-3)
    y = torch.as_tensor(labels)
    full = Split(normalise(images, mean, std), y)
    num_classes = int(max(labels.max(), test[1].max()) + 1)
    spec = DataSpec(num_classes=num_classes, image_size=cfg.image_size,
                    in_chans=int(images.shape[1]), mean=tuple(float(v) for v in mean),
                    std=tuple(float(v) for v in std), class_names=tuple(class_names),
                    hflip_ok=hflip_ok)
    return DatasetSplits(
        train=full.subset(train_idx),
        val=full.subset(val_idx),
        test=Split(normalise(test[0], mean, std), torch.as_tensor(test[1])),
        spec=spec,
    )
