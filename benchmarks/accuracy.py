"""Accuracy benchmark: every server method on the same cached uploads, side by side.

Usage::

    python -m benchmarks.accuracy sim_configs/digits.yaml [--seeds 0,1] [--splits dir-0.1]
        [--set key=value ...] [--tag name]

The preset holds ``run-config`` (run-config keys, as for ``preset=`` in the app)
and ``sweep``: ``num-clients``, ``seeds`` and ``splits`` (a list of mappings of
partition keys, e.g. ``{partitioner: dirichlet, alpha: 0.1}``). Clients are
trained once per (split, seed) and cached under ``benchmarks/cache/``; the
server methods are the app's (``fedmitr_core.server_job.run_server_methods``).
Writes ``benchmarks/results/<preset>[-<tag>]/``: ``table.md`` (test top-1,
mean ± std over seeds), ``val_table.md`` (the validation split, on which
defaults are chosen), ``results.json`` (every seed), ``runs/`` (each run's
outputs) and ``accuracy.png``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from fedmitr_core.config import ConfigError, FedMITRConfig, parse_config, parse_overrides
from fedmitr_core.data import load_dataset
from fedmitr_core.methods import ROUND_METHODS
from fedmitr_core.server_job import run_server_methods
from fedmitr_core.upload_cache import cached_teachers

ROOT = Path(__file__).resolve().parent
SWEEP_KEYS = {"num-clients", "seeds", "splits"}


def split_name(split: dict[str, Any]) -> str:
    """Short column name of a split: ``dir-0.1``, ``path-2``, ``iid``."""
    kind = split.get("partitioner", "dirichlet")
    if kind == "dirichlet":
        return f"dir-{split['alpha']}"
    if kind == "pathological":
        return f"path-{split['classes-per-client']}"
    return str(kind)


def load_sweep(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read a preset: its run-config overrides and its sweep, validated."""
    if not path.is_file():
        raise ConfigError(f"benchmark preset '{path}': no such file")
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict) or not isinstance(data.get("sweep"), dict):
        raise ConfigError(f"benchmark preset '{path}': expected mappings 'run-config' and "
                          "'sweep'")
    run_config = dict(data.get("run-config") or {})
    sweep = dict(data["sweep"])
    unknown = sorted(set(sweep) - SWEEP_KEYS)
    if unknown:
        raise ConfigError(f"benchmark preset '{path}': unknown sweep key '{unknown[0]}' "
                          f"(expected {sorted(SWEEP_KEYS)})")
    for key in SWEEP_KEYS:
        if key not in sweep:
            raise ConfigError(f"benchmark preset '{path}': sweep key '{key}' is missing")
    if not isinstance(sweep["splits"], list) or not all(
            isinstance(s, dict) for s in sweep["splits"]):
        raise ConfigError(f"benchmark preset '{path}': sweep key 'splits' must be a list of "
                          "mappings of partition keys")
    cfg = parse_config(run_config)  # unknown or bad run-config keys fail here, first
    rounds = sorted(set(cfg.server.methods) & ROUND_METHODS)
    if rounds:
        raise ConfigError(f"benchmark preset '{path}': run-config key 'methods': {rounds} "
                          "needs more rounds with the clients; it runs through `flwr run .` "
                          "(see README), not on the cached one-shot uploads")
    for split in sweep["splits"]:
        parse_config({**run_config, **split})
    return run_config, sweep


def _mean_std(values: list[float]) -> str:
    arr = 100 * np.asarray(values, dtype=float)
    return f"{arr.mean():.2f} ± {arr.std():.2f}" if len(arr) > 1 else f"{arr.mean():.2f}"


