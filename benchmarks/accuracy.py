"""Accuracy benchmark: every server method on the same cached uploads, side by side.

Usage::

    python -m benchmarks.accuracy sim_configs/digits.yaml [--seeds 0,1] [--splits dir-0.1]
        [--set key=value ...] [--tag name]

The preset holds ``run-config`` (run-config keys, as for ``preset=`` in the app)
and ``sweep``: ``num-clients``, ``seeds`` and ``splits`` (a list of mappings of
partition keys, e.g. ``{partitioner: dirichlet, alpha: 0.1}``). Clients are
trained once per (split, seed) and cached under ``benchmarks/cache/``; the
server methods run through the app's pipeline (``fedmitr_core.server.pipeline``).
Writes ``benchmarks/results/<preset>[-<tag>]/``: ``table.md`` (test top-1,
mean ± std over seeds), ``seeds.md`` (every seed's figure), ``val_table.md``
(the validation split, on which defaults are chosen), ``leads.md`` (FedMITR minus
each baseline per split, and on how many seeds it is ahead), ``results.json`` (every
seed), ``runs/`` (each run's outputs), ``accuracy.png`` and, when ``methods``
holds ``fedavg-rounds``, ``rounds.png`` (FedAvg accuracy against rounds,
one-shot methods as lines); with ``privacy-audit=true``, ``audit/``
(``benchmarks.privacy_audit``'s report of every run's audit).

``--variant LABEL KEY=VALUE ...`` runs the server again on the same uploads with
those keys changed (server keys only) and adds its methods' rows as
``<method> (LABEL)``, e.g. ``--variant "no prior" feature-stats=false
methods=fedmitr,deepinversion`` gives the rows ``fedmitr (no prior)`` and
``deepinversion (no prior)``.

``--tables-only`` runs nothing: it rewrites the tables and pictures of the
results folder named by the preset and ``--tag`` from its ``results.json``
(e.g. after copying results from another checkout, or after a table's format
changed).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from benchmarks.privacy_audit import saved_audit, write_report
from benchmarks.tables import mean_std
from benchmarks.upload_cache import cached_uploads, client_key, uploads_digest
from fedmitr_core.config import ConfigError, FedMITRConfig, parse_config, parse_overrides
from fedmitr_core.data.datasets import DatasetSplits, load_dataset
from fedmitr_core.methods import BASELINES
from fedmitr_core.progress import Emit
from fedmitr_core.server.pipeline import run_pipeline
from fedmitr_core.server.reports import draw_rounds

ROOT = Path(__file__).resolve().parent
SWEEP_KEYS = {"num-clients", "seeds", "splits"}
# A variant: its label and the run-config keys it changes.
Variants = dict[str, dict[str, Any]]


def split_name(split: dict[str, Any]) -> str:
    """Short column name of a split: ``dir-0.1``, ``path-2``, ``iid``.

    A split that also makes its clients private (``dp-epsilon``) says so: ``dir-0.5-eps8``.
    """
    kind = split.get("partitioner", "dirichlet")
    if kind == "dirichlet":
        name = f"dir-{split['alpha']}"
    elif kind == "pathological":
        name = f"path-{split['classes-per-client']}"
    else:
        name = str(kind)
    return f"{name}-eps{split['dp-epsilon']:g}" if "dp-epsilon" in split else name


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
    parse_config(run_config)  # unknown or bad run-config keys fail here, first
    for split in sweep["splits"]:
        parse_config({**run_config, **split})
    return run_config, sweep


def _by_split(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The records of each split (splits in first-seen order), sorted by seed."""
    splits = dict.fromkeys(r["split"] for r in records)
    return {s: sorted((r for r in records if r["split"] == s), key=lambda r: r["seed"])
            for s in splits}


