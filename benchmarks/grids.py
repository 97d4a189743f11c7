r"""Synthetic pools side by side as one picture, e.g. with and without the prior.

Usage::

    python -m benchmarks.grids docs/images/prior_grids.png \\
        "DeepInversion, no prior=<run>-no-prior/state/pools/dense-inversion.safetensors" \\
        "DeepInversion, prior=<run>/state/pools/dense-inversion.safetensors" [--per-class 3]

Each ``LABEL=POOL`` is a pool a run saved under ``<run>/state/pools/``; the
patch size is read from that run's ``config.yaml``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import yaml

from fedmitr_core.config import ConfigError
from fedmitr_core.server.reports import plot_pool_grids
from fedmitr_core.server.state import load_pool
from fedmitr_core.synthesis.pool import SyntheticPool


def read_pool(path: Path) -> tuple[SyntheticPool, int]:
    """A saved pool and the patch size of the run that made it."""
    if not path.is_file():
        raise ConfigError(f"pool '{path}': no such file (expected <run>/state/pools/*.safetensors)")
    config = path.parents[2] / "config.yaml"
    if not config.is_file():
        raise ConfigError(f"pool '{path}': no config.yaml in its run folder '{path.parents[2]}'")
    patch_size = int((yaml.safe_load(config.read_text(encoding="utf-8")) or {})["patch-size"])
    pool, _ = load_pool(path, torch.Generator())
    return pool, patch_size


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="the picture to write (.png)")
    parser.add_argument("pools", nargs="+", metavar="LABEL=POOL")
    parser.add_argument("--per-class", type=int, default=3)
    parser.add_argument("--no-marks", action="store_true",
                        help="leave L and pruned patches unshaded")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    pools: dict[str, SyntheticPool] = {}
    patch_sizes = set()
    for item in args.pools:
        label, sep, file = item.partition("=")
        if not sep:
            raise ConfigError(f"'{item}': expected LABEL=POOL")
        pools[label], patch = read_pool(Path(file))
        patch_sizes.add(patch)
    if len(patch_sizes) != 1:
        raise ConfigError(f"pools made with different patch sizes {sorted(patch_sizes)}")
    num_classes = max(int(p.labels.max()) + 1 for p in pools.values())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot_pool_grids(pools, args.out, patch_sizes.pop(), num_classes, args.per_class,
                    marks=not args.no_marks, title=args.title)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
