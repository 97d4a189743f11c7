"""Write each client's partition to disk, to try a deployment with real SuperNodes.

Usage::

    python -m fedmitr_core.export_partitions OUT --num-partitions 3
        [--format npz|imagefolder] [--run-config alpha=0.1 ...]

The partitions are the ones a simulation with the same run config trains on
(same dataset, partitioner, seed; the training split only: validation and test
stay with the server). ``npz`` writes ``OUT/site-<i>.npz`` with float pixels in
``[0, 1]`` (exact); ``imagefolder`` writes ``OUT/site-<i>/<class>/<n>.png``.
Each becomes one SuperNode's ``--node-config "data-path=..."``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from fedmitr_core.client.training import client_partition
from fedmitr_core.config import FedMITRConfig, parse_config, parse_overrides
from fedmitr_core.data.datasets import DataSpec, Split, load_dataset
from fedmitr_core.data.local import NPZ_IMAGES, NPZ_LABELS
from fedmitr_core.data.partition import label_counts

FORMATS = ("npz", "imagefolder")


def raw_pixels(split: Split, spec: DataSpec) -> np.ndarray:
    """Undo the normalisation: images ``(n, h, w, c)`` float32 in ``[0, 1]``."""
    mean = torch.tensor(spec.mean).view(1, -1, 1, 1)
    std = torch.tensor(spec.std).view(1, -1, 1, 1)
    pixels = (split.images * std + mean).clamp(0, 1)
    return pixels.permute(0, 2, 3, 1).numpy().astype(np.float32)


def _write_image_tree(folder: Path, pixels: np.ndarray, labels: np.ndarray,
                      class_names: tuple[str, ...]) -> None:
    from PIL import Image

    for name in class_names:
        (folder / name).mkdir(parents=True, exist_ok=True)
    for n, (img, y) in enumerate(zip(pixels, labels, strict=True)):
        arr = np.round(img * 255).astype(np.uint8)
        pil = Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr)
        pil.save(folder / class_names[int(y)] / f"{n:05d}.png")


def export_partitions(cfg: FedMITRConfig, num_partitions: int, out: Path,
                      fmt: str = "npz") -> list[Path]:
    """Write ``num_partitions`` client partitions under ``out``; return their data paths."""
    if fmt not in FORMATS:
        raise ValueError(f"--format: expected one of {FORMATS}, got {fmt!r}")
    if num_partitions < 1:
        raise ValueError(f"--num-partitions: expected an integer >= 1, got {num_partitions}")
    splits = load_dataset(cfg.data, cfg.seed)
    out.mkdir(parents=True, exist_ok=True)
    paths, summary = [], {}
    for pid in range(num_partitions):
        part = client_partition(cfg, splits, pid, num_partitions)
        pixels, labels = raw_pixels(part, splits.spec), part.labels.numpy().astype(np.int64)
        if fmt == "npz":
            path = out / f"site-{pid}.npz"
            np.savez_compressed(path, **{NPZ_IMAGES: pixels, NPZ_LABELS: labels})
        else:
            path = out / f"site-{pid}"
            _write_image_tree(path, pixels, labels, splits.spec.class_names)
        paths.append(path)
        summary[path.name] = label_counts(labels, splits.spec.num_classes).tolist()
    (out / "label_counts.json").write_text(json.dumps(
        {"class-names": list(splits.spec.class_names), "sites": summary}, indent=1),
        encoding="utf-8")
    return paths


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write the partitions to")
    parser.add_argument("--num-partitions", type=int, required=True)
    parser.add_argument("--format", choices=FORMATS, default="npz")
    parser.add_argument("--run-config", nargs="*", default=[], metavar="KEY=VALUE",
                        help="run-config keys that choose the data and the split")
    args = parser.parse_args(argv)
    cfg = parse_config(parse_overrides(args.run_config, "--run-config"))
    paths = export_partitions(cfg, args.num_partitions, args.out, args.format)
    for pid, path in enumerate(paths):
        print(f"site {pid}: flower-supernode ... --node-config \"data-path={path.resolve()}\"")


if __name__ == "__main__":
    main()