def _method_table(by_split: dict[str, list[dict[str, Any]]], heads: list[str],
                  cell: Callable[[list[Any]], str], metric: str) -> str:
    """Markdown: one row per method, one column per split of ``by_split`` (``heads``).

    Each cell is ``cell`` of the method's ``metric`` on that split's records, in seed order.
    """
    methods = dict.fromkeys(m for rs in by_split.values() for r in rs for m in r["results"])
    lines = ["| method | " + " | ".join(heads) + " |", "|---" * (len(by_split) + 1) + "|"]
    for m in methods:
        cells = [cell([r["results"].get(m, {}).get(metric) for r in rs])
                 for rs in by_split.values()]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_table(records: list[dict[str, Any]], metric: str = "accuracy") -> str:
    """Markdown: rows methods, columns splits, cells mean ± std over seeds (%).

    When the splits were not run with the same number of seeds, each column
    says how many it has.
    """
    by_split = _by_split(records)
    seeds = {s: len({r["seed"] for r in rs}) for s, rs in by_split.items()}
    heads = list(seeds) if len(set(seeds.values())) <= 1 else [
        f"{s} ({n} seed{'s' if n > 1 else ''})" for s, n in seeds.items()]

    def cell(values: list[float | None]) -> str:
        present = [v for v in values if v is not None]
        return mean_std(present, scale=100) if present else "-"

    return _method_table(by_split, heads, cell, metric)


def seed_table(records: list[dict[str, Any]], metric: str = "accuracy") -> str:
    """Markdown: rows methods, columns splits, cells every seed's figure (%) in seed order.

    The column head names the seeds, so a reader can line up a seed across methods.
    """
    by_split = _by_split(records)
    heads = [f"{s}, seeds " + " / ".join(str(r["seed"]) for r in rs)
             for s, rs in by_split.items()]

    def cell(values: list[float | None]) -> str:
        return " / ".join(f"{100 * v:.1f}" if v is not None else "-" for v in values)

    return _method_table(by_split, heads, cell, metric)


def seconds_table(records: list[dict[str, Any]]) -> str:
    """Markdown: rows methods, columns splits, cells mean server seconds over seeds.

    Each cell is ``wall / CPU``: wall-clock seconds grow when other runs share the
    cores, the process's CPU seconds do not, so the CPU figure is the one to
    compare across methods, tables and machines of one kind. ``-`` where a record
    has none (records made before CPU seconds were kept).
    """
    timed = [{**r, "results": {m: {"time": (v.get("seconds"), v.get("cpu-seconds"))}
                               for m, v in r["results"].items()}} for r in records]

    def mean(values: list[float | None]) -> str:
        present = [v for v in values if v is not None]
        return f"{np.mean(present):.0f}" if present else "-"

    def cell(times: list[tuple[float | None, float | None] | None]) -> str:
        pairs = [t if t is not None else (None, None) for t in times]
        return f"{mean([w for w, _ in pairs])} / {mean([c for _, c in pairs])}"

    by_split = _by_split(timed)
    return _method_table(by_split, list(by_split), cell, "time")


