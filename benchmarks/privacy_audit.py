"""Privacy audit of finished benchmark runs: what each method's pool and model reveal.

Usage::

    python -m benchmarks.privacy_audit benchmarks/results/digits [--runs dir-0.3-seed0,...]
        [--out benchmarks/results/digits/audit]

For every run folder under ``<results>/runs/`` that still holds its server state
(``state/``: each method's model and the synthetic pools it distilled from), with the
run's own ``config.yaml``: the clients' training images of that run are the members,
the test split the non-members, balanced by class
(:func:`fedmitr_core.privacy.audit.balanced_members`). Each saved pool is audited in
pixel space and in the feature space of a fixed, seeded, never-trained ViT of the
run's architecture (it knows neither set, so it cannot favour members); each method's
global model gets the loss-threshold membership attack. Runs made with
``privacy-audit=true`` also carry the audit of the clients' own uploads (the loss
attack on each client's model, the tracing attack on its token statistics; from
their ``metrics.json``), the reference risk. Writes ``audit.json``, ``audit.md``
(mean ± std over the runs of each split and variant) and ``audit.png``.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from benchmarks.tables import mean_std
from fedmitr_core.config import parse_config
from fedmitr_core.data.datasets import load_dataset
from fedmitr_core.models.vit import vit_factory
from fedmitr_core.privacy.audit import audit_state

POOL_FIGURES = ("pool-to-train-median", "pool-to-heldout-median", "closer-to-train",
                "pool-attack-auc", "pool-attack-tpr")
CLIENT_FIGURES = ("loss-attack-auc", "loss-attack-tpr", "stats-attack-auc", "stats-attack-tpr")


def saved_audit(run_dir: Path) -> dict[str, Any]:
    """The audit a run made itself (``privacy-audit`` in its ``metrics.json``); ``{}`` if none."""
    metrics_file = run_dir / "metrics.json"
    if not metrics_file.is_file():
        return {}
    return json.loads(metrics_file.read_text(encoding="utf-8")).get("privacy-audit") or {}


def audit_run(run_dir: Path) -> dict[str, Any]:
    """Every saved pool and method model of one run, audited against its clients' data."""
    settings = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    cfg = parse_config({k: v for k, v in settings.items() if k != "preset"})
    data = load_dataset(cfg.data, cfg.seed)
    return {"run": run_dir.name, "clients": saved_audit(run_dir).get("clients", {}),
            **audit_state(run_dir / "state", data, vit_factory(cfg.model, data.spec),
                          pairs_picture=run_dir / "privacy_pairs.png")}


def _group(run: str) -> str:
    """``dir-0.3-seed1-no-prior`` -> ``dir-0.3 no-prior``: the split and the variant."""
    head, _, tail = run.partition("-seed")
    variant = tail.partition("-")[2]
    return f"{head} {variant}".strip()


def write_report(records: list[dict[str, Any]], out: Path) -> str:
    """``audit.json``, ``audit.md`` and ``audit.png`` under ``out``; the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "audit.json").write_text(json.dumps(records, indent=1), encoding="utf-8")
    pools: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    attacks: dict[tuple[str, str], list[float]] = defaultdict(list)
    tprs: dict[tuple[str, str], list[float]] = defaultdict(list)
    clients: dict[tuple[str, str], list[float]] = defaultdict(list)
    for rec in records:
        group = _group(rec["run"])
        for pool, spaces in rec["pools"].items():
            for space, figures in spaces.items():
                for key in POOL_FIGURES:
                    pools[(group, f"{pool} ({space})", key)].append(figures[key])
        for method, auc in rec["loss-attack-auc"].items():
            attacks[(group, method)].append(auc)
            tprs[(group, method)].append(rec.get("loss-attack-tpr", {}).get(method, np.nan))
        for row in rec.get("clients", {}).values():
            for key in CLIENT_FIGURES:
                if key in row:
                    clients[(group, key)].append(row[key])
    rows = sorted({(g, p) for g, p, _ in pools})
    md = ["# Privacy audit", "",
          f"{len(records)} runs: {', '.join(r['run'] for r in records)}. Members: the "
          "clients' training images; non-members: the test split, as many per class. "
          "Mean ± std over the runs of each split and variant.", "",
          "## Synthetic pools: nearest neighbours and the distance attack", "",
          "| split variant | pool (space) | " + " | ".join(POOL_FIGURES) + " |",
          "|---|---|" + "---|" * len(POOL_FIGURES)]
    md += [f"| {g} | {p} | "
           + " | ".join(mean_std(pools[(g, p, k)], digits=3) for k in POOL_FIGURES) + " |"
           for g, p in rows]
    md += ["", "## Global models: loss-threshold membership attack (AUC 0.5, TPR 0.01: no "
           "signal)", "", "| split variant | method | AUC | TPR at 1 % FPR |", "|---|---|---|---|"]
    md += [f"| {g} | {m} | {mean_std(v, digits=3)} | {mean_std(tprs[(g, m)], digits=3)} |"
           for (g, m), v in sorted(attacks.items())]
    groups = sorted({g for g, _ in clients})
    if groups:
        md += ["", "## The clients' own uploads: the reference risk", "",
               "Loss attack on each client's uploaded model, tracing attack on its token "
               "statistics; members: that client's images. Mean ± std over clients and runs.",
               "", "| split variant | " + " | ".join(CLIENT_FIGURES) + " |",
               "|---|" + "---|" * len(CLIENT_FIGURES)]
        md += [f"| {g} | " + " | ".join(mean_std(clients[(g, k)], digits=3) for k in CLIENT_FIGURES)
               + " |" for g in groups]
    text = "\n".join(md) + "\n"
    (out / "audit.md").write_text(text, encoding="utf-8")
    _plot(attacks, pools, out / "audit.png")
    return text


def _plot(attacks: dict[tuple[str, str], list[float]],
          pools: dict[tuple[str, str, str], list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, items, title in (
            (axes[0], {f"{g}\n{m}": v for (g, m), v in sorted(attacks.items())},
             "global model: loss attack AUC"),
            (axes[1], {f"{g}\n{p}": v for (g, p, k), v in sorted(pools.items())
                       if k == "pool-attack-auc"}, "synthetic pool: distance attack AUC")):
        names = list(items)
        ax.barh(range(len(names)), [np.mean(items[n]) for n in names],
                xerr=[np.std(items[n]) for n in names], color="tab:blue")
        ax.axvline(0.5, color="k", lw=1, ls="--")
        ax.set_yticks(range(len(names)), names, fontsize=6)
        ax.set_xlim(0.3, 1.0)
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="a benchmark's results folder")
    parser.add_argument("--runs", default="", help="comma-separated run folder names")
    parser.add_argument("--out", type=Path, help="default: <results>/audit")
    args = parser.parse_args(argv)
    runs_dir = args.results / "runs"
    names = [n for n in args.runs.split(",") if n] or sorted(
        p.name for p in runs_dir.iterdir() if (p / "state").is_dir())
    if not names:
        raise SystemExit(f"no run under {runs_dir} still holds its state/ folder")
    records = []
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] auditing {name}", flush=True)
        records.append(audit_run(runs_dir / name))
    print(write_report(records, args.out or args.results / "audit"))


if __name__ == "__main__":
    main()
