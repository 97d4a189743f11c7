"""Accuracy against ε: the private-client benchmark beside the non-private one.

Usage::

    python -m benchmarks.dp_curve benchmarks/results/digits-dp \
        [--reference benchmarks/results/digits-audit] [--methods fedmitr,fedavg,ensemble]

Reads ``results.json`` of a run of ``sim_configs/digits-dp.yaml`` (splits named
``dir-0.5-eps8`` ...) and, for ε = ∞, the reference benchmark's records of the same
base split and seeds. Writes ``dp_curve.md`` (every seed) and ``dp_curve.png``
beside the private results.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent
PRIVATE = re.compile(r"^(?P<split>.+)-eps(?P<eps>[0-9.]+)$")


def _records(folder: Path) -> list[dict[str, Any]]:
    data = json.loads((folder / "results.json").read_text(encoding="utf-8"))
    return data if isinstance(data, list) else data["records"]


def curve_points(private: list[dict[str, Any]], reference: list[dict[str, Any]],
                 methods: list[str]) -> dict[tuple[str, str, float], dict[int, float]]:
    """``(split, method, ε) -> {seed: accuracy}``; ε = inf from ``reference``."""
    points: dict[tuple[str, str, float], dict[int, float]] = defaultdict(dict)
    seeds: dict[str, set[int]] = defaultdict(set)
    for rec in private:
        match = PRIVATE.match(rec["split"])
        if match is None:
            continue
        split, eps = match["split"], float(match["eps"])
        seeds[split].add(rec["seed"])
        for method in methods:
            result = rec["results"].get(method) or {}
            if result.get("accuracy") is not None:
                points[(split, method, eps)][rec["seed"]] = 100 * result["accuracy"]
    for rec in reference:
        if rec["seed"] in seeds.get(rec["split"], ()):
            for method in methods:
                result = rec["results"].get(method) or {}
                if result.get("accuracy") is not None:
                    points[(rec["split"], method, math.inf)][rec["seed"]] = \
                        100 * result["accuracy"]
    return dict(points)


def write_curve(points: dict[tuple[str, str, float], dict[int, float]], out: Path) -> str:
    """``dp_curve.md`` and ``dp_curve.png`` under ``out``; the markdown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = sorted({s for s, _, _ in points})
    methods = list(dict.fromkeys(m for _, m, _ in points))
    md = ["# Accuracy against ε (test top-1 %, each seed, then the mean)", "",
          "| split | method | ε | seeds | mean |", "|---|---|---|---|---|"]
    fig, axes = plt.subplots(1, len(splits), figsize=(5 * len(splits), 3.8), squeeze=False)
    for ax, split in zip(axes[0], splits, strict=True):
        for method in methods:
            eps = sorted((e for s, m, e in points if s == split and m == method), reverse=True)
            means = []
            for e in eps:
                by_seed = points[(split, method, e)]
                means.append(float(np.mean(list(by_seed.values()))))
                shown = " / ".join(f"{by_seed[s]:.1f}" for s in sorted(by_seed))
                md.append(f"| {split} | {method} | {'∞' if math.isinf(e) else f'{e:g}'} | "
                          f"{shown} (seeds {', '.join(map(str, sorted(by_seed)))}) | "
                          f"{means[-1]:.2f} |")
            labels = ["∞" if math.isinf(e) else f"{e:g}" for e in eps]
            ax.plot(range(len(eps)), means, marker="o", label=method)
            ax.set_xticks(range(len(eps)), labels)
        ax.set_xlabel("client ε (δ = 1e-5)")
        ax.set_ylabel("test top-1 (%)")
        ax.set_title(split, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "dp_curve.png", dpi=130)
    plt.close(fig)
    text = "\n".join(md) + "\n"
    (out / "dp_curve.md").write_text(text, encoding="utf-8")
    return text


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("private", type=Path, help="results folder of digits-dp")
    parser.add_argument("--reference", type=Path, default=ROOT / "results" / "digits-audit",
                        help="the non-private run of the same seeds (ε = ∞) on uploads "
                             "trained by the same code and machine as the private ones")
    parser.add_argument("--methods", default="fedmitr,fedavg,ensemble")
    args = parser.parse_args(argv)
    points = curve_points(_records(args.private), _records(args.reference),
                          args.methods.split(","))
    print(write_curve(points, args.private))


if __name__ == "__main__":
    main()
