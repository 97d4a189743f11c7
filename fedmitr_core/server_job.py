"""The server's long work after the uploads are in: run methods, evaluate, write outputs."""

from __future__ import annotations

import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

from fedmitr_core.checkpoint import (
    load_method_result,
    load_pool,
    save_method_result,
)
from fedmitr_core.config import FedMITRConfig
from fedmitr_core.data import DatasetSplits
from fedmitr_core.ensemble import TeacherEnsemble, TeacherSet, select_teachers
from fedmitr_core.methods import METHODS, ROUND_METHODS, ServerContext
from fedmitr_core.progress import Emit
from fedmitr_core.reports import (
    plot_label_distribution,
    plot_synthetic_grid,
    results_table,
    write_config,
    write_metrics,
    write_report,
)
from fedmitr_core.training import accuracy, resolve_device, set_seed, uses_bf16

REFERENCES = ("ensemble", "fedavg", "local-mean")


@dataclass
class ServerOutcome:
    """The saved global model and every method's and reference's figures."""

    global_model: nn.Module
    results: dict[str, dict[str, Any]]
    run_dir: Path


def resolve_run_dir(cfg: FedMITRConfig, app_dir: Path) -> Path:
    """``<output-dir>/<run-name>`` as an absolute path (output-dir relative to the app)."""
    out = Path(cfg.server.output_dir).expanduser()
    if not out.is_absolute():
        out = app_dir / out
    name = cfg.server.run_name or time.strftime("%Y%m%d-%H%M%S")
    return out.resolve() / name


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (Linux/macOS)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes vs KiB


def _versions() -> dict[str, str]:
    import timm

    return {"python": platform.python_version(), "torch": torch.__version__,
            "timm": timm.__version__, "numpy": np.__version__}


