"""The multi-round reference: Flower's own FedAvg, continued after the one-shot round.

Round 1 of FedAvg is the one-shot round: the same clients train the same
initial model with the same local epochs, and its aggregate is the one-shot
``fedavg`` model. ``fedavg-rounds`` therefore starts Flower's ``FedAvg`` from
that model and runs rounds 2..R, scoring the global model after every round.
It is a reference for what R rounds of communication buy; it is not one-shot.
Unlike the one-shot strategy, Flower's FedAvg averages every reply it gets
(no validation of uploads).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedmitr_core.config import FedMITRConfig
from fedmitr_core.data.datasets import DatasetSplits
from fedmitr_core.methods import METHODS
from fedmitr_core.methods.base import fedavg_state
from fedmitr_core.models.evaluate import accuracy
from fedmitr_core.models.vit import vit_factory
from fedmitr_core.runtime import resolve_device
from fedmitr_core.server.reports import append_report, plot_rounds, results_table, write_metrics
from fedmitr_core.server.screening import screen_teachers
from fedmitr_core.server.uploads import load_teacher_set


def run_fedavg_rounds(grid: Grid, cfg: FedMITRConfig, data: DatasetSplits,
                      round1_state: dict[str, torch.Tensor], emit: Callable[[str], None]
                      ) -> dict[str, Any]:
    """Rounds 2..``num-rounds`` of Flower's FedAvg from the one-shot FedAvg model.

    Returns the ``fedavg-rounds`` result: final accuracies, the wall seconds of
    rounds 2..R (client training included) and ``rounds``, the accuracy after
    each round (round 1 is the one-shot ``fedavg`` model).
    """
    new_model = vit_factory(cfg.model, data.spec)
    device = resolve_device(cfg.runtime.device)
    rounds: list[dict[str, float]] = []

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = new_model()
        model.load_state_dict(arrays.to_torch_state_dict())
        test, val = accuracy(model, data.test, device), accuracy(model, data.val, device)
        done = server_round + 1  # Flower's round 0 is the model it starts from: round 1's
        rounds.append({"round": done, "accuracy": test, "val-accuracy": val})
        emit(f"fedavg-rounds: after round {done}/{cfg.server.num_rounds}: test accuracy "
             f"{100 * test:.2f} %")
        return MetricRecord({"accuracy": test, "val-accuracy": val})

    nodes = max(1, cfg.server.min_clients)
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=nodes,
                      min_available_nodes=nodes)
    # Clients seed each round's training from the round number; 'round-offset'
    # continues the count after the one-shot round.
    train_config = ConfigRecord({**data.spec.to_record(), "round-offset": 1})
    start = time.perf_counter()
    strategy.start(grid=grid, initial_arrays=ArrayRecord(round1_state),
                   num_rounds=cfg.server.num_rounds - 1, timeout=cfg.server.round_timeout,
                   train_config=train_config, evaluate_fn=evaluate)
    last = rounds[-1]
    return {"accuracy": last["accuracy"], "val-accuracy": last["val-accuracy"],
            "seconds": time.perf_counter() - start, "rounds": rounds}


def add_fedavg_rounds(grid: Grid, cfg: FedMITRConfig, data: DatasetSplits, run_dir: Path,
                      emit: Callable[[str], None], uploads: Path | None = None
                      ) -> dict[str, Any]:
    """Run the reference after the one-shot round; add it to the run's outputs.

    Adds ``results["fedavg-rounds"]`` to ``metrics.json``, its row to
    ``report.md`` and ``fedavg_rounds.png`` (accuracy per round, the one-shot
    methods as lines). Round 1's model is the FedAvg of the uploads persisted
    in ``uploads`` (default: ``<run_dir>/uploads``).
    """
    uploaded = load_teacher_set(uploads or run_dir / "uploads", vit_factory(cfg.model, data.spec))
    # Round 1 is the one-shot round: the same screened uploads as the one-shot methods.
    teachers = screen_teachers(uploaded, cfg.server.outlier_ratio, cfg.server.count_cap).teachers
    result = run_fedavg_rounds(grid, cfg, data, fedavg_state(teachers), emit)
    metrics = json.loads((run_dir / "metrics.json").read_text(encoding="utf-8"))
    results = metrics["results"]
    results["fedavg-rounds"] = result
    write_metrics(run_dir, metrics)
    name = f"fedavg-rounds ({cfg.server.num_rounds} rounds)"
    row = results_table({name: result}).splitlines()[-1]
    note = "fedavg-rounds: not one-shot; its seconds are rounds 2..R, client training included"
    append_report(run_dir, [row, "", f"- {note}"])
    one_shot = {m: results[m]["accuracy"] for m in cfg.server.methods
                if m in METHODS and results.get(m, {}).get("accuracy") is not None}
    plot_rounds(result["rounds"], one_shot, run_dir / "fedavg_rounds.png")
    emit("results (test top-1):\n" + results_table(results))
    return result
