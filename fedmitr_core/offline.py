"""The server's work without a Flower round: resume a stopped run, or distil published models.

Usage::

    python -m fedmitr_core.offline --resume-from <run folder>
    python -m fedmitr_core.offline --teachers <folder> --out <run folder> [--run-config k=v ...]

``--resume-from`` continues a run whose server was stopped (crash, SIGKILL,
reboot) from what it persisted: the validated uploads, the synthetic pools,
the last distillation checkpoints and the methods that had finished; no
client is contacted. ``--teachers`` is the "model market" case: a folder of
``<name>.safetensors`` state dicts, each with a ``<name>.json`` holding its
``label-counts``; they are validated like uploads (never unpickled) before
the server methods run on them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from safetensors.numpy import load_file

from fedmitr_core.config import ConfigError, FedMITRConfig, parse_config, parse_overrides
from fedmitr_core.data import DatasetSplits, load_dataset
from fedmitr_core.models import vit_factory
from fedmitr_core.server_job import ServerOutcome, run_server_methods
from fedmitr_core.uploads import (
    Upload,
    expected_spec,
    load_teacher_set,
    persist_upload,
    validate_upload,
)

UPLOAD_REPORT = "upload_report.json"


def resume_run(run_dir: Path, emit=print) -> ServerOutcome:  # noqa: ANN001
    """Finish the run in ``run_dir`` from its persisted uploads and server state."""
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        raise ConfigError(f"resume-from '{run_dir}': no config.yaml (not a run folder)")
    flat = yaml.safe_load(config_file.read_text(encoding="utf-8"))
    flat["resume-from"] = str(run_dir)
    cfg = parse_config(flat)
    splits = load_dataset(cfg.data, cfg.seed)
    teachers = load_teacher_set(run_dir / "uploads", vit_factory(cfg, splits))
    report_file = run_dir / UPLOAD_REPORT
    report = json.loads(report_file.read_text()) if report_file.is_file() else {}
    emit(f"resuming {run_dir}: {len(teachers)} persisted uploads, no client contacted")
    return run_server_methods(teachers, cfg, splits, run_dir, emit=emit,
                              upload_report=report, resume=True)


def import_teachers(folder: Path, cfg: FedMITRConfig, splits: DatasetSplits, run_dir: Path
                    ) -> dict[str, Any]:
    """Validate published checkpoints and persist the good ones as the run's uploads."""
    spec = expected_spec(vit_factory(cfg, splits)())
    accepted: list[dict[str, Any]] = []
    rejected: list[dict[str, Any]] = []
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"--teachers '{folder}': no *.safetensors files")
    for weights in files:
        meta_file = weights.with_suffix(".json")
        problems: list[str] = []
        try:
            arrays = dict(load_file(str(weights)))
        except Exception as err:  # noqa: BLE001 - any unreadable file is rejected, not fatal
            arrays, problems = {}, [f"not a readable safetensors file: {err}"]
        meta: dict[str, Any] = {}
        if meta_file.is_file():
            meta = json.loads(meta_file.read_text(encoding="utf-8"))
        else:
            problems.append(f"no {meta_file.name} with 'label-counts'")
        counts = meta.get("label-counts")
        metrics = {"label-counts": counts,
                   "num-examples": int(np.sum(counts)) if isinstance(counts, list) else None}
        if not problems:
            problems = validate_upload(arrays, metrics, spec, splits.num_classes)
        if problems:
            rejected.append({"client-id": weights.stem, "reasons": problems})
            continue
        persist_upload(run_dir / "uploads", Upload(
            client_id=weights.stem, arrays=arrays, num_examples=int(metrics["num-examples"]),
            label_counts=np.asarray(counts, dtype=np.int64), metrics={}))
        accepted.append({"client-id": weights.stem, "num-examples": metrics["num-examples"]})
    report = {"accepted": accepted, "rejected": rejected, "failed": [], "source": str(folder)}
    (run_dir / UPLOAD_REPORT).write_text(json.dumps(report, indent=1), encoding="utf-8")
    if not accepted:
        raise ConfigError(f"--teachers '{folder}': no valid checkpoint ({rejected})")
    return report


def distil_published(folder: Path, run_dir: Path, run_config: dict[str, Any], emit=print
                     ) -> ServerOutcome:  # noqa: ANN001
    """Run the server methods on checkpoints that clients published in ``folder``."""
    cfg = parse_config(run_config)
    splits = load_dataset(cfg.data, cfg.seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    report = import_teachers(folder, cfg, splits, run_dir)
    teachers = load_teacher_set(run_dir / "uploads", vit_factory(cfg, splits))
    return run_server_methods(teachers, cfg, splits, run_dir, emit=emit, upload_report=report)


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
