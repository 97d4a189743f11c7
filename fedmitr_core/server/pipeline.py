"""The server pipeline, after the uploads are in: context, methods, references, outputs.

One function, :func:`run_pipeline`, serves every caller the same way: the
strategy after its round, both offline commands (resume, published
checkpoints) and the benchmark. It reads the persisted uploads back as the
teacher set, runs the configured methods (resuming what a stopped run left
under ``<run>/state/``), scores them and the references on the test and
validation splits, and writes every output.
"""

from __future__ import annotations

import os
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

from fedmitr_core.config import ConfigError, FedMITRConfig
from fedmitr_core.data.datasets import DatasetSplits
from fedmitr_core.methods import METHODS, ROUND_METHODS, ServerContext
from fedmitr_core.models.evaluate import accuracy
from fedmitr_core.models.vit import vit_factory
from fedmitr_core.privacy.audit import audit_clients, audit_state
from fedmitr_core.progress import Emit
from fedmitr_core.runtime import (
    NonFiniteLossError,
    Seconds,
    Stopwatch,
    resolve_device,
    set_seed,
    uses_bf16,
)
from fedmitr_core.server.ensemble import TeacherEnsemble, TeacherSet, select_teachers
from fedmitr_core.server.reports import (
    plot_label_distribution,
    plot_synthetic_grid,
    results_table,
    write_config,
    write_metrics,
    write_report,
)
from fedmitr_core.server.screening import Screening, screen_teachers
from fedmitr_core.server.state import load_method_result, load_pool, save_method_result
from fedmitr_core.server.uploads import load_teacher_set, read_upload_report
from fedmitr_core.synthesis.pool import SyntheticPool

Results = dict[str, dict[str, Any]]


@dataclass
class ServerOutcome:
    """The saved global model (None when every method failed) and every figure."""

    global_model: nn.Module | None
    results: Results
    status: str = "complete"


def resolve_run_dir(cfg: FedMITRConfig, app_dir: Path) -> Path:
    """``<output-dir>/<run-name>`` as an absolute path (output-dir relative to the app)."""
    out = Path(cfg.server.output_dir).expanduser()
    if not out.is_absolute():
        out = app_dir / out
    name = cfg.server.run_name or time.strftime("%Y%m%d-%H%M%S")
    return out.resolve() / name


def make_run_dir(cfg: FedMITRConfig, app_dir: Path) -> Path:
    """Create the run folder (:func:`resolve_run_dir`) before any client trains.

    A path that cannot be one is refused naming its run-config key.
    """
    run_dir = resolve_run_dir(cfg, app_dir)
    for key, path in (("output-dir", run_dir.parent), ("run-name", run_dir)):
        if path.exists() and not path.is_dir():
            raise ConfigError(f"run config key '{key}': '{path}' is a file, expected a folder")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"run config key 'output-dir': cannot create the run folder "
                          f"'{run_dir}': {err.strerror or err}") from err
    if not os.access(run_dir, os.W_OK):
        raise ConfigError(f"run config key 'output-dir': '{run_dir}' is not writable")
    return run_dir


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (Linux/macOS)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes vs KiB


def run_pipeline(cfg: FedMITRConfig, data: DatasetSplits, run_dir: Path,
                 emit: Emit | None = None, resume: bool = False, source: Path | None = None
                 ) -> ServerOutcome:
    """Run the configured methods on the persisted uploads and write every output.

    Parameters
    ----------
    cfg
        The run config; ``methods`` decides what runs, the first is saved.
    data
        The dataset's splits: the test split scores everything, the validation
        split is reported beside it for tuning; the training split only feeds
        the ``kd-real`` oracle.
    run_dir
        Where outputs go (created).
    emit
        Where progress lines go.
    resume
        Reuse ``<run_dir>/state/`` (finished methods, pools, distillation
        checkpoints) left by a run that was stopped; otherwise start afresh.
    source
        The folder holding ``uploads/`` and ``upload_report.json`` (default: ``run_dir``).
    """
    source = source or run_dir
    uploads = load_teacher_set(source / "uploads", vit_factory(cfg.model, data.spec))
    state_dir = run_dir / "state"
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        shutil.rmtree(state_dir, ignore_errors=True)
    write_config(run_dir, cfg.to_flat())
    set_seed(cfg.seed)
    screening = screen_teachers(uploads, cfg.server.outlier_ratio, cfg.server.count_cap)
    _log_screening(screening, emit or (lambda _msg: None))
    ctx = build_context(screening.teachers, cfg, data, state_dir, emit)
    results, global_model, first_pool = run_methods(ctx, data)
    add_references(ctx, data, results)
    status = run_status(results, cfg.server.methods)
    report = read_upload_report(source)
    audit = (_privacy_audit(ctx, data, state_dir, uploads, report.get("num-partitions"),
                            emit or print) if cfg.server.privacy_audit else None)
    write_outputs(ctx, run_dir, results, global_model, first_pool,
                  {**report, "screening": screening.record()}, status, audit)
    return ServerOutcome(global_model=global_model, results=results, status=status)