def lead_table(records: list[dict[str, Any]], method: str = "fedmitr",
               metric: str = "accuracy") -> str:
    """Markdown: ``method`` against each baseline, per split, seed by seed.

    Rows: each of ``BASELINES`` in the records, then ``best baseline`` (each seed's
    best of them); a cell is the mean over seeds of ``method`` minus that row
    (points) and on how many of the seeds ``method`` is ahead, e.g. ``+2.31 (4/5)``.
    The last row is ``method``'s mean as a share of the ensemble's mean.
    """
    by_split = _by_split(records)
    present = {m for rs in by_split.values() for r in rs for m in r["results"]}
    rows = [b for b in BASELINES if b in present]

    def values(rs: list[dict[str, Any]], m: str) -> dict[int, float]:
        return {r["seed"]: 100 * r["results"][m][metric] for r in rs
                if r["results"].get(m, {}).get(metric) is not None}

    def lead(mine: dict[int, float], theirs: dict[int, float]) -> str:
        seeds = sorted(mine.keys() & theirs.keys())
        if not seeds:
            return "-"
        diffs = [mine[s] - theirs[s] for s in seeds]
        return f"{np.mean(diffs):+.2f} ({sum(d > 0 for d in diffs)}/{len(diffs)})"

    lines = [f"| {method} against | " + " | ".join(by_split) + " |",
             "|---" * (len(by_split) + 1) + "|"]
    share = f"{method} / ensemble"
    cells: dict[str, list[str]] = {row: [] for row in [*rows, "best baseline", share]}
    for rs in by_split.values():
        mine = values(rs, method)
        theirs = {b: values(rs, b) for b in rows}
        for b in rows:
            cells[b].append(lead(mine, theirs[b]))
        best = {s: max(t[s] for t in theirs.values() if s in t)
                for s in mine if any(s in t for t in theirs.values())}
        cells["best baseline"].append(lead(mine, best))
        ens = values(rs, "ensemble")
        seeds = sorted(mine.keys() & ens.keys())
        cells[share].append(
            f"{100 * np.mean([mine[s] for s in seeds]) / np.mean([ens[s] for s in seeds]):.1f} %"
            if seeds else "-")
    lines += [f"| {row} | " + " | ".join(row_cells) + " |" for row, row_cells in cells.items()]
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
                    if r["split"] == s and r["results"].get(m, {}).get("accuracy") is not None]
            means.append(np.mean(vals) if vals else np.nan)
            stds.append(np.std(vals) if vals else 0.0)
        ax.bar(np.arange(len(splits)) + i * width, means, width, yerr=stds, label=m)
    ax.set_xticks(np.arange(len(splits)) + width * (len(methods) - 1) / 2, splits)
    ax.set_ylabel("test top-1 (%)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_rounds(run_config: dict[str, Any], cfg: FedMITRConfig, data: DatasetSplits,
               uploads: Path, num_clients: int, run_dir: Path, emit: Emit) -> dict[str, Any]:
    """``fedavg-rounds`` on the cached uploads: Flower's FedAvg with the real ClientApp.

    Round 1 is the cached one-shot round (its FedAvg model); rounds 2..R train
    every client again through the app's ClientApp, delivered in this process
    (``server_app.in_process_grid``), and Flower's ``FedAvg`` aggregates them.
    """
    from server_app.fedavg_rounds import add_fedavg_rounds
    from server_app.in_process_grid import InProcessGrid

    grid = InProcessGrid(run_config, num_clients)
    return add_fedavg_rounds(grid, cfg, data, run_dir, emit, uploads)


