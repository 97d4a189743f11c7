"""Hostile-client benchmark: one attacker among honest clients, the defence off and on.

Usage::

    python -m benchmarks.hostile [--seeds 0,1,2] [--alphas 0.1,0.5] [--clients 10]
        [--out benchmarks/results/hostile]

For each (α, seed) the benchmark's cached honest uploads of ``sim_configs/digits.yaml``
(trained once, as ``benchmarks.accuracy`` trains them) are read, then client 0 is
replaced by an attacker. Measured side by side, on the test split:

- how far the honest uploads are from each screen's bound (the largest
  ``|w|`` over ``max(|w0|, 1)``, the largest distance to the median teacher
  over the typical one, the largest claim over the lower median): the margin
  the defaults leave;
- the class-weighted ensemble and one-shot FedAvg (the two things a client's
  claims act on directly; every data-free method distils from the ensemble)
  with the attacker, the defence off and on (the app's defaults for
  ``max-weight-ratio``, ``outlier-ratio`` and ``count-cap``).

Attacks: ``random+claims`` (freshly drawn weights, every label count times
10^6), ``random`` (the same weights with the client's true counts: what claims
cannot add to), ``boosted`` (the client's update times 10), ``own+claims``
(the client's own model, counts times 10^6), ``huge`` (every weight 1e30).
Writes ``table.md`` and ``results.json`` (every seed, with the config).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from benchmarks.accuracy import ROOT, load_sweep
from benchmarks.tables import mean_std
from benchmarks.upload_cache import cached_uploads
from fedmitr_core.client.training import initial_model
from fedmitr_core.config import FedMITRConfig, parse_config
from fedmitr_core.data.datasets import DatasetSplits, load_dataset
from fedmitr_core.methods.base import fedavg_state
from fedmitr_core.models.evaluate import accuracy
from fedmitr_core.models.vit import vit_factory
from fedmitr_core.server.ensemble import TeacherEnsemble, TeacherSet
from fedmitr_core.server.screening import lower_median, median_distances, screen_teachers
from fedmitr_core.server.uploads import (
    expected_spec,
    load_teacher_set,
    magnitude_bounds,
    validate_upload,
)

ATTACKER = 0
INFLATE = 10**6
CPU = torch.device("cpu")


def references(teachers: TeacherSet, cfg: FedMITRConfig, data: DatasetSplits) -> dict[str, float]:
    """Test top-1 (%) of the class-weighted ensemble and of one-shot FedAvg."""
    ensemble = TeacherEnsemble(teachers, cfg.server.weighting, "loop", CPU)
    fedavg = vit_factory(cfg.model, data.spec)()
    fedavg.load_state_dict(fedavg_state(teachers))
    return {"ensemble": 100 * accuracy(lambda x: ensemble.predict(x), data.test, CPU),
            "fedavg": 100 * accuracy(fedavg.eval(), data.test, CPU)}


def honest_margins(teachers: TeacherSet, initial: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each screen's statistic at its largest over the honest uploads."""
    bounds = magnitude_bounds(initial, 1.0)
    peak = max(float(m.state_dict()[k].abs().max()) / bounds[k]
               for m in teachers.models for k in bounds)
    distances = median_distances(teachers.models)
    claims = teachers.num_examples
    return {"weight-ratio": peak,
            "distance-ratio": float(distances.max() / lower_median(distances)),
            "claim-ratio": float(claims.max() / lower_median(claims))}


def attacks(teachers: TeacherSet, initial: dict[str, torch.Tensor], cfg: FedMITRConfig,
            data: DatasetSplits) -> dict[str, TeacherSet]:
    """The teacher set with client ``ATTACKER`` replaced, one per attack."""
    factory = vit_factory(cfg.model, data.spec)
    own = teachers.models[ATTACKER]
    torch.manual_seed(1234)
    drawn = factory()

    def model(state: dict[str, torch.Tensor]) -> torch.nn.Module:
        m = factory()
        m.load_state_dict(state)
        return m.eval()

    true = teachers.label_counts[ATTACKER]
    inflated = (true + 1) * INFLATE
    variants = {
        "random+claims": (drawn, inflated),
        "random": (drawn, true),
        "boosted": (model({k: initial[k] + 10 * (v - initial[k])
                           for k, v in own.state_dict().items()}), true),
        "own+claims": (own, inflated),
        "huge": (model({k: torch.full_like(v, 1e30) for k, v in own.state_dict().items()}), true),
    }
    out = {}
    for name, (attacker, counts) in variants.items():
        models = list(teachers.models)
        models[ATTACKER] = attacker
        label_counts = teachers.label_counts.copy()
        label_counts[ATTACKER] = counts
        out[name] = TeacherSet(models, label_counts, list(teachers.client_ids))
    return out