def _privacy_audit(ctx: ServerContext, data: DatasetSplits, state_dir: Path,
                   uploads: TeacherSet, num_partitions: Any, log: Emit) -> dict[str, Any]:
    """The experimenter's audit (it reads the clients' training split: simulations only).

    The clients' own uploads are audited too when the run knows its partitions.
    """
    audit = audit_state(state_dir, data, ctx.new_vit, ctx.cfg.seed,
                        pairs_picture=state_dir.parent / "privacy_pairs.png")
    if isinstance(num_partitions, int) and num_partitions > 0:
        audit["clients"] = audit_clients(uploads, data, ctx.cfg.partition, num_partitions,
                                         ctx.cfg.seed)
        _log_client_audit(audit["clients"], log)
    for method, auc in audit["loss-attack-auc"].items():
        pool = audit["method-pools"].get(method)
        pool_auc = (f", its pool's distance attack "
                    f"{audit['pools'][pool]['pixel']['pool-attack-auc']:.3f} (pixel) / "
                    f"{audit['pools'][pool]['feature']['pool-attack-auc']:.3f} (feature)"
                    if pool else "")
        log(f"privacy audit: {method}: loss attack AUC {auc:.3f}{pool_auc} (0.5: no signal)")
    return audit


def _log_client_audit(clients: dict[str, dict[str, float]], log: Emit) -> None:
    for key, what in (("loss-attack-auc", "loss attack on their models"),
                      ("stats-attack-auc", "tracing attack on their token statistics")):
        aucs = [row[key] for row in clients.values() if key in row]
        if aucs:
            log(f"privacy audit: clients' uploads: {what}: AUC {np.mean(aucs):.3f} mean, "
                f"{max(aucs):.3f} max over {len(aucs)} clients (0.5: no signal)")


def _log_screening(screening: Screening, log: Emit) -> None:
    for item in screening.dropped:
        log(f"teacher {item['client-id']} left out: {item['reason']}")
    for item in screening.capped:
        log(f"teacher {item['client-id']}: claimed {item['claimed']} examples, weighted as "
            f"{item['used']} (run config key 'count-cap')")
    for note in screening.notes:
        log(f"note: {note}")


def global_method(results: Results, methods: tuple[str, ...]) -> str | None:
    """The first configured method that succeeded: its model is the global model."""
    return next((m for m in methods if m in results and "error" not in results[m]), None)


def run_status(results: Results, methods: tuple[str, ...]) -> str:
    """``complete``, ``partial`` (a method failed, a model was saved) or ``failed``."""
    if global_method(results, methods) is None:
        return "failed"
    return "partial" if any("error" in results.get(m, {}) for m in methods) else "complete"


def build_context(teachers: TeacherSet, cfg: FedMITRConfig, data: DatasetSplits,
                  state_dir: Path, emit: Emit | None) -> ServerContext:
    """The teacher ensemble on the run's device, and everything a method may use."""
    log = emit or (lambda _msg: None)
    device = resolve_device(cfg.runtime.device)
    experts = select_teachers(teachers, cfg.server.teachers_per_class)
    ensemble = TeacherEnsemble(experts, cfg.server.weighting, cfg.server.ensemble_form, device)
    if len(ensemble) > 50:
        log(f"note: {len(ensemble)} teachers: every inversion step runs all of them; "
            "teachers-per-class=2 caps the ensemble at 2 per class")
    log(f"ensemble of {len(ensemble)} teachers (of {len(teachers)} uploads; "
        f"teachers-per-class {cfg.server.teachers_per_class or 'all'}) on {device}, form "
        f"'{ensemble.form}'")
    log(token_stats_note(token_stats_record(ensemble, cfg)))
    return ServerContext(teachers=teachers, ensemble=ensemble, cfg=cfg, spec=data.spec,
                         device=device, emit=emit, real_train=data.train, state_dir=state_dir)