def plot_rounds_by_split(records: list[dict[str, Any]], path: Path) -> None:
    """Per split: FedAvg accuracy against rounds (mean over seeds), one-shot methods as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = list(dict.fromkeys(r["split"] for r in records if "fedavg-rounds" in r["results"]))
    fig, axes = plt.subplots(1, len(splits), figsize=(4.2 * len(splits), 3.4), squeeze=False)
    for ax, split in zip(axes[0], splits, strict=True):
        rows = [r["results"] for r in records if r["split"] == split
                and "fedavg-rounds" in r["results"]]
        per_round = np.array([[x["accuracy"] for x in res["fedavg-rounds"]["rounds"]]
                              for res in rows]).mean(axis=0)
        levels = {m: float(np.mean([res[m]["accuracy"] for res in rows if m in res]))
                  for m in rows[0] if m not in ("fedavg-rounds", "fedavg", "local-mean")}
        draw_rounds(ax, [{"round": i + 1, "accuracy": float(a)}
                         for i, a in enumerate(per_round)], levels)
        ax.set_title(f"{split} (mean of {len(rows)} seed{'s' if len(rows) > 1 else ''})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


SWEPT_KEYS = ("seed", "methods", "preset", "partitioner", "alpha", "classes-per-client")


def resolved_settings(run_config: dict[str, Any]) -> dict[str, Any]:
    """Every setting a run config resolves to (defaults included), but those a sweep varies."""
    flat = parse_config(run_config).to_flat()
    return {k: v for k, v in flat.items() if k not in SWEPT_KEYS}


def saved_results(out: Path) -> dict[str, Any]:
    """``out/results.json`` parsed, or ``{}`` if the folder has none yet."""
    path = out / "results.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def previous_records(out: Path, saved: dict[str, Any],
                     run_config: dict[str, Any]) -> list[dict[str, Any]]:
    """The records of ``saved`` (``out``'s results.json), if made with the same settings.

    The resolved settings are compared, defaults included, so a default that
    changed in the code since is caught; only ``methods`` (and what the sweep
    varies) may differ. Folders written before the settings were saved in
    ``results.json`` are compared with their first run's ``config.yaml``. A key the
    folder does not name was added to the code since; it matches when the new run
    leaves it at its default (new keys default to the behaviour from before them).
    """
    records = list(saved.get("records", []))
    old = saved.get("resolved-config")
    if old is None and records:
        first = out / "runs" / f"{records[0]['split']}-seed{records[0]['seed']}" / "config.yaml"
        old = {k: v for k, v in (yaml.safe_load(first.read_text(encoding="utf-8")) or {}).items()
               if k not in SWEPT_KEYS}
    if old is None:
        return records
    new = resolved_settings(run_config)
    default = resolved_settings({})
    differing = sorted(k for k in set(old) | set(new)
                       if old.get(k, default.get(k)) != new.get(k))
    if differing:
        k = differing[0]
        raise ConfigError(f"--append: {out / 'results.json'} was made with other settings "
                          f"(key '{k}': {old.get(k)!r} there, {new.get(k)!r} now); "
                          "use another --tag")
    return records


# Rows that depend on the uploads only: equal on the same uploads whatever the server ran.
UPLOAD_ROWS = ("ensemble", "fedavg", "local-mean")


def merge_record(kept: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new``'s rows over ``kept``'s, for one (split, seed) run again with ``--append``.

    Rows of methods ``new`` did not run stay, so a method can be added to or run
    again in a table. Both must come from the same uploads: the same
    ``uploads-digest``, or, for a record kept from before digests were saved,
    the same accuracy in every row of ``UPLOAD_ROWS`` they share. The merged
    record keeps how the uploads were made from the first run and lists the run
    folders of both in ``run-folders``.
    """
    name = f"{new['split']}-seed{new['seed']}"
    if "uploads-digest" in kept:
        same = kept["uploads-digest"] == new["uploads-digest"]
        seen = f"digest {kept['uploads-digest']} there, {new['uploads-digest']} now"
    else:
        shared = [m for m in UPLOAD_ROWS if m in kept["results"] and m in new["results"]]
        same = bool(shared) and all(kept["results"][m]["accuracy"]
                                    == new["results"][m]["accuracy"] for m in shared)
        seen = f"rows {shared or list(UPLOAD_ROWS)} differ"
    if not same:
        raise ConfigError(f"--append: {name} ran on other uploads than its record in "
                          f"results.json ({seen}); their rows cannot share a table: "
                          "use another --tag")
    made = {k: kept[k] for k in ("cached", "client-seconds") if k in kept}
    return {**new, **made, "run-folders": kept.get("run-folders", [name]) + new["run-folders"],
            "results": {**kept["results"], **new["results"]}}


def method_union(first: str, then: str) -> str:
    """The comma-separated methods of ``first``, then those of ``then`` not among them."""
    methods = [m for m in first.split(",") if m]
    return ",".join(methods + [m for m in then.split(",") if m and m not in methods])


def saved_table(saved: dict[str, Any],
                run_config: dict[str, Any]) -> tuple[dict[str, Any], Variants]:
    """The run config and variants of the table ``saved`` (a results.json), with this run's.

    ``methods`` becomes every method the table has run (its own first, then this
    run's); variants keep their labels' definitions (kept across appends).
    """
    methods = method_union(",".join(parse_config(saved.get("run-config", {})).server.methods),
                           ",".join(parse_config(run_config).server.methods))
    return {**run_config, "methods": methods}, saved.get("variants", {})


def merge_variants(saved: Variants, new: Variants, run_methods: str = "") -> Variants:
    """The table's variant labels with this run's: one label, one setting.

    A label run again with other ``methods`` (``run_methods`` where it names none)
    covers both runs' methods; with any other key changed it is refused, since
    its earlier rows were made without it.
    """
    merged = dict(saved)
    for label, keys in new.items():
        old = saved.get(label)
        if old is None:
            merged[label] = keys
            continue
        settings = {k: v for k, v in keys.items() if k != "methods"}
        if settings != {k: v for k, v in old.items() if k != "methods"}:
            raise ConfigError(f"--variant {label!r}: the table's rows of this label were made "
                              f"with {old}, not {keys}; use another label")
        methods = method_union(str(old.get("methods", "")),
                               str(keys.get("methods", run_methods)))
        merged[label] = {**keys, "methods": methods} if methods else keys
    return merged


def free_folder(folder: Path) -> Path:
    """``folder``, or ``<folder>-run2`` (``-run3``, ...) if a run is already there."""
    n = 1
    while (candidate := folder if n == 1 else folder.with_name(f"{folder.name}-run{n}")
           ).exists():
        n += 1
    return candidate


def check_variants(variants: Variants, run_config: dict[str, Any]) -> None:
    """Refuse a variant that is badly named or would change the clients' uploads."""
    base = parse_config(run_config)
    for label, keys in variants.items():
        if not label.strip() or any(c in label for c in "/()"):
            raise ConfigError(f"--variant {label!r}: a label without '/', '(' or ')' expected")
        cfg = parse_config({**run_config, **keys})
        if client_key(cfg, 1, threads=1) != client_key(base, 1, threads=1):
            raise ConfigError(f"--variant {label!r}: {sorted(keys)} change the clients' "
                              "uploads; a variant may change server keys only")


def run_pair(run_config: dict[str, Any], split: dict[str, Any], seed: int, num_clients: int,
             out: Path, cache_dir: Path, variants: Variants | None = None,
             keep_runs: bool = False) -> dict[str, Any]:
    """One (split, seed): train or load the clients, run every server method; its record.

    Each of ``variants`` runs the server again on the same uploads; its methods'
    results join the record as ``<method> (<label>)``. With ``keep_runs`` a run
    folder already under ``out/runs`` is not overwritten (``free_folder``); the
    record's ``run-folders`` names the folders written.
    """
    pair_config = {**run_config, **split, "seed": seed}
    cfg: FedMITRConfig = parse_config(pair_config)
    name = f"{split_name(split)}-seed{seed}"
    data = load_dataset(cfg.data, cfg.seed)
    start = time.perf_counter()
    source, cached = cached_uploads(cfg, num_clients, data, cache_dir)
    client_s = time.perf_counter() - start
    print(f"[{name}] uploads in {source} "
          f"({'cached' if cached else f'trained in {client_s:.0f} s'})", flush=True)
    emit = lambda line: print(f"[{name}] {line}", flush=True)  # noqa: E731
    place = free_folder if keep_runs else (lambda folder: folder)
    run_dir = place(out / "runs" / name)
    folders = [run_dir.name]
    outcome = run_pipeline(cfg, data, run_dir, emit=emit, source=source)
    if "fedavg-rounds" in cfg.server.methods:
        outcome.results["fedavg-rounds"] = run_rounds(
            pair_config, cfg, data, source / "uploads", num_clients, run_dir, emit)
    for label, keys in (variants or {}).items():
        variant = parse_config({**pair_config, **keys})
        folder = place(out / "runs" / f"{name}-{label.strip().replace(' ', '-')}")
        folders.append(folder.name)
        emit(f"variant '{label}': {keys}")
        results = run_pipeline(variant, data, folder, emit=emit, source=source).results
        outcome.results.update({f"{m} ({label})": results[m] for m in variant.server.methods
                                if m in results})
    return {"split": split_name(split), "seed": seed, "cached": cached,
            "uploads-digest": uploads_digest(source), "torch-threads": torch.get_num_threads(),
            "client-seconds": 0.0 if cached else client_s, "run-folders": folders,
            "results": outcome.results}


def _run_pairs(pairs: list[tuple[dict[str, Any], int]], run_config: dict[str, Any],
               num_clients: int, out: Path, cache_dir: Path, workers: int,
               keep: Callable[[dict[str, Any]], None], variants: Variants | None = None,
               keep_runs: bool = False) -> None:
    """Run every (split, seed) pair, in this process or in ``workers`` processes."""
    if workers <= 1:
        for split, seed in pairs:
            keep(run_pair(run_config, split, seed, num_clients, out, cache_dir, variants,
                          keep_runs))
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    print(f"{len(pairs)} (split, seed) pairs on {workers} worker processes, "
          f"{threads} torch thread(s) each", flush=True)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=torch.set_num_threads,
                             initargs=(threads,)) as pool:
        futures = [pool.submit(run_pair, run_config, split, seed, num_clients, out, cache_dir,
                               variants, keep_runs) for split, seed in pairs]
        for future in as_completed(futures):
            keep(future.result())


