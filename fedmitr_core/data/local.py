"""A deployed client's own data: a ``.npz`` file or an ImageFolder tree.

In deployment a SuperNode is started with ``--node-config "data-path=..."``
and has no simulated partition. What its images must look like (classes,
size, channels, normalisation) comes from the server with the train message
as a :class:`~fedmitr_core.data.datasets.DataSpec`, so every client prepares its data exactly as the
server prepares its test split.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fedmitr_core.data.datasets import DataSpec, Split, normalise, resize

NPZ_IMAGES, NPZ_LABELS = "images", "labels"


class LocalDataError(ValueError):
    """A client's local data cannot be used; the message names the path."""


def _to_spec(images: torch.Tensor, spec: DataSpec) -> torch.Tensor:
    """Raw ``[0, 1]`` images ``(n, c, h, w)`` resized, channel-matched and normalised."""
    if images.shape[1] != spec.in_chans:
        if images.shape[1] == 1:
            images = images.expand(-1, spec.in_chans, -1, -1)
        elif spec.in_chans == 1:
            images = images.mean(dim=1, keepdim=True)
    return normalise(resize(images, spec.image_size), torch.tensor(spec.mean),
                     torch.tensor(spec.std)).contiguous()


def _channels_first(images: np.ndarray, path: Path) -> np.ndarray:
    if images.ndim == 3:  # (n, h, w): grey
        return images[:, None]
    if images.ndim == 4 and images.shape[-1] in (1, 3):  # (n, h, w, c)
        return images.transpose(0, 3, 1, 2)
    if images.ndim == 4 and images.shape[1] in (1, 3):  # (n, c, h, w)
        return images
    raise LocalDataError(f"data-path '{path}': '{NPZ_IMAGES}' must have shape (n, h, w), "
                         f"(n, h, w, c) or (n, c, h, w) with 1 or 3 channels, "
                         f"got {images.shape}")


def _load_npz(path: Path, spec: DataSpec) -> tuple[torch.Tensor, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as npz:
            if NPZ_IMAGES not in npz or NPZ_LABELS not in npz:
                raise LocalDataError(f"data-path '{path}': expected arrays '{NPZ_IMAGES}' and "
                                     f"'{NPZ_LABELS}', found {sorted(npz.files)}")
            images, labels = npz[NPZ_IMAGES], npz[NPZ_LABELS]
    except (OSError, ValueError) as err:
        if isinstance(err, LocalDataError):
            raise
        raise LocalDataError(f"data-path '{path}': not a readable .npz file: {err}") from err
    if images.dtype == np.uint8:
        pixels = images.astype(np.float32) / 255.0
    elif np.issubdtype(images.dtype, np.floating):
        pixels = images.astype(np.float32)
        if pixels.size and (not np.isfinite(pixels).all() or pixels.min() < 0
                            or pixels.max() > 1):
            raise LocalDataError(f"data-path '{path}': float '{NPZ_IMAGES}' must lie in "
                                 "[0, 1] (or store uint8 pixels)")
    else:
        raise LocalDataError(f"data-path '{path}': '{NPZ_IMAGES}' must be uint8 or float, "
                             f"got {images.dtype}")
    if not np.issubdtype(labels.dtype, np.integer) or labels.ndim != 1:
        raise LocalDataError(f"data-path '{path}': '{NPZ_LABELS}' must be a 1-d integer "
                             f"array, got {labels.dtype} {labels.shape}")
    if len(labels) != len(images):
        raise LocalDataError(f"data-path '{path}': {len(images)} images but "
                             f"{len(labels)} labels")
    return torch.from_numpy(_channels_first(pixels, path)), labels.astype(np.int64)


def _load_image_tree(root: Path, spec: DataSpec) -> tuple[torch.Tensor, np.ndarray]:
    from PIL import Image
    from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset
    from torchvision.transforms.functional import to_tensor

    folders = sorted(p.name for p in root.iterdir() if p.is_dir())
    unknown = sorted(set(folders) - set(spec.class_names))
    if unknown:
        raise LocalDataError(f"data-path '{root}': class folders {unknown} are not among the "
                             f"server's classes {list(spec.class_names)}")
    class_to_idx = {name: i for i, name in enumerate(spec.class_names) if name in folders}
    samples = make_dataset(str(root), class_to_idx, extensions=IMG_EXTENSIONS,
                           allow_empty=True)
    mode = "L" if spec.in_chans == 1 else "RGB"
    size = (spec.image_size, spec.image_size)
    images = [to_tensor(Image.open(p).convert(mode).resize(size, Image.BILINEAR))
              for p, _ in samples]
    labels = np.asarray([y for _, y in samples], dtype=np.int64)
    if not images:
        return torch.zeros(0, spec.in_chans, *size), labels
    return torch.stack(images), labels


def load_local_data(path: str | Path, spec: DataSpec) -> Split:
    """This client's images as a normalised :class:`Split`.

    Parameters
    ----------
    path
        A ``.npz`` file with ``images`` (uint8 pixels, or floats in ``[0, 1]``;
        ``(n, h, w)``, ``(n, h, w, c)`` or ``(n, c, h, w)``) and ``labels``
        (class indices in the server's class order), or a folder with one
        sub-folder of images per class, named as the server's classes.
    spec
        What the server expects (classes, size, channels, normalisation).
    """
    path = Path(path).expanduser()
    if path.is_file() and path.suffix == ".npz":
        pixels, labels = _load_npz(path, spec)
    elif path.is_dir():
        pixels, labels = _load_image_tree(path, spec)
    else:
        raise LocalDataError(f"node config 'data-path': '{path}' is neither a .npz file nor "
                             "a folder with one sub-folder per class")
    bad = labels[(labels < 0) | (labels >= spec.num_classes)]
    if bad.size:
        raise LocalDataError(f"data-path '{path}': labels must be class indices in "
                             f"0..{spec.num_classes - 1}, found {sorted(set(bad.tolist()))[:5]}")
    return Split(_to_spec(pixels, spec), torch.from_numpy(labels))