def token_stats_record(ensemble: TeacherEnsemble, cfg: FedMITRConfig) -> dict[str, Any]:
    """Which teachers the token-statistics prior matches, and whether it is on at all."""
    ids = ensemble.client_ids or [str(k) for k in range(len(ensemble))]
    with_stats = [i for i, s in zip(ids, ensemble.token_stats, strict=True) if s is not None]
    return {"prior": cfg.prior.feature_stats and bool(with_stats), "with": with_stats,
            "without": [i for i in ids if i not in with_stats]}


def token_stats_note(record: dict[str, Any]) -> str:
    """One log line for :func:`token_stats_record`."""
    have, total = len(record["with"]), len(record["with"]) + len(record["without"])
    if not record["prior"]:
        why = "no teacher sent token statistics" if not have else "feature-stats is false"
        return f"token-statistics prior off: {why}"
    line = f"token-statistics prior on: {have} of {total} teachers sent statistics"
    if record["without"]:
        shown = ", ".join(record["without"][:5]) + (" ..." if len(record["without"]) > 5 else "")
        line += f"; it skips {shown} (none sent or refused)"
    return line


def score(model: Any, data: DatasetSplits, device: torch.device, seconds: Seconds,
          **details: Any) -> dict[str, Any]:
    """Test and validation accuracy of ``model``, with its wall and CPU seconds and details."""
    return {"accuracy": accuracy(model, data.test, device),
            "val-accuracy": accuracy(model, data.val, device), **timing(seconds), **details}


def timing(seconds: Seconds) -> dict[str, float]:
    """The ``seconds`` (wall clock) and ``cpu-seconds`` entries of a result."""
    return {"seconds": seconds.wall, "cpu-seconds": seconds.cpu}


def run_methods(ctx: ServerContext, data: DatasetSplits
                ) -> tuple[Results, nn.Module | None, tuple[str, SyntheticPool] | None]:
    """Every configured one-shot method, scored; the global model; the first pool made.

    A method that finished before a restart is read back from its state folder.
    A method whose loss turns NaN or Inf, or whose model holds non-finite
    weights, is recorded with its ``error`` and the others go on; the global
    model is the first method's that succeeded (``None`` if none did).
    """
    log = ctx.emit or (lambda _msg: None)
    results: Results = {}
    first_pool, global_model = None, None
    for name in ctx.cfg.server.methods:
        if name in ROUND_METHODS:
            continue  # more rounds with the clients: the ServerApp runs it afterwards
        watch = Stopwatch()
        try:
            model, seconds, details, pool = _finished_or_run(ctx, name, log)
            if not finite_weights(model):
                raise NonFiniteLossError("the distilled model has NaN or Inf weights")
        except NonFiniteLossError as err:
            results[name] = {"accuracy": None, "val-accuracy": None,
                             **timing(watch.elapsed()), "error": str(err)}
            log(f"method '{name}' FAILED: {err}")
            continue
        results[name] = score(model.to(ctx.device), data, ctx.device, seconds, **details)
        log(f"method '{name}': test accuracy {100 * results[name]['accuracy']:.2f} % "
            f"in {seconds.wall:.1f} s ({seconds.cpu:.1f} CPU s)")
        if global_model is None:
            global_model = model
            if name != ctx.cfg.server.methods[0]:
                log(f"the global model is method '{name}''s: the first method failed")
        if first_pool is None and pool is not None:
            first_pool = (name, pool)
    return results, global_model, first_pool


def finite_weights(model: nn.Module) -> bool:
    """Whether every parameter and buffer of ``model`` is finite."""
    return all(bool(torch.isfinite(t).all()) for t in model.state_dict().values()
               if t.is_floating_point())