def defended(teachers: TeacherSet, initial: dict[str, torch.Tensor],
             cfg: FedMITRConfig) -> tuple[TeacherSet, str]:
    """What the server keeps of ``teachers`` with the defaults on, and what it did."""
    counts = teachers.label_counts[ATTACKER]
    problems = validate_upload(
        {k: v.numpy() for k, v in teachers.models[ATTACKER].state_dict().items()},
        {"num-examples": int(counts.sum()), "label-counts": [int(c) for c in counts]},
        expected_spec(initial), len(counts),
        bounds=magnitude_bounds(initial, cfg.server.max_weight_ratio))
    if problems:  # what the intake would have done on arrival
        keep = [k for k in range(len(teachers)) if k != ATTACKER]
        teachers = TeacherSet([teachers.models[k] for k in keep], teachers.label_counts[keep],
                              [teachers.client_ids[k] for k in keep])
        return teachers, "rejected on arrival"
    screened = screen_teachers(teachers, cfg.server.outlier_ratio, cfg.server.count_cap)
    action = ("dropped (outlier-ratio)" if screened.dropped
              else "capped (count-cap)" if screened.capped else "kept")
    return screened.teachers, action


def run(seeds: list[int], alphas: list[float], clients: int, out: Path) -> list[dict[str, Any]]:
    """Every (α, seed): margins, then each attack with the defence off and on."""
    run_config, _ = load_sweep(ROOT.parent / "sim_configs" / "digits.yaml")
    records = []
    for alpha in alphas:
        for seed in seeds:
            cfg = parse_config({**run_config, "partitioner": "dirichlet", "alpha": alpha,
                                "seed": seed})
            data = load_dataset(cfg.data, cfg.seed)
            folder, _ = cached_uploads(cfg, clients, data, ROOT / "cache")
            teachers = load_teacher_set(folder / "uploads", vit_factory(cfg.model, data.spec))
            initial = initial_model(cfg, data.spec).state_dict()
            screened = screen_teachers(teachers, cfg.server.outlier_ratio, cfg.server.count_cap)
            record: dict[str, Any] = {
                "alpha": alpha, "seed": seed, "margins": honest_margins(teachers, initial),
                "honest": {"off": references(teachers, cfg, data),
                           "on": references(screened.teachers, cfg, data),
                           "defence": f"dropped {len(screened.dropped)}, "
                                      f"capped {len(screened.capped)}"},
                "attacks": {}}
            for name, attacked in attacks(teachers, initial, cfg, data).items():
                kept, action = defended(attacked, initial, cfg)
                record["attacks"][name] = {"off": references(attacked, cfg, data),
                                           "on": references(kept, cfg, data),
                                           "defence": action}
            print(json.dumps(record), flush=True)
            records.append(record)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {"seeds": seeds, "alphas": alphas, "clients": clients, "run-config": run_config,
         "defaults": {k: getattr(cfg.server, k.replace("-", "_"))
                      for k in ("max-weight-ratio", "outlier-ratio", "count-cap")},
         "records": records}, indent=1), encoding="utf-8")
    text = table(records)
    (out / "table.md").write_text(text + "\n", encoding="utf-8")
    print(text)
    return records


def table(records: list[dict[str, Any]]) -> str:
    """Markdown: per α, ensemble / FedAvg test top-1 (%) honest, attacked off and on."""
    lines = []
    for alpha in dict.fromkeys(r["alpha"] for r in records):
        rows = [r for r in records if r["alpha"] == alpha]
        seeds = ",".join(str(r["seed"]) for r in rows)
        lines += [f"α {alpha} (seeds {seeds}), ensemble / FedAvg test top-1 (%):", "",
                  "| attack | defence off | defence on | what the defence did |",
                  "|---|---|---|---|"]
        cases = {"none (honest)": [r["honest"] for r in rows]}
        cases.update({name: [r["attacks"][name] for r in rows] for name in rows[0]["attacks"]})
        for name, outcomes in cases.items():
            cells = [" / ".join(mean_std([o[side][ref] for o in outcomes], digits=1)
                                for ref in ("ensemble", "fedavg")) for side in ("off", "on")]
            actions = sorted({o["defence"] for o in outcomes})
            lines.append(f"| {name} | {cells[0]} | {cells[1]} | {', '.join(actions)} |")
        margins = {k: max(r["margins"][k] for r in rows) for k in rows[0]["margins"]}
        lines += ["", "largest honest statistic: " + ", ".join(
            f"{k} {v:.2f}" for k, v in margins.items()), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--alphas", default="0.1,0.5")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "hostile")
    args = parser.parse_args(argv)
    run([int(s) for s in args.seeds.split(",")], [float(a) for a in args.alphas.split(",")],
        args.clients, args.out)


if __name__ == "__main__":
    main()