def write_tables(records: list[dict[str, Any]], out: Path) -> None:
    """Write the tables and pictures of ``records`` to ``out``.

    The tables: ``table.md``, ``seeds.md``, ``val_table.md``, ``seconds.md`` and,
    with FedMITR in the records, ``leads.md``.

    The pictures: ``accuracy.png`` and, with ``fedavg-rounds``, ``rounds.png``.

    The tables are printed as well.
    """
    (out / "table.md").write_text(summary_table(records) + "\n", encoding="utf-8")
    (out / "seeds.md").write_text(seed_table(records) + "\n", encoding="utf-8")
    (out / "val_table.md").write_text(summary_table(records, "val-accuracy") + "\n",
                                      encoding="utf-8")
    (out / "seconds.md").write_text(seconds_table(records) + "\n", encoding="utf-8")
    if any("fedmitr" in r["results"] for r in records):
        (out / "leads.md").write_text(lead_table(records) + "\n", encoding="utf-8")
    plot_accuracy(records, out / "accuracy.png")
    if any("fedavg-rounds" in r["results"] for r in records):
        plot_rounds_by_split(records, out / "rounds.png")
    print(f"test top-1 (%), mean ± std over seeds; written to {out}\n"
          + summary_table(records))
    print("validation top-1 (%)\n" + summary_table(records, "val-accuracy"))


