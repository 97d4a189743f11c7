"""The server's work without a Flower round: resume a stopped run, or distil published models.

Usage::

    python -m fedmitr_core.offline --resume-from <run folder>
    python -m fedmitr_core.offline --teachers <folder> --out <run folder> [--run-config k=v ...]

``--resume-from`` continues a run whose server was stopped (crash, SIGKILL,
reboot) from what it persisted: the validated uploads, the synthetic pools,
the last distillation checkpoints and the methods that had finished; no
client is contacted. ``--teachers`` is the "model market" case: a folder of
``<name>.safetensors`` state dicts, each with a ``<name>.json`` holding its
``label-counts`` and, optionally, token statistics in
``<name>.stats.safetensors`` (``mean``, ``var``; the json then gives
``token-stats-images``); they are validated like uploads (never unpickled)
before the server methods run on them. A checkpoint without statistics is
accepted; the token-statistics prior skips it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from safetensors.numpy import load_file

from fedmitr_core.client.training import initial_model_load
from fedmitr_core.config import ConfigError, FedMITRConfig, parse_config, parse_overrides
from fedmitr_core.data.datasets import DatasetSplits, load_dataset
from fedmitr_core.progress import Emit
from fedmitr_core.server.pipeline import ServerOutcome, run_pipeline
from fedmitr_core.server.reports import mark_failed, write_config
from fedmitr_core.server.uploads import (
    STATS_SUFFIX,
    UPLOAD_REPORT,
    UploadIntake,
    read_upload_report,
    short_reason,
    stats_file,
)


def resume_run(run_dir: Path, emit: Emit = print) -> ServerOutcome:
    """Finish the run in ``run_dir`` from its persisted uploads and server state."""
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        raise ConfigError(f"resume-from '{run_dir}': no config.yaml (not a run folder)")
    flat = yaml.safe_load(config_file.read_text(encoding="utf-8"))
    flat["resume-from"] = str(run_dir)
    cfg = parse_config(flat)
    data = load_dataset(cfg.data, cfg.seed)
    count = len(list((run_dir / "uploads").glob("*.json")))
    round_state = read_upload_report(run_dir).get("round")
    emit(f"resuming {run_dir}: {count} persisted uploads, no client contacted"
         + ("; the round had not closed when the server stopped" if round_state == "open"
            else ""))
    return _marking_failure(run_dir, lambda: run_pipeline(cfg, data, run_dir, emit=emit,
                                                          resume=True))


def _marking_failure(run_dir: Path, work: Callable[[], ServerOutcome]) -> ServerOutcome:
    """``work()``; if it raises, ``metrics.json`` says ``status: failed`` first."""
    try:
        return work()
    except Exception as err:
        mark_failed(run_dir, short_reason(f"{type(err).__name__}: {err}"))
        raise


def _inside(path: Path, folder: Path) -> bool:
    """Whether ``path``, links resolved, lies directly in ``folder``."""
    return path.resolve().parent == folder.resolve()


def _read_published(weights: Path, folder: Path
                    ) -> tuple[dict[str, np.ndarray], dict[str, Any], list[str]]:
    """Arrays, metrics and problems of one published checkpoint and its ``.json``.

    Only regular files inside ``folder`` are read: links out of it are refused.
    """
    meta_file = weights.with_suffix(".json")
    for path in (weights, meta_file):
        if path.exists() and not _inside(path, folder):
            return {}, {}, [f"{path.name} links outside the folder ({path.resolve()}); refused"]
    if not meta_file.is_file():
        return {}, {}, [f"no {meta_file.name} with 'label-counts'"]
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        return {}, {}, [f"{meta_file.name} is not valid JSON: {err}"]
    if not isinstance(meta, dict) or "label-counts" not in meta:
        return {}, {}, [f"{meta_file.name} must be a JSON object with 'label-counts'"]
    counts = meta["label-counts"]
    if not isinstance(counts, list) or not all(
            isinstance(c, int) and not isinstance(c, bool) for c in counts):
        return {}, {}, [f"{meta_file.name}: 'label-counts' must be a list of whole numbers, "
                        f"got {short_reason(repr(counts), 80)}"]
    try:
        arrays = dict(load_file(str(weights)))
    except Exception as err:  # noqa: BLE001 - any unreadable file is rejected, not fatal
        return {}, {}, [f"{weights.name} is not a readable safetensors file: {err}"]
    metrics = {"label-counts": counts, "num-examples": sum(counts)}
    # Top level in a published .json; under "metrics" in a run folder's uploads/.
    images = meta.get("token-stats-images", (meta.get("metrics") or {}).get("token-stats-images"))
    if images is not None:
        metrics["token-stats-images"] = images
    return arrays, metrics, []


def _read_published_stats(weights: Path, folder: Path) -> dict[str, Any] | None:
    """The checkpoint's token statistics; None when it has none, ``{}`` when unreadable.

    ``{}`` is refused by the intake with a reason; the weights are still taken.
    """
    path = stats_file(weights)
    if not path.exists():
        return None
    if not _inside(path, folder):
        return {}
    try:
        return dict(load_file(str(path)))
    except Exception:  # noqa: BLE001 - unreadable statistics are refused, not fatal
        return {}


def import_teachers(folder: Path, cfg: FedMITRConfig, data: DatasetSplits, run_dir: Path,
                    emit: Emit = print) -> dict[str, Any]:
    """Validate published checkpoints and persist the good ones as the run's uploads.

    Each rejection is printed with its reason and kept in ``upload_report.json``.
    """
    files = sorted(f for f in folder.glob("*.safetensors") if not f.name.endswith(STATS_SUFFIX))
    if not files:
        raise ConfigError(f"--teachers '{folder}': no *.safetensors files")
    model, pretrained = initial_model_load(cfg, data.spec)
    emit(pretrained.summary())
    intake = UploadIntake(run_dir, model.state_dict(), data.spec.num_classes,
                          cfg.server.max_weight_ratio)
    for weights in files:
        arrays, metrics, problems = _read_published(weights, folder)
        if problems:
            intake.reject(weights.stem, problems)
        else:
            problems = intake.take(weights.stem, arrays, metrics,
                                   token_stats=_read_published_stats(weights, folder))
        if problems:
            emit(f"rejected {weights.name}: {'; '.join(intake.rejected[-1]['reasons'])}")
        elif intake.accepted[-1]["token-stats"] != "accepted":
            emit(f"note: {weights.name} comes without token statistics "
                 f"({intake.accepted[-1]['token-stats']}): the prior skips it")
    report = intake.write_report(source=str(folder), pretrained=pretrained.record())
    emit(f"{len(intake.accepted)} of {len(files)} checkpoints accepted from {folder}")
    if not intake.accepted:
        raise ConfigError(f"--teachers '{folder}': no valid checkpoint (reasons in "
                          f"{run_dir / UPLOAD_REPORT})")
    return report


def distil_published(folder: Path, run_dir: Path, run_config: dict[str, Any],
                     emit: Emit = print) -> ServerOutcome:
    """Run the server methods on checkpoints that clients published in ``folder``.

    If anything fails once ``run_dir`` exists, its ``metrics.json`` says
    ``status: failed`` with the error.
    """
    cfg = parse_config(run_config)
    data = load_dataset(cfg.data, cfg.seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_config(run_dir, cfg.to_flat())

    def work() -> ServerOutcome:
        import_teachers(folder, cfg, data, run_dir, emit)
        return run_pipeline(cfg, data, run_dir, emit=emit)

    return _marking_failure(run_dir, work)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--resume-from", type=Path, help="a run folder to finish")
    group.add_argument("--teachers", type=Path, help="a folder of published checkpoints")
    parser.add_argument("--out", type=Path, help="run folder for --teachers")
    parser.add_argument("--run-config", nargs="*", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if args.resume_from is not None:
        resume_run(args.resume_from.expanduser().resolve())
        return
    if args.out is None:
        parser.error("--teachers needs --out <run folder>")
    try:
        overrides = parse_overrides(args.run_config, "--run-config")
    except ConfigError as err:
        parser.error(str(err))
    distil_published(args.teachers.expanduser().resolve(), args.out.expanduser().resolve(),
                     overrides)


if __name__ == "__main__":
    main()