def run_server_methods(teachers: TeacherSet, cfg: FedMITRConfig, splits: DatasetSplits,
                       run_dir: Path, emit: Emit | None = None,
                       upload_report: dict[str, Any] | None = None, resume: bool = False
                       ) -> ServerOutcome:
    """Run the configured methods on the teachers and write every output.

    Parameters
    ----------
    teachers
        The validated uploads (loaded back from disk).
    cfg
        The run config; ``methods`` decides what runs, the first is saved.
    splits
        Dataset splits; the test split scores everything, the validation
        split is reported beside it for tuning.
    run_dir
        Where outputs go (created).
    emit
        Where progress lines go.
    upload_report
        Accepted / rejected uploads, recorded in ``metrics.json``.
    resume
        Reuse ``<run_dir>/state/`` (finished methods, pools, distillation
        checkpoints) left by a run that was stopped; otherwise start afresh.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    state_dir = run_dir / "state"
    if not resume:
        shutil.rmtree(state_dir, ignore_errors=True)
    write_config(run_dir, cfg.to_flat())
    set_seed(cfg.seed)
    device = resolve_device(cfg.server.device)
    log = emit or (lambda _msg: None)
    experts = select_teachers(teachers, cfg.server.teachers_per_class)
    ensemble = TeacherEnsemble(experts, cfg.server.weighting, cfg.server.ensemble_form, device)
    if len(ensemble) > 50:
        log(f"note: {len(ensemble)} teachers: every inversion step runs all of them; "
            "teachers-per-class=2 caps the ensemble at 2 per class")
    log(f"ensemble of {len(ensemble)} teachers (of {len(teachers)} uploads; "
        f"teachers-per-class {cfg.server.teachers_per_class or 'all'}) on {device}, form "
        f"'{ensemble.form}' (probe seconds: {ensemble.form_timings or 'not measured'})")
    ctx = ServerContext(
        teachers=teachers, ensemble=ensemble, cfg=cfg, num_classes=splits.num_classes,
        in_chans=splits.in_chans, image_size=splits.image_size, hflip_ok=splits.hflip_ok,
        device=device, emit=emit, real_train=splits.train, state_dir=state_dir,
    )

    def score(model: Any, seconds: float, **details: Any) -> dict[str, Any]:
        return {"accuracy": accuracy(model, splits.test, device),
                "val-accuracy": accuracy(model, splits.val, device),
                "seconds": seconds, **details}

    results: dict[str, dict[str, Any]] = {}
    first_pool = None
    global_model: nn.Module | None = None
    for name in cfg.server.methods:
        if name in ROUND_METHODS:
            continue  # more rounds with the clients: the ServerApp runs it afterwards
        folder = ctx.method_state(name)
        assert folder is not None
        done = load_method_result(folder, ctx.new_vit)
        if done is not None:
            model, saved = done
            seconds, details = float(saved["seconds"]), saved["details"]
            pool_file = state_dir / saved["pool"] if saved.get("pool") else None
            pool = (load_pool(pool_file, torch.Generator())[0]
                    if pool_file is not None and pool_file.is_file() else None)
            log(f"method '{name}': finished before the restart, read from {folder}")
        else:
            log(f"method '{name}': start")
            start = time.perf_counter()
            out = METHODS[name](ctx)
            seconds = time.perf_counter() - start + out.reused_seconds
            model, details, pool = out.model, out.details, out.pool
            pool_name = (str(out.pool_file.relative_to(state_dir))
                         if out.pool_file is not None else None)
            save_method_result(folder, model, {"seconds": seconds, "details": details,
                                               "pool": pool_name})
        results[name] = score(model.to(device), seconds, **details)
        log(f"method '{name}': test accuracy {100 * results[name]['accuracy']:.2f} % "
            f"in {seconds:.1f} s")
        if global_model is None:
            global_model = model
        if first_pool is None and pool is not None:
            first_pool = (name, pool)

    start = time.perf_counter()
    ens = score(lambda x: ensemble.predict(x), 0.0)
    ens["seconds"] = time.perf_counter() - start
    results["ensemble"] = ens
    if "fedavg" not in results:
        start = time.perf_counter()
        fedavg = METHODS["fedavg"](ctx).model.to(device)
        results["fedavg"] = score(fedavg, time.perf_counter() - start)
    local = [score(m.to(device).eval(), 0.0) for m in teachers.models]
    results["local-mean"] = {
        "accuracy": float(np.mean([r["accuracy"] for r in local])),
        "val-accuracy": float(np.mean([r["val-accuracy"] for r in local])),
        "seconds": 0.0,
    }

    assert global_model is not None
    save_file({k: v.detach().cpu().contiguous() for k, v in global_model.state_dict().items()},
              str(run_dir / "global_model.safetensors"))
    plot_label_distribution(teachers.label_counts, teachers.client_ids,
                            run_dir / "label_distribution.png")
    if first_pool is not None:
        plot_synthetic_grid(first_pool[1], run_dir / "synthetic_grid.png",
                            cfg.model.patch_size, splits.num_classes,
                            title=f"{first_pool[0]}: synthetic images per class "
                                  "(red: low-attention L, blue: pruned)")
    payload = {
        "results": results,
        "global-method": cfg.server.methods[0],
        "num-teachers": len(teachers),
        "client-ids": teachers.client_ids,
        "ensemble-teachers": experts.client_ids,
        "ensemble-form": ensemble.form,
        "ensemble-form-probe-seconds": ensemble.form_timings,
        "device": str(device),
        "server-peak-rss-mb": peak_rss_mb(),
        "bf16-autocast": uses_bf16(device, cfg.server.precision),
        "seed": cfg.seed,
        "versions": _versions(),
        "uploads": upload_report or {},
    }
    write_metrics(run_dir, payload)
    notes = [f"{len(teachers)} teachers, dataset {cfg.data.dataset}, "
             f"partitioner {cfg.partition.partitioner} (alpha {cfg.partition.alpha}), "
             f"model {cfg.model.model}, seed {cfg.seed}",
             f"global model: {cfg.server.methods[0]} -> global_model.safetensors",
             "accuracy: top-1 on the test split; val: the held-out validation split"]
    write_report(run_dir, "FedMITR one-shot run", results, notes)
    log("results (test top-1):\n" + results_table(results))
    return ServerOutcome(global_model=global_model, results=results, run_dir=run_dir)