def results_folder(results_root: Path, preset: Path, tag: str = "") -> Path:
    """``<results_root>/<preset name>[-<tag>]``, where a run of ``preset`` writes."""
    return results_root / (preset.stem + (f"-{tag}" if tag else ""))


def rewrite_tables(out: Path) -> list[dict[str, Any]]:
    """Write the tables of ``out`` again from ``out/results.json``; return its records."""
    path = out / "results.json"
    if not path.is_file():
        raise ConfigError(f"--tables-only: {path} not found; a results folder written by "
                          "this benchmark expected")
    records = json.loads(path.read_text(encoding="utf-8")).get("records")
    if not records:
        raise ConfigError(f"--tables-only: {path} holds no 'records'")
    write_tables(records, out)
    summarise_audits(out)
    return records


def run_benchmark(preset: Path, *, seeds: list[int] | None = None,
                  splits: list[str] | None = None, overrides: dict[str, Any] | None = None,
                  tag: str = "", results_root: Path = ROOT / "results",
                  cache_dir: Path = ROOT / "cache", append: bool = False,
                  workers: int = 1, variants: Variants | None = None) -> list[dict[str, Any]]:
    """Run the sweep of ``preset``; return one record per (split, seed).

    The keyword options are the command line's flags, one each. With ``append``
    the records already in the results folder are kept and the tables cover them
    all; a (split, seed) pair run again replaces the rows of the methods it ran
    and keeps the others, on the same uploads only (``merge_record``). With
    ``workers > 1`` the (split, seed) pairs run in that many processes, the CPU
    cores shared out between them as torch threads. Each pair seeds its own
    generators, so its result does not depend on which pairs ran before it.
    """
    run_config, sweep = load_sweep(preset)
    run_config.update(overrides or {})
    variants = variants or {}
    check_variants(variants, run_config)
    out = results_folder(results_root, preset, tag)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    chosen = [s for s in sweep["splits"] if not splits or split_name(s) in splits]
    saved = saved_results(out) if append else {}
    earlier = {(r["split"], r["seed"]): r for r in previous_records(out, saved, run_config)}
    table_config, labels = saved_table(saved, run_config) if earlier else (run_config, {})
    labels = merge_variants(labels, variants, ",".join(parse_config(run_config).server.methods))
    order = [split_name(s) for s in sweep["splits"]]
    settings = resolved_settings(run_config)
    records: list[dict[str, Any]] = []

    def all_records() -> list[dict[str, Any]]:
        done = {(r["split"], r["seed"]) for r in records}
        kept = [r for r in earlier.values() if (r["split"], r["seed"]) not in done]
        return sorted(kept + records, key=lambda r: (
            order.index(r["split"]) if r["split"] in order else len(order), r["seed"]))

    def keep(record: dict[str, Any]) -> None:
        pair = (record["split"], record["seed"])
        records.append(merge_record(earlier[pair], record) if pair in earlier else record)
        (out / "results.json").write_text(json.dumps(
            {"preset": str(preset), "run-config": table_config,
             "resolved-config": settings, "sweep": sweep, "variants": labels,
             "records": all_records()}, indent=1, default=float), encoding="utf-8")

    pairs = [(split, int(seed)) for split in chosen
             for seed in (seeds if seeds is not None else sweep["seeds"])]
    _run_pairs(pairs, run_config, int(sweep["num-clients"]), out, cache_dir, workers, keep,
               variants, keep_runs=append)
    records = all_records()
    write_tables(records, out)
    summarise_audits(out)
    return records