def _finished_or_run(ctx: ServerContext, name: str, log: Emit
                     ) -> tuple[nn.Module, Seconds, dict[str, Any], SyntheticPool | None]:
    """Method ``name``'s model, seconds, details and pool: read back if it finished, else run."""
    folder = ctx.method_state(name)
    assert folder is not None and ctx.state_dir is not None
    done = load_method_result(folder, ctx.new_vit)
    if done is not None:
        model, saved = done
        pool_file = ctx.state_dir / saved["pool"] if saved.get("pool") else None
        pool = (load_pool(pool_file, torch.Generator())[0]
                if pool_file is not None and pool_file.is_file() else None)
        log(f"method '{name}': finished before the restart, read from {folder}")
        # a result saved before CPU seconds were kept reads as 0 CPU seconds
        seconds = Seconds(float(saved["seconds"]), float(saved.get("cpu-seconds", 0.0)))
        return model, seconds, saved["details"], pool
    log(f"method '{name}': start")
    watch = Stopwatch()
    out = METHODS[name](ctx)
    seconds = watch.elapsed() + out.reused_seconds
    pool_name = str(out.pool_file.relative_to(ctx.state_dir)) if out.pool_file else None
    save_method_result(folder, out.model, {**timing(seconds), "details": out.details,
                                           "pool": pool_name})
    return out.model, seconds, out.details, out.pool


def add_references(ctx: ServerContext, data: DatasetSplits, results: Results) -> None:
    """The references beside the methods: the ensemble, one-shot FedAvg, the local models."""
    watch = Stopwatch()
    ens = score(lambda x: ctx.ensemble.predict(x), data, ctx.device, Seconds())
    results["ensemble"] = {**ens, **timing(watch.elapsed())}  # its seconds: scoring it
    if "fedavg" not in results:
        watch = Stopwatch()
        fedavg = METHODS["fedavg"](ctx).model.to(ctx.device)
        results["fedavg"] = score(fedavg, data, ctx.device, watch.elapsed())
    local = [score(m.to(ctx.device).eval(), data, ctx.device, Seconds())
             for m in ctx.teachers.models]
    results["local-mean"] = {
        "accuracy": float(np.mean([r["accuracy"] for r in local])),
        "val-accuracy": float(np.mean([r["val-accuracy"] for r in local])),
        **timing(Seconds()),
    }


def write_outputs(ctx: ServerContext, run_dir: Path, results: Results,
                  global_model: nn.Module | None, first_pool: tuple[str, SyntheticPool] | None,
                  upload_report: dict[str, Any], status: str = "complete",
                  privacy_audit: dict[str, Any] | None = None) -> None:
    """Global model (if one succeeded), pictures, ``metrics.json``, ``report.md``; the table."""
    cfg, teachers = ctx.cfg, ctx.teachers
    saved = global_method(results, cfg.server.methods)
    model_file = run_dir / "global_model.safetensors"
    if global_model is not None:
        save_file({k: v.detach().cpu().contiguous()
                   for k, v in global_model.state_dict().items()}, str(model_file))
    else:
        model_file.unlink(missing_ok=True)
    plot_label_distribution(teachers.label_counts, teachers.client_ids,
                            run_dir / "label_distribution.png")
    if first_pool is not None:
        plot_synthetic_grid(first_pool[1], run_dir / "synthetic_grid.png",
                            cfg.model.patch_size, ctx.spec.num_classes,
                            title=f"{first_pool[0]}: synthetic images per class "
                                  "(red: low-attention L, blue: pruned)")
    write_metrics(run_dir, {
        "status": status,
        "results": results,
        "global-method": saved,
        "num-teachers": len(teachers),
        "client-ids": teachers.client_ids,
        "ensemble-teachers": ctx.ensemble.client_ids,
        "ensemble-form": ctx.ensemble.form,
        "device": str(ctx.device),
        "server-peak-rss-mb": peak_rss_mb(),
        "bf16-autocast": uses_bf16(ctx.device, cfg.runtime.precision),
        "seed": cfg.seed,
        "versions": _versions(),
        "uploads": upload_report,
        "token-stats": token_stats_record(ctx.ensemble, cfg),
        **({"privacy-audit": privacy_audit} if privacy_audit is not None else {}),
    })
    notes = [f"{len(teachers)} teachers, dataset {cfg.data.dataset}, "
             f"partitioner {cfg.partition.partitioner} (alpha {cfg.partition.alpha}), "
             f"model {cfg.model.model}, seed {cfg.seed}",
             f"status: {status}; global model: "
             + (f"{saved} -> global_model.safetensors" if saved else "none (every method failed)"),
             "accuracy: top-1 on the test split; val: the held-out validation split"]
    write_report(run_dir, "FedMITR one-shot run", results, notes)
    if ctx.emit is not None:
        ctx.emit("results (test top-1):\n" + results_table(results))


def _versions() -> dict[str, str]:
    import timm

    return {"python": platform.python_version(), "torch": torch.__version__,
            "timm": timm.__version__, "numpy": np.__version__}