def summary_table(records: list[dict[str, Any]], metric: str = "accuracy") -> str:
    """Markdown: rows methods, columns splits, cells mean ± std over seeds (%)."""
    splits = list(dict.fromkeys(r["split"] for r in records))
    methods = list(dict.fromkeys(m for r in records for m in r["results"]))
    lines = ["| method | " + " | ".join(splits) + " |", "|---" * (len(splits) + 1) + "|"]
    for m in methods:
        cells = []
        for s in splits:
            vals = [r["results"][m][metric] for r in records
                    if r["split"] == s and m in r["results"]]
            cells.append(_mean_std(vals) if vals else "-")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_accuracy(records: list[dict[str, Any]], path: Path) -> None:
    """Grouped bars: test accuracy per method per split (mean, std as error bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = list(dict.fromkeys(r["split"] for r in records))
    methods = list(dict.fromkeys(m for r in records for m in r["results"]))
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(splits), 3.6))
    for i, m in enumerate(methods):
        means, stds = [], []
        for s in splits:
            vals = [100 * r["results"][m]["accuracy"] for r in records
                    if r["split"] == s and m in r["results"]]
            means.append(np.mean(vals) if vals else np.nan)
            stds.append(np.std(vals) if vals else 0.0)
        ax.bar(np.arange(len(splits)) + i * width, means, width, yerr=stds, label=m)
    ax.set_xticks(np.arange(len(splits)) + width * (len(methods) - 1) / 2, splits)
    ax.set_ylabel("test top-1 (%)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_benchmark(preset: Path, seeds: list[int] | None = None,
                  splits: list[str] | None = None, overrides: dict[str, Any] | None = None,
                  tag: str = "", results_root: Path = ROOT / "results",
                  cache_dir: Path = ROOT / "cache") -> list[dict[str, Any]]:
    """Run the sweep of ``preset``; return one record per (split, seed)."""
    run_config, sweep = load_sweep(preset)
    run_config.update(overrides or {})
    out = results_root / (preset.stem + (f"-{tag}" if tag else ""))
    (out / "runs").mkdir(parents=True, exist_ok=True)
    chosen = [s for s in sweep["splits"] if not splits or split_name(s) in splits]
    records: list[dict[str, Any]] = []
    for split in chosen:
        for seed in seeds if seeds is not None else sweep["seeds"]:
            cfg: FedMITRConfig = parse_config({**run_config, **split, "seed": int(seed)})
            name = f"{split_name(split)}-seed{seed}"
            data = load_dataset(cfg.data, cfg.seed)
            start = time.perf_counter()
            teachers, cached = cached_teachers(cfg, int(sweep["num-clients"]), data, cache_dir)
            client_s = time.perf_counter() - start
            print(f"[{name}] {len(teachers)} teachers "
                  f"({'cached' if cached else f'trained in {client_s:.0f} s'})", flush=True)
            outcome = run_server_methods(teachers, cfg, data, out / "runs" / name,
                                         emit=lambda line, n=name: print(f"[{n}] {line}",
                                                                         flush=True))
            records.append({"split": split_name(split), "seed": int(seed), "cached": cached,
                            "results": outcome.results})
            (out / "results.json").write_text(json.dumps(
                {"preset": str(preset), "run-config": run_config, "sweep": sweep,
                 "records": records}, indent=1, default=float), encoding="utf-8")
    (out / "table.md").write_text(summary_table(records) + "\n", encoding="utf-8")
    (out / "val_table.md").write_text(summary_table(records, "val-accuracy") + "\n",
                                      encoding="utf-8")
    plot_accuracy(records, out / "accuracy.png")
    print(f"test top-1 (%), mean ± std over seeds; written to {out}\n"
          + summary_table(records))
    print("validation top-1 (%)\n" + summary_table(records, "val-accuracy"))
    return records


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("preset", type=Path, help="sim_configs/<name>.yaml with a 'sweep'")
    parser.add_argument("--seeds", help="comma-separated seeds (default: the preset's)")
    parser.add_argument("--splits", help="comma-separated split names, e.g. dir-0.1,path-2")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a run-config key (repeatable)")
    parser.add_argument("--tag", default="", help="suffix of the results folder")
    args = parser.parse_args(argv)
    run_benchmark(
        args.preset,
        seeds=[int(s) for s in args.seeds.split(",")] if args.seeds else None,
        splits=args.splits.split(",") if args.splits else None,
        overrides=parse_overrides(args.set, "--set"), tag=args.tag,
    )


if __name__ == "__main__":
    main()