def summarise_audits(out: Path) -> None:
    """The privacy audits of the runs made with ``privacy-audit=true``, in ``<out>/audit/``.

    Read from each run's ``metrics.json``; nothing is written when no run has one.
    """
    runs = sorted((out / "runs").iterdir()) if (out / "runs").is_dir() else []
    records = [{"run": run.name, **audit} for run in runs if (audit := saved_audit(run))]
    if records:
        write_report(records, out / "audit")


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("preset", type=Path, help="sim_configs/<name>.yaml with a 'sweep'")
    parser.add_argument("--seeds", help="comma-separated seeds (default: the preset's)")
    parser.add_argument("--splits", help="comma-separated split names, e.g. dir-0.1,path-2")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a run-config key (repeatable)")
    parser.add_argument("--tag", default="", help="suffix of the results folder")
    parser.add_argument("--results-root", type=Path, default=ROOT / "results",
                        help="where the results folder goes (tuning runs: "
                             "benchmarks/results/tuning)")
    parser.add_argument("--append", action="store_true",
                        help="keep the records already in the results folder (same run "
                             "config but for 'methods'); a (split, seed) pair run again "
                             "replaces the rows of the methods it ran, on the same uploads "
                             "only")
    parser.add_argument("--workers", type=int, default=1,
                        help="(split, seed) pairs run in parallel processes (default 1); "
                             "on a small CPU, 2 single-threaded workers beat 1 with 2 threads")
    parser.add_argument("--variant", nargs="+", action="append", default=[],
                        metavar=("LABEL", "KEY=VALUE"),
                        help="run the server again with these keys changed; rows "
                             "'<method> (LABEL)' (repeatable)")
    parser.add_argument("--tables-only", action="store_true",
                        help="run nothing: rewrite the results folder's tables from its "
                             "results.json")
    args = parser.parse_args(argv)
    if args.tables_only:
        rewrite_tables(results_folder(args.results_root, args.preset, args.tag))
        return
    variants = {label: parse_overrides(keys, f"--variant {label!r}")
                for label, *keys in args.variant}
    run_benchmark(
        args.preset,
        seeds=[int(s) for s in args.seeds.split(",")] if args.seeds else None,
        splits=args.splits.split(",") if args.splits else None,
        overrides=parse_overrides(args.set, "--set"), tag=args.tag, append=args.append,
        workers=args.workers, results_root=args.results_root, variants=variants,
    )


if __name__ == "__main__":
    main()
